//! Ranks as processes linked by TCP: one persistent connection to the successor and one from
//! the predecessor, opened once when the ring is built.
//!
//! Both sockets are non-blocking and a single thread drives them with `poll`, so a rank's send
//! to its successor and its receive from its predecessor overlap without extra threads or
//! copies: data is written straight from the caller's buffer and handed to the caller in
//! pieces as it is read. Frames carry an 8-byte header (kind, length); an abort frame carries
//! the error that ended the ring, so every rank names the rank that was really lost.

use std::io::{self, ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use socket2::{Domain, Protocol, SockRef, Socket, TcpKeepalive, Type};

use super::{Incoming, PIECE_ALIGN, Transport, frame_length_mismatch};
use crate::collective::CollectiveError;

const SOCKET_BUFFER_BYTES: usize = 4 * 1024 * 1024;
const INBOX_BYTES: usize = 1024 * 1024;
/// Most bytes read from the predecessor at once: small enough to stay in cache until the
/// reduction reads them.
const READ_BYTES: usize = 1024 * 1024;
const HEADER_BYTES: usize = 8;
const FRAME_DATA: u32 = 1;
const FRAME_ABORT: u32 = 2;
const HELLO_MAGIC: &[u8; 4] = b"NFRG";
const HELLO_VERSION: u32 = 1;
const HELLO_BYTES: usize = 16;
/// How long a failing rank spends telling its successor before it closes the link.
const ABORT_GRACE: Duration = Duration::from_secs(2);
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(100);
const MAX_ABORT_REASON_BYTES: usize = 1024;
/// Frames at least this large are written by a second thread while this one receives.
const THREADED_SEND_MIN_BYTES: usize = 1024 * 1024;
/// How often a sending thread blocked on a full socket checks whether to give up.
const STOP_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// Where the ring's ranks listen and how long to wait for them.
#[derive(Clone, Debug)]
pub struct TcpRingSetup {
    pub rank: usize,
    /// The listening address of every rank, in rank order.
    pub endpoints: Vec<SocketAddr>,
    /// Deadline for opening both links (`HCCL_CONNECT_TIMEOUT`).
    pub connect_timeout: Duration,
    /// Longest a collective waits for a neighbour to make progress.
    pub op_timeout: Duration,
}

/// Opens the listening socket a rank's predecessor connects to.
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    // Accepted sockets inherit these; the receive window is negotiated at connect time.
    socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES)?;
    socket.set_send_buffer_size(SOCKET_BUFFER_BYTES)?;
    socket.bind(&addr.into())?;
    socket.listen(16)?;
    Ok(socket.into())
}

struct Links {
    to_successor: TcpStream,
    from_predecessor: TcpStream,
}

/// Bytes read from the predecessor but not yet handed over; may hold the start of the next
/// frame when the predecessor runs ahead.
struct Inbox {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// A frame partly written to the successor; an abort pads it out so the abort frame that
/// follows is read as a frame.
#[derive(Clone, Copy)]
struct OwedFrame {
    header: [u8; HEADER_BYTES],
    written: usize,
    total: usize,
}

pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    op_timeout: Duration,
    links: Option<Links>,
    inbox: Inbox,
    owed: Option<OwedFrame>,
    parked: Option<TcpStream>,
}

enum FrameHeader {
    Data,
    Abort(usize),
}

/// Where a received frame goes.
enum Sink<'a> {
    Pieces(&'a mut dyn FnMut(&[u8])),
    /// Read straight into this buffer, bypassing the inbox once the frame has started.
    Buffer(&'a mut [u8]),
}

struct Receiving<'a> {
    len: usize,
    sink: Sink<'a>,
    header: Option<FrameHeader>,
    delivered: usize,
    done: bool,
}

