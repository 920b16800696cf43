//! The HCCL transport: the tensor-parallel collectives on NPUs, over the communicator that HCCL
//! builds from the operator's rank table.
//!
//! The model works on host slices, so each call stages its data into device memory, runs the
//! HCCL collective on this rank's stream, waits for it, and copies the result back.

use std::ffi::{CString, c_void};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use npufleet_contract::env;
use npufleet_contract::rank_table::{PodIdentity, RankTable};

use super::bindings::types::{
    HCCL_DATA_TYPE_FP32, HCCL_DATA_TYPE_UINT8, HCCL_DATA_TYPE_UINT64, HCCL_E_TIMEOUT,
    HCCL_REDUCE_SUM, HcclComm, HcclResult,
};
use super::device::{Acl, Scratch, Stream, logical_device};
use super::error::AscendError;
use crate::collective::hccl_env;
use crate::collective::rank_table;
use crate::collective::setup::join_concurrently;
use crate::collective::{Collective, CollectiveError};

/// What the HCCL transport reads from the pod's environment, checked before anything is loaded.
#[derive(Clone, Debug)]
pub struct HcclSettings {
    /// `RANK_TABLE_FILE`: the `hccl.json` the operator mounts.
    pub rank_table: PathBuf,
    /// `NPUFLEET_RANK`, `POD_IP` and `LOCAL_RANK`, resolved against the table as for the ring.
    pub identity: PodIdentity,
    /// `HCCL_CONNECT_TIMEOUT` (120..=7200 s, as HCCL accepts); also bounds the wait for the
    /// rank table to complete. HCCL reads the variable itself.
    pub connect_timeout: Duration,
    /// `HCCL_EXEC_TIMEOUT`, read by HCCL itself; reported when a collective times out.
    pub exec_timeout: Duration,
    /// `ASCEND_VISIBLE_DEVICES` and `ASCEND_RT_VISIBLE_DEVICES`, to map the table's device.
    pub visible_devices: Option<String>,
    pub rt_visible_devices: Option<String>,
}

impl HcclSettings {
    /// Reads the settings through `lookup` (normally `std::env::var`), checking every value.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<HcclSettings, AscendError> {
        let set = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let rank_table = set(env::RANK_TABLE_FILE).ok_or_else(|| {
            AscendError::Config(format!(
                "{} is not set; HCCL needs the hccl.json rank table",
                env::RANK_TABLE_FILE
            ))
        })?;
        let number = |name: &str| {
            set(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        AscendError::Config(format!("{name} must be a whole number, got {v:?}"))
                    })
                })
                .transpose()
        };
        let identity = PodIdentity {
            rank_override: number(env::RANK)?,
            pod_ip: set(env::POD_IP),
            local_index: number(env::LOCAL_RANK)?,
        };
        let connect_timeout =
            hccl_env::connect_timeout(lookup(env::HCCL_CONNECT_TIMEOUT).as_deref(), false)
                .map_err(AscendError::Config)?;
        let exec_timeout = hccl_env::exec_timeout(lookup(env::HCCL_EXEC_TIMEOUT).as_deref())
            .map_err(AscendError::Config)?;
        Ok(HcclSettings {
            rank_table: PathBuf::from(rank_table),
            identity,
            connect_timeout,
            exec_timeout,
            visible_devices: set("ASCEND_VISIBLE_DEVICES"),
            rt_visible_devices: set("ASCEND_RT_VISIBLE_DEVICES"),
        })
    }

    /// Waits for the rank table to complete and works out this rank and its device.
    pub fn plan(&self) -> Result<HcclPlan, AscendError> {
        let table = rank_table::wait_for_completed(&self.rank_table, self.connect_timeout)
            .map_err(|e| AscendError::Config(e.to_string()))?;
        self.plan_for(&table)
    }

    pub fn plan_for(&self, table: &RankTable) -> Result<HcclPlan, AscendError> {
        let rank = table
            .find_rank(&self.identity)
            .map_err(|e| AscendError::Config(e.to_string()))?;
        self.plan_rank(table, rank)
    }

    /// Waits for the rank table to complete and plans every rank this process runs (all of
    /// its server's devices unless `LOCAL_RANK` or `NPUFLEET_RANK` picks one).
    pub fn local_plans(&self) -> Result<Vec<HcclPlan>, AscendError> {
        let table = rank_table::wait_for_completed(&self.rank_table, self.connect_timeout)
            .map_err(|e| AscendError::Config(e.to_string()))?;
        table
            .local_ranks(&self.identity)
            .map_err(|e| AscendError::Config(e.to_string()))?
            .into_iter()
            .map(|rank| self.plan_rank(&table, rank))
            .collect()
    }

    fn plan_rank(&self, table: &RankTable, rank: usize) -> Result<HcclPlan, AscendError> {
        let physical = table
            .servers
            .iter()
            .flat_map(|s| &s.devices)
            .find(|d| d.rank_id == rank)
            .map(|d| d.device_id)
            .ok_or_else(|| {
                AscendError::Config(format!("rank {rank} has no device in the table"))
            })?;
        let device = logical_device(
            Some(physical),
            self.visible_devices.as_deref(),
            self.rt_visible_devices.as_deref(),
        )?;
        HcclPlan::new(&self.rank_table, rank, table.world_size(), device)
    }
}

