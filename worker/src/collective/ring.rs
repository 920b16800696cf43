//! Ring all-reduce, all-gather and broadcast over any [`Transport`].

use std::ops::Range;
use std::sync::Mutex;

use super::transport::{Incoming, Transport};
use super::{Collective, CollectiveError};

/// A broadcast starts with a fixed-size frame holding the length and the first bytes, so a
/// small message (a batch plan) crosses each link in one frame.
const BROADCAST_HEAD_BYTES: usize = 4096;
const BROADCAST_SEGMENT_BYTES: usize = 1024 * 1024;

/// A [`Collective`] running the ring algorithms over one transport. Calls are serialised; after
/// a transport failure every later call fails at once with the same error.
pub struct RingCollective<T: Transport> {
    rank: usize,
    world_size: usize,
    state: Mutex<RingState<T>>,
}

struct RingState<T> {
    transport: T,
    failure: Option<CollectiveError>,
}

impl<T: Transport> RingCollective<T> {
    pub fn new(transport: T) -> Self {
        RingCollective {
            rank: transport.rank(),
            world_size: transport.world_size(),
            state: Mutex::new(RingState {
                transport,
                failure: None,
            }),
        }
    }

    fn with_transport<R>(
        &self,
        op: impl FnOnce(&mut T) -> Result<R, CollectiveError>,
    ) -> Result<R, CollectiveError> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(failure) = &state.failure {
            return Err(failure.clone());
        }
        op(&mut state.transport).inspect_err(|error| {
            state.transport.abort(error);
            state.failure = Some(error.clone());
        })
    }

    /// Element range of chunk `c` when `len` elements are split into `world_size` chunks whose
    /// sizes differ by at most one.
    fn chunk(&self, len: usize, c: usize) -> Range<usize> {
        let p = self.world_size;
        (c * len / p)..((c + 1) * len / p)
    }
}

impl<T: Transport> RingCollective<T> {
    fn ring_all_reduce(&self, transport: &mut T, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let (p, r, len) = (self.world_size, self.rank, buf.len());
        for step in 0..p - 1 {
            let send = self.chunk(len, (r + p - step) % p);
            let recv = self.chunk(len, (r + 2 * p - step - 1) % p);
            let (send, recv) = split_disjoint(buf, send, recv);
            let recv_bytes = recv.len() * 4;
            let mut filled = 0;
            let mut on_piece = |bytes: &[u8]| {
                let n = bytes.len() / 4;
                add_into(&mut recv[filled..filled + n], bytes);
                filled += n;
            };
            let incoming = Incoming {
                len: recv_bytes,
                on_piece: &mut on_piece,
            };
            transport.exchange(Some(bytemuck::cast_slice(send)), Some(incoming))?;
        }
        // Rank r now holds the complete sum of chunk r + 1.
        for step in 0..p - 1 {
            let send = self.chunk(len, (r + 1 + p - step) % p);
            let recv = self.chunk(len, (r + p - step) % p);
            let (send, recv) = split_disjoint(buf, send, recv);
            transport.exchange_into(
                Some(bytemuck::cast_slice(send)),
                bytemuck::cast_slice_mut(recv),
            )?;
        }
        Ok(())
    }
}

/// Borrows `send` for reading and `recv` for writing out of one buffer; the ranges never
/// overlap because they are different chunks.
fn split_disjoint<E>(buf: &mut [E], send: Range<usize>, recv: Range<usize>) -> (&[E], &mut [E]) {
    if send.end <= recv.start {
        let (head, tail) = buf.split_at_mut(recv.start);
        (&head[send], &mut tail[..recv.len()])
    } else {
        let (head, tail) = buf.split_at_mut(send.start);
        (&tail[..send.len()], &mut head[recv])
    }
}