impl Receiving<'_> {
    /// Reads more of the frame from the predecessor: straight into the destination when it
    /// is a buffer and the inbox holds nothing of this frame, otherwise into the inbox.
    /// `Ok(false)` when nothing was ready.
    fn read_from(
        &mut self,
        stream: &mut TcpStream,
        inbox: &mut Inbox,
        predecessor: usize,
    ) -> Result<bool, CollectiveError> {
        if let (Some(FrameHeader::Data), Sink::Buffer(buf)) = (&self.header, &mut self.sink)
            && inbox.start == inbox.end
            && self.delivered < self.len
        {
            return match read_some(stream, &mut buf[self.delivered..self.len], predecessor)? {
                0 => Ok(false),
                n => {
                    self.delivered += n;
                    Ok(true)
                }
            };
        }
        inbox.fill(stream, predecessor)
    }
}

/// One non-blocking read; `Ok(0)` when nothing was ready.
fn read_some(
    stream: &mut TcpStream,
    buf: &mut [u8],
    predecessor: usize,
) -> Result<usize, CollectiveError> {
    match stream.read(buf) {
        Ok(0) => Err(CollectiveError::LostRank {
            rank: predecessor,
            reason: "its connection closed (the process exited or left the ring)".into(),
        }),
        Ok(n) => Ok(n),
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(CollectiveError::LostRank {
            rank: predecessor,
            reason: e.to_string(),
        }),
    }
}

impl TcpTransport {
    /// Connects to the successor (retrying until `connect_timeout`) while accepting the
    /// predecessor on `listener`, and checks each peer says it is the expected rank.
    pub fn establish(listener: TcpListener, setup: &TcpRingSetup) -> Result<Self, CollectiveError> {
        let world_size = setup.endpoints.len();
        if setup.rank >= world_size {
            return Err(CollectiveError::Invalid(format!(
                "rank {} is outside a ring of {world_size} endpoints",
                setup.rank
            )));
        }
        let deadline = Instant::now() + setup.connect_timeout;
        let successor = (setup.rank + 1) % world_size;
        let predecessor = (setup.rank + world_size - 1) % world_size;
        let (to_successor, from_predecessor) = std::thread::scope(|scope| {
            let accepting =
                scope.spawn(|| accept_predecessor(&listener, setup, predecessor, deadline));
            let connected = connect_successor(setup, successor, deadline);
            let accepted = accepting.join().unwrap_or_else(|_| {
                Err(CollectiveError::Invalid(
                    "the accepting thread panicked".into(),
                ))
            });
            Ok::<_, CollectiveError>((connected?, accepted?))
        })?;
        for stream in [&to_successor, &from_predecessor] {
            tune(stream)
                .and_then(|()| stream.set_nonblocking(true))
                .map_err(|e| {
                    CollectiveError::Invalid(format!("cannot configure a ring socket: {e}"))
                })?;
        }
        Ok(TcpTransport {
            rank: setup.rank,
            world_size,
            op_timeout: setup.op_timeout,
            links: Some(Links {
                to_successor,
                from_predecessor,
            }),
            inbox: Inbox {
                buf: vec![0; INBOX_BYTES],
                start: 0,
                end: 0,
            },
            owed: None,
            parked: None,
        })
    }
}

fn closed(rank: usize) -> CollectiveError {
    CollectiveError::Invalid(format!(
        "rank {rank}: the ring was closed by an earlier failure"
    ))
}

fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let socket = SockRef::from(stream);
    socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES)?;
    socket.set_send_buffer_size(SOCKET_BUFFER_BYTES)?;
    // A peer whose host vanishes without a reset is found by keepalive probes.
    socket.set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(5))
            .with_retries(4),
    )
}