/// A rank this process runs on an NPU: its device and its communicator.
pub struct LocalNpuRank {
    pub device: i32,
    pub collective: Arc<dyn Collective>,
}

/// Joins the HCCL communicator described by this pod's environment and rank table, once for
/// every rank this process runs, in rank order.
pub fn join_local_ranks() -> anyhow::Result<Vec<LocalNpuRank>> {
    let settings = HcclSettings::from_env(|name| std::env::var(name).ok())?;
    let plans = settings.local_plans()?;
    // HcclCommInitClusterInfo returns only once every rank has joined.
    let exec_timeout = settings.exec_timeout;
    join_concurrently(plans, "HCCL", |plan| {
        tracing::info!(
            rank = plan.rank,
            world_size = plan.world_size,
            device = plan.device,
            rank_table = %plan.rank_table.display(),
            "joining the HCCL communicator"
        );
        let device = plan.device;
        let collective = HcclCollective::new(plan, exec_timeout)?;
        Ok(LocalNpuRank {
            device,
            collective: Arc::new(collective),
        })
    })
}

/// Where this rank sits: the rank table HCCL reads, this rank, and the device it runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcclPlan {
    pub rank_table: PathBuf,
    pub rank: u32,
    pub world_size: usize,
    /// The index handed to `aclrtSetDevice` (see [`super::device::logical_device`]).
    pub device: i32,
}

impl HcclPlan {
    pub fn new(
        rank_table: &Path,
        rank: usize,
        world_size: usize,
        device: i32,
    ) -> Result<HcclPlan, AscendError> {
        if world_size == 0 {
            return Err(AscendError::Config(format!(
                "rank table {} lists no ranks",
                rank_table.display()
            )));
        }
        if rank >= world_size {
            return Err(AscendError::Config(format!(
                "rank {rank} is outside the rank table {} ({world_size} ranks: 0..{})",
                rank_table.display(),
                world_size - 1
            )));
        }
        let rank = u32::try_from(rank)
            .map_err(|_| AscendError::Config(format!("rank {rank} does not fit HCCL's u32")))?;
        if device < 0 {
            return Err(AscendError::Config(format!(
                "device index {device} is negative"
            )));
        }
        Ok(HcclPlan {
            rank_table: rank_table.to_path_buf(),
            rank,
            world_size,
            device,
        })
    }

    /// The path as HCCL takes it: a NUL-terminated C string.
    pub fn rank_table_c_string(&self) -> Result<CString, AscendError> {
        use std::os::unix::ffi::OsStrExt;
        CString::new(self.rank_table.as_os_str().as_bytes()).map_err(|_| {
            AscendError::Config(format!(
                "rank table path {} contains a NUL byte",
                self.rank_table.display()
            ))
        })
    }
}

/// Element counts as HCCL takes them, with buffer sizes in bytes.
/// Where a collective reads its host values from and writes its result to.
enum Exchange<'a> {
    /// The result replaces the values.
    InPlace(&'a mut [f32]),
    Into {
        input: &'a [f32],
        out: &'a mut [f32],
    },
}

impl Exchange<'_> {
    fn input(&self) -> &[f32] {
        match self {
            Exchange::InPlace(buf) => buf,
            Exchange::Into { input, .. } => input,
        }
    }

    fn out(&mut self) -> &mut [f32] {
        match self {
            Exchange::InPlace(buf) => buf,
            Exchange::Into { out, .. } => out,
        }
    }
}

