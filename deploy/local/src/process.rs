//! Child processes that can never outlive the test binary.
//!
//! Every process is started in its own process group with `PR_SET_PDEATHSIG`, from one
//! long-lived spawner thread (the signal follows the *thread* that forked, so a test's own
//! thread would take its children down when the test ends). Processes and scratch
//! directories are also registered for an `atexit` clean-up, because a shared cluster lives
//! in a `static` whose destructor never runs.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// What an exit clean-up undoes beyond killing process groups and removing directories (a
/// container runtime's mounts and network, for example), keyed by [`register_clean_up`]'s id.
type CleanUp = Box<dyn FnMut() + Send>;

struct Registry {
    pids: Vec<i32>,
    clean_ups: Vec<(u64, CleanUp)>,
    dirs: Vec<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    pids: Vec::new(),
    clean_ups: Vec::new(),
    dirs: Vec::new(),
});

extern "C" fn clean_up_at_exit() {
    let Ok(mut reg) = REGISTRY.lock() else { return };
    for pid in reg.pids.drain(..) {
        // SAFETY: signalling a process group we created; a stale id only yields ESRCH.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
    // After the kills (nothing starts new containers any more), before the directories
    // that may hold mounts go.
    for (_, mut clean_up) in reg.clean_ups.drain(..) {
        clean_up();
    }
    for dir in reg.dirs.drain(..) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn register_at_exit() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: registering a plain extern "C" function with no captured state.
        unsafe { libc::atexit(clean_up_at_exit) };
    });
}

/// Runs `clean_up` when the test binary exits, unless [`unregister_clean_up`] takes it back
/// first (its owner ran it on drop). Returns the id to take it back with.
pub fn register_clean_up(clean_up: impl FnMut() + Send + 'static) -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    register_at_exit();
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    REGISTRY
        .lock()
        .expect("registry")
        .clean_ups
        .push((id, Box::new(clean_up)));
    id
}

/// Takes back a clean-up [`register_clean_up`] registered.
pub fn unregister_clean_up(id: u64) {
    if let Ok(mut reg) = REGISTRY.lock() {
        reg.clean_ups.retain(|(registered, _)| *registered != id);
    }
}

/// A directory removed when the test binary exits (or by [`ScratchDir::drop`]).
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    pub fn new(prefix: &str) -> Result<Self> {
        register_at_exit();
        remove_stale_scratch_dirs();
        let path = std::env::temp_dir().join(format!(
            "npufleet-test-{}-{prefix}-{}",
            std::process::id(),
            unique_suffix()
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        REGISTRY.lock().expect("registry").dirs.push(path.clone());
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        if let Ok(mut reg) = REGISTRY.lock() {
            reg.dirs.retain(|d| d != &self.path);
        }
    }
}

fn unique_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{:x}{:x}", nanos, N.fetch_add(1, Ordering::Relaxed))
}

/// Directories left by a test binary that was SIGKILLed (no `atexit` ran).
fn remove_stale_scratch_dirs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("npufleet-test-") else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            // SAFETY: signal 0 only checks that the process exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            if !alive {
                // A real node's containers may still hold mounts there.
                unmount_below(&entry.path(), |_| true);
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    });
}

/// Detaches every mount point below `dir` that `select` picks, deepest first, so that removing
/// the directory removes only its own files.
pub fn unmount_below(dir: &Path, select: impl Fn(&Path) -> bool) {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mount_point(field)))
        .filter(|point| point.starts_with(dir) && point != dir && select(point))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    points.dedup();
    for point in points {
        let Ok(c_path) = std::ffi::CString::new(point.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path; detaching a mount the caller owns.
        unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
    }
}

/// `/proc/self/mountinfo` writes space, tab, newline and backslash in a path as `\ooo`.
fn unescape_mount_point(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|digits| {
            std::str::from_utf8(digits)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("process-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The thread must outlive every child; park it when the sender is gone.
                loop {
                    std::thread::park();
                }
            })
            .expect("spawner thread");
        Mutex::new(tx)
    })
}

/// A running child process, killed with its whole process group on drop.
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
    command: Recorded,
    /// Killed and waited for: its id may belong to another process by now, so it is never
    /// signalled again.
    reaped: bool,
}

/// What [`Process::restart`] starts again.
struct Recorded {
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    envs: Vec<(std::ffi::OsString, Option<std::ffi::OsString>)>,
    dir: Option<PathBuf>,
}

