//! The prefix cache's events in vLLM's wire format, for consumers built for vLLM (llm-d's
//! precise prefix scorer, and the KV routers of Dynamo and AIBrix): a ZeroMQ PUB socket
//! sends each batch as three frames (topic, an 8-byte big-endian sequence number, a msgpack
//! `EventBatch`), and an optional ROUTER socket replays batches from a sequence number on
//! request. The encoding is msgspec's `array_like` form that vLLM's publisher uses:
//! a batch is `[ts, events, data_parallel_rank]`, an event `[tag, fields...]`.
//!
//! This project's own router reads the same events from the gRPC load service instead.

use std::collections::VecDeque;
use std::future::Future;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::kv_events::{CacheEvent, CacheUpdate, KvEventLog};

/// Where and under which topic the events go.
#[derive(Clone, Debug)]
pub struct ZmqEventsConfig {
    /// The PUB socket's endpoint. As in vLLM, an endpoint with a wildcard host
    /// (`tcp://*:5557`), or an `ipc://` one, is bound; any other is connected to (a
    /// consumer that binds, such as llm-d's endpoint picker).
    pub endpoint: String,
    /// The ROUTER socket that answers replay requests, always bound.
    pub replay_endpoint: Option<String>,
    pub topic: String,
}

/// The storage vLLM names the accelerator's own KV cache: consumers weigh blocks there
/// above blocks offloaded to host memory, and this engine keeps no other tier.
const MEDIUM: &str = "GPU";

/// The sequence number that ends a replay, as vLLM's publisher sends it.
const END_OF_REPLAY: i64 = -1;

/// Encoded batches kept for replay, bounded by their size rather than their count: a batch
/// of a long prompt's blocks is a thousand times one of a single eviction.
const REPLAY_BYTES: usize = 16 << 20;

/// Whether vLLM's publisher would bind `endpoint` rather than connect to it.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::") || endpoint.starts_with("ipc://")
}

/// `endpoint` as this ZeroMQ implementation binds it: libzmq's wildcard host `*` (every
/// interface, vLLM's default `tcp://*:5557`) is `0.0.0.0` here.
fn bindable(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_owned(),
    }
}

/// Checks that `endpoint` is a ZeroMQ endpoint this worker can use, for the command line.
pub fn parse_endpoint(endpoint: &str) -> Result<String, String> {
    zeromq::Endpoint::from_str(&bindable(endpoint))
        .map(|_| endpoint.to_owned())
        .map_err(|error| {
            format!("'{endpoint}' is no ZeroMQ endpoint (tcp://host:port or ipc://path): {error}")
        })
}

/// One batch, msgpack-encoded. Consecutive stored blocks of one chain become one
/// `BlockStored` (with the first block's parent and the blocks' tokens in order), and
/// consecutive removals one `BlockRemoved`, as vLLM groups them.
pub fn encode_batch(ts: f64, cleared: bool, events: &[CacheEvent], block_size: usize) -> Vec<u8> {
    let groups = group(events);
    let mut out = Vec::with_capacity(64 + events.len() * (24 + 3 * block_size));
    let w = &mut out;
    // Writes to a Vec cannot fail.
    let _ = rmp::encode::write_array_len(w, 3);
    let _ = rmp::encode::write_f64(w, ts);
    let _ = rmp::encode::write_array_len(w, (groups.len() + usize::from(cleared)) as u32);
    if cleared {
        let _ = rmp::encode::write_array_len(w, 1);
        let _ = rmp::encode::write_str(w, "AllBlocksCleared");
    }
    for group in groups {
        match group {
            Group::Stored { parent, blocks } => {
                let _ = rmp::encode::write_array_len(w, 8);
                let _ = rmp::encode::write_str(w, "BlockStored");
                let _ = rmp::encode::write_array_len(w, blocks.len() as u32);
                for (hash, _) in &blocks {
                    write_hash(w, *hash);
                }
                match parent {
                    Some(parent) => write_hash(w, parent),
                    None => {
                        let _ = rmp::encode::write_nil(w);
                    }
                }
                let tokens: usize = blocks.iter().map(|(_, t)| t.len()).sum();
                let _ = rmp::encode::write_array_len(w, tokens as u32);
                for token in blocks.iter().flat_map(|(_, t)| t.iter()) {
                    let _ = rmp::encode::write_uint(w, u64::from(*token));
                }
                let _ = rmp::encode::write_uint(w, block_size as u64);
                let _ = rmp::encode::write_nil(w); // lora_id
                let _ = rmp::encode::write_str(w, MEDIUM);
                let _ = rmp::encode::write_nil(w); // lora_name
            }
            Group::Removed(hashes) => {
                let _ = rmp::encode::write_array_len(w, 3);
                let _ = rmp::encode::write_str(w, "BlockRemoved");
                let _ = rmp::encode::write_array_len(w, hashes.len() as u32);
                for hash in hashes {
                    write_hash(w, hash);
                }
                let _ = rmp::encode::write_str(w, MEDIUM);
            }
        }
    }
    let _ = rmp::encode::write_uint(w, 0); // data_parallel_rank: one engine per worker
    out
}