fn staged_bytes(elements: usize, element_bytes: usize) -> Result<(u64, usize), AscendError> {
    let bytes = elements.checked_mul(element_bytes).ok_or_else(|| {
        AscendError::Config(format!("{elements} elements overflow a device buffer"))
    })?;
    let count = u64::try_from(elements)
        .map_err(|_| AscendError::Config(format!("{elements} elements overflow HCCL's count")))?;
    Ok((count, bytes))
}

/// Device buffers reused across calls; the lock also keeps one collective on the stream at a time.
struct Staging {
    send: Scratch,
    recv: Scratch,
}

pub struct HcclCollective {
    acl: &'static Acl,
    comm: HcclComm,
    stream: Stream,
    plan: HcclPlan,
    exec_timeout: Duration,
    staging: Mutex<Staging>,
}

// SAFETY: the communicator is used only while holding `staging`, on threads that first bind the
// communicator's device; HCCL communicators may be used from any such thread.
unsafe impl Send for HcclCollective {}
// SAFETY: as above; every method that touches the communicator takes the `staging` lock.
unsafe impl Sync for HcclCollective {}

impl HcclCollective {
    /// Joins the communicator described by the rank table. Blocks until every rank has joined or
    /// `HCCL_CONNECT_TIMEOUT` passes.
    pub fn new(plan: HcclPlan, exec_timeout: Duration) -> Result<HcclCollective, AscendError> {
        let acl = Acl::get()?;
        let path = plan.rank_table_c_string()?;
        acl.bind_thread(plan.device)?;
        let stream = Stream::new(acl, plan.device)?;
        let mut comm: HcclComm = ptr::null_mut();
        // SAFETY: `path` is NUL-terminated and outlives the call; `comm` is a valid out-pointer.
        let code = unsafe {
            acl.cann
                .hccl
                .HcclCommInitClusterInfo(path.as_ptr(), plan.rank, &mut comm)
        };
        hccl_result(acl, "HcclCommInitClusterInfo", code)?;
        Ok(HcclCollective {
            acl,
            comm,
            stream,
            plan,
            exec_timeout,
            staging: Mutex::new(Staging {
                send: Scratch::new(acl),
                recv: Scratch::new(acl),
            }),
        })
    }

    pub fn plan(&self) -> &HcclPlan {
        &self.plan
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Staging>, AscendError> {
        self.staging
            .lock()
            .map_err(|_| AscendError::Config("an earlier HCCL call panicked".into()))
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), AscendError> {
        let (count, bytes) = staged_bytes(buf.len(), size_of::<f32>())?;
        if count == 0 {
            return Ok(());
        }
        self.staged(
            "HcclAllReduce",
            Exchange::InPlace(buf),
            bytes,
            |send, recv| {
                // SAFETY: both device buffers hold at least `count` f32 values and stay alive until
                // the stream has been synchronised after this call.
                unsafe {
                    self.acl.cann.hccl.HcclAllReduce(
                        send,
                        recv,
                        count,
                        HCCL_DATA_TYPE_FP32,
                        HCCL_REDUCE_SUM,
                        self.comm,
                        self.stream.raw(),
                    )
                }
            },
        )
    }

    fn gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), AscendError> {
        let expected = local.len().checked_mul(self.plan.world_size);
        if expected != Some(out.len()) {
            return Err(AscendError::Config(format!(
                "all_gather: output holds {} values, expected {} ranks × {}",
                out.len(),
                self.plan.world_size,
                local.len()
            )));
        }
        let (count, _) = staged_bytes(local.len(), size_of::<f32>())?;
        if count == 0 {
            return Ok(());
        }
        let (_, recv_bytes) = staged_bytes(out.len(), size_of::<f32>())?;
        let exchange = Exchange::Into { input: local, out };
        self.staged("HcclAllGather", exchange, recv_bytes, |send, recv| {
            // SAFETY: `send` holds `count` values and `recv` world_size × `count`; both outlive
            // the stream synchronisation after this call.
            unsafe {
                self.acl.cann.hccl.HcclAllGather(
                    send,
                    recv,
                    count,
                    HCCL_DATA_TYPE_FP32,
                    self.comm,
                    self.stream.raw(),
                )
            }
        })
    }

