//! The container images as `tests/setup/images.sh` builds them from `deploy/*.Dockerfile`
//! (this build's binaries, the runtime base from Debian packages): each archive carries the
//! tag the chart and the samples name, its entrypoint, the non-root user and its ports, and
//! the `smollm2` worker image serves the sample's model under runc as that user on a
//! read-only root with nothing writable mounted, as a pod with `readOnlyRootFilesystem` runs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use npufleet_contract::ports::{GRPC_PORT, HTTP_PORT};
use npufleet_crds::InferenceService;
use npufleet_tests::chart::{self, LocalImages};
use npufleet_tests::paths::ImageArchive;
use npufleet_tests::{net, paths, wait};
use serde_json::{Value, json};

const NONROOT: &str = "65532:65532";
const SMOLLM2_SAMPLE: &str = "deploy/samples/cpu-smollm2.yaml";

/// The images of this build, built on first use (cached by the script between runs).
fn images() -> Result<&'static [ImageArchive]> {
    static IMAGES: OnceLock<Vec<ImageArchive>> = OnceLock::new();
    if let Some(images) = IMAGES.get() {
        return Ok(images);
    }
    let built = LocalImages::build(&paths::target_bin_dir())?;
    Ok(IMAGES.get_or_init(|| built.all().into_iter().cloned().collect()))
}

fn image(repository: &str, tag: &str) -> Result<&'static ImageArchive> {
    images()?
        .iter()
        .find(|i| i.name == repository && i.tag == tag)
        .with_context(|| format!("images.sh built no {repository}:{tag}"))
}