/// A hash always as msgpack's uint64, whatever its value: consumers in typed languages
/// decode it as one integer type.
fn write_hash(w: &mut Vec<u8>, hash: u64) {
    let _ = rmp::encode::write_u64(w, hash);
}

enum Group<'a> {
    /// Blocks stored one after another, each the parent of the next: `parent` is the first's.
    Stored {
        parent: Option<u64>,
        blocks: Vec<(u64, &'a [u32])>,
    },
    Removed(Vec<u64>),
}

fn group(events: &[CacheEvent]) -> Vec<Group<'_>> {
    let mut groups: Vec<Group<'_>> = Vec::new();
    for event in events {
        match (event, groups.last_mut()) {
            (
                CacheEvent::Stored {
                    hash,
                    parent,
                    tokens,
                },
                Some(Group::Stored { blocks, .. }),
            ) if *parent == blocks.last().map(|(h, _)| *h) => {
                blocks.push((*hash, tokens));
            }
            (
                CacheEvent::Stored {
                    hash,
                    parent,
                    tokens,
                },
                _,
            ) => groups.push(Group::Stored {
                parent: *parent,
                blocks: vec![(*hash, tokens)],
            }),
            (CacheEvent::Removed { hash }, Some(Group::Removed(hashes))) => hashes.push(*hash),
            (CacheEvent::Removed { hash }, _) => groups.push(Group::Removed(vec![*hash])),
        }
    }
    groups
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Batches already sent, for replay.
#[derive(Default)]
struct Sent {
    batches: VecDeque<(u64, Bytes)>,
    bytes: usize,
}

impl Sent {
    fn keep(&mut self, seq: u64, payload: Bytes) {
        self.bytes += payload.len();
        self.batches.push_back((seq, payload));
        while self.bytes > REPLAY_BYTES && self.batches.len() > 1 {
            if let Some((_, dropped)) = self.batches.pop_front() {
                self.bytes -= dropped.len();
            }
        }
    }

    /// The kept batches from `start` on, or `None` when some of those are no longer kept.
    fn from(&self, start: u64) -> Option<Vec<(u64, Bytes)>> {
        let first_kept = self.batches.front().map_or(0, |(seq, _)| *seq);
        (start >= first_kept).then(|| {
            self.batches
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect()
        })
    }
}

/// An update's sequence number and payload. A snapshot is every block the cache holds,
/// after `AllBlocksCleared`: what a consumer that missed batches starts again from. The first
/// batch after start is one (of an empty cache), which tells consumers that a restarted
/// worker holds nothing it held before.
fn encode_update(update: CacheUpdate, block_size: usize) -> (u64, Bytes) {
    match update {
        CacheUpdate::Snapshot { seq, blocks } => {
            (seq, encode_batch(now(), true, &blocks, block_size).into())
        }
        CacheUpdate::Batch(batch) => (
            batch.seq,
            encode_batch(now(), false, &batch.events, block_size).into(),
        ),
    }
}

/// The sockets, set up: a wrong endpoint fails the worker's start, not its first batch.
pub struct ZmqPublisher {
    config: ZmqEventsConfig,
    publisher: zeromq::PubSocket,
    /// Set when the PUB socket connects: a consumer that binds may restart, and its going
    /// away is how the socket learns to connect again.
    monitor: Option<futures::channel::mpsc::Receiver<SocketEvent>>,
    replay: Option<zeromq::RouterSocket>,
}

