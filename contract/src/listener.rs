//! How every listener of the worker and the router takes connections, written once: each
//! accepted socket gets `TCP_NODELAY`, each listener holds at most `--max-connections`, a
//! connection that sends no request in time is closed, and on shutdown every connection is
//! closed once its open requests are answered.
//!
//! The bounds, and what enforces them:
//! - `--header-read-timeout`: a new connection must open its first request within it (any
//!   protocol; a connection still silent, or still in its HTTP/2 handshake, is closed), and an
//!   HTTP/1 connection must send a request's complete headers within it of starting to wait
//!   for them (hyper's own header-read timeout, which starts at the end of the previous
//!   response).
//! - `--idle-timeout`: a connection on which no request has been open for that long is closed
//!   (HTTP/2: a GOAWAY first). On HTTP/1 the header-read timeout, counted from the end of the
//!   last response, closes an idle connection first when it is the shorter.
//! - `--max-connections`: a connection beyond it is still accepted, and answered: every
//!   request on it gets 503 with `Retry-After: 1` (HTTP) or UNAVAILABLE (gRPC) naming the limit,
//!   and it is closed after that answer (HTTP/1) or with a GOAWAY (HTTP/2), at the latest after
//!   `--header-read-timeout`. Past [`REFUSING_CONNECTIONS`] such connections at once, a further
//!   one is closed unanswered. Well-behaved clients retry either elsewhere or later, while the
//!   connections within the limit are served as before.
//! - HTTP/2 keep-alive pings (`--http2-keepalive-interval`) drop a peer that has gone away
//!   mid-stream, and `--http2-max-concurrent-streams` bounds one connection's open requests.

use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;

/// hyper's own default for its HTTP/1 header-read timeout.
pub const DEFAULT_HEADER_READ_TIMEOUT_SECONDS: f64 = 30.0;
pub const DEFAULT_IDLE_TIMEOUT_SECONDS: f64 = 60.0;
/// Far below the file descriptors a pod gets (tens of thousands): the router holds an
/// upstream connection beside each client's.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 4096;
pub const DEFAULT_HTTP2_KEEPALIVE_INTERVAL_SECONDS: f64 = 30.0;
/// Above a worker's queue limit plus its batch (1024 + 128 by default): the router sends every
/// gRPC request for one worker over a single connection.
pub const DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS: u32 = 2048;

/// Connections over the limit answered at once with a refusal; beyond them a connection is
/// closed unanswered, so that a flood of connections cannot hold descriptors for long.
pub const REFUSING_CONNECTIONS: usize = 64;

/// How long a connection told to close may take to finish with no request open, before it is
/// dropped: enough for a GOAWAY or the last bytes of a response to go out.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The bounds a listener puts on its connections; the flags (and environment variables) of
/// the worker's `serve` and of the router.
#[derive(Clone, Copy, Debug, PartialEq, clap::Args)]
pub struct ConnectionLimits {
    /// Longest wait, in seconds, for a request: a new connection must open its first request
    /// within it, and an HTTP/1 connection must send a request's complete headers within it
    /// of the previous response (or of opening). Slower connections are closed.
    #[arg(
        long,
        env = "NPUFLEET_HEADER_READ_TIMEOUT",
        default_value_t = DEFAULT_HEADER_READ_TIMEOUT_SECONDS,
        value_parser = parse_positive_seconds,
    )]
    pub header_read_timeout: f64,
    /// Seconds a connection with no request open is kept before it is closed (HTTP/2 gets a
    /// GOAWAY first). An idle HTTP/1 connection also meets --header-read-timeout, whichever
    /// is shorter.
    #[arg(
        long,
        env = "NPUFLEET_IDLE_TIMEOUT",
        default_value_t = DEFAULT_IDLE_TIMEOUT_SECONDS,
        value_parser = parse_positive_seconds,
    )]
    pub idle_timeout: f64,
    /// Most connections open at once on each listener. A connection beyond it gets 503 with
    /// Retry-After (HTTP) or UNAVAILABLE (gRPC) to its requests and is closed.
    #[arg(
        long,
        env = "NPUFLEET_MAX_CONNECTIONS",
        default_value_t = DEFAULT_MAX_CONNECTIONS,
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub max_connections: u32,
    /// Seconds between the HTTP/2 pings sent on each connection; a peer that leaves one
    /// unanswered as long is disconnected. 0 sends none.
    #[arg(
        long,
        env = "NPUFLEET_HTTP2_KEEPALIVE_INTERVAL",
        default_value_t = DEFAULT_HTTP2_KEEPALIVE_INTERVAL_SECONDS,
        value_parser = parse_seconds,
    )]
    pub http2_keepalive_interval: f64,
    /// Most requests (streams) open at once on one HTTP/2 connection; a client waits for one
    /// to end before it opens more.
    #[arg(
        long,
        env = "NPUFLEET_HTTP2_MAX_CONCURRENT_STREAMS",
        default_value_t = DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS,
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub http2_max_concurrent_streams: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT_SECONDS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT_SECONDS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            http2_keepalive_interval: DEFAULT_HTTP2_KEEPALIVE_INTERVAL_SECONDS,
            http2_max_concurrent_streams: DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS,
        }
    }
}

