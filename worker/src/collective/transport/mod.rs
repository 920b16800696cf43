//! Byte pipes around the ring. A rank talks only to its successor (`rank + 1`) and its
//! predecessor (`rank - 1`); everything else, including the HCCL transport on Ascend hosts,
//! plugs in behind [`Transport`].

pub mod inproc;
pub mod tcp;

use super::CollectiveError;

/// Received frames are handed over in pieces whose lengths are multiples of this (except a
/// frame's last piece), so `f32` data can be consumed as it arrives.
pub const PIECE_ALIGN: usize = 4;

/// One frame to receive from the predecessor: exactly `len` bytes, handed to `on_piece` in
/// order as they arrive.
pub struct Incoming<'a> {
    pub len: usize,
    pub on_piece: &'a mut dyn FnMut(&[u8]),
}

/// A rank's two links: one to its successor and one from its predecessor.
///
/// Data moves in frames. Both ends of a link agree on each frame's length in advance (every
/// rank runs the same collective with the same sizes); a frame of another length is reported
/// as [`CollectiveError::Invalid`]. Once a call fails the transport is unusable: the caller
/// reports the failure with [`Transport::abort`] so it travels on around the ring.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Sends `outgoing` as one frame to the successor while receiving one frame from the
    /// predecessor, both optional, overlapping the two directions so no rank waits for its
    /// own send to drain before it reads.
    fn exchange(
        &mut self,
        outgoing: Option<&[u8]>,
        incoming: Option<Incoming<'_>>,
    ) -> Result<(), CollectiveError>;

    /// As [`Transport::exchange`], receiving a frame of exactly `incoming.len()` bytes
    /// straight into `incoming`. Transports that can read into the destination without an
    /// intermediate buffer override this.
    fn exchange_into(
        &mut self,
        outgoing: Option<&[u8]>,
        incoming: &mut [u8],
    ) -> Result<(), CollectiveError> {
        let len = incoming.len();
        let mut filled = 0;
        let mut on_piece = |bytes: &[u8]| {
            incoming[filled..filled + bytes.len()].copy_from_slice(bytes);
            filled += bytes.len();
        };
        self.exchange(
            outgoing,
            Some(Incoming {
                len,
                on_piece: &mut on_piece,
            }),
        )
    }

    /// Long all-reduces run slice by slice (see [`crate::collective::RingCollective`]); this
    /// is the slice length in bytes that suits the transport.
    fn all_reduce_slice_bytes(&self) -> usize {
        4 * 1024 * 1024
    }

    /// Best effort: tells the successor about `error` (so ranks further round the ring fail
    /// naming the rank that was really lost) and closes both links.
    fn abort(&mut self, error: &CollectiveError);

    fn successor(&self) -> usize {
        (self.rank() + 1) % self.world_size()
    }

    fn predecessor(&self) -> usize {
        (self.rank() + self.world_size() - 1) % self.world_size()
    }
}

pub(crate) fn frame_length_mismatch(from: usize, got: usize, expected: usize) -> CollectiveError {
    CollectiveError::Invalid(format!(
        "rank {from} sent a frame of {got} bytes where {expected} were expected: \
         the ranks called collectives in different orders or with different lengths"
    ))
}
