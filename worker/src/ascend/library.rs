//! Finding and opening CANN's shared libraries at run time.
//!
//! The worker links nothing from CANN: the libraries are opened only when the accelerator is
//! Ascend, so one binary runs on CPU-only hosts too.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::bindings::{acl_blas::AclBlas, acl_op::AclOp, acl_runtime::AclRuntime, hccl::Hccl};
use super::error::AscendError;

/// The toolkit's install location when neither `ASCEND_HOME_PATH` nor `LD_LIBRARY_PATH` names it.
pub const DEFAULT_CANN_HOME: &str = "/usr/local/Ascend/ascend-toolkit/latest";

pub const ASCENDCL: &str = "libascendcl.so";
pub const ACL_OP_EXECUTOR: &str = "libacl_op_executor.so";
pub const ACL_CBLAS: &str = "libacl_cblas.so";
pub const HCCL: &str = "libhccl.so";

/// The directories searched for CANN's libraries, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SearchPath {
    dirs: Vec<PathBuf>,
}

impl SearchPath {
    /// `$ASCEND_HOME_PATH/lib64`, then each `LD_LIBRARY_PATH` entry, then the default install.
    pub fn new(ascend_home: Option<&OsStr>, ld_library_path: Option<&OsStr>) -> Self {
        let mut dirs = Vec::new();
        if let Some(home) = ascend_home.filter(|h| !h.is_empty()) {
            dirs.push(Path::new(home).join("lib64"));
        }
        if let Some(paths) = ld_library_path {
            dirs.extend(std::env::split_paths(paths).filter(|p| !p.as_os_str().is_empty()));
        }
        dirs.push(Path::new(DEFAULT_CANN_HOME).join("lib64"));
        let mut unique = Vec::with_capacity(dirs.len());
        for dir in dirs {
            if !unique.contains(&dir) {
                unique.push(dir);
            }
        }
        SearchPath { dirs: unique }
    }

    pub fn from_env() -> Self {
        Self::new(
            std::env::var_os("ASCEND_HOME_PATH").as_deref(),
            std::env::var_os("LD_LIBRARY_PATH").as_deref(),
        )
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The first directory holding `library`.
    pub fn find(&self, library: &str) -> Option<PathBuf> {
        self.dirs
            .iter()
            .map(|dir| dir.join(library))
            .find(|path| path.is_file())
    }
}

/// The opened CANN libraries, one function table each.
pub struct Cann {
    pub runtime: AclRuntime,
    pub op: AclOp,
    pub blas: AclBlas,
    pub hccl: Hccl,
    /// Where each library was opened from, for the start-up log.
    pub paths: Vec<PathBuf>,
}

impl Cann {
    /// Opens every library the worker needs, or names all that are missing and where they were
    /// looked for.
    pub fn load(search: &SearchPath) -> Result<Cann, AscendError> {
        let ascendcl = search.find(ASCENDCL);
        // Newer toolkits move the single-operator API out of libascendcl.so.
        let op_executor = search.find(ACL_OP_EXECUTOR).or_else(|| ascendcl.clone());
        let cblas = search.find(ACL_CBLAS);
        let hccl = search.find(HCCL);
        let missing: Vec<&'static str> =
            [(ASCENDCL, &ascendcl), (ACL_CBLAS, &cblas), (HCCL, &hccl)]
                .into_iter()
                .filter(|(_, found)| found.is_none())
                .map(|(name, _)| name)
                .collect();
        let (Some(ascendcl), Some(op_executor), Some(cblas), Some(hccl)) =
            (ascendcl, op_executor, cblas, hccl)
        else {
            return Err(AscendError::LibraryNotFound {
                missing,
                searched: search.dirs.clone(),
            });
        };
        // SAFETY: these are CANN's own libraries, found in its install directories; opening them
        // runs their initialisers, which is what linking against them would do too. Every symbol
        // is resolved against the signature generated from the same version's headers.
        let runtime = open(ASCENDCL, &ascendcl, |p| unsafe { AclRuntime::new(p) })?;
        let op = open(ACL_OP_EXECUTOR, &op_executor, |p| unsafe { AclOp::new(p) })?;
        let blas = open(ACL_CBLAS, &cblas, |p| unsafe { AclBlas::new(p) })?;
        let hccl_table = open(HCCL, &hccl, |p| unsafe { Hccl::new(p) })?;
        Ok(Cann {
            runtime,
            op,
            blas,
            hccl: hccl_table,
            paths: vec![ascendcl, op_executor, cblas, hccl],
        })
    }

