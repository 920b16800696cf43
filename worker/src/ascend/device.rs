//! The ACL runtime: process initialisation, device selection, device memory and streams.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use super::bindings::types::{
    ACL_ERROR_REPEAT_INITIALIZE, ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE, aclrtStream,
};
use super::error::{AscendError, acl_check};
use super::library::Cann;

/// The libraries with the ACL runtime initialised (`aclInit`, once per process).
pub struct Acl {
    pub cann: &'static Cann,
}

impl Acl {
    pub fn get() -> Result<&'static Acl, AscendError> {
        static ACL: OnceLock<Acl> = OnceLock::new();
        if let Some(acl) = ACL.get() {
            return Ok(acl);
        }
        let cann = Cann::get()?;
        // SAFETY: a null configuration path asks for the defaults.
        let code = unsafe { cann.runtime.aclInit(ptr::null()) };
        // Another component of the process may have initialised ACL already; that is fine.
        if code != ACL_ERROR_REPEAT_INITIALIZE {
            acl_check("aclInit", code)?;
        }
        Ok(ACL.get_or_init(|| Acl { cann }))
    }

    pub fn device_count(&self) -> Result<u32, AscendError> {
        let mut count = 0u32;
        // SAFETY: the out-pointer is valid for the call.
        acl_check("aclrtGetDeviceCount", unsafe {
            self.cann.runtime.aclrtGetDeviceCount(&mut count)
        })?;
        Ok(count)
    }

    /// Makes `device` current on the calling thread. ACL keeps the current device per thread and
    /// worker threads come and go, so every entry point calls this; repeated calls for the same
    /// device need a single `aclrtResetDevice`, and the thread-local check keeps them cheap.
    pub fn bind_thread(&self, device: i32) -> Result<(), AscendError> {
        thread_local! {
            static CURRENT: Cell<Option<i32>> = const { Cell::new(None) };
        }
        if CURRENT.get() == Some(device) {
            return Ok(());
        }
        // SAFETY: plain value argument.
        acl_check("aclrtSetDevice", unsafe {
            self.cann.runtime.aclrtSetDevice(device)
        })?;
        CURRENT.set(Some(device));
        Ok(())
    }

    /// Releases the runtime at the end of a short-lived command; nothing may use ACL afterwards.
    pub fn finalize(&self, device: i32) -> Result<(), AscendError> {
        // SAFETY: plain value arguments; callers have dropped every stream and buffer.
        acl_check("aclrtResetDevice", unsafe {
            self.cann.runtime.aclrtResetDevice(device)
        })?;
        acl_check("aclFinalize", unsafe { self.cann.runtime.aclFinalize() })
    }
}

/// Which device index to hand to `aclrtSetDevice`.
///
/// The rank table names physical device ids. Inside a container that the Ascend device plugin set
/// up, the runtime numbers the mounted devices from 0 in the order of `ASCEND_VISIBLE_DEVICES`,
/// and `ASCEND_RT_VISIBLE_DEVICES` renumbers again from 0 in its own order.
pub fn logical_device(
    rank_table_device: Option<u32>,
    ascend_visible_devices: Option<&str>,
    ascend_rt_visible_devices: Option<&str>,
) -> Result<i32, AscendError> {
    let visible = parse_device_list("ASCEND_VISIBLE_DEVICES", ascend_visible_devices)?;
    let rt_visible = parse_device_list("ASCEND_RT_VISIBLE_DEVICES", ascend_rt_visible_devices)?;
    let Some(physical) = rank_table_device else {
        // Without a rank table the process uses the first device it can see.
        return Ok(0);
    };
    let runtime_id = match &visible {
        Some(list) => position(list, physical).ok_or_else(|| {
            AscendError::Config(format!(
                "the rank table assigns device {physical}, which is not among \
                 ASCEND_VISIBLE_DEVICES={}",
                ascend_visible_devices.unwrap_or_default()
            ))
        })?,
        None => physical,
    };
    let logical = match &rt_visible {
        Some(list) => position(list, runtime_id).ok_or_else(|| {
            AscendError::Config(format!(
                "the rank table assigns device {physical} (runtime id {runtime_id}), which is not \
                 among ASCEND_RT_VISIBLE_DEVICES={}",
                ascend_rt_visible_devices.unwrap_or_default()
            ))
        })?,
        None => runtime_id,
    };
    i32::try_from(logical)
        .map_err(|_| AscendError::Config(format!("device id {logical} is out of range")))
}

