//! Errors of the Ascend path, and the mapping of ACL and HCCL return codes to them.

use std::path::PathBuf;

use super::bindings::types::{
    ACL_ERROR_NAMES, ACL_SUCCESS, HCCL_RESULT_NAMES, HCCL_SUCCESS, HcclResult, aclError,
};

/// How to get the libraries, appended to every "not found" error.
pub const INSTALL_HINT: &str = "Install the CANN toolkit for this NPU (the Ascend \
    community or commercial edition, e.g. Ascend-cann-toolkit_<version>_linux-<arch>.run \
    --install), then `source <install dir>/ascend-toolkit/set_env.sh` or set ASCEND_HOME_PATH \
    to <install dir>/ascend-toolkit/latest; in a container, use an image with CANN or mount the \
    host's toolkit. Set accelerator to `cpu` or `auto` to run without NPUs.";

#[derive(Debug, thiserror::Error)]
pub enum AscendError {
    #[error(
        "CANN {} not found: {} (searched: {}). {INSTALL_HINT}",
        if missing.len() == 1 { "library" } else { "libraries" },
        missing.join(", "),
        display_paths(searched)
    )]
    LibraryNotFound {
        missing: Vec<&'static str>,
        searched: Vec<PathBuf>,
    },
    #[error("CANN library {library} found at {} but could not be loaded: {source}", path.display())]
    LibraryLoad {
        library: &'static str,
        path: PathBuf,
        source: libloading::Error,
    },
    #[error("{call} failed with ACL error {code}{}", code_name(ACL_ERROR_NAMES, i64::from(*code)))]
    Acl { call: &'static str, code: aclError },
    #[error("{call} failed with HcclResult {code}{}{}", code_name(HCCL_RESULT_NAMES, i64::from(*code)), detail_suffix(detail))]
    Hccl {
        call: &'static str,
        code: HcclResult,
        detail: Option<String>,
    },
    #[error("{0}")]
    Config(String),
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "no directories".to_string();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn code_name(table: &[(i64, &str)], code: i64) -> String {
    match table.iter().find(|(value, _)| *value == code) {
        Some((_, name)) => format!(" ({name})"),
        None => String::new(),
    }
}

fn detail_suffix(detail: &Option<String>) -> String {
    match detail {
        Some(text) if !text.is_empty() => format!(": {text}"),
        _ => String::new(),
    }
}

/// `Ok` for `ACL_SUCCESS`, otherwise an error naming the call and the code.
pub fn acl_check(call: &'static str, code: aclError) -> Result<(), AscendError> {
    if code == ACL_SUCCESS {
        Ok(())
    } else {
        Err(AscendError::Acl { call, code })
    }
}

/// `Ok` for `HCCL_SUCCESS`, otherwise an error naming the call and the code.
pub fn hccl_check(call: &'static str, code: HcclResult) -> Result<(), AscendError> {
    if code == HCCL_SUCCESS {
        Ok(())
    } else {
        Err(AscendError::Hccl {
            call,
            code,
            detail: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ascend::bindings::types::{
        ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_INVALID_DEVICEID, HCCL_E_PARA, HCCL_E_TIMEOUT,
    };

    #[test]
    fn success_codes_are_ok() {
        assert!(acl_check("aclInit", 0).is_ok());
        assert!(hccl_check("HcclAllReduce", 0).is_ok());
    }

    #[test]
    fn acl_codes_name_the_call_and_the_code() {
        let err = acl_check("aclrtMalloc", ACL_ERROR_INVALID_PARAM).unwrap_err();
        assert_eq!(
            err.to_string(),
            "aclrtMalloc failed with ACL error 100000 (ACL_ERROR_INVALID_PARAM)"
        );
        let err =
            acl_check("aclrtSetDevice", ACL_ERROR_RT_INVALID_DEVICEID as aclError).unwrap_err();
        assert_eq!(
            err.to_string(),
            "aclrtSetDevice failed with ACL error 107001 (ACL_ERROR_RT_INVALID_DEVICEID)"
        );
    }

    #[test]
    fn unknown_acl_codes_keep_the_number() {
        let err = acl_check("aclrtMemcpy", 424242).unwrap_err();
        assert_eq!(err.to_string(), "aclrtMemcpy failed with ACL error 424242");
    }

    #[test]
    fn hccl_codes_carry_the_result_name() {
        let err = hccl_check("HcclAllReduce", HCCL_E_TIMEOUT).unwrap_err();
        assert_eq!(
            err.to_string(),
            "HcclAllReduce failed with HcclResult 9 (HCCL_E_TIMEOUT)"
        );
        let err = AscendError::Hccl {
            call: "HcclCommInitClusterInfo",
            code: HCCL_E_PARA,
            detail: Some("parameter error".into()),
        };
        assert_eq!(
            err.to_string(),
            "HcclCommInitClusterInfo failed with HcclResult 1 (HCCL_E_PARA): parameter error"
        );
        let err = hccl_check("HcclBroadcast", 77).unwrap_err();
        assert_eq!(err.to_string(), "HcclBroadcast failed with HcclResult 77");
    }

    #[test]
    fn every_hccl_result_has_a_name() {
        for code in 1..=24 {
            let message = hccl_check("HcclAllGather", code).unwrap_err().to_string();
            assert!(message.ends_with(")"), "{message}");
        }
        assert!(ACL_ERROR_NAMES.len() > 150, "{}", ACL_ERROR_NAMES.len());
    }
}