impl ConnectionLimits {
    pub fn header_read(&self) -> Duration {
        Duration::from_secs_f64(self.header_read_timeout)
    }

    pub fn idle(&self) -> Duration {
        Duration::from_secs_f64(self.idle_timeout)
    }

    /// How long an HTTP/1 connection may wait for its next request before the server closes
    /// it: a client pool should drop idle connections sooner, so that it never sends a request
    /// on one the server is closing.
    pub fn http1_keep_alive(&self) -> Duration {
        self.header_read().min(self.idle())
    }

    fn http2_keepalive(&self) -> Option<Duration> {
        (self.http2_keepalive_interval > 0.0)
            .then(|| Duration::from_secs_f64(self.http2_keepalive_interval))
    }
}

/// A number of seconds, `s` suffix allowed, not negative.
pub fn parse_seconds(value: &str) -> Result<f64, String> {
    let seconds: f64 = value
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("'{value}' is not a number of seconds"))?;
    if seconds.is_finite() && seconds >= 0.0 {
        Ok(seconds)
    } else {
        Err(format!("'{value}' is not a non-negative number of seconds"))
    }
}

/// A number of seconds above zero.
pub fn parse_positive_seconds(value: &str) -> Result<f64, String> {
    let seconds = parse_seconds(value)?;
    if seconds > 0.0 {
        Ok(seconds)
    } else {
        Err(format!("'{value}' must be more than 0 seconds"))
    }
}

/// What a listener speaks, and so how it refuses a connection over its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1, and HTTP/2 with prior knowledge; refused with 503.
    Http,
    /// HTTP/2 only; refused with UNAVAILABLE.
    Grpc,
}

/// Serves `app` on `listener` within `limits` until `shutdown` resolves; then stops accepting,
/// asks every connection to close (HTTP/2: GOAWAY) and returns once each has, its open
/// requests answered. `configure` sees each accepted socket first.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    protocol: Protocol,
    limits: ConnectionLimits,
    configure: impl Fn(&TcpStream) + Send,
    shutdown: impl Future<Output = ()> + Send,
) {
    let builder = Arc::new(connection_builder(protocol, &limits));
    let slots = Arc::new(Semaphore::new(limits.max_connections as usize));
    let refusing = Arc::new(Semaphore::new(REFUSING_CONNECTIONS));
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
        };
        // Without it a streamed token waits for the client's delayed ACK of the one before
        // (40 ms on Linux) whenever two are written within a round trip.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::warn!(%error, "cannot set TCP_NODELAY on a connection");
        }
        configure(&stream);
        if let Ok(slot) = slots.clone().try_acquire_owned() {
            connections.spawn(serve_connection(
                stream,
                app.clone(),
                builder.clone(),
                limits,
                stopping.clone(),
                slot,
            ));
        } else if let Ok(refusal) = refusing.clone().try_acquire_owned() {
            tracing::debug!(
                limit = limits.max_connections,
                "refusing a connection over --max-connections"
            );
            connections.spawn(refuse(stream, protocol, limits, refusal));
        } else {
            tracing::debug!(
                limit = limits.max_connections,
                "closing a connection over --max-connections unanswered"
            );
        }
    }
    drop(listener);
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
}