fn hello(rank: usize, world_size: usize) -> [u8; HELLO_BYTES] {
    let mut bytes = [0; HELLO_BYTES];
    bytes[..4].copy_from_slice(HELLO_MAGIC);
    bytes[4..8].copy_from_slice(&HELLO_VERSION.to_le_bytes());
    bytes[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
    bytes[12..16].copy_from_slice(&(world_size as u32).to_le_bytes());
    bytes
}

/// Reads a peer's hello and returns the rank it claims, or why it is not a ring peer.
fn read_hello(stream: &mut TcpStream, world_size: usize) -> Result<usize, String> {
    let mut bytes = [0; HELLO_BYTES];
    stream
        .read_exact(&mut bytes)
        .map_err(|e| format!("no greeting: {e}"))?;
    let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
    if &bytes[..4] != HELLO_MAGIC || word(4) != HELLO_VERSION {
        return Err("not an npufleet ring peer of this version".into());
    }
    if word(12) as usize != world_size {
        return Err(format!(
            "peer is in a ring of {} ranks, not {world_size}",
            word(12)
        ));
    }
    Ok(word(8) as usize)
}

fn connect_successor(
    setup: &TcpRingSetup,
    successor: usize,
    deadline: Instant,
) -> Result<TcpStream, CollectiveError> {
    let addr = setup.endpoints[successor];
    let world_size = setup.endpoints.len();
    let mut last_error = String::from("no attempt made");
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            tracing::warn!(successor, %addr, error = %last_error, "could not reach the ring successor");
            return Err(CollectiveError::Timeout {
                rank: successor,
                seconds: setup.connect_timeout.as_secs(),
            });
        }
        match try_connect(addr, remaining.min(Duration::from_secs(5))) {
            Ok(mut stream) => {
                let greeted = stream
                    .set_read_timeout(Some(remaining.max(Duration::from_millis(1))))
                    .and_then(|()| stream.write_all(&hello(setup.rank, world_size)))
                    .map_err(|e| e.to_string())
                    .and_then(|()| read_hello(&mut stream, world_size));
                match greeted {
                    Ok(rank) if rank == successor => {
                        stream.set_read_timeout(None).map_err(|e| {
                            CollectiveError::Invalid(format!("cannot configure a ring socket: {e}"))
                        })?;
                        return Ok(stream);
                    }
                    Ok(rank) => {
                        return Err(CollectiveError::Invalid(format!(
                            "{addr} should be rank {successor}'s ring endpoint but rank {rank} answered: \
                             the ranks disagree about the rank table"
                        )));
                    }
                    Err(reason) => last_error = format!("{addr}: {reason}"),
                }
            }
            Err(e) => last_error = format!("{addr}: {e}"),
        }
        std::thread::sleep(
            CONNECT_RETRY_PAUSE.min(deadline.saturating_duration_since(Instant::now())),
        );
    }
}

fn try_connect(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // Set before connecting so the window scale is negotiated for the large buffer.
    socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES)?;
    socket.set_send_buffer_size(SOCKET_BUFFER_BYTES)?;
    socket.connect_timeout(&addr.into(), timeout)?;
    Ok(socket.into())
}

fn accept_predecessor(
    listener: &TcpListener,
    setup: &TcpRingSetup,
    predecessor: usize,
    deadline: Instant,
) -> Result<TcpStream, CollectiveError> {
    let world_size = setup.endpoints.len();
    let timed_out = || CollectiveError::Timeout {
        rank: predecessor,
        seconds: setup.connect_timeout.as_secs(),
    };
    let setup_error =
        |e: io::Error| CollectiveError::Invalid(format!("cannot accept ring peers: {e}"));
    listener.set_nonblocking(true).map_err(setup_error)?;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(timed_out());
        }
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                wait_for(&[(listener, PollFlags::IN)], remaining);
                continue;
            }
            Err(e) => return Err(setup_error(e)),
        };
        let greeted = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(remaining.max(Duration::from_millis(1)))))
            .map_err(|e| e.to_string())
            .and_then(|()| read_hello(&mut stream, world_size));
        match greeted {
            Ok(rank) if rank == predecessor => {
                stream
                    .write_all(&hello(setup.rank, world_size))
                    .and_then(|()| stream.set_read_timeout(None))
                    .map_err(|e| CollectiveError::LostRank {
                        rank: predecessor,
                        reason: format!("connection broke during the greeting: {e}"),
                    })?;
                return Ok(stream);
            }
            Ok(rank) => {
                tracing::warn!(%peer, rank, predecessor, "refusing a ring connection from a rank that is not this rank's predecessor");
            }
            Err(reason) => tracing::warn!(%peer, %reason, "refusing a ring connection"),
        }
    }
}

