//! When a request goes to another replica, the one rule of the HTTP front door, gRPC calls and
//! each request of a gRPC stream: only a failure before the replica answered anything (it
//! could not be reached, or it refused the request: 503 / UNAVAILABLE while draining or
//! warming up, 429 / RESOURCE_EXHAUSTED with its queue full) is tried again, on a replica not
//! tried yet, at most `max_attempts` times in all, after a short backoff with jitter. Once a
//! replica's answer has begun reaching the client nothing is retried: the driver hands the
//! answer over and is done.

use std::time::Duration;

use http::StatusCode;
use tonic::Code;

use crate::error::RouteError;
use crate::pool::Lease;
use crate::request::RoutedRequest;
use crate::route::Router;

/// Why an attempt is tried again; the `reason` label of the retry metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// No connection to the replica.
    Connect,
    /// The connection failed before the replica answered.
    Transport,
    /// The replica is draining or warming up (503, UNAVAILABLE).
    Unavailable,
    /// The replica's queue is full (429, RESOURCE_EXHAUSTED).
    Busy,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Connect => "connect",
            Reason::Transport => "transport",
            Reason::Unavailable => "unavailable",
            Reason::Busy => "busy",
        }
    }

    /// A replica's HTTP status that refuses the request, if it is one.
    pub fn of_http_status(status: StatusCode) -> Option<Reason> {
        match status {
            StatusCode::SERVICE_UNAVAILABLE => Some(Reason::Unavailable),
            StatusCode::TOO_MANY_REQUESTS => Some(Reason::Busy),
            _ => None,
        }
    }

    /// An HTTP request that got no response at all.
    pub fn of_http_error(error: &reqwest::Error) -> Reason {
        if error.is_connect() {
            Reason::Connect
        } else {
            Reason::Transport
        }
    }

    /// A gRPC status that means the replica refused or never saw the call, if it is one.
    /// (The channel reports a replica it cannot reach as UNAVAILABLE too.)
    pub fn of_grpc_code(code: Code) -> Option<Reason> {
        match code {
            Code::Unavailable => Some(Reason::Unavailable),
            Code::ResourceExhausted => Some(Reason::Busy),
            _ => None,
        }
    }
}

/// The retry budget and the backoff between attempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Replicas one request may be sent to, the first included.
    pub max_attempts: usize,
    /// The wait before the first retry; it doubles with each further one.
    pub backoff_base: Duration,
    /// The longest wait between two attempts.
    pub backoff_max: Duration,
}

impl RetryPolicy {
    /// After `attempts` attempts, the last refused: how long to wait before the next, or
    /// `None` when the budget is spent. `jitter` in `0..1` (a random draw) spreads the wait
    /// over its upper half, so that requests refused together do not come back together.
    pub fn next_attempt(&self, attempts: usize, jitter: f64) -> Option<Duration> {
        (attempts < self.max_attempts).then(|| self.backoff(attempts, jitter))
    }

    /// The wait before retry number `retry` (1 for the first).
    pub fn backoff(&self, retry: usize, jitter: f64) -> Duration {
        let doublings = u32::try_from(retry.saturating_sub(1)).unwrap_or(u32::MAX);
        let full = self
            .backoff_base
            .saturating_mul(2u32.saturating_pow(doublings))
            .min(self.backoff_max);
        full.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0)
    }
}

/// How one attempt at a replica went.
pub enum Attempt<T, E> {
    /// The replica took the request: `T` goes to the client, and the request is never retried
    /// from here on.
    Answered(T),
    /// The replica did not take the request: another may.
    Refused(Reason, E),
    /// A failure the replica gave as its answer (a bad request, an internal error): retrying
    /// would not mend it, or the replica may have acted on the request.
    Failed(E),
}

/// Why a request got no replica's answer.
pub enum Unanswered<E> {
    /// No replica could be had: the router's own answer (unknown model, hold over, ...).
    Route(RouteError),
    /// The replica's failure that ends the request: one not to retry, or the last refusal once
    /// the budget was spent or no replica was left to try.
    Replica { pod: String, error: E },
}

