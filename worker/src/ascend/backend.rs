//! The ACL device backend: weight matrices resident in NPU memory, multiplied with
//! `aclblasGemmEx` on the device's stream; everything without a public kernel in CANN's
//! headers (attention, and the element-wise work the model does itself) stays on the host.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Mutex, OnceLock};

use half::f16;

use super::bindings::types::{
    ACL_COMPUTE_HIGH_PRECISION, ACL_FLOAT, ACL_FLOAT16, ACL_INT8, ACL_INT32, ACL_TRANS_N,
    ACL_TRANS_T, aclDataType,
};
use super::device::{Acl, DeviceBuffer, Scratch, Stream};
use super::error::{AscendError, acl_check};
use crate::backend::cpu::CpuBackend;
use crate::backend::{AttentionChunk, Backend, Matrix, WeightData};

/// Directory of single-operator models (`atc --singleop`) for the GEMM operator, handed to
/// `aclopSetModelDir`; CANN runs `aclblasGemmEx` only for operator shapes it has a model for.
pub const OP_MODEL_DIR_ENV: &str = "NPUFLEET_ACL_OP_MODEL_DIR";

/// `y[n × rows] = x[n × cols] · Wᵀ` as one row-major GEMM call: A = x (n × k), B = W stored
/// rows × k and read transposed, C = y (n × rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
}

impl GemmShape {
    pub fn for_matmul(tokens: usize, rows: usize, cols: usize) -> Result<GemmShape, AscendError> {
        let int = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| {
                AscendError::Config(format!("GEMM {what} {v} exceeds aclblasGemmEx's int range"))
            })
        };
        Ok(GemmShape {
            m: int("m", tokens)?,
            n: int("n", rows)?,
            k: int("k", cols)?,
            lda: int("lda", cols)?,
            ldb: int("ldb", cols)?,
            ldc: int("ldc", rows)?,
        })
    }
}

