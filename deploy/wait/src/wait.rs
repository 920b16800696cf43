//! Polling with a deadline: the only way the platform and the tests wait.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

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
    let deadline = Instant::now() + timeout;
    let mut interval = Duration::from_millis(20);
    let mut last = String::from("condition never held");
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) if e.is::<Fatal>() => return Err(e.context(format!("waiting for {what}"))),
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}: {last}");
        }
        tokio::time::sleep(interval).await;
        interval = (interval * 2).min(Duration::from_millis(250));
    }
}

/// Blocking variant for code outside an async runtime.
pub fn until_blocking<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut interval = Duration::from_millis(20);
    let mut last = String::from("condition never held");
    loop {
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) if e.is::<Fatal>() => return Err(e.context(format!("waiting for {what}"))),
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}: {last}");
        }
        std::thread::sleep(interval);
        interval = (interval * 2).min(Duration::from_millis(250));
    }
}