/// Sends `request` by `attempt` to replicas in turn, per the router's [`RetryPolicy`]: the
/// replica that answered (its lease counts the request in flight there) and its answer. `first`,
/// if given, is the replica to try first. Records the replica in the current span and the
/// retries in the metrics.
pub async fn send<T, E, F, Fut>(
    router: &Router,
    request: &RoutedRequest,
    mut first: Option<Lease>,
    mut attempt: F,
) -> Result<(Lease, T), Unanswered<E>>
where
    F: FnMut(&Lease) -> Fut,
    Fut: Future<Output = Attempt<T, E>>,
{
    let policy = router.settings.retry;
    let model = request.model.as_str();
    let mut tried: Vec<String> = Vec::new();
    let mut refused: Option<(Reason, String, E)> = None;
    loop {
        let lease = match first.take() {
            Some(lease) => Ok(lease),
            None => router.lease(request, &tried).await,
        };
        let lease = match (lease, refused.take()) {
            (Ok(lease), None) => lease,
            (Ok(lease), Some((reason, _, _))) => {
                router
                    .metrics
                    .retries
                    .with_label_values(&[model, reason.as_str()])
                    .inc();
                lease
            }
            // Every replica was tried: the last refusal is the answer.
            (Err(RouteError::ReplicasFailed { .. }), Some((reason, pod, error))) => {
                exhausted(router, model, reason);
                return Err(Unanswered::Replica { pod, error });
            }
            (Err(error), _) => return Err(Unanswered::Route(error)),
        };
        tried.push(lease.pod.clone());
        tracing::Span::current().record("replica", lease.pod.as_str());
        let (reason, error) = match attempt(&lease).await {
            Attempt::Answered(answer) => return Ok((lease, answer)),
            Attempt::Failed(error) => {
                return Err(Unanswered::Replica {
                    pod: lease.pod.clone(),
                    error,
                });
            }
            Attempt::Refused(reason, error) => (reason, error),
        };
        tracing::debug!(replica = %lease.pod, reason = reason.as_str(), "the replica did not take the request");
        let pod = lease.pod.clone();
        drop(lease);
        let Some(wait) = policy.next_attempt(tried.len(), rand::random()) else {
            exhausted(router, model, reason);
            return Err(Unanswered::Replica { pod, error });
        };
        tokio::time::sleep(wait).await;
        refused = Some((reason, pod, error));
    }
}

fn exhausted(router: &Router, model: &str, reason: Reason) {
    router
        .metrics
        .retries_exhausted
        .with_label_values(&[model, reason.as_str()])
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 5,
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(40),
    };

    #[test]
    fn refusals_before_an_answer_are_retried_and_answers_are_not() {
        assert_eq!(
            Reason::of_http_status(StatusCode::SERVICE_UNAVAILABLE),
            Some(Reason::Unavailable)
        );
        assert_eq!(
            Reason::of_http_status(StatusCode::TOO_MANY_REQUESTS),
            Some(Reason::Busy)
        );
        for answered in [
            StatusCode::OK,
            StatusCode::BAD_REQUEST,
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::BAD_GATEWAY,
        ] {
            assert_eq!(Reason::of_http_status(answered), None, "{answered}");
        }
        assert_eq!(
            Reason::of_grpc_code(Code::Unavailable),
            Some(Reason::Unavailable)
        );
        assert_eq!(
            Reason::of_grpc_code(Code::ResourceExhausted),
            Some(Reason::Busy)
        );
        for answered in [
            Code::InvalidArgument,
            Code::Internal,
            Code::Unauthenticated,
            Code::Cancelled,
        ] {
            assert_eq!(Reason::of_grpc_code(answered), None, "{answered:?}");
        }
    }

    #[test]
    fn the_budget_counts_every_attempt_the_first_included() {
        assert!(POLICY.next_attempt(1, 0.0).is_some());
        assert!(POLICY.next_attempt(4, 0.0).is_some());
        assert_eq!(POLICY.next_attempt(5, 0.0), None);
        let once = RetryPolicy {
            max_attempts: 1,
            ..POLICY
        };
        assert_eq!(
            once.next_attempt(1, 0.5),
            None,
            "one attempt leaves no retry"
        );
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap() {
        let top = |retry| POLICY.backoff(retry, 1.0);
        assert_eq!(
            [top(1), top(2), top(3), top(4), top(60)],
            [10, 20, 40, 40, 40].map(Duration::from_millis)
        );
    }

    #[test]
    fn jitter_spreads_the_wait_over_its_upper_half() {
        assert_eq!(POLICY.backoff(2, 0.0), Duration::from_millis(10));
        assert_eq!(POLICY.backoff(2, 0.5), Duration::from_millis(15));
        assert_eq!(POLICY.backoff(2, 1.0), Duration::from_millis(20));
        // An out-of-range draw stays within the bounds.
        assert_eq!(POLICY.backoff(2, 7.0), Duration::from_millis(20));
        assert_eq!(POLICY.backoff(2, -1.0), Duration::from_millis(10));
    }
}