/// Waits until one of `fds` is ready or `timeout` passes; returns whether one is ready.
fn wait_for<Fd: std::os::fd::AsFd>(fds: &[(&Fd, PollFlags)], timeout: Duration) -> bool {
    let mut poll_fds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|(fd, flags)| PollFd::new(*fd, *flags))
        .collect();
    let timeout = Timespec::try_from(timeout).unwrap_or(Timespec {
        tv_sec: i64::MAX,
        tv_nsec: 0,
    });
    matches!(poll(&mut poll_fds, Some(&timeout)), Ok(n) if n > 0)
}

impl Inbox {
    /// Reads whatever the predecessor has sent; `Ok(false)` when nothing was ready.
    fn fill(
        &mut self,
        stream: &mut TcpStream,
        predecessor: usize,
    ) -> Result<bool, CollectiveError> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < self.buf.len() / 2 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        // Small reads keep the bytes in cache for the reduction that consumes them.
        let end = self.buf.len().min(self.end + READ_BYTES);
        let n = read_some(stream, &mut self.buf[self.end..end], predecessor)?;
        self.end += n;
        Ok(n > 0)
    }

    /// Hands buffered bytes of the current frame over; `Ok(true)` once the frame is complete.
    fn deliver(
        &mut self,
        rx: &mut Receiving<'_>,
        predecessor: usize,
    ) -> Result<bool, CollectiveError> {
        loop {
            let available = self.end - self.start;
            match rx.header {
                None => {
                    if available < HEADER_BYTES {
                        return Ok(false);
                    }
                    let header = &self.buf[self.start..self.start + HEADER_BYTES];
                    let kind = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
                    let len = u32::from_le_bytes(header[4..].try_into().expect("4 bytes")) as usize;
                    self.start += HEADER_BYTES;
                    rx.header = Some(match kind {
                        FRAME_DATA if len == rx.len => FrameHeader::Data,
                        FRAME_DATA => {
                            return Err(frame_length_mismatch(predecessor, len, rx.len));
                        }
                        FRAME_ABORT if len <= self.buf.len() => FrameHeader::Abort(len),
                        _ => {
                            return Err(CollectiveError::Invalid(format!(
                                "rank {predecessor} sent an unreadable frame header (kind {kind}, {len} bytes)"
                            )));
                        }
                    });
                }
                Some(FrameHeader::Abort(len)) => {
                    if available < len {
                        return Ok(false);
                    }
                    let error = decode_abort(&self.buf[self.start..self.start + len], predecessor);
                    self.start += len;
                    return Err(error);
                }
                Some(FrameHeader::Data) => {
                    let remaining = rx.len - rx.delivered;
                    if remaining == 0 {
                        return Ok(true);
                    }
                    let mut take = available.min(remaining);
                    if take < remaining {
                        take -= take % PIECE_ALIGN;
                    }
                    if take == 0 {
                        return Ok(false);
                    }
                    let bytes = &self.buf[self.start..self.start + take];
                    match &mut rx.sink {
                        Sink::Pieces(on_piece) => on_piece(bytes),
                        Sink::Buffer(buf) => {
                            buf[rx.delivered..rx.delivered + take].copy_from_slice(bytes);
                        }
                    }
                    self.start += take;
                    rx.delivered += take;
                }
            }
        }
    }
}

fn encode_abort(error: &CollectiveError) -> Vec<u8> {
    let (kind, rank, seconds, reason): (u8, usize, u64, &str) = match error {
        CollectiveError::LostRank { rank, reason } => (0, *rank, 0, reason),
        CollectiveError::Timeout { rank, seconds } => (1, *rank, *seconds, ""),
        CollectiveError::Invalid(reason) => (2, 0, 0, reason),
    };
    let mut reason_end = reason.len().min(MAX_ABORT_REASON_BYTES);
    while !reason.is_char_boundary(reason_end) {
        reason_end -= 1;
    }
    let reason = &reason.as_bytes()[..reason_end];
    let payload_len = 1 + 8 + 8 + reason.len();
    let mut frame = Vec::with_capacity(HEADER_BYTES + payload_len);
    frame.extend_from_slice(&FRAME_ABORT.to_le_bytes());
    frame.extend_from_slice(&(payload_len as u32).to_le_bytes());
    frame.push(kind);
    frame.extend_from_slice(&(rank as u64).to_le_bytes());
    frame.extend_from_slice(&seconds.to_le_bytes());
    frame.extend_from_slice(reason);
    frame
}

