//! Polling with a deadline: the only way tests wait for the cluster.

use std::future::Future;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};

/// Marks an error as final: [`until`] returns it at once instead of retrying (for example
/// when the process being waited for has exited).
#[derive(Debug)]
pub struct Fatal(pub anyhow::Error);

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for Fatal {}

pub fn fatal(e: anyhow::Error) -> anyhow::Error {
    anyhow::Error::new(Fatal(e))
}

/// Calls `check` until it returns `Ok(Some(v))` or `timeout` passes. `Ok(None)` and errors
/// mean "not yet"; the last one is reported on timeout so a failure says what was seen.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let mut poll = Poll::new(what, timeout);
    loop {
        match poll.after(check().await) {
            ControlFlow::Break(outcome) => return outcome,
            ControlFlow::Continue(pause) => tokio::time::sleep(pause).await,
        }
    }
}

/// Blocking variant for code outside an async runtime.
pub fn until_blocking<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let mut poll = Poll::new(what, timeout);
    loop {
        match poll.after(check()) {
            ControlFlow::Break(outcome) => return outcome,
            ControlFlow::Continue(pause) => std::thread::sleep(pause),
        }
    }
}

/// One wait's deadline, its backoff and the last "not yet" seen.
struct Poll<'a> {
    what: &'a str,
    timeout: Duration,
    deadline: Instant,
    interval: Duration,
    last: String,
}

impl<'a> Poll<'a> {
    fn new(what: &'a str, timeout: Duration) -> Self {
        Self {
            what,
            timeout,
            deadline: Instant::now() + timeout,
            interval: Duration::from_millis(20),
            last: String::from("condition never held"),
        }
    }

    /// What one check's result means: the wait's outcome, or how long to pause before the
    /// next check.
    fn after<T>(&mut self, checked: Result<Option<T>>) -> ControlFlow<Result<T>, Duration> {
        let what = self.what;
        match checked {
            Ok(Some(v)) => return ControlFlow::Break(Ok(v)),
            Ok(None) => {}
            Err(e) if e.is::<Fatal>() => {
                return ControlFlow::Break(Err(e.context(format!("waiting for {what}"))));
            }
            Err(e) => self.last = format!("{e:#}"),
        }
        if Instant::now() >= self.deadline {
            let (timeout, last) = (self.timeout, &self.last);
            return ControlFlow::Break(Err(anyhow!(
                "timed out after {timeout:?} waiting for {what}: {last}"
            )));
        }
        let pause = self.interval;
        self.interval = (pause * 2).min(Duration::from_millis(250));
        ControlFlow::Continue(pause)
    }
}