impl ZmqPublisher {
    pub async fn start(config: ZmqEventsConfig) -> anyhow::Result<ZmqPublisher> {
        use anyhow::Context as _;
        let mut publisher = zeromq::PubSocket::new();
        let monitor = if binds(&config.endpoint) {
            let bound = publisher
                .bind(&bindable(&config.endpoint))
                .await
                .with_context(|| {
                    format!("cannot bind the KV event endpoint {}", config.endpoint)
                })?;
            tracing::info!(endpoint = %bound, topic = %config.topic, "publishing KV events");
            None
        } else {
            tracing::info!(endpoint = %config.endpoint, topic = %config.topic, "publishing KV events to a consumer");
            Some(publisher.monitor())
        };
        let replay = match &config.replay_endpoint {
            Some(endpoint) => {
                let mut socket = zeromq::RouterSocket::new();
                let bound = socket.bind(&bindable(endpoint)).await.with_context(|| {
                    format!("cannot bind the KV event replay endpoint {endpoint}")
                })?;
                tracing::info!(endpoint = %bound, "replaying KV events");
                Some(socket)
            }
            None => None,
        };
        Ok(ZmqPublisher {
            config,
            publisher,
            monitor,
            replay,
        })
    }

    /// Publishes `log`'s batches until `closing` resolves.
    pub async fn run(mut self, log: &KvEventLog, closing: impl Future<Output = ()>) {
        tokio::pin!(closing);
        let topic = Bytes::from(self.config.topic.clone().into_bytes());
        let mut connected = self.monitor.is_none();
        let mut sent = Sent::default();
        let mut follower = log.follow();
        // The first update is the snapshot, at hand at once: kept for replay before any
        // request for it can come.
        if let Some(update) = follower.next().await {
            let (seq, payload) = encode_update(update, log.block_size);
            send(&mut self.publisher, &topic, seq, payload, &mut sent).await;
        }
        loop {
            if !connected {
                tokio::select! {
                    () = &mut closing => return,
                    result = self.publisher.connect(&self.config.endpoint) => match result {
                        Ok(()) => connected = true,
                        Err(error) => {
                            tracing::warn!(%error, endpoint = %self.config.endpoint, "cannot reach the KV event consumer; retrying");
                            continue;
                        }
                    }
                }
            }
            tokio::select! {
                () = &mut closing => return,
                event = next_event(self.monitor.as_mut()) => {
                    if matches!(event, Some(SocketEvent::Disconnected(_))) {
                        connected = false;
                    }
                }
                request = next_request(self.replay.as_mut()) => {
                    if let (Some(socket), Some(request)) = (self.replay.as_mut(), request) {
                        answer_replay(socket, request, &sent, log).await;
                    }
                }
                update = follower.next() => {
                    let Some(update) = update else { return };
                    let (seq, payload) = encode_update(update, log.block_size);
                    send(&mut self.publisher, &topic, seq, payload, &mut sent).await;
                }
            }
        }
    }
}

async fn next_event(
    monitor: Option<&mut futures::channel::mpsc::Receiver<SocketEvent>>,
) -> Option<SocketEvent> {
    match monitor {
        Some(monitor) => futures::StreamExt::next(monitor).await,
        None => std::future::pending().await,
    }
}

async fn next_request(socket: Option<&mut zeromq::RouterSocket>) -> Option<ZmqMessage> {
    match socket {
        Some(socket) => socket.recv().await.ok(),
        None => std::future::pending().await,
    }
}