fn connection_builder(
    protocol: Protocol,
    limits: &ConnectionLimits,
) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read());
    let keepalive = limits.http2_keepalive();
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .keep_alive_interval(keepalive)
        .keep_alive_timeout(keepalive.unwrap_or_default());
    match protocol {
        Protocol::Http => builder,
        Protocol::Grpc => builder.http2_only(),
    }
}

/// A failed accept is the client's (a connection reset before it was taken) or passes with
/// time (out of file descriptors); either way the listener goes on.
async fn accept_failed(error: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if !matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        tracing::error!(%error, "accepting a connection failed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn serve_connection(
    stream: TcpStream,
    app: axum::Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: ConnectionLimits,
    mut stopping: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let open = Arc::new(watch::channel(0usize).0);
    let mut requests = open.subscribe();
    let service = Counted { app, open };
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = pin!(connection);
    // A connection that opens no request in time is dropped: it has nothing to finish, and
    // one still in its HTTP/2 handshake would not take a GOAWAY.
    let used = tokio::select! {
        served = connection.as_mut() => return log_end(served),
        // The first change of the count is the first request opening.
        first = tokio::time::timeout(limits.header_read(), requests.changed()) => first.is_ok(),
        _ = stopping.wait_for(|stop| *stop) => true,
    };
    if !used {
        return;
    }
    tokio::select! {
        served = connection.as_mut() => return log_end(served),
        () = quiet_for(&mut requests, limits.idle()) => {}
        _ = stopping.wait_for(|stop| *stop) => {}
    }
    connection.as_mut().graceful_shutdown();
    tokio::select! {
        served = connection.as_mut() => log_end(served),
        () = quiet_for(&mut requests, CLOSE_GRACE) => {}
    }
}

fn log_end(served: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    if let Err(error) = served {
        tracing::debug!(%error, "a connection ended with an error");
    }
}

/// Resolves once no request has been open on the connection for `quiet`. Any change of the
/// count starts the wait again: a request that opens and closes within it is not lost.
async fn quiet_for(requests: &mut watch::Receiver<usize>, quiet: Duration) {
    loop {
        if requests.wait_for(|open| *open == 0).await.is_err() {
            return ended().await;
        }
        match tokio::time::timeout(quiet, requests.changed()).await {
            Err(_) => return,
            Ok(Ok(())) => {}
            Ok(Err(_)) => return ended().await,
        }
    }
}

/// The connection's service is gone, and with it the connection, which ends the wait.
async fn ended() {
    std::future::pending().await
}

/// The listener's app, counting the connection's open requests: a request is open from its
/// headers to the end of its response body.
#[derive(Clone)]
struct Counted {
    app: axum::Router,
    open: Arc<watch::Sender<usize>>,
}

impl hyper::service::Service<Request<Incoming>> for Counted {
    type Response = Response<CountedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let open = OpenRequest::new(self.open.clone());
        let app = self.app.clone();
        Box::pin(async move {
            let response = app.oneshot(request).await?;
            Ok(response.map(|body| CountedBody { body, _open: open }))
        })
    }
}

/// One open request; closed when dropped.
struct OpenRequest(Arc<watch::Sender<usize>>);

impl OpenRequest {
    fn new(open: Arc<watch::Sender<usize>>) -> Self {
        open.send_modify(|n| *n += 1);
        OpenRequest(open)
    }
}

