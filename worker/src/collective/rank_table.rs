//! Waiting for the mounted rank table to complete. Its schema and parser are the contract's
//! ([`npufleet_contract::rank_table`]), shared with the operator that writes it.

use std::path::Path;
use std::time::{Duration, Instant};

use npufleet_contract::rank_table::{RankTable, RankTableError, TableStatus, parse};

const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// Re-reads the mounted rank table until its status is `"completed"`, for at most `timeout`.
/// A file that does not exist yet counts as not ready; any other problem fails at once.
pub fn wait_for_completed(path: &Path, timeout: Duration) -> Result<RankTable, RankTableError> {
    wait_until_completed(
        || std::fs::read_to_string(path),
        &path.display().to_string(),
        timeout,
    )
}

fn wait_until_completed(
    mut read: impl FnMut() -> std::io::Result<String>,
    path: &str,
    timeout: Duration,
) -> Result<RankTable, RankTableError> {
    let deadline = Instant::now() + timeout;
    loop {
        match read() {
            Ok(text) => {
                if let TableStatus::Completed(table) = parse(&text)? {
                    return Ok(table);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(RankTableError::Unreadable {
                    path: path.to_string(),
                    reason: e.to_string(),
                });
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(RankTableError::StillInitializing {
                path: path.to_string(),
                seconds: timeout.as_secs(),
            });
        }
        std::thread::sleep(POLL_INTERVAL.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMPLETED: &str = r#"{"status": "completed", "version": "1.0", "server_count": "1",
      "server_list": [{"server_id": "10.0.0.11", "container_ip": "172.16.0.5",
        "device": [{"device_id": "0", "device_ip": "192.168.101.1", "rank_id": "0"},
                   {"device_id": "1", "device_ip": "192.168.101.2", "rank_id": "1"}]}]}"#;

    #[test]
    fn a_table_stuck_initializing_times_out_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hccl.json");
        std::fs::write(&path, r#"{"status": "initializing", "version": "1.0", "server_count": "0", "server_list": []}"#).unwrap();
        let started = Instant::now();
        let err = wait_for_completed(&path, Duration::from_millis(600)).unwrap_err();
        assert!(
            started.elapsed() >= Duration::from_millis(600)
                && started.elapsed() < Duration::from_secs(5)
        );
        assert!(matches!(err, RankTableError::StillInitializing { .. }));
        assert!(
            err.to_string().contains("still says \"initializing\""),
            "{err}"
        );
    }

    #[test]
    fn waiting_reads_past_a_missing_and_an_initializing_table_until_it_completes() {
        let mut reads = 0;
        let table = wait_until_completed(
            || {
                reads += 1;
                match reads {
                    1 => Err(std::io::ErrorKind::NotFound.into()),
                    2 => Ok(r#"{"status": "initializing", "version": "1.0"}"#.to_string()),
                    _ => Ok(COMPLETED.to_string()),
                }
            },
            "hccl.json",
            Duration::from_secs(20),
        )
        .unwrap();
        assert_eq!(reads, 3);
        assert_eq!(table.world_size(), 2);
    }

    #[test]
    fn an_unreadable_table_fails_at_once_naming_the_path() {
        let err = wait_until_completed(
            || Err(std::io::ErrorKind::PermissionDenied.into()),
            "/mnt/hccl.json",
            Duration::from_secs(20),
        )
        .unwrap_err();
        assert!(err.to_string().contains("/mnt/hccl.json"), "{err}");
    }
}