impl Recorded {
    fn of(cmd: &Command) -> Self {
        Self {
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
            envs: cmd
                .get_envs()
                .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
                .collect(),
            dir: cmd.get_current_dir().map(Path::to_path_buf),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        for (key, value) in &self.envs {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
        if let Some(dir) = &self.dir {
            cmd.current_dir(dir);
        }
        cmd
    }
}

impl Process {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub fn start(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        register_at_exit();
        let command = Recorded::of(&cmd);
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        spawner()
            .lock()
            .expect("spawner")
            .send((cmd, reply_tx))
            .context("spawner thread is gone")?;
        let child = reply_rx
            .recv()
            .context("spawner thread is gone")?
            .with_context(|| format!("starting {name}"))?;
        REGISTRY
            .lock()
            .expect("registry")
            .pids
            .push(child.id() as i32);
        Ok(Self {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            command,
            reaped: false,
        })
    }

    /// Kills the process group (SIGKILL, as a crash would) and starts the same command line
    /// again, appending to the same log: a fault test's restart.
    pub fn restart(&mut self) -> Result<()> {
        // The old process must be gone first: it holds the ports the new one binds.
        self.kill();
        let restarted = Process::start(&self.name, self.command.command(), &self.log)?;
        drop(std::mem::replace(self, restarted));
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of the process's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `Some(status)` once the process has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.try_wait().ok().flatten();
        if status.is_some() {
            self.mark_reaped();
        }
        status
    }

    /// Fails with the log's tail when the process has already exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.try_wait() {
            anyhow::bail!(
                "{} exited with {status}; last log lines:\n{}",
                self.name,
                self.log_tail(30)
            );
        }
        Ok(())
    }

    /// Sends `signal` to the process group.
    pub fn signal(&self, signal: i32) {
        if self.reaped {
            return;
        }
        // SAFETY: signalling the process group this struct owns, whose leader is not reaped.
        unsafe { libc::kill(-(self.child.id() as i32), signal) };
    }

    /// SIGTERM, then SIGKILL if the process has not exited within `grace`.
    pub fn terminate(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    /// SIGKILL to the process group, once; waits for the process.
    pub fn kill(&mut self) {
        if self.reaped {
            return;
        }
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
        self.mark_reaped();
    }

    fn mark_reaped(&mut self) {
        self.reaped = true;
        let pid = self.child.id() as i32;
        if let Ok(mut reg) = REGISTRY.lock() {
            reg.pids.retain(|p| *p != pid);
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Keeps processes running as a Deployment keeps its pod running: one that exited is started
/// again with the same command line, up to a limit of restarts each, past which the error
/// names its exit and carries its log's tail rather than loop on a process that cannot start.
pub struct Supervisor {
    limit: u32,
    restarts: std::collections::HashMap<String, u32>,
}

impl Supervisor {
    pub fn new(limit: u32) -> Self {
        Self {
            limit,
            restarts: Default::default(),
        }
    }

    /// Starts again each of `processes` that has exited; returns a line for each restart.
    pub fn restart_exited(&mut self, processes: &mut [&mut Process]) -> Result<Vec<String>> {
        let mut said = Vec::new();
        for process in processes.iter_mut() {
            let Some(status) = process.try_wait() else {
                continue;
            };
            let restarts = self.restarts.entry(process.name().to_string()).or_default();
            anyhow::ensure!(
                *restarts < self.limit,
                "{} exited with {status} after {} restarts; last log lines:\n{}",
                process.name(),
                self.limit,
                process.log_tail(30)
            );
            *restarts += 1;
            process.restart()?;
            said.push(format!(
                "{} exited with {status}; started again (restart {}), as its Deployment's pod would be; log: {}",
                process.name(),
                restarts,
                process.log_path().display()
            ));
        }
        Ok(said)
    }
}

/// Runs `cmd` to completion and returns what it printed; a non-zero exit is an error that
/// carries the command and everything it printed.
pub fn stdout_of(mut cmd: Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exited_process_is_started_again_until_its_restarts_run_out() {
        let log = std::env::temp_dir().join(format!("supervised-{}.log", unique_suffix()));
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo started; exit 3"]);
        let mut process = Process::start("short-lived", cmd, &log).expect("sh starts");
        let mut supervisor = Supervisor::new(2);
        let mut restarted = Vec::new();
        let error =
            crate::wait::until_blocking("the restarts to run out", Duration::from_secs(30), || {
                match supervisor.restart_exited(&mut [&mut process]) {
                    Ok(lines) => {
                        restarted.extend(lines);
                        Ok(None)
                    }
                    Err(error) => Ok(Some(error)),
                }
            })
            .unwrap_or_else(|timeout| panic!("{timeout:#}; restarted only {restarted:?}"));
        assert_eq!(restarted.len(), 2, "{restarted:?}");
        assert!(
            restarted[0]
                .starts_with("short-lived exited with exit status: 3; started again (restart 1)"),
            "{}",
            restarted[0]
        );
        let message = error.to_string();
        assert!(
            message.contains("short-lived exited with exit status: 3 after 2 restarts"),
            "{message}"
        );
        // Three runs, one log: the error carries what each printed.
        assert_eq!(
            message.matches("started\n").count() + usize::from(message.ends_with("started")),
            3,
            "{message}"
        );
        let _ = std::fs::remove_file(log);
    }
}
