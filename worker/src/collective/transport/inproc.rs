//! Ranks as threads of one process, linked by shared-memory channels.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use super::{Incoming, PIECE_ALIGN, Transport, frame_length_mismatch};
use crate::collective::CollectiveError;

/// Frames are cut into pieces of this size so the receiver starts consuming while the sender
/// is still copying.
const PIECE_BYTES: usize = 256 * 1024;
const _: () = assert!(PIECE_BYTES.is_multiple_of(PIECE_ALIGN));

enum Message {
    Piece { frame_len: usize, bytes: Vec<u8> },
    Abort(CollectiveError),
}

pub struct InProcTransport {
    rank: usize,
    world_size: usize,
    to_successor: Option<Sender<Message>>,
    from_predecessor: Receiver<Message>,
    /// Piece buffers go back to the rank that filled them, so steady traffic allocates (and
    /// page-faults) nothing.
    spent_to_predecessor: Sender<Vec<u8>>,
    spent_from_successor: Receiver<Vec<u8>>,
    op_timeout: Duration,
    aborted: bool,
}

/// Builds the `world_size` linked ends of an in-process ring, one per rank, in rank order.
/// A rank waiting longer than `op_timeout` for its predecessor fails with a timeout.
pub fn ring(world_size: usize, op_timeout: Duration) -> Vec<InProcTransport> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..world_size).map(|_| channel()).unzip();
    // Channel i carries data into rank i, so rank i sends on channel i + 1; spent buffers
    // travel back on channel i of the second set, from rank i + 1 to rank i.
    let mut senders: Vec<Option<Sender<Message>>> = senders.into_iter().map(Some).collect();
    let (spent_senders, spent_receivers): (Vec<_>, Vec<_>) =
        (0..world_size).map(|_| channel()).unzip();
    let mut spent_senders: Vec<Option<Sender<Vec<u8>>>> =
        spent_senders.into_iter().map(Some).collect();
    receivers
        .into_iter()
        .zip(spent_receivers)
        .enumerate()
        .map(
            |(rank, (from_predecessor, spent_from_successor))| InProcTransport {
                rank,
                world_size,
                to_successor: senders[(rank + 1) % world_size].take(),
                from_predecessor,
                spent_to_predecessor: spent_senders[(rank + world_size - 1) % world_size]
                    .take()
                    .expect("one each"),
                spent_from_successor,
                op_timeout,
                aborted: false,
            },
        )
        .collect()
}

impl InProcTransport {
    fn closed(&self) -> CollectiveError {
        CollectiveError::Invalid(format!(
            "rank {}: the ring was closed by an earlier failure",
            self.rank
        ))
    }

    fn send_frame(&self, frame: &[u8]) -> Result<(), CollectiveError> {
        let successor = self.successor();
        let to_successor = self.to_successor.as_ref().ok_or_else(|| self.closed())?;
        let lost = || CollectiveError::LostRank {
            rank: successor,
            reason: "its end of the in-process ring was dropped".into(),
        };
        if frame.is_empty() {
            return to_successor
                .send(Message::Piece {
                    frame_len: 0,
                    bytes: Vec::new(),
                })
                .map_err(|_| lost());
        }
        for piece in frame.chunks(PIECE_BYTES) {
            let mut bytes = self.spent_from_successor.try_recv().unwrap_or_default();
            bytes.clear();
            bytes.extend_from_slice(piece);
            to_successor
                .send(Message::Piece {
                    frame_len: frame.len(),
                    bytes,
                })
                .map_err(|_| lost())?;
        }
        Ok(())
    }

    fn receive_frame(&self, incoming: Incoming<'_>) -> Result<(), CollectiveError> {
        let predecessor = self.predecessor();
        if self.aborted {
            return Err(self.closed());
        }
        let from_predecessor = &self.from_predecessor;
        let mut received = 0;
        loop {
            let message = from_predecessor
                .recv_timeout(self.op_timeout)
                .map_err(|e| match e {
                    RecvTimeoutError::Timeout => CollectiveError::Timeout {
                        rank: predecessor,
                        seconds: self.op_timeout.as_secs(),
                    },
                    RecvTimeoutError::Disconnected => CollectiveError::LostRank {
                        rank: predecessor,
                        reason: "its end of the in-process ring was dropped".into(),
                    },
                })?;
            match message {
                Message::Abort(error) => return Err(error),
                Message::Piece { frame_len, bytes } => {
                    if frame_len != incoming.len {
                        return Err(frame_length_mismatch(predecessor, frame_len, incoming.len));
                    }
                    received += bytes.len();
                    if !bytes.is_empty() {
                        (incoming.on_piece)(&bytes);
                    }
                    // A predecessor that is gone needs no buffers back.
                    let _ = self.spent_to_predecessor.send(bytes);
                    if received >= frame_len {
                        return Ok(());
                    }
                }
            }
        }
    }
}

impl Transport for InProcTransport {
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
        // Sends never block (the channel is unbounded), so sending first cannot deadlock.
        if let Some(frame) = outgoing {
            self.send_frame(frame)?;
        }
        match incoming {
            Some(incoming) => self.receive_frame(incoming),
            None => Ok(()),
        }
    }

    fn abort(&mut self, error: &CollectiveError) {
        if let Some(to_successor) = self.to_successor.take() {
            // The successor may be gone already; nothing more to tell then.
            let _ = to_successor.send(Message::Abort(error.clone()));
        }
        // The receiving end stays open: if the predecessor's sends failed now, it would blame
        // this rank instead of hearing about the rank that was really lost.
        self.aborted = true;
    }
}
