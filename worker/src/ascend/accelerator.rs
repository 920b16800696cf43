//! Choosing where the worker computes: `cpu`, `ascend`, or `auto` (Ascend when it works, else CPU).

use std::path::PathBuf;

use super::device::Acl;
use super::error::AscendError;
use super::library::{Cann, SearchPath};

/// The configured accelerator (CLI `--accelerator`, env `NPUFLEET_ACCELERATOR`). The operator
/// passes its accelerator type, so the chip families are accepted as names of `ascend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AcceleratorKind {
    Cpu,
    #[value(alias = "ascend910", alias = "ascend310p", alias = "npu")]
    Ascend,
    Auto,
}

/// What the worker will compute on.
#[derive(Debug)]
pub enum Selected {
    Cpu {
        /// Why `auto` did not pick the NPU; `None` when the CPU was asked for.
        fallback_reason: Option<String>,
    },
    Ascend(AscendRuntime),
}

/// CANN's libraries loaded and ACL initialised, with the NPUs this process can see.
#[derive(Debug)]
pub struct AscendRuntime {
    pub device_count: u32,
    pub libraries: Vec<PathBuf>,
}

/// Resolves the configured accelerator. `ascend` fails with the reason (which library is missing,
/// where it was looked for, how to install CANN; or which ACL call failed); `auto` falls back to
/// the CPU and hands the reason back for the caller's start-up warning.
pub fn select_backend(kind: AcceleratorKind) -> Result<Selected, AscendError> {
    resolve(kind, open_ascend)
}

/// Like [`select_backend`], looking for the libraries only in `search` and without initialising
/// ACL: the part of the decision that can be exercised on a host without NPUs.
pub fn select_libraries(
    kind: AcceleratorKind,
    search: &SearchPath,
) -> Result<Selected, AscendError> {
    resolve(kind, || {
        let cann = Cann::load(search)?;
        Ok(AscendRuntime {
            device_count: 0,
            libraries: cann.paths,
        })
    })
}

fn resolve(
    kind: AcceleratorKind,
    open: impl FnOnce() -> Result<AscendRuntime, AscendError>,
) -> Result<Selected, AscendError> {
    match kind {
        AcceleratorKind::Cpu => Ok(Selected::Cpu {
            fallback_reason: None,
        }),
        AcceleratorKind::Ascend => open().map(Selected::Ascend),
        AcceleratorKind::Auto => match open() {
            Ok(runtime) => Ok(Selected::Ascend(runtime)),
            Err(err) => Ok(Selected::Cpu {
                fallback_reason: Some(err.to_string()),
            }),
        },
    }
}

fn open_ascend() -> Result<AscendRuntime, AscendError> {
    let acl = Acl::get()?;
    let device_count = acl.device_count()?;
    if device_count == 0 {
        return Err(AscendError::Config(
            "CANN is installed but no NPU is visible to this process (check `npu-smi info`, the \
             pod's NPU resource request and ASCEND_VISIBLE_DEVICES)"
                .into(),
        ));
    }
    tracing::info!(
        device_count,
        libraries = ?acl.cann.paths,
        "Ascend runtime initialised"
    );
    Ok(AscendRuntime {
        device_count,
        libraries: acl.cann.paths.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    fn empty_search(dir: &std::path::Path) -> SearchPath {
        SearchPath::new(Some(dir.join("cann").as_os_str()), Some(OsStr::new("")))
    }

    #[test]
    fn the_operator_accelerator_types_name_ascend() {
        let parse = |v: &str| <AcceleratorKind as clap::ValueEnum>::from_str(v, false);
        assert_eq!(parse("cpu"), Ok(AcceleratorKind::Cpu));
        assert_eq!(parse("auto"), Ok(AcceleratorKind::Auto));
        for value in ["ascend", "ascend910", "ascend310p", "npu"] {
            assert_eq!(parse(value), Ok(AcceleratorKind::Ascend), "{value}");
        }
        assert!(parse("gpu").is_err());
    }

    #[test]
    fn cpu_never_touches_the_libraries() {
        let dir = tempfile::tempdir().unwrap();
        let selected = select_libraries(AcceleratorKind::Cpu, &empty_search(dir.path())).unwrap();
        assert!(matches!(
            selected,
            Selected::Cpu {
                fallback_reason: None
            }
        ));
    }

    #[test]
    fn ascend_without_cann_fails_naming_libraries_and_paths() {
        let dir = tempfile::tempdir().unwrap();
        let search = empty_search(dir.path());
        let message = select_libraries(AcceleratorKind::Ascend, &search)
            .unwrap_err()
            .to_string();
        assert!(message.contains("libascendcl.so"), "{message}");
        assert!(message.contains("libhccl.so"), "{message}");
        assert!(
            message.contains(&dir.path().join("cann/lib64").display().to_string()),
            "{message}"
        );
        assert!(
            message.contains("/usr/local/Ascend/ascend-toolkit/latest/lib64"),
            "{message}"
        );
        assert!(message.contains("Install the CANN toolkit"), "{message}");
    }

    #[test]
    fn auto_without_cann_falls_back_to_the_cpu_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let selected = select_libraries(AcceleratorKind::Auto, &empty_search(dir.path())).unwrap();
        match selected {
            Selected::Cpu {
                fallback_reason: Some(reason),
            } => assert!(reason.contains("libascendcl.so"), "{reason}"),
            other => panic!("expected a CPU fallback, got {other:?}"),
        }
    }

    #[test]
    fn select_backend_on_this_host_follows_the_environment() {
        // The process environment decides where CANN is searched for; on a host without it,
        // `ascend` fails and `auto` serves on the CPU, while on an Ascend host both select it.
        match select_backend(AcceleratorKind::Ascend) {
            Ok(Selected::Ascend(runtime)) => {
                assert!(runtime.device_count > 0);
                assert!(matches!(
                    select_backend(AcceleratorKind::Auto),
                    Ok(Selected::Ascend(_))
                ));
            }
            Ok(Selected::Cpu { .. }) => panic!("`ascend` must never select the CPU"),
            Err(err) => {
                let message = err.to_string();
                assert!(
                    message.contains("libascendcl.so") || message.contains("NPU"),
                    "{message}"
                );
                assert!(matches!(
                    select_backend(AcceleratorKind::Auto),
                    Ok(Selected::Cpu {
                        fallback_reason: Some(_)
                    })
                ));
            }
        }
    }
}

#[cfg(test)]
mod contract_tests {
    use clap::ValueEnum;
    use npufleet_contract::accelerator::AcceleratorType;

    use super::AcceleratorKind;

    /// The operator passes an InferenceService's accelerator type through `NPUFLEET_ACCELERATOR`:
    /// every one of those names must select a backend.
    #[test]
    fn every_accelerator_type_the_operator_passes_is_accepted() {
        for kind in AcceleratorType::ALL {
            let parsed = AcceleratorKind::from_str(kind.as_str(), true)
                .unwrap_or_else(|e| panic!("{kind}: {e}"));
            let expected = if kind.is_npu() {
                AcceleratorKind::Ascend
            } else {
                AcceleratorKind::Cpu
            };
            assert_eq!(parsed, expected, "{kind}");
        }
    }
}
