//! AVX2 + FMA + F16C kernels, and AVX-512 VNNI variants of the grouped matmul kernels in
//! [`vnni`]. Each has a scalar twin (in `quant.rs`, `kquant.rs` or `scalar.rs`) it is tested
//! against.
//!
//! The kernels live by concern in the submodules; this module detects the CPU features and
//! re-exports the entry points `cpu.rs` picks from.

mod attention;
#[macro_use]
mod common;
mod float;
#[macro_use]
mod int8;
#[macro_use]
mod kquant;
pub mod vnni;

pub use attention::{CacheValue, axpy_strided, dot_strided};
pub use float::{axpy, dot_f32_rows, exp_sum, silu_mul};
pub use int8::{
    dot_q4_0, dot_q4_1, dot_q8_0, gemm_q4_0_group, gemm_q4_1_group, gemm_q5_0_group,
    gemm_q5_1_group, gemm_q8_0_group, quantize_act,
};
pub use kquant::{
    gemm_q4_k_group, gemm_q4_kx8_group, gemm_q5_k_group, gemm_q6_k_group, gemm_q6_kx8_group,
};

/// Whether this CPU can run the kernels in this module.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}
