//! Where the repository, its set-up scripts, its binaries and the cached artefacts are.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// A file every checkout has and the local platform runs: what marks a directory as the
/// repository root.
const CHECKOUT_MARKER: &str = "tests/setup/control-plane.sh";

static ROOT: OnceLock<PathBuf> = OnceLock::new();

/// Finds the repository root once and keeps it for [`repo_root`]: `explicit` when given (a
/// flag), else the workspace of the crate cargo runs (`CARGO_MANIFEST_DIR`, read at run time:
/// build outputs are shared between checkouts, so a path compiled in could name another
/// checkout), else the checkout holding this executable, else the one holding the current
/// directory. A binary run on its own (not by cargo) passes its flag here before anything
/// asks for a path.
pub fn locate_repo_root(explicit: Option<&Path>) -> Result<&'static Path> {
    if let Some(root) = ROOT.get() {
        return Ok(root);
    }
    let is_checkout = |dir: &Path| dir.join(CHECKOUT_MARKER).is_file();
    let found = match explicit {
        Some(dir) => {
            if !is_checkout(dir) {
                bail!(
                    "{} is not an npufleet checkout: it has no {CHECKOUT_MARKER}",
                    dir.display()
                );
            }
            dir.to_path_buf()
        }
        None => {
            let starts: Vec<PathBuf> = [
                std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
                std::env::current_exe().ok(),
                std::env::current_dir().ok(),
            ]
            .into_iter()
            .flatten()
            .collect();
            starts
                .iter()
                .find_map(|start| start.ancestors().find(|dir| is_checkout(dir)))
                .with_context(|| {
                    let looked: Vec<String> =
                        starts.iter().map(|s| s.display().to_string()).collect();
                    format!(
                        "cannot find the npufleet checkout (the directory holding {CHECKOUT_MARKER}) \
                         above {}; run from inside it, or name it with --repo or NPUFLEET_REPO",
                        looked.join(", ")
                    )
                })?
                .to_path_buf()
        }
    };
    let found =
        std::path::absolute(&found).with_context(|| format!("resolving {}", found.display()))?;
    Ok(ROOT.get_or_init(|| found))
}

/// The repository root ([`locate_repo_root`] with nothing explicit, unless a binary located it
/// first). Panics where there is none: tests run under cargo, which always names one.
pub fn repo_root() -> &'static Path {
    locate_repo_root(None).unwrap_or_else(|error| panic!("{error:#}"))
}

/// Runs one of `tests/setup/*.sh` and returns everything it printed on stdout.
/// The scripts are idempotent and fast once their cache is filled.
fn setup_stdout(script: &str, args: &[&str]) -> Result<String> {
    let path = repo_root().join("tests/setup").join(script);
    let out = Command::new("bash")
        .arg(&path)
        .args(args)
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}):\n{}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).context("set-up script printed non-UTF-8")
}

/// Runs one of `tests/setup/*.sh` and returns the path it prints on its last line.
fn setup_output(script: &str, args: &[&str]) -> Result<PathBuf> {
    let stdout = setup_stdout(script, args)?;
    let last = stdout
        .lines()
        .last()
        .with_context(|| format!("{script} printed nothing"))?;
    Ok(PathBuf::from(last.trim()))
}

fn cached(cell: &'static OnceLock<PathBuf>, script: &str, args: &[&str]) -> Result<PathBuf> {
    if let Some(p) = cell.get() {
        return Ok(p.clone());
    }
    let p = setup_output(script, args)?;
    Ok(cell.get_or_init(|| p).clone())
}

/// The directory holding kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
/// etcd, helm and kwok (built on first use).
pub fn control_plane_bin() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    cached(&BIN, "control-plane.sh", &[])
}

/// llama.cpp's `llama-server`, an engine this project did not write (built on first use).
pub fn llama_server() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    cached(&BIN, "llama-server.sh", &[])
}

/// The directory holding Prometheus and prometheus-adapter (built on first use).
pub fn monitoring_bin() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    cached(&BIN, "monitoring.sh", &[])
}

/// The directory holding kubelet, kube-proxy and coredns for a real node (built, and the
/// container runtime's packages installed, on first use).
pub fn node_bin() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    cached(&BIN, "node.sh", &[])
}