/// Adds the little-endian f32 values in `bytes` into `dst`.
fn add_into(dst: &mut [f32], bytes: &[u8]) {
    // Received f32 data is almost always aligned; read in place, this loop vectorises.
    if cfg!(target_endian = "little")
        && let Ok(values) = bytemuck::try_cast_slice::<u8, f32>(bytes)
    {
        for (d, s) in dst.iter_mut().zip(values) {
            *d += s;
        }
        return;
    }
    for (d, s) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *d += f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

impl<T: Transport> Collective for RingCollective<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    /// Reduce-scatter then all-gather: the buffer is cut into `p` chunks and each of the
    /// 2(p−1) steps sends one chunk to the successor while receiving another from the
    /// predecessor, so every rank moves 2(p−1)/p of the buffer whatever `p` is.
    ///
    /// A long buffer is all-reduced slice by slice (every rank cuts it the same way): a chunk
    /// reduced in one step is then still in cache when the next step sends it on, instead of
    /// being fetched from memory again.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.world_size == 1 || buf.is_empty() {
            return Ok(());
        }
        self.with_transport(|transport| {
            let slice_len = (transport.all_reduce_slice_bytes() / 4).max(self.world_size);
            buf.chunks_mut(slice_len)
                .try_for_each(|slice| self.ring_all_reduce(transport, slice))
        })
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        let (p, r, n) = (self.world_size, self.rank, local.len());
        if out.len() != n * p {
            return Err(CollectiveError::Invalid(format!(
                "all_gather output holds {} values; {p} ranks × {n} need {}",
                out.len(),
                n * p
            )));
        }
        out[r * n..(r + 1) * n].copy_from_slice(local);
        if p == 1 || n == 0 {
            return Ok(());
        }
        self.with_transport(|transport| {
            for step in 0..p - 1 {
                let send_chunk = (r + p - step) % p;
                let recv_chunk = (r + 2 * p - step - 1) % p;
                let (send, recv) = split_disjoint(
                    out,
                    send_chunk * n..(send_chunk + 1) * n,
                    recv_chunk * n..(recv_chunk + 1) * n,
                );
                transport.exchange_into(
                    Some(bytemuck::cast_slice(send)),
                    bytemuck::cast_slice_mut(recv),
                )?;
            }
            Ok(())
        })
    }

    /// Pipelined along the ring from `root`: each rank forwards every segment as soon as it
    /// has it, except the rank just before `root`.
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        let (p, r) = (self.world_size, self.rank);
        if root >= p {
            return Err(CollectiveError::Invalid(format!(
                "broadcast root {root} is not a rank of a ring of {p}"
            )));
        }
        if p == 1 {
            return Ok(());
        }
        let forwards = (r + 1) % p != root;
        self.with_transport(|transport| {
            let mut head = vec![0u8; BROADCAST_HEAD_BYTES];
            if r == root {
                let inline = buf.len().min(BROADCAST_HEAD_BYTES - 8);
                head[..8].copy_from_slice(&(buf.len() as u64).to_le_bytes());
                head[8..8 + inline].copy_from_slice(&buf[..inline]);
                transport.exchange(Some(&head), None)?;
                for segment in buf[inline..].chunks(BROADCAST_SEGMENT_BYTES) {
                    transport.exchange(Some(segment), None)?;
                }
                return Ok(());
            }
            transport.exchange_into(None, &mut head)?;
            if forwards {
                transport.exchange(Some(&head), None)?;
            }
            let total = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
            let total = usize::try_from(total).map_err(|_| {
                CollectiveError::Invalid(format!(
                    "rank {root} broadcast an impossible length {total}"
                ))
            })?;
            let inline = total.min(BROADCAST_HEAD_BYTES - 8);
            buf.clear();
            buf.extend_from_slice(&head[8..8 + inline]);
            buf.resize(total, 0);
            let mut start = inline;
            while start < total {
                let end = (start + BROADCAST_SEGMENT_BYTES).min(total);
                transport.exchange_into(None, &mut buf[start..end])?;
                if forwards {
                    transport.exchange(Some(&buf[start..end]), None)?;
                }
                start = end;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_into_reads_aligned_and_unaligned_bytes_alike() {
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut bytes = vec![0u8];
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        let mut aligned = vec![1.0f32; values.len()];
        add_into(&mut aligned, bytemuck::cast_slice(&values));
        let mut unaligned = vec![1.0f32; values.len()];
        add_into(&mut unaligned, &bytes[1..]);
        let expected: Vec<f32> = values.iter().map(|v| v + 1.0).collect();
        assert_eq!(aligned, expected);
        assert_eq!(unaligned, expected);
    }
}
