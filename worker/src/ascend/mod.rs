//! The Ascend NPU path: CANN's ACL runtime for device memory, streams and matrix products, and
//! HCCL for the tensor-parallel collectives.
//!
//! Nothing here is linked: [`bindings`] are generated from the vendor's headers and the
//! libraries are opened at run time ([`library`]) only when the configured accelerator is
//! Ascend, so the same binary serves on CPU-only hosts. [`accelerator::select_backend`] makes
//! that decision; [`backend::AclBackend`] and [`hccl::HcclCollective`] plug into the model's
//! backend and collective interfaces.

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    clippy::all
)]
#[rustfmt::skip]
pub mod bindings;

pub mod accelerator;
pub mod backend;
pub mod device;
pub mod error;
pub mod hccl;
pub mod library;

pub use accelerator::{AcceleratorKind, AscendRuntime, Selected, select_backend};
pub use error::AscendError;