impl Drop for OpenRequest {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// A response body that keeps its request open until the connection is done with it.
struct CountedBody {
    body: Body,
    _open: OpenRequest,
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Answers every request of a connection over the limit with a refusal that names it, and
/// closes the connection after the first answer (HTTP/1) or with a GOAWAY (HTTP/2).
async fn refuse(
    stream: TcpStream,
    protocol: Protocol,
    limits: ConnectionLimits,
    _refusal: OwnedSemaphorePermit,
) {
    let message = format!(
        "the server already has {} connections open, the most --max-connections allows; \
         retry on a new connection later",
        limits.max_connections
    );
    let builder = match protocol {
        Protocol::Http => auto::Builder::new(TokioExecutor::new()),
        Protocol::Grpc => auto::Builder::new(TokioExecutor::new()).http2_only(),
    };
    let answered = Arc::new(tokio::sync::Notify::new());
    let service = {
        let answered = answered.clone();
        hyper::service::service_fn(move |_request: Request<Incoming>| {
            answered.notify_one();
            std::future::ready(Ok::<_, Infallible>(refusal(protocol, &message)))
        })
    };
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = pin!(connection);
    let refused = async {
        // After the first answer, so that an HTTP/2 GOAWAY cannot overtake the client's first
        // request; what it sent meanwhile is answered too.
        tokio::select! {
            _ = connection.as_mut() => return,
            () = answered.notified() => connection.as_mut().graceful_shutdown(),
        }
        let _ = connection.await;
    };
    let _ = tokio::time::timeout(limits.header_read(), refused).await;
}

fn refusal(protocol: Protocol, message: &str) -> Response<Body> {
    match protocol {
        Protocol::Grpc => tonic::Status::unavailable(message).into_http(),
        Protocol::Http => {
            let body = serde_json::json!({
                "error": {
                    "message": message,
                    "type": "service_unavailable",
                    "param": null,
                    "code": "too_many_connections",
                }
            });
            let mut response = Response::new(Body::from(body.to_string()));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            let headers = response.headers_mut();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::routing::get;
    use clap::Parser;
    use npufleet_test_support::raw_http;
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// How long the slow route takes to answer: longer than the idle bound of the tests.
    const SLOW: Duration = Duration::from_millis(600);

    /// `/` answers at once; `/slow` tells `entered` it has begun, then takes [`SLOW`].
    fn app(entered: Arc<tokio::sync::Notify>) -> axum::Router {
        axum::Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/slow",
                get(|| async move {
                    entered.notify_one();
                    tokio::time::sleep(SLOW).await;
                    "slow"
                }),
            )
    }

    fn limits(header_read: f64, idle: f64, max_connections: u32) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: header_read,
            idle_timeout: idle,
            max_connections,
            ..ConnectionLimits::default()
        }
    }

    struct Server {
        address: SocketAddr,
        /// Stops the server when sent or dropped.
        stop: tokio::sync::oneshot::Sender<()>,
        served: tokio::task::JoinHandle<()>,
        slow_entered: Arc<tokio::sync::Notify>,
    }

    /// Serves [`app`] on a loopback port.
    async fn start(limits: ConnectionLimits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let slow_entered = Arc::new(tokio::sync::Notify::new());
        let served = tokio::spawn(serve(
            listener,
            app(slow_entered.clone()),
            Protocol::Http,
            limits,
            |_| {},
            async {
                let _ = stopped.await;
            },
        ));
        Server {
            address,
            stop,
            served,
            slow_entered,
        }
    }