fn position(list: &[u32], id: u32) -> Option<u32> {
    list.iter()
        .position(|&d| d == id)
        .and_then(|i| u32::try_from(i).ok())
}

fn parse_device_list(variable: &str, value: Option<&str>) -> Result<Option<Vec<u32>>, AscendError> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let mut ids = Vec::new();
    for item in value.split(',') {
        let item = item.trim();
        // The device plugin writes "Ascend910-0,Ascend910-1" when the annotation is passed through.
        let number = item.rsplit('-').next().unwrap_or(item);
        let id = number.parse::<u32>().map_err(|_| {
            AscendError::Config(format!(
                "{variable}={value}: `{item}` is not a device id (expected e.g. 0,1,2)"
            ))
        })?;
        if ids.contains(&id) {
            return Err(AscendError::Config(format!(
                "{variable}={value}: device {id} is listed twice"
            )));
        }
        ids.push(id);
    }
    Ok(Some(ids))
}

/// A stream on one device. Work queued on it runs in order.
pub struct Stream {
    acl: &'static Acl,
    raw: aclrtStream,
}

// SAFETY: an ACL stream handle may be used from any thread of the process that has the stream's
// device current; every user binds the device first (`Acl::bind_thread`).
unsafe impl Send for Stream {}
// SAFETY: as above; users that enqueue from several threads serialise through their own lock.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(acl: &'static Acl, device: i32) -> Result<Stream, AscendError> {
        acl.bind_thread(device)?;
        let mut raw: aclrtStream = ptr::null_mut();
        // SAFETY: the out-pointer is valid for the call.
        acl_check("aclrtCreateStream", unsafe {
            acl.cann.runtime.aclrtCreateStream(&mut raw)
        })?;
        Ok(Stream { acl, raw })
    }

    pub fn raw(&self) -> aclrtStream {
        self.raw
    }

    pub fn synchronize(&self) -> Result<(), AscendError> {
        // SAFETY: the stream is alive until drop.
        acl_check("aclrtSynchronizeStream", unsafe {
            self.acl.cann.runtime.aclrtSynchronizeStream(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by aclrtCreateStream and not used after this.
        let code = unsafe { self.acl.cann.runtime.aclrtDestroyStream(self.raw) };
        if let Err(err) = acl_check("aclrtDestroyStream", code) {
            tracing::warn!("{err}");
        }
    }
}

/// Memory on the device, freed on drop.
pub struct DeviceBuffer {
    acl: &'static Acl,
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: a device address is valid from any thread of the process.
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared references only expose the address; writes go through `&mut self`.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    pub fn alloc(acl: &'static Acl, bytes: usize) -> Result<DeviceBuffer, AscendError> {
        let mut ptr: *mut c_void = ptr::null_mut();
        // ACL rejects zero-sized allocations; one byte keeps empty buffers uniform.
        let size = bytes.max(1);
        // SAFETY: the out-pointer is valid for the call.
        acl_check("aclrtMalloc", unsafe {
            acl.cann
                .runtime
                .aclrtMalloc(&mut ptr, size, ACL_MEM_MALLOC_HUGE_FIRST)
        })?;
        Ok(DeviceBuffer { acl, ptr, bytes })
    }

    /// A buffer holding a copy of `host`.
    pub fn upload<T: Copy>(acl: &'static Acl, host: &[T]) -> Result<DeviceBuffer, AscendError> {
        let mut buffer = DeviceBuffer::alloc(acl, std::mem::size_of_val(host))?;
        buffer.write(host)?;
        Ok(buffer)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// Copies `host` to the start of the buffer (synchronously).
    pub fn write<T: Copy>(&mut self, host: &[T]) -> Result<(), AscendError> {
        let bytes = std::mem::size_of_val(host);
        if bytes > self.bytes {
            return Err(AscendError::Config(format!(
                "copy of {bytes} bytes into a device buffer of {} bytes",
                self.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are at least `bytes` long and do not overlap (host vs device).
        acl_check("aclrtMemcpy", unsafe {
            self.acl.cann.runtime.aclrtMemcpy(
                self.ptr,
                self.bytes,
                host.as_ptr().cast(),
                bytes,
                ACL_MEMCPY_HOST_TO_DEVICE,
            )
        })
    }

    /// Copies the start of the buffer into `host` (synchronously).
    pub fn read<T: Copy>(&self, host: &mut [T]) -> Result<(), AscendError> {
        let bytes = std::mem::size_of_val(host);
        if bytes > self.bytes {
            return Err(AscendError::Config(format!(
                "copy of {bytes} bytes out of a device buffer of {} bytes",
                self.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are at least `bytes` long; `T: Copy` has no invalid bit patterns
        // among the types used here (f32, f16, i8, i32, u8, u64).
        acl_check("aclrtMemcpy", unsafe {
            self.acl.cann.runtime.aclrtMemcpy(
                host.as_mut_ptr().cast(),
                bytes,
                self.ptr,
                bytes,
                ACL_MEMCPY_DEVICE_TO_HOST,
            )
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by aclrtMalloc and not used after this.
        let code = unsafe { self.acl.cann.runtime.aclrtFree(self.ptr) };
        if let Err(err) = acl_check("aclrtFree", code) {
            tracing::warn!("{err}");
        }
    }
}

/// A device buffer that grows to the largest size asked of it (for staging host data).
pub struct Scratch {
    acl: &'static Acl,
    buffer: Option<DeviceBuffer>,
}

impl Scratch {
    pub fn new(acl: &'static Acl) -> Scratch {
        Scratch { acl, buffer: None }
    }

    pub fn at_least(&mut self, bytes: usize) -> Result<&mut DeviceBuffer, AscendError> {
        let big_enough = self.buffer.as_ref().is_some_and(|b| b.bytes() >= bytes);
        if !big_enough {
            // Drop the old buffer first so peak device memory is only the new one.
            self.buffer = None;
            self.buffer = Some(DeviceBuffer::alloc(self.acl, bytes)?);
        }
        self.buffer
            .as_mut()
            .ok_or_else(|| AscendError::Config("device scratch buffer missing".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_table_device_maps_through_both_visibility_lists() {
        assert_eq!(logical_device(Some(5), None, None).unwrap(), 5);
        assert_eq!(logical_device(Some(5), Some("4,5,6,7"), None).unwrap(), 1);
        assert_eq!(
            logical_device(Some(5), Some("Ascend910-4,Ascend910-5"), None).unwrap(),
            1
        );
        assert_eq!(
            logical_device(Some(6), Some("4,5,6,7"), Some("3,2")).unwrap(),
            1
        );
        assert_eq!(logical_device(Some(2), None, Some("2,3")).unwrap(), 0);
    }

    #[test]
    fn without_a_rank_table_the_first_visible_device_is_used() {
        assert_eq!(logical_device(None, Some("4,5"), Some("1")).unwrap(), 0);
        assert_eq!(logical_device(None, None, None).unwrap(), 0);
    }

    #[test]
    fn devices_outside_the_visible_lists_are_rejected_by_name() {
        let err = logical_device(Some(3), Some("4,5"), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device 3") && err.contains("ASCEND_VISIBLE_DEVICES=4,5"),
            "{err}"
        );
        let err = logical_device(Some(1), None, Some("0"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ASCEND_RT_VISIBLE_DEVICES=0"), "{err}");
    }

    #[test]
    fn malformed_device_lists_are_rejected() {
        let err = logical_device(Some(0), Some("0,x"), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`x` is not a device id"), "{err}");
        let err = logical_device(Some(0), None, Some("1,1"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("listed twice"), "{err}");
        assert!(logical_device(None, Some(" "), Some("")).is_ok());
    }
}
