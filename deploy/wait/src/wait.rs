//! Polling with a deadline: the only way the platform and the tests wait.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Result;

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
        if let Some(done) = poll.judge(check().await) {
            return done;
        }
        tokio::time::sleep(poll.next_interval()).await;
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
        if let Some(done) = poll.judge(check()) {
            return done;
        }
        std::thread::sleep(poll.next_interval());
    }
}

/// One wait's deadline, backoff and the last thing seen.
struct Poll<'a> {
    what: &'a str,
    timeout: Duration,
    deadline: Instant,
    interval: Duration,
    last: String,
}

impl<'a> Poll<'a> {
    fn new(what: &'a str, timeout: Duration) -> Self {
        Poll {
            what,
            timeout,
            deadline: Instant::now() + timeout,
            interval: Duration::from_millis(10),
            last: String::from("condition never held"),
        }
    }

    /// What one check says: done (a value, a fatal error, or the deadline passed) or not yet.
    fn judge<T>(&mut self, checked: Result<Option<T>>) -> Option<Result<T>> {
        match checked {
            Ok(Some(v)) => return Some(Ok(v)),
            Ok(None) => {}
            Err(e) if e.is::<Fatal>() => {
                return Some(Err(e.context(format!("waiting for {}", self.what))));
            }
            Err(e) => self.last = format!("{e:#}"),
        }
        (Instant::now() >= self.deadline).then(|| {
            Err(anyhow::anyhow!(
                "timed out after {:?} waiting for {}: {}",
                self.timeout,
                self.what,
                self.last
            ))
        })
    }

    /// 20 ms doubling to 250 ms: quick for what is nearly ready, light on what is slow.
    fn next_interval(&mut self) -> Duration {
        self.interval = (self.interval * 2).min(Duration::from_millis(250));
        self.interval
    }
}