    /// Copies the exchange's input into the device send buffer, runs `call` (given the send
    /// and receive buffers) on this rank's stream, waits for the stream, and copies the
    /// receive buffer to the exchange's output.
    fn staged(
        &self,
        name: &'static str,
        mut exchange: Exchange<'_>,
        recv_bytes: usize,
        call: impl FnOnce(*mut c_void, *mut c_void) -> HcclResult,
    ) -> Result<(), AscendError> {
        let mut staging = self.lock()?;
        self.acl.bind_thread(self.plan.device)?;
        let Staging { send, recv } = &mut *staging;
        let send = send.at_least(size_of_val(exchange.input()))?;
        let recv = recv.at_least(recv_bytes)?;
        send.write(exchange.input())?;
        hccl_result(self.acl, name, call(send.as_ptr(), recv.as_ptr()))?;
        self.stream.synchronize()?;
        recv.read(exchange.out())
    }

    fn broadcast(&self, buf: &mut Vec<u8>, root: usize) -> Result<(), AscendError> {
        if root >= self.plan.world_size {
            return Err(AscendError::Config(format!(
                "broadcast root {root} is outside the {} ranks",
                self.plan.world_size
            )));
        }
        let root = root as u32;
        let mut staging = self.lock()?;
        self.acl.bind_thread(self.plan.device)?;
        let device_buffer = staging.send.at_least(size_of::<u64>())?;
        // The receivers learn the length first, then the bytes.
        let mut length = [buf.len() as u64];
        device_buffer.write(&length)?;
        self.broadcast_on_device(device_buffer.as_ptr(), 1, HCCL_DATA_TYPE_UINT64, root)?;
        device_buffer.read(&mut length)?;
        let len = usize::try_from(length[0]).map_err(|_| {
            AscendError::Config(format!("broadcast of {} bytes does not fit", length[0]))
        })?;
        if len == 0 {
            buf.clear();
            return Ok(());
        }
        let device_buffer = staging.send.at_least(len)?;
        if self.plan.rank == root {
            device_buffer.write(buf)?;
        }
        self.broadcast_on_device(
            device_buffer.as_ptr(),
            len as u64,
            HCCL_DATA_TYPE_UINT8,
            root,
        )?;
        buf.resize(len, 0);
        device_buffer.read(buf)
    }

    fn broadcast_on_device(
        &self,
        device_ptr: *mut std::ffi::c_void,
        count: u64,
        data_type: super::bindings::types::HcclDataType,
        root: u32,
    ) -> Result<(), AscendError> {
        // SAFETY: the caller's device buffer holds `count` elements of `data_type` and outlives
        // the synchronisation below.
        let code = unsafe {
            self.acl.cann.hccl.HcclBroadcast(
                device_ptr,
                count,
                data_type,
                root,
                self.comm,
                self.stream.raw(),
            )
        };
        hccl_result(self.acl, "HcclBroadcast", code)?;
        self.stream.synchronize()
    }

    /// HCCL reports failures of the whole communicator without naming a peer, so the rank in
    /// the error is this one; a broken communicator is treated like a lost rank (the group is
    /// torn down and recreated).
    fn collective_error(&self, err: AscendError) -> CollectiveError {
        match err {
            AscendError::Hccl {
                code: HCCL_E_TIMEOUT,
                ..
            } => CollectiveError::Timeout {
                rank: self.plan.rank as usize,
                seconds: self.exec_timeout.as_secs(),
            },
            AscendError::Config(message) => CollectiveError::Invalid(message),
            other => CollectiveError::LostRank {
                rank: self.plan.rank as usize,
                reason: format!("{other} (HCCL does not name the failing peer)"),
            },
        }
    }
}

impl Drop for HcclCollective {
    fn drop(&mut self) {
        if self.acl.bind_thread(self.plan.device).is_err() {
            return;
        }
        // SAFETY: created by HcclCommInitClusterInfo and not used after this.
        let code = unsafe { self.acl.cann.hccl.HcclCommDestroy(self.comm) };
        if let Err(err) = hccl_result(self.acl, "HcclCommDestroy", code) {
            tracing::warn!("{err}");
        }
    }
}

impl Collective for HcclCollective {
    fn rank(&self) -> usize {
        self.plan.rank as usize
    }