fn decode_abort(payload: &[u8], predecessor: usize) -> CollectiveError {
    if payload.len() < 17 {
        return CollectiveError::LostRank {
            rank: predecessor,
            reason: "it sent a truncated abort notice".into(),
        };
    }
    let rank = u64::from_le_bytes(payload[1..9].try_into().expect("8 bytes")) as usize;
    let seconds = u64::from_le_bytes(payload[9..17].try_into().expect("8 bytes"));
    let reason = String::from_utf8_lossy(&payload[17..]).into_owned();
    match payload[0] {
        0 => CollectiveError::LostRank { rank, reason },
        1 => CollectiveError::Timeout { rank, seconds },
        _ => CollectiveError::Invalid(reason),
    }
}

/// Writes as much of the owed frame as the socket takes now; `Ok(true)` if any was written.
fn send_some(
    stream: &mut TcpStream,
    owed: &mut Option<OwedFrame>,
    payload: &[u8],
    successor: usize,
) -> Result<bool, CollectiveError> {
    let Some(frame) = owed.as_mut() else {
        return Ok(false);
    };
    let written = if frame.written < HEADER_BYTES {
        stream.write_vectored(&[
            IoSlice::new(&frame.header[frame.written..]),
            IoSlice::new(payload),
        ])
    } else {
        stream.write(&payload[frame.written - HEADER_BYTES..])
    };
    match written {
        Ok(0) => Err(CollectiveError::LostRank {
            rank: successor,
            reason: "its connection accepts no more data".into(),
        }),
        Ok(n) => {
            frame.written += n;
            if frame.written == frame.total {
                *owed = None;
            }
            Ok(true)
        }
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
            Ok(false)
        }
        Err(e) => Err(CollectiveError::LostRank {
            rank: successor,
            reason: e.to_string(),
        }),
    }
}