/// Per-row symmetric int8: row `r` is `q[r] · scale[r]`, |q| ≤ 127. Used for weights (once, at
/// upload) and for activations (per token, before each product).
pub fn quantize_rows_i8(values: &[f32], cols: usize) -> (Vec<i8>, Vec<f32>) {
    let rows = values.len().checked_div(cols).unwrap_or(0);
    let mut q = vec![0i8; values.len()];
    let mut scales = vec![0f32; rows];
    for ((row, out), scale) in values
        .chunks_exact(cols.max(1))
        .zip(q.chunks_exact_mut(cols.max(1)))
        .zip(scales.iter_mut())
    {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        if max == 0.0 || !max.is_finite() {
            continue;
        }
        *scale = max / 127.0;
        let inv = 127.0 / max;
        for (o, v) in out.iter_mut().zip(row) {
            *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
    (q, scales)
}

/// Turns the device's int32 accumulators back into `y = x · Wᵀ`.
pub fn dequantize_products(acc: &[i32], token_scales: &[f32], row_scales: &[f32], out: &mut [f32]) {
    let rows = row_scales.len();
    for ((out_row, acc_row), ts) in out
        .chunks_exact_mut(rows)
        .zip(acc.chunks_exact(rows))
        .zip(token_scales)
    {
        for ((o, a), rs) in out_row.iter_mut().zip(acc_row).zip(row_scales) {
            *o = *a as f32 * ts * rs;
        }
    }
}

/// A weight matrix in device memory.
enum DeviceWeight {
    F16(DeviceBuffer),
    I8 {
        data: DeviceBuffer,
        row_scales: Vec<f32>,
    },
}

/// Weights are found again by where the model keeps them: the model owns its matrices for as
/// long as it uses the backend and never changes them after loading.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct WeightKey {
    address: usize,
    rows: usize,
    cols: usize,
    kind: &'static str,
}

impl WeightKey {
    fn of(w: &Matrix) -> WeightKey {
        let address = match &w.data {
            WeightData::F32(v) => v.as_ptr() as usize,
            WeightData::F16(v) => v.as_ptr() as usize,
            WeightData::Q4_0(v) => v.as_ptr() as usize,
            WeightData::Q4_1(v) => v.as_ptr() as usize,
            WeightData::Q5_0(v) => v.as_ptr() as usize,
            WeightData::Q5_1(v) => v.as_ptr() as usize,
            WeightData::Q8_0(v) => v.as_ptr() as usize,
            WeightData::Q4K(v) => v.as_ptr() as usize,
            WeightData::Q4KX8(v) => v.as_ptr() as usize,
            WeightData::Q5K(v) => v.as_ptr() as usize,
            WeightData::Q6K(v) => v.as_ptr() as usize,
            WeightData::Q6KX8(v) => v.as_ptr() as usize,
        };
        WeightKey {
            address,
            rows: w.rows,
            cols: w.cols,
            kind: w.type_name(),
        }
    }
}

struct DeviceState {
    weights: HashMap<WeightKey, DeviceWeight>,
    input: Scratch,
    output: Scratch,
    /// α = 1 and β = 0 as GEMM operands on the device, for f32 and for int32 results.
    alpha_f32: DeviceBuffer,
    beta_f32: DeviceBuffer,
    alpha_i32: DeviceBuffer,
    beta_i32: DeviceBuffer,
    device_bytes: usize,
}

pub struct AclBackend {
    acl: &'static Acl,
    device: i32,
    stream: Stream,
    host: CpuBackend,
    state: Mutex<DeviceState>,
    reported_failure: OnceLock<()>,
}

impl AclBackend {
    /// Opens NPU `device` (an `aclrtSetDevice` index); `threads` sizes the host pool that runs
    /// attention and the fallback path.
    pub fn new(device: i32, threads: usize) -> Result<AclBackend, AscendError> {
        let acl = Acl::get()?;
        let count = acl.device_count()?;
        if device < 0 || device as u32 >= count {
            return Err(AscendError::Config(format!(
                "NPU {device} does not exist: this process sees {count} (ASCEND_RT_VISIBLE_DEVICES \
                 and the pod's NPU request decide which)"
            )));
        }
        acl.bind_thread(device)?;
        set_op_model_dir(acl)?;
        let stream = Stream::new(acl, device)?;
        let host = CpuBackend::new(threads)
            .map_err(|e| AscendError::Config(format!("host thread pool: {e}")))?;
        let state = DeviceState {
            weights: HashMap::new(),
            input: Scratch::new(acl),
            output: Scratch::new(acl),
            alpha_f32: DeviceBuffer::upload(acl, &[1f32])?,
            beta_f32: DeviceBuffer::upload(acl, &[0f32])?,
            alpha_i32: DeviceBuffer::upload(acl, &[1i32])?,
            beta_i32: DeviceBuffer::upload(acl, &[0i32])?,
            device_bytes: 0,
        };
        Ok(AclBackend {
            acl,
            device,
            stream,
            host,
            state: Mutex::new(state),
            reported_failure: OnceLock::new(),
        })
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// Bytes of weights held in device memory.
    pub fn resident_bytes(&self) -> usize {
        self.state.lock().map(|s| s.device_bytes).unwrap_or(0)
    }

    fn matmul_on_device(
        &self,
        w: &Matrix,
        x: &[f32],
        tokens: usize,
        out: &mut [f32],
    ) -> Result<(), AscendError> {
        let shape = GemmShape::for_matmul(tokens, w.rows, w.cols)?;
        let mut state = self
            .state
            .lock()
            .map_err(|_| AscendError::Config("an earlier device matmul panicked".into()))?;
        self.acl.bind_thread(self.device)?;
        let key = WeightKey::of(w);
        if !state.weights.contains_key(&key) {
            let (weight, bytes) = self.upload(w)?;
            state.device_bytes += bytes;
            state.weights.insert(key, weight);
        }
        let DeviceState {
            weights,
            input,
            output,
            alpha_f32,
            beta_f32,
            alpha_i32,
            beta_i32,
            ..
        } = &mut *state;
        let Some(weight) = weights.get(&key) else {
            return Err(AscendError::Config(
                "device weight cache lost an entry".into(),
            ));
        };
        match weight {
            DeviceWeight::F16(data) => {
                let x16: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                let input = input.at_least(size_of_val(x16.as_slice()))?;
                input.write(&x16)?;
                let output = output.at_least(size_of_val(out))?;
                self.gemm(
                    shape,
                    (input, ACL_FLOAT16),
                    (data, ACL_FLOAT16),
                    (output, ACL_FLOAT),
                    (alpha_f32, beta_f32),
                )?;
                output.read(out)
            }
            DeviceWeight::I8 { data, row_scales } => {
                let (xq, token_scales) = quantize_rows_i8(x, w.cols);
                let input = input.at_least(xq.len())?;
                input.write(&xq)?;
                let output = output.at_least(out.len() * size_of::<i32>())?;
                self.gemm(
                    shape,
                    (input, ACL_INT8),
                    (data, ACL_INT8),
                    (output, ACL_INT32),
                    (alpha_i32, beta_i32),
                )?;
                let mut acc = vec![0i32; out.len()];
                output.read(&mut acc)?;
                dequantize_products(&acc, &token_scales, row_scales, out);
                Ok(())
            }
        }
    }

    /// Float weights go to the device as f16, block-quantised ones as per-row int8.
    fn upload(&self, w: &Matrix) -> Result<(DeviceWeight, usize), AscendError> {
        if w.is_quantized() {
            let (q, row_scales) = quantize_rows_i8(&w.to_f32(), w.cols);
            let data = DeviceBuffer::upload(self.acl, &q)?;
            let bytes = data.bytes();
            Ok((DeviceWeight::I8 { data, row_scales }, bytes))
        } else {
            let f16 = w.to_f16_matrix();
            let WeightData::F16(values) = &f16.data else {
                return Err(AscendError::Config(
                    "f16 conversion produced another type".into(),
                ));
            };
            let data = DeviceBuffer::upload(self.acl, values)?;
            let bytes = data.bytes();
            Ok((DeviceWeight::F16(data), bytes))
        }
    }

    fn gemm(
        &self,
        shape: GemmShape,
        (a, a_type): (&DeviceBuffer, aclDataType),
        (b, b_type): (&DeviceBuffer, aclDataType),
        (c, c_type): (&DeviceBuffer, aclDataType),
        (alpha, beta): (&DeviceBuffer, &DeviceBuffer),
    ) -> Result<(), AscendError> {
        // SAFETY: every buffer was sized for `shape` by the caller and stays alive until the
        // stream is synchronised below; α and β match C's type.
        let code = unsafe {
            self.acl.cann.blas.aclblasGemmEx(
                ACL_TRANS_N,
                ACL_TRANS_T,
                ACL_TRANS_N,
                shape.m,
                shape.n,
                shape.k,
                alpha.as_ptr(),
                a.as_ptr(),
                shape.lda,
                a_type,
                b.as_ptr(),
                shape.ldb,
                b_type,
                beta.as_ptr(),
                c.as_ptr(),
                shape.ldc,
                c_type,
                ACL_COMPUTE_HIGH_PRECISION,
                self.stream.raw(),
            )
        };
        acl_check("aclblasGemmEx", code)?;
        self.stream.synchronize()
    }
}

/// `aclopSetModelDir` may be called once per process.
fn set_op_model_dir(acl: &Acl) -> Result<(), AscendError> {
    static SET: OnceLock<()> = OnceLock::new();
    let Some(dir) = std::env::var_os(OP_MODEL_DIR_ENV).filter(|d| !d.is_empty()) else {
        return Ok(());
    };
    if SET.get().is_some() {
        return Ok(());
    }
    use std::os::unix::ffi::OsStrExt;
    let path = CString::new(dir.as_bytes())
        .map_err(|_| AscendError::Config(format!("{OP_MODEL_DIR_ENV} contains a NUL byte")))?;
    // SAFETY: `path` is NUL-terminated and outlives the call.
    acl_check("aclopSetModelDir", unsafe {
        acl.cann.op.aclopSetModelDir(path.as_ptr())
    })?;
    let _ = SET.set(());
    Ok(())
}

impl Backend for AclBackend {
    fn name(&self) -> String {
        format!(
            "ascend (NPU {}: matmul via aclblasGemmEx, f16 and int8; attention on the host: {})",
            self.device,
            self.host.name()
        )
    }

    fn threads(&self) -> usize {
        self.host.threads()
    }

    fn run(&self, work: &mut (dyn FnMut() + Send)) {
        self.host.run(work)
    }

    fn matmul(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        w.check_matmul_shapes(x, n, out);
        if n == 0 {
            return;
        }
        if let Err(err) = self.matmul_on_device(w, x, n, out) {
            // The trait has no error path: keep serving on the host and say so once.
            if self.reported_failure.set(()).is_ok() {
                tracing::error!(
                    "NPU {} matmul failed, falling back to the host for failed calls: {err}",
                    self.device
                );
            }
            self.host.matmul(w, x, n, out);
        }
    }

    fn swiglu(&self, gate: &mut [f32], up: &[f32], width: usize) {
        self.host.swiglu(gate, up, width)
    }

    fn attention(&self, q: &[f32], chunks: &[AttentionChunk<'_>], n_heads: usize, out: &mut [f32]) {
        self.host.attention(q, chunks, n_heads, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_shape_is_row_major_x_times_w_transposed() {
        let s = GemmShape::for_matmul(3, 1536, 576).unwrap();
        assert_eq!((s.m, s.n, s.k), (3, 1536, 576));
        assert_eq!((s.lda, s.ldb, s.ldc), (576, 576, 1536));
        let err = GemmShape::for_matmul(1, 1 << 31, 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("GEMM n 2147483648"), "{err}");
    }

    #[test]
    fn int8_rows_round_trip_within_half_a_step() {
        let values: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.13)
            .collect();
        let (q, scales) = quantize_rows_i8(&values, 32);
        assert_eq!(scales.len(), 2);
        for (r, row) in values.chunks(32).enumerate() {
            let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scales[r], max / 127.0);
            for (c, v) in row.iter().enumerate() {
                let back = q[r * 32 + c] as f32 * scales[r];
                assert!((back - v).abs() <= scales[r] / 2.0 + 1e-6, "{back} vs {v}");
            }
        }
        assert!(q.iter().any(|&v| v == 127 || v == -127));
    }

    #[test]
    fn zero_rows_quantise_to_zero() {
        let (q, scales) = quantize_rows_i8(&[0.0; 8], 4);
        assert_eq!(q, vec![0; 8]);
        assert_eq!(scales, vec![0.0, 0.0]);
    }

    /// The int8 scheme the device runs (per-row weights and per-token activations, exact int32
    /// products) stays close to the host's f32 result on a real-sized projection.
    #[test]
    fn int8_products_track_the_f32_matmul() {
        let (tokens, rows, cols) = (3, 48, 576);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 2003) as f32 / 2003.0 - 0.5) * 0.2)
            .collect();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 4.0)
            .collect();
        let (wq, row_scales) = quantize_rows_i8(&w, cols);
        let (xq, token_scales) = quantize_rows_i8(&x, cols);
        let acc: Vec<i32> = (0..tokens)
            .flat_map(|t| {
                let (xq, wq) = (&xq, &wq);
                (0..rows).map(move |r| {
                    (0..cols)
                        .map(|c| i32::from(xq[t * cols + c]) * i32::from(wq[r * cols + c]))
                        .sum()
                })
            })
            .collect();
        let mut int8 = vec![0f32; tokens * rows];
        dequantize_products(&acc, &token_scales, &row_scales, &mut int8);

        let host = CpuBackend::new(1).unwrap();
        let mut exact = vec![0f32; tokens * rows];
        host.matmul(&Matrix::f32(rows, cols, w), &x, tokens, &mut exact);
        let norm = exact.iter().map(|v| v * v).sum::<f32>().sqrt();
        let err = exact
            .iter()
            .zip(&int8)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        assert!(err / norm < 0.01, "relative error {}", err / norm);
    }

    #[test]
    fn weights_are_keyed_by_storage_and_shape() {
        let a = Matrix::f32(2, 3, vec![0.0; 6]);
        let b = Matrix::f32(2, 3, vec![0.0; 6]);
        assert_eq!(WeightKey::of(&a), WeightKey::of(&a));
        assert_ne!(WeightKey::of(&a), WeightKey::of(&b));
        assert_ne!(WeightKey::of(&a), WeightKey::of(&a.to_f16_matrix()));
    }
}