    #[tokio::test]
    async fn a_partial_request_head_is_closed_within_the_header_read_timeout() {
        let server = start(limits(0.3, 30.0, 16)).await;
        let mut partial = TcpStream::connect(server.address).await.unwrap();
        partial
            .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n")
            .await
            .unwrap();
        let (sent, after) = raw_http::wait_closed(&mut partial, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(sent.is_empty(), "{}", String::from_utf8_lossy(&sent));
        assert!(
            (Duration::from_millis(250)..Duration::from_millis(900)).contains(&after),
            "closed after {after:?}"
        );
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_within_the_header_read_timeout() {
        let server = start(limits(0.3, 30.0, 16)).await;
        let mut silent = TcpStream::connect(server.address).await.unwrap();
        let (_, after) = raw_http::wait_closed(&mut silent, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            (Duration::from_millis(250)..Duration::from_millis(900)).contains(&after),
            "closed after {after:?}"
        );
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout_but_a_slow_request_is_answered()
     {
        let server = start(limits(30.0, 0.3, 16)).await;
        // Open longer than the idle bound: a request in progress is not idleness.
        let mut slow = TcpStream::connect(server.address).await.unwrap();
        assert_eq!(
            raw_http::get(&mut slow, "/slow").await.unwrap(),
            (200, "slow".into())
        );
        // A request answered at once, before the connection's watch could see it open.
        let mut kept = TcpStream::connect(server.address).await.unwrap();
        assert_eq!(
            raw_http::get(&mut kept, "/").await.unwrap(),
            (200, "ok".into())
        );
        let within = Duration::from_secs(5);
        let (slow, kept) = tokio::join!(
            raw_http::wait_closed(&mut slow, within),
            raw_http::wait_closed(&mut kept, within),
        );
        for (_, after) in [slow.unwrap(), kept.unwrap()] {
            assert!(
                (Duration::from_millis(200)..Duration::from_millis(900)).contains(&after),
                "closed after {after:?}"
            );
        }
    }

    #[tokio::test]
    async fn connections_over_the_limit_get_503_while_the_first_ones_are_served() {
        let server = start(limits(30.0, 30.0, 2)).await;
        let mut first = TcpStream::connect(server.address).await.unwrap();
        let mut second = TcpStream::connect(server.address).await.unwrap();
        for connection in [&mut first, &mut second] {
            assert_eq!(raw_http::get(connection, "/").await.unwrap().0, 200);
        }

        let answer = raw_http::get_until_closed(server.address, "/", Duration::from_secs(5))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.to_lowercase().contains("retry-after: 1"), "{answer}");
        assert!(answer.contains("--max-connections"), "{answer}");

        for connection in [&mut first, &mut second] {
            assert_eq!(raw_http::get(connection, "/").await.unwrap().0, 200);
        }
        // A closed connection frees its place.
        drop(first);
        npufleet_test_support::wait::until(
            "a place freed by a closed connection",
            Duration::from_secs(5),
            || async {
                let mut next = TcpStream::connect(server.address).await?;
                Ok((raw_http::get(&mut next, "/").await?.0 == 200).then_some(()))
            },
        )
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn shutdown_answers_open_requests_and_closes_every_connection() {
        let server = start(limits(30.0, 30.0, 16)).await;
        let mut idle = TcpStream::connect(server.address).await.unwrap();
        assert_eq!(raw_http::get(&mut idle, "/").await.unwrap().0, 200);
        let mut busy = TcpStream::connect(server.address).await.unwrap();
        busy.write_all(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), server.slow_entered.notified())
            .await
            .expect("the slow request reached its handler");
        server.stop.send(()).unwrap();
        assert_eq!(
            raw_http::read_response(&mut busy).await.unwrap(),
            (200, "slow".into())
        );
        raw_http::wait_closed(&mut idle, Duration::from_secs(5))
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), server.served)
            .await
            .expect("serve returned once every connection closed")
            .unwrap();
    }

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        limits: ConnectionLimits,
    }

    #[test]
    fn the_flags_default_to_the_documented_bounds_and_refuse_nonsense() {
        let defaults = Flags::try_parse_from(["serve"]).unwrap().limits;
        assert_eq!(defaults, ConnectionLimits::default());
        let set = Flags::try_parse_from(["serve", "--idle-timeout", "2.5s"])
            .unwrap()
            .limits;
        assert_eq!(set.idle(), Duration::from_millis(2500));
        for (flag, value, says) in [
            ("--idle-timeout", "0", "must be more than 0 seconds"),
            (
                "--header-read-timeout",
                "soon",
                "is not a number of seconds",
            ),
            ("--max-connections", "0", "0"),
        ] {
            let error = Flags::try_parse_from(["serve", flag, value])
                .err()
                .unwrap_or_else(|| panic!("{flag} {value} was accepted"))
                .to_string();
            assert!(error.contains(flag) && error.contains(says), "{error}");
        }
    }
}