async fn send(
    publisher: &mut zeromq::PubSocket,
    topic: &Bytes,
    seq: u64,
    payload: Bytes,
    sent: &mut Sent,
) {
    let message = ZmqMessage::try_from(vec![
        topic.clone(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.clone(),
    ])
    .expect("three frames");
    if let Err(error) = publisher.send(message).await {
        tracing::warn!(%error, seq, "cannot publish a KV event batch");
    }
    sent.keep(seq, payload);
}

/// Answers `[identity, "", start]` with the batches from `start` on, each as
/// `[identity, "", seq, payload]`, then `[identity, "", -1, ""]`. When some of those batches
/// are no longer kept, the answer is a snapshot instead, numbered as the latest batch:
/// batches up to that number are in it.
async fn answer_replay(
    socket: &mut zeromq::RouterSocket,
    request: ZmqMessage,
    sent: &Sent,
    log: &KvEventLog,
) {
    let frames = request.into_vec();
    let [identity, _, start] = frames.as_slice() else {
        tracing::warn!(
            frames = frames.len(),
            "a KV event replay request needs 3 frames"
        );
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
        tracing::warn!(
            bytes = start.len(),
            "a KV event replay request's start must be 8 bytes"
        );
        return;
    };
    let start = u64::from_be_bytes(start);
    let batches = sent.from(start).unwrap_or_else(|| {
        let (seq, blocks) = log.snapshot();
        vec![encode_update(
            CacheUpdate::Snapshot { seq, blocks },
            log.block_size,
        )]
    });
    let end = (END_OF_REPLAY.to_be_bytes().to_vec().into(), Bytes::new());
    for (seq, payload) in batches
        .into_iter()
        .map(|(seq, payload)| (Bytes::copy_from_slice(&seq.to_be_bytes()), payload))
        .chain(std::iter::once(end))
    {
        let reply = ZmqMessage::try_from(vec![identity.clone(), Bytes::new(), seq, payload])
            .expect("four frames");
        if let Err(error) = socket.send(reply).await {
            tracing::warn!(%error, "cannot answer a KV event replay request");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rmpv::Value;

    use super::*;

    fn stored(hash: u64, parent: Option<u64>, tokens: &[u32]) -> CacheEvent {
        CacheEvent::Stored {
            hash,
            parent,
            tokens: Arc::from(tokens),
        }
    }

    fn decode(bytes: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    #[test]
    fn a_chain_of_stored_blocks_is_one_event_in_vllms_array_form() {
        let events = [
            stored(10, Some(9), &[1, 2]),
            stored(11, Some(10), &[3, 4]),
            stored(20, None, &[5, 6]),
            CacheEvent::Removed { hash: 7 },
            CacheEvent::Removed { hash: 8 },
        ];
        let batch = decode(&encode_batch(1.5, false, &events, 2));
        let expected = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![10u64.into(), 11u64.into()]),
                    9u64.into(),
                    Value::Array(vec![1.into(), 2.into(), 3.into(), 4.into()]),
                    2.into(),
                    Value::Nil,
                    MEDIUM.into(),
                    Value::Nil,
                ]),
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![20u64.into()]),
                    Value::Nil,
                    Value::Array(vec![5.into(), 6.into()]),
                    2.into(),
                    Value::Nil,
                    MEDIUM.into(),
                    Value::Nil,
                ]),
                Value::Array(vec![
                    "BlockRemoved".into(),
                    Value::Array(vec![7u64.into(), 8u64.into()]),
                    MEDIUM.into(),
                ]),
            ]),
            0.into(),
        ]);
        assert_eq!(batch, expected);
    }

    #[test]
    fn hashes_are_always_eight_byte_integers() {
        let bytes = encode_batch(0.0, false, &[CacheEvent::Removed { hash: 1 }], 16);
        // ... "BlockRemoved", [uint64 1]: the marker 0xcf and eight bytes, not a fixint.
        let one = [0x91, 0xcf, 0, 0, 0, 0, 0, 0, 0, 1];
        assert!(bytes.windows(one.len()).any(|w| w == one));
    }

    #[test]
    fn a_cleared_batch_leads_with_all_blocks_cleared() {
        let batch = decode(&encode_batch(0.0, true, &[], 16));
        assert_eq!(
            batch[1],
            Value::Array(vec![Value::Array(vec!["AllBlocksCleared".into()])])
        );
    }

    #[test]
    fn replay_serves_kept_batches_and_says_when_it_cannot() {
        let mut sent = Sent::default();
        assert_eq!(sent.from(0), Some(vec![]), "nothing sent, nothing missed");
        for seq in 0..3 {
            sent.keep(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs =
            |v: Option<Vec<(u64, Bytes)>>| v.map(|v| v.iter().map(|b| b.0).collect::<Vec<_>>());
        assert_eq!(seqs(sent.from(1)), Some(vec![1, 2]));
        assert_eq!(seqs(sent.from(3)), Some(vec![]));
        sent.keep(3, Bytes::from(vec![0; REPLAY_BYTES]));
        assert_eq!(seqs(sent.from(3)), Some(vec![3]));
        assert_eq!(sent.from(2), None, "batch 2 was dropped to keep the bound");
    }

    #[test]
    fn endpoints_bind_or_connect_as_vllms_do() {
        assert!(binds("tcp://*:5557"));
        assert!(binds("tcp://[::]:5557"));
        assert!(binds("ipc:///tmp/kv"));
        assert!(!binds("tcp://epp.llm-d.svc:5557"));
        assert!(!binds("tcp://127.0.0.1:5557"));
        assert_eq!(bindable("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert!(parse_endpoint("tcp://*:5557").is_ok());
        assert!(parse_endpoint("tcp://epp:5557").is_ok());
        let error = parse_endpoint("epp:5557").unwrap_err();
        assert!(
            error.contains("'epp:5557' is no ZeroMQ endpoint"),
            "{error}"
        );
    }
}