fn tar(args: &[&std::ffi::OsStr]) -> Result<Vec<u8>> {
    let out = Command::new("tar").args(args).output()?;
    ensure!(
        out.status.success(),
        "tar {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

/// A docker-archive unpacked into a temporary directory: its one manifest entry, its image
/// configuration and its layer tarballs.
struct Archive {
    dir: tempfile::TempDir,
    manifest: Value,
    config: Value,
}

impl Archive {
    fn unpack(archive: &Path) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        tar(&[
            "-xf".as_ref(),
            archive.as_os_str(),
            "-C".as_ref(),
            dir.path().as_os_str(),
        ])?;
        let read = |name: &str| -> Result<Value> {
            let bytes = std::fs::read(dir.path().join(name))
                .with_context(|| format!("{name} in {}", archive.display()))?;
            Ok(serde_json::from_slice(&bytes)?)
        };
        let manifests = read("manifest.json")?;
        let [manifest] = manifests
            .as_array()
            .context("manifest.json is no list")?
            .as_slice()
        else {
            bail!("{} does not hold exactly one image", archive.display());
        };
        let config = read(
            manifest["Config"]
                .as_str()
                .context("manifest without Config")?,
        )?;
        Ok(Self {
            manifest: manifest.clone(),
            config: config["config"].clone(),
            dir,
        })
    }

    /// The layer tarballs, lowest first.
    fn layers(&self) -> Result<Vec<PathBuf>> {
        self.manifest["Layers"]
            .as_array()
            .context("manifest without Layers")?
            .iter()
            .map(|l| {
                Ok(self
                    .dir
                    .path()
                    .join(l.as_str().context("a layer name that is no string")?))
            })
            .collect()
    }

    fn ports(&self) -> BTreeSet<String> {
        self.config["ExposedPorts"]
            .as_object()
            .map(|ports| ports.keys().cloned().collect())
            .unwrap_or_default()
    }
}

fn chart_file(name: &str) -> Result<serde_yaml::Value> {
    let path = paths::repo_root().join("charts/npufleet").join(name);
    Ok(serde_yaml::from_str(&std::fs::read_to_string(&path)?)?)
}

/// What the SmolLM2 sample names: its worker image's name (last path segment) and tag, and
/// the model file's path in that image.
struct Sample {
    image_name: String,
    image_tag: String,
    model: String,
}

fn smollm2_sample() -> Result<Sample> {
    let path = paths::repo_root().join(SMOLLM2_SAMPLE);
    let sample: InferenceService = serde_yaml::from_str(&std::fs::read_to_string(path)?)?;
    let image = sample
        .spec
        .template
        .image
        .context("the sample names no image")?;
    let (name, tag) = name_and_tag(&image)?;
    Ok(Sample {
        image_name: name.to_owned(),
        image_tag: tag.to_owned(),
        model: sample
            .spec
            .model
            .source
            .image_path
            .context("the sample has no imagePath")?,
    })
}

/// Splits `registry/path/name:tag` into the image's name (last path segment) and tag.
fn name_and_tag(reference: &str) -> Result<(&str, &str)> {
    let (repository, tag) = reference
        .rsplit_once(':')
        .context("an image without a tag")?;
    Ok((repository.rsplit('/').next().unwrap_or(repository), tag))
}

fn tcp(ports: &[u16]) -> BTreeSet<String> {
    ports.iter().map(|p| format!("{p}/tcp")).collect()
}

#[test]
fn archives_carry_the_chart_tags_entrypoints_nonroot_user_and_ports() -> Result<()> {
    let version = chart_file("Chart.yaml")?["appVersion"]
        .as_str()
        .context("Chart.yaml has no appVersion")?
        .to_owned();
    let values = chart_file("values.yaml")?;
    let metrics_port = values["metrics"]["port"]
        .as_u64()
        .context("values.yaml has no metrics.port")?;
    let Sample {
        image_name: sample_name,
        image_tag: sample_tag,
        model,
    } = smollm2_sample()?;
    let worker_ports = tcp(&[HTTP_PORT, GRPC_PORT]);

    let expected = [
        (
            &values["image"]["repository"],
            version.clone(),
            tcp(&[metrics_port as u16]),
        ),
        (
            &values["router"]["image"]["repository"],
            version.clone(),
            worker_ports.clone(),
        ),
        (
            &values["workerImage"]["repository"],
            version.clone(),
            worker_ports.clone(),
        ),
        (
            &values["workerImage"]["repository"],
            sample_tag.to_owned(),
            worker_ports,
        ),
    ];
    assert_eq!(images()?.len(), expected.len(), "{:?}", images()?);
    for (chart_repository, tag, ports) in expected {
        let chart_repository = chart_repository
            .as_str()
            .context("an image without repository")?;
        let name = chart_repository
            .rsplit('/')
            .next()
            .unwrap_or(chart_repository);
        let image = image(&format!("localhost/npufleet/{name}"), &tag)?;
        let archive = Archive::unpack(&image.path)?;
        let reference = chart::reference(image);
        assert_eq!(
            archive.manifest["RepoTags"],
            json!([reference]),
            "{reference}"
        );
        assert_eq!(archive.config["User"], NONROOT, "{reference}");
        assert_eq!(
            archive.config["Entrypoint"],
            json!([format!("/usr/local/bin/{name}")]),
            "{reference}"
        );
        assert_eq!(archive.ports(), ports, "{reference}");
        if name == sample_name {
            assert_eq!(archive.config["Cmd"], json!(["serve"]), "{reference}");
        }
    }

    // The sample's model path is a file of the image its tag names.
    let smollm2 = image(&format!("localhost/npufleet/{sample_name}"), &sample_tag)?;
    let archive = Archive::unpack(&smollm2.path)?;
    let mut found = false;
    for layer in archive.layers()? {
        let files = String::from_utf8(tar(&["-tf".as_ref(), layer.as_os_str()])?)?;
        found |= files
            .lines()
            .any(|file| file.trim_start_matches("./") == model.trim_start_matches('/'));
    }
    ensure!(
        found,
        "{model} is in no layer of {}",
        smollm2.path.display()
    );
    Ok(())
}

/// A container run by runc from an unpacked image, with its own state directory; killed and
/// deleted on drop.
struct Container {
    runc_root: PathBuf,
    id: String,
    child: Child,
}

impl Container {
    /// Unpacks `image` under `dir` and starts its entrypoint with `args` (the image's CMD when
    /// empty) as the image's user, on a read-only root and the host's network.
    fn run(image: &ImageArchive, dir: &Path, args: &[String]) -> Result<Self> {
        let archive = Archive::unpack(&image.path)?;
        let bundle = dir.join("bundle");
        let rootfs = bundle.join("rootfs");
        std::fs::create_dir_all(&rootfs)?;
        for layer in archive.layers()? {
            tar(&[
                "--numeric-owner".as_ref(),
                "-xpf".as_ref(),
                layer.as_os_str(),
                "-C".as_ref(),
                rootfs.as_os_str(),
            ])?;
        }
        let runc_root = dir.join("runc");
        let status = Command::new("runc")
            .arg("spec")
            .current_dir(&bundle)
            .status()?;
        ensure!(status.success(), "runc spec: {status}");
        let spec_path = bundle.join("config.json");
        let mut spec: Value = serde_json::from_slice(&std::fs::read(&spec_path)?)?;
        let config = &archive.config;
        let (uid, gid) = config["User"]
            .as_str()
            .and_then(|u| u.split_once(':'))
            .context("the image names no uid:gid user")?;
        let mut process_args: Vec<Value> = config["Entrypoint"]
            .as_array()
            .context("no Entrypoint")?
            .clone();
        if args.is_empty() {
            process_args.extend(config["Cmd"].as_array().cloned().unwrap_or_default());
        } else {
            process_args.extend(args.iter().map(|a| json!(a)));
        }
        spec["process"]["terminal"] = json!(false);
        spec["process"]["user"] = json!({ "uid": uid.parse::<u32>()?, "gid": gid.parse::<u32>()? });
        spec["process"]["args"] = json!(process_args);
        spec["process"]["env"] = config["Env"].clone();
        spec["process"]["cwd"] = config["WorkingDir"].clone();
        spec["root"]["readonly"] = json!(true);
        // Without a network namespace of its own the container listens on the host's
        // loopback, where the test reaches it.
        let namespaces = spec["linux"]["namespaces"]
            .as_array_mut()
            .context("no namespaces")?;
        namespaces.retain(|n| n["type"] != "network");
        std::fs::write(&spec_path, serde_json::to_vec(&spec)?)?;
        let id = format!("npufleet-test-{}", std::process::id());
        let child = Command::new("runc")
            .arg("--root")
            .arg(&runc_root)
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .spawn()
            .context("starting runc (apt-get install runc)")?;
        Ok(Self {
            runc_root,
            id,
            child,
        })
    }

    /// The uid and gid lines of the container's first process.
    fn ids(&self) -> Result<Vec<String>> {
        let out = Command::new("runc")
            .arg("--root")
            .arg(&self.runc_root)
            .args(["state", &self.id])
            .output()?;
        ensure!(
            out.status.success(),
            "runc state: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let state: Value = serde_json::from_slice(&out.stdout)?;
        let pid = state["pid"].as_u64().context("runc state without pid")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        Ok(status
            .lines()
            .filter(|l| l.starts_with("Uid:") || l.starts_with("Gid:"))
            .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
            .collect())
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .arg("--root")
            .arg(&self.runc_root)
            .args(["delete", "--force", &self.id])
            .status();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_worker_image_serves_as_nonroot_on_a_read_only_root() -> Result<()> {
    let Sample {
        image_name: sample_name,
        image_tag: sample_tag,
        model,
    } = smollm2_sample()?;
    let image = image(&format!("localhost/npufleet/{sample_name}"), &sample_tag)?;
    let http = net::free_addr()?;
    let grpc = net::free_addr()?;
    let dir = tempfile::tempdir()?;
    let args = [
        "serve".to_owned(),
        format!("--model={model}"),
        format!("--http-addr={http}"),
        format!("--grpc-addr={grpc}"),
        "--accelerator=cpu".to_owned(),
        "--threads=1".to_owned(),
    ];
    let container = tokio::task::block_in_place(|| Container::run(image, dir.path(), &args))?;

    let client = reqwest::Client::new();
    let ready = format!("http://{http}/v2/health/ready");
    wait::until(
        "the worker in the image to be ready",
        Duration::from_secs(60),
        || async {
            Ok(client
                .get(&ready)
                .send()
                .await?
                .status()
                .is_success()
                .then_some(()))
        },
    )
    .await?;
    assert_eq!(container.ids()?, ["65532 65532 65532 65532"; 2]);

    let served = Path::new(&model)
        .file_stem()
        .context("model file name")?
        .to_string_lossy();
    let answer: Value = client
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&json!({
            "model": served,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4,
        }))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    assert_eq!(answer["usage"]["completion_tokens"], 4, "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
    );
    Ok(())
}