/// Writes the whole owed frame, giving up quietly once `stop` is set (the receiving side has
/// failed and reports why).
fn send_until_done(
    stream: &mut TcpStream,
    owed: &mut Option<OwedFrame>,
    payload: &[u8],
    successor: usize,
    op_timeout: Duration,
    stop: &AtomicBool,
) -> Result<(), CollectiveError> {
    let mut last_progress = Instant::now();
    while owed.is_some() {
        if send_some(stream, owed, payload, successor)? {
            last_progress = Instant::now();
            continue;
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let remaining = op_timeout.saturating_sub(last_progress.elapsed());
        if remaining.is_zero() {
            return Err(CollectiveError::Timeout {
                rank: successor,
                seconds: op_timeout.as_secs(),
            });
        }
        wait_for(
            &[(&*stream, PollFlags::OUT)],
            remaining.min(STOP_CHECK_INTERVAL),
        );
    }
    Ok(())
}

fn receive_until_done(
    stream: &mut TcpStream,
    inbox: &mut Inbox,
    rx: &mut Receiving<'_>,
    predecessor: usize,
    op_timeout: Duration,
) -> Result<(), CollectiveError> {
    let mut last_progress = Instant::now();
    while !inbox.deliver(rx, predecessor)? {
        if rx.read_from(stream, inbox, predecessor)? {
            last_progress = Instant::now();
            continue;
        }
        let remaining = op_timeout.saturating_sub(last_progress.elapsed());
        if remaining.is_zero() {
            return Err(CollectiveError::Timeout {
                rank: predecessor,
                seconds: op_timeout.as_secs(),
            });
        }
        wait_for(&[(&*stream, PollFlags::IN)], remaining);
    }
    Ok(())
}

impl TcpTransport {
    /// Sends `outgoing` as one frame while receiving `rx`, overlapping the two directions.
    fn transfer(
        &mut self,
        outgoing: Option<&[u8]>,
        rx: &mut Option<Receiving<'_>>,
    ) -> Result<(), CollectiveError> {
        let (successor, predecessor) = (self.successor(), self.predecessor());
        let Self {
            rank,
            links,
            inbox,
            owed,
            op_timeout,
            ..
        } = self;
        let links = links.as_mut().ok_or_else(|| closed(*rank))?;
        let payload = outgoing.unwrap_or(&[]);
        if outgoing.is_some() {
            let len = u32::try_from(payload.len()).map_err(|_| {
                CollectiveError::Invalid(format!(
                    "a frame of {} bytes is too large to send",
                    payload.len()
                ))
            })?;
            let mut header = [0; HEADER_BYTES];
            header[..4].copy_from_slice(&FRAME_DATA.to_le_bytes());
            header[4..].copy_from_slice(&len.to_le_bytes());
            *owed = Some(OwedFrame {
                header,
                written: 0,
                total: HEADER_BYTES + payload.len(),
            });
        }
        if payload.len() >= THREADED_SEND_MIN_BYTES
            && let Some(rx) = rx.as_mut()
        {
            // A second thread writes while this one reads and reduces, so the two kernel
            // copies and the reduction of a large frame run in parallel.
            let Links {
                to_successor,
                from_predecessor,
            } = links;
            let op_timeout = *op_timeout;
            let stop = AtomicBool::new(false);
            return std::thread::scope(|scope| {
                let sending = scope.spawn(|| {
                    send_until_done(to_successor, owed, payload, successor, op_timeout, &stop)
                });
                let received =
                    receive_until_done(from_predecessor, inbox, rx, predecessor, op_timeout);
                if received.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                let sent = sending.join().unwrap_or_else(|_| {
                    Err(CollectiveError::Invalid(
                        "the sending thread panicked".into(),
                    ))
                });
                received.and(sent)
            });
        }
        let mut last_progress = Instant::now();
        loop {
            let mut progressed = send_some(&mut links.to_successor, owed, payload, successor)?;
            if let Some(rx) = rx.as_mut().filter(|rx| !rx.done) {
                rx.done = inbox.deliver(rx, predecessor)?;
                if !rx.done && rx.read_from(&mut links.from_predecessor, inbox, predecessor)? {
                    progressed = true;
                    rx.done = inbox.deliver(rx, predecessor)?;
                }
            }
            let receiving = rx.as_ref().is_some_and(|rx| !rx.done);
            if owed.is_none() && !receiving {
                return Ok(());
            }
            if progressed {
                last_progress = Instant::now();
                continue;
            }
            let remaining = op_timeout.saturating_sub(last_progress.elapsed());
            let ready = match (owed.is_some(), receiving) {
                (true, true) => wait_for(
                    &[
                        (&links.to_successor, PollFlags::OUT),
                        (&links.from_predecessor, PollFlags::IN),
                    ],
                    remaining,
                ),
                (true, false) => wait_for(&[(&links.to_successor, PollFlags::OUT)], remaining),
                _ => wait_for(&[(&links.from_predecessor, PollFlags::IN)], remaining),
            };
            if !ready && last_progress.elapsed() >= *op_timeout {
                return Err(CollectiveError::Timeout {
                    rank: if receiving { predecessor } else { successor },
                    seconds: op_timeout.as_secs(),
                });
            }
        }
    }
}

impl TcpTransport {
    /// A broken link to the successor often means the successor gave up because a rank
    /// further round the ring was lost; its notice of that travels the long way round and
    /// arrives from the predecessor. Before blaming the successor, read on from the
    /// predecessor for a moment (skipping the rest of the current frame) and report the loss
    /// the predecessor's abort notice names, if one comes.
    fn blame_upstream(
        &mut self,
        error: CollectiveError,
        rx: Option<Receiving<'_>>,
    ) -> CollectiveError {
        let successor = self.successor();
        let predecessor = self.predecessor();
        if self.world_size <= 2
            || !matches!(error, CollectiveError::LostRank { rank, .. } if rank == successor)
        {
            return error;
        }
        let Some(links) = self.links.as_mut() else {
            return error;
        };
        let inbox = &mut self.inbox;
        let (mut skip, mut abort_len) =
            match rx.and_then(|rx| rx.header.map(|h| (h, rx.len - rx.delivered))) {
                Some((FrameHeader::Data, left)) => (left, None),
                Some((FrameHeader::Abort(len), _)) => (0, Some(len)),
                None => (0, None),
            };
        let deadline = Instant::now() + self.op_timeout.min(ABORT_GRACE);
        loop {
            let available = inbox.end - inbox.start;
            if skip > 0 && available > 0 {
                let n = available.min(skip);
                inbox.start += n;
                skip -= n;
                continue;
            }
            if skip == 0 {
                match abort_len {
                    Some(len) if available >= len => {
                        return decode_abort(
                            &inbox.buf[inbox.start..inbox.start + len],
                            predecessor,
                        );
                    }
                    Some(_) => {}
                    None if available >= HEADER_BYTES => {
                        let header = &inbox.buf[inbox.start..inbox.start + HEADER_BYTES];
                        let kind = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
                        let len =
                            u32::from_le_bytes(header[4..].try_into().expect("4 bytes")) as usize;
                        if kind != FRAME_ABORT || len > inbox.buf.len() {
                            // The predecessor carries on normally: the successor really went.
                            return error;
                        }
                        inbox.start += HEADER_BYTES;
                        abort_len = Some(len);
                        continue;
                    }
                    None => {}
                }
            }
            match inbox.fill(&mut links.from_predecessor, predecessor) {
                Ok(true) => {}
                Ok(false) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return error;
                    }
                    wait_for(&[(&links.from_predecessor, PollFlags::IN)], left);
                }
                Err(_) => return error,
            }
        }
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn exchange(
        &mut self,
        outgoing: Option<&[u8]>,
        incoming: Option<Incoming<'_>>,
    ) -> Result<(), CollectiveError> {
        let rx = incoming.map(|incoming| Receiving {
            len: incoming.len,
            sink: Sink::Pieces(incoming.on_piece),
            header: None,
            delivered: 0,
            done: false,
        });
        let mut rx = rx;
        let result = self.transfer(outgoing, &mut rx);
        result.map_err(|error| self.blame_upstream(error, rx))
    }

    fn exchange_into(
        &mut self,
        outgoing: Option<&[u8]>,
        incoming: &mut [u8],
    ) -> Result<(), CollectiveError> {
        let rx = Receiving {
            len: incoming.len(),
            sink: Sink::Buffer(incoming),
            header: None,
            delivered: 0,
            done: false,
        };
        let mut rx = Some(rx);
        let result = self.transfer(outgoing, &mut rx);
        result.map_err(|error| self.blame_upstream(error, rx))
    }

    /// Slices of 1 MiB keep every frame of a long all-reduce below
    /// [`THREADED_SEND_MIN_BYTES`]: with the ring's ranks already occupying the cores, one
    /// thread per rank polling both sockets moves data faster than a second sending thread.
    fn all_reduce_slice_bytes(&self) -> usize {
        1024 * 1024
    }

    fn abort(&mut self, error: &CollectiveError) {
        let Some(mut links) = self.links.take() else {
            return;
        };
        let stream = &mut links.to_successor;
        let grace = self
            .op_timeout
            .min(ABORT_GRACE)
            .max(Duration::from_millis(1));
        let told = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_write_timeout(Some(grace)))
            .and_then(|()| {
                if let Some(frame) = self.owed.take() {
                    if frame.written < HEADER_BYTES {
                        stream.write_all(&frame.header[frame.written..])?;
                    }
                    let zeros = vec![0; 64 * 1024];
                    let mut left = frame.total - frame.written.max(HEADER_BYTES);
                    while left > 0 {
                        let n = left.min(zeros.len());
                        stream.write_all(&zeros[..n])?;
                        left -= n;
                    }
                }
                stream.write_all(&encode_abort(error))
            });
        if let Err(e) = told {
            tracing::debug!(error = %e, "could not pass the ring failure on to the successor");
        }
        let _ = links.to_successor.shutdown(Shutdown::Both);
        // The link from the predecessor stays open until the transport is dropped: if its
        // writes failed now, it would blame this rank instead of hearing about the rank that
        // was really lost.
        self.parked = Some(links.from_predecessor);
    }
}