/// An image archive for `ctr images import`, as the set-up scripts list them.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageArchive {
    /// What the project calls it (`pause`, `netcheck`, ...).
    pub name: String,
    /// The reference the archive names the image by.
    pub tag: String,
    pub path: PathBuf,
}

/// The tag of the image the project calls `name` (`pause`, `netcheck`) among `images`.
pub fn image_tag(images: &[ImageArchive], name: &str) -> Result<String> {
    images
        .iter()
        .find(|image| image.name == name)
        .map(|image| image.tag.clone())
        .with_context(|| format!("no {name} image among {images:?}"))
}

/// Reads `<name> <tag> <archive path>` lines, as `tests/setup/node.sh images` and
/// `tests/setup/images.sh` print them.
pub fn parse_image_lines(text: &str) -> Result<Vec<ImageArchive>> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let mut fields = line.split_whitespace();
            match (fields.next(), fields.next(), fields.next(), fields.next()) {
                (Some(name), Some(tag), Some(path), None) => Ok(ImageArchive {
                    name: name.to_owned(),
                    tag: tag.to_owned(),
                    path: PathBuf::from(path),
                }),
                _ => bail!("expected `<name> <tag> <archive path>`, got {line:?}"),
            }
        })
        .collect()
}

/// The images a real node needs whatever it runs: the pod sandbox (`pause`) and the
/// real-node tests' `netcheck`.
pub fn node_images() -> Result<Vec<ImageArchive>> {
    static IMAGES: OnceLock<Vec<ImageArchive>> = OnceLock::new();
    if let Some(images) = IMAGES.get() {
        return Ok(images.clone());
    }
    let images = parse_image_lines(&setup_stdout("node.sh", &["images"])?)?;
    Ok(IMAGES.get_or_init(|| images).clone())
}

/// The KWOK stage definitions that ship with the pinned KWOK version.
pub fn kwok_stages() -> Result<PathBuf> {
    Ok(control_plane_bin()?
        .parent()
        .context("bin dir has a parent")?
        .join("kwok-stages"))
}

/// The Gateway API Inference Extension's InferencePool CRD file (fetched on first use).
pub fn inference_pool_crd() -> Result<PathBuf> {
    static CRD: OnceLock<PathBuf> = OnceLock::new();
    cached(&CRD, "inference-extension.sh", &[])
}

/// SmolLM2-135M-Instruct (Q4_1 GGUF).
pub fn smollm2_gguf() -> Result<PathBuf> {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    cached(&MODEL, "model.sh", &[])
}

/// The Python interpreter of the environment holding the real third-party clients.
pub fn test_python() -> Result<PathBuf> {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    cached(&PY, "python-env.sh", &[])
}

/// The directory cargo puts this build's binaries in (`target/<profile>`).
pub fn target_bin_dir() -> PathBuf {
    // Integration tests live in target/<profile>/deps.
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// A binary of this workspace, built before the tests run (`cargo test --workspace` builds
/// every member's binaries).
pub fn workspace_bin(name: &str) -> Result<PathBuf> {
    let path = target_bin_dir().join(name);
    if !path.is_file() {
        bail!(
            "{} is missing; build the workspace binaries first (cargo build --workspace --bins)",
            path.display()
        );
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_lines_name_tag_and_archive() {
        let images = parse_image_lines(
            "pause registry.k8s.io/pause:3.10 /cache/pause.tar\n\nlocalhost/npufleet/npufleet-worker 0.1.0 /cache/w.tar\n",
        )
        .unwrap();
        assert_eq!(
            images,
            vec![
                ImageArchive {
                    name: "pause".into(),
                    tag: "registry.k8s.io/pause:3.10".into(),
                    path: "/cache/pause.tar".into(),
                },
                ImageArchive {
                    name: "localhost/npufleet/npufleet-worker".into(),
                    tag: "0.1.0".into(),
                    path: "/cache/w.tar".into(),
                },
            ]
        );
    }

    #[test]
    fn an_image_line_without_three_fields_is_refused() {
        for line in ["pause registry.k8s.io/pause:3.10", "a b c d"] {
            let error = parse_image_lines(line).unwrap_err().to_string();
            assert!(error.contains("<name> <tag> <archive path>"), "{error}");
        }
    }
}