    fn world_size(&self) -> usize {
        self.plan.world_size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce(buf).map_err(|e| self.collective_error(e))
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        self.gather(local, out)
            .map_err(|e| self.collective_error(e))
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        self.broadcast(buf, root)
            .map_err(|e| self.collective_error(e))
    }
}

/// Like [`super::error::hccl_check`], with HCCL's own description of the code.
fn hccl_result(acl: &Acl, call: &'static str, code: HcclResult) -> Result<(), AscendError> {
    super::error::hccl_check(call, code).map_err(|_| {
        // SAFETY: HcclGetErrorString returns a static string or null.
        let text = unsafe { acl.cann.hccl.HcclGetErrorString(code) };
        let detail = (!text.is_null()).then(|| {
            // SAFETY: non-null results are NUL-terminated static strings.
            unsafe { std::ffi::CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        });
        AscendError::Hccl { call, code, detail }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = r#"{"status": "completed", "version": "1.0", "server_count": "2",
      "server_list": [
        {"server_id": "10.0.0.11", "host_ip": "10.0.0.11", "container_ip": "172.16.0.5",
         "device": [{"device_id": "4", "device_ip": "192.168.101.1", "rank_id": "0"},
                    {"device_id": "5", "device_ip": "192.168.101.2", "rank_id": "1"}]},
        {"server_id": "10.0.0.12", "host_ip": "10.0.0.12", "container_ip": "172.16.0.6",
         "device": [{"device_id": "2", "device_ip": "192.168.102.1", "rank_id": "2"},
                    {"device_id": "3", "device_ip": "192.168.102.2", "rank_id": "3"}]}]}"#;

    fn table() -> RankTable {
        match npufleet_contract::rank_table::parse(TABLE).unwrap() {
            npufleet_contract::rank_table::TableStatus::Completed(table) => table,
            npufleet_contract::rank_table::TableStatus::Initializing => {
                panic!("the test table is completed")
            }
        }
    }

    fn settings(vars: &[(&str, &str)]) -> Result<HcclSettings, AscendError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HcclSettings::from_env(move |name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    const MOUNT: &str = "/user/serverid/devindex/config/hccl.json";

    #[test]
    fn settings_default_to_hccl_timeouts() {
        let s = settings(&[("RANK_TABLE_FILE", MOUNT)]).unwrap();
        assert_eq!(s.rank_table, PathBuf::from(MOUNT));
        assert_eq!(s.connect_timeout, Duration::from_secs(120));
        assert_eq!(s.exec_timeout, Duration::from_secs(1836));
        assert_eq!(s.identity.rank_override, None);
        assert_eq!(s.identity.local_index, None);
    }

    #[test]
    fn settings_pass_valid_timeouts_through() {
        let s = settings(&[
            ("RANK_TABLE_FILE", MOUNT),
            ("HCCL_CONNECT_TIMEOUT", "7200"),
            ("HCCL_EXEC_TIMEOUT", "600"),
        ])
        .unwrap();
        assert_eq!(s.connect_timeout, Duration::from_secs(7200));
        assert_eq!(s.exec_timeout, Duration::from_secs(600));
    }

    #[test]
    fn bad_settings_are_rejected_by_name() {
        let err = |vars: &[(&str, &str)]| settings(vars).unwrap_err().to_string();
        let missing = err(&[]);
        assert!(missing.contains("RANK_TABLE_FILE is not set"), "{missing}");
        // HCCL itself refuses connect timeouts under 120 s, so the test-only escape the CPU
        // ring honours does not apply here.
        let short = err(&[
            ("RANK_TABLE_FILE", MOUNT),
            ("HCCL_CONNECT_TIMEOUT", "5"),
            ("NPUFLEET_ALLOW_SHORT_TIMEOUTS", "1"),
        ]);
        assert!(
            short.contains("HCCL_CONNECT_TIMEOUT") && short.contains("120"),
            "{short}"
        );
        let exec = err(&[("RANK_TABLE_FILE", MOUNT), ("HCCL_EXEC_TIMEOUT", "ten")]);
        assert!(exec.contains("HCCL_EXEC_TIMEOUT"), "{exec}");
        let rank = err(&[("RANK_TABLE_FILE", MOUNT), ("NPUFLEET_RANK", "first")]);
        assert!(
            rank.contains("NPUFLEET_RANK") && rank.contains("first"),
            "{rank}"
        );
        let local = err(&[("RANK_TABLE_FILE", MOUNT), ("LOCAL_RANK", "-1")]);
        assert!(local.contains("LOCAL_RANK"), "{local}");
    }

    #[test]
    fn the_plan_comes_from_the_pod_ip_and_local_rank() {
        let s = settings(&[
            ("RANK_TABLE_FILE", MOUNT),
            ("POD_IP", "172.16.0.6"),
            ("LOCAL_RANK", "1"),
        ])
        .unwrap();
        let plan = s.plan_for(&table()).unwrap();
        assert_eq!(plan.rank, 3);
        assert_eq!(plan.world_size, 4);
        assert_eq!(plan.device, 3);
        assert_eq!(plan.rank_table, PathBuf::from(MOUNT));
    }

    #[test]
    fn the_plan_maps_the_device_through_the_visible_lists() {
        let s = settings(&[
            ("RANK_TABLE_FILE", MOUNT),
            ("NPUFLEET_RANK", "1"),
            ("ASCEND_VISIBLE_DEVICES", "4,5"),
        ])
        .unwrap();
        assert_eq!(s.plan_for(&table()).unwrap().device, 1);
        let s = settings(&[
            ("RANK_TABLE_FILE", MOUNT),
            ("NPUFLEET_RANK", "1"),
            ("ASCEND_VISIBLE_DEVICES", "6,7"),
        ])
        .unwrap();
        let err = s.plan_for(&table()).unwrap_err().to_string();
        assert!(
            err.contains("device 5") && err.contains("ASCEND_VISIBLE_DEVICES=6,7"),
            "{err}"
        );
    }

    #[test]
    fn ranks_outside_the_table_or_unknown_pods_are_rejected() {
        let s = settings(&[("RANK_TABLE_FILE", MOUNT), ("NPUFLEET_RANK", "4")]).unwrap();
        let err = s.plan_for(&table()).unwrap_err().to_string();
        assert!(err.contains("NPUFLEET_RANK=4"), "{err}");
        let s = settings(&[("RANK_TABLE_FILE", MOUNT), ("POD_IP", "10.9.9.9")]).unwrap();
        let err = s.plan_for(&table()).unwrap_err().to_string();
        assert!(err.contains("10.9.9.9"), "{err}");
    }

    #[test]
    fn an_incomplete_rank_table_times_out_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hccl.json");
        std::fs::write(&path, r#"{"status": "initializing", "version": "1.0"}"#).unwrap();
        let mut s = settings(&[("RANK_TABLE_FILE", path.to_str().unwrap())]).unwrap();
        s.connect_timeout = Duration::from_millis(300);
        let err = s.plan().unwrap_err().to_string();
        assert!(
            err.contains("initializing") && err.contains("hccl.json"),
            "{err}"
        );
    }

    #[test]
    fn plan_checks_rank_against_the_table() {
        let table = Path::new("/user/serverid/devindex/config/hccl.json");
        let plan = HcclPlan::new(table, 3, 4, 1).unwrap();
        assert_eq!(plan.rank, 3);
        assert_eq!(
            plan.rank_table_c_string().unwrap().as_bytes(),
            table.as_os_str().as_encoded_bytes()
        );
        let err = HcclPlan::new(table, 4, 4, 0).unwrap_err().to_string();
        assert!(
            err.contains("rank 4 is outside") && err.contains("0..3"),
            "{err}"
        );
        let err = HcclPlan::new(table, 0, 0, 0).unwrap_err().to_string();
        assert!(err.contains("lists no ranks"), "{err}");
        let err = HcclPlan::new(table, 0, 2, -1).unwrap_err().to_string();
        assert!(err.contains("negative"), "{err}");
    }

    #[test]
    fn paths_with_nul_bytes_are_rejected() {
        use std::os::unix::ffi::OsStrExt;
        let path = Path::new(std::ffi::OsStr::from_bytes(b"/tmp/hc\0cl.json"));
        let plan = HcclPlan::new(path, 0, 1, 0).unwrap();
        let err = plan.rank_table_c_string().unwrap_err().to_string();
        assert!(err.contains("NUL"), "{err}");
    }

    #[test]
    fn staged_sizes_are_checked() {
        assert_eq!(staged_bytes(10, 4).unwrap(), (10, 40));
        assert!(staged_bytes(usize::MAX, 4).is_err());
    }
}