    /// The process-wide libraries, opened on first use from the environment's search path.
    /// A failed attempt is not remembered, so the error is reported to every caller.
    pub fn get() -> Result<&'static Cann, AscendError> {
        static CANN: OnceLock<Cann> = OnceLock::new();
        if let Some(cann) = CANN.get() {
            return Ok(cann);
        }
        let loaded = Cann::load(&SearchPath::from_env())?;
        Ok(CANN.get_or_init(|| loaded))
    }
}

fn open<T>(
    library: &'static str,
    path: &Path,
    load: impl FnOnce(&Path) -> Result<T, libloading::Error>,
) -> Result<T, AscendError> {
    load(path).map_err(|source| AscendError::LibraryLoad {
        library,
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_order_is_home_then_ld_library_path_then_default() {
        let search = SearchPath::new(
            Some(OsStr::new("/opt/cann/latest")),
            Some(OsStr::new("/a/lib::/b/lib:/opt/cann/latest/lib64")),
        );
        let expected: Vec<PathBuf> = [
            "/opt/cann/latest/lib64",
            "/a/lib",
            "/b/lib",
            "/usr/local/Ascend/ascend-toolkit/latest/lib64",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(search.dirs(), expected.as_slice());
    }

    #[test]
    fn without_environment_only_the_default_is_searched() {
        let search = SearchPath::new(None, None);
        assert_eq!(
            search.dirs(),
            [PathBuf::from(
                "/usr/local/Ascend/ascend-toolkit/latest/lib64"
            )]
        );
        let empty = SearchPath::new(Some(OsStr::new("")), Some(OsStr::new("")));
        assert_eq!(empty, search);
    }

    #[test]
    fn missing_libraries_are_all_named_with_every_searched_directory() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("cann");
        let extra = dir.path().join("extra");
        std::fs::create_dir_all(&extra).unwrap();
        let search = SearchPath::new(Some(home.as_os_str()), Some(extra.as_os_str()));
        let message = Cann::load(&search).err().expect("no CANN here").to_string();
        for name in [ASCENDCL, ACL_CBLAS, HCCL] {
            assert!(message.contains(name), "{message}");
        }
        for searched in search.dirs() {
            assert!(
                message.contains(&searched.display().to_string()),
                "{message}"
            );
        }
        assert!(message.contains("Install the CANN toolkit"), "{message}");
        assert!(message.contains("ASCEND_HOME_PATH"), "{message}");
    }

    #[test]
    fn a_file_that_is_not_a_library_is_reported_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let lib64 = dir.path().join("lib64");
        std::fs::create_dir_all(&lib64).unwrap();
        for name in [ASCENDCL, ACL_CBLAS, HCCL] {
            std::fs::write(lib64.join(name), b"not an ELF file").unwrap();
        }
        let search = SearchPath::new(Some(dir.path().as_os_str()), None);
        let err = Cann::load(&search).err().expect("garbage must not load");
        let message = err.to_string();
        assert!(
            matches!(
                err,
                AscendError::LibraryLoad {
                    library: ASCENDCL,
                    ..
                }
            ),
            "{message}"
        );
        assert!(
            message.contains(&lib64.join(ASCENDCL).display().to_string()),
            "{message}"
        );
    }
}
