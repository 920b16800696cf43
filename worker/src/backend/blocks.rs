//! Storage for a weight matrix's values: owned, or read in place from a model file's memory
//! map, so a file's weights are not held twice (once mapped, once copied).

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, Range};
use std::sync::Arc;

use bytemuck::Pod;
use half::f16;
use memmap2::Mmap;

use super::kquant::{BlockQ4K, BlockQ5K, BlockQ6K, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};
use super::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES,
    Q5_1_BYTES, Q8_0_BYTES,
};

/// A value type whose bytes in memory, on a little-endian host, are its encoding in a model
/// file (GGUF blocks, safetensors scalars): `Pod` rules out padding, and `FILE_BYTES` is the
/// encoded size, which the type's size is checked against at compile time.
pub trait FileLayout: Pod {
    const FILE_BYTES: usize;
}

macro_rules! file_layout {
    ($($t:ty = $bytes:expr),* $(,)?) => {$(
        const _: () = assert!(size_of::<$t>() == $bytes);
        impl FileLayout for $t {
            const FILE_BYTES: usize = $bytes;
        }
    )*};
}

file_layout!(
    f32 = 4,
    f16 = 2,
    BlockQ4_0 = Q4_0_BYTES,
    BlockQ4_1 = Q4_1_BYTES,
    BlockQ5_0 = Q5_0_BYTES,
    BlockQ5_1 = Q5_1_BYTES,
    BlockQ8_0 = Q8_0_BYTES,
    BlockQ4K = Q4_K_BYTES,
    BlockQ5K = Q5_K_BYTES,
    BlockQ6K = Q6_K_BYTES,
);

/// A run of `T` (quantisation blocks or scalars) that dereferences to `&[T]`.
pub struct Blocks<T>(Storage<T>);

enum Storage<T> {
    Owned(Vec<T>),
    /// `map[bytes]` reinterpreted; checked aligned and a whole number of `T` when built.
    Mapped {
        map: Arc<Mmap>,
        bytes: Range<usize>,
        values: PhantomData<T>,
    },
}

impl<T: FileLayout> Blocks<T> {
    /// The values encoded in `map[bytes]`, used in place; `None` when that would not read them
    /// as encoded (a big-endian host) or the range is out of the map, not aligned for `T` or
    /// not a whole number of values, for which the caller decodes a copy instead.
    pub fn mapped(map: &Arc<Mmap>, bytes: Range<usize>) -> Option<Blocks<T>> {
        let in_place = cfg!(target_endian = "little")
            && bytemuck::try_cast_slice::<u8, T>(map.get(bytes.clone())?).is_ok();
        in_place.then(|| {
            Blocks(Storage::Mapped {
                map: Arc::clone(map),
                bytes,
                values: PhantomData,
            })
        })
    }
}

impl<T: Pod> Blocks<T> {
    /// Whether the values are read from a file's mapping rather than held in memory.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Storage::Mapped { .. })
    }

    /// Takes mapped values' pages out of the process's resident set once a copy replaced
    /// them (the file's pages stay cached, and are mapped again if read). Advisory: a failure
    /// only leaves them resident.
    pub fn release_pages(&self) {
        let Storage::Mapped { map, bytes, .. } = &self.0 else {
            return;
        };
        let page = rustix::param::page_size();
        let (start, end) = (bytes.start.next_multiple_of(page), bytes.end / page * page);
        if start < end {
            // SAFETY: the map is read-only, so dropping its pages loses nothing: a later read
            // maps the file's bytes again.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// Values `range`: a narrower view of mapped values, a copy of owned ones.
    pub fn slice(&self, range: Range<usize>) -> Blocks<T> {
        // Panics on a bad range exactly as slicing the values would.
        let values = &self[range.clone()];
        match &self.0 {
            Storage::Owned(_) => values.to_vec().into(),
            Storage::Mapped { map, bytes, .. } => {
                let size = size_of::<T>();
                Blocks(Storage::Mapped {
                    map: Arc::clone(map),
                    bytes: bytes.start + range.start * size..bytes.start + range.end * size,
                    values: PhantomData,
                })
            }
        }
    }
}

impl<T: Pod> Deref for Blocks<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.0 {
            Storage::Owned(v) => v,
            Storage::Mapped { map, bytes, .. } => bytemuck::cast_slice(&map[bytes.clone()]),
        }
    }
}

impl<T> From<Vec<T>> for Blocks<T> {
    fn from(v: Vec<T>) -> Self {
        Blocks(Storage::Owned(v))
    }
}

impl<T: Clone> Clone for Blocks<T> {
    /// Owned values are copied; mapped ones share the mapping.
    fn clone(&self) -> Self {
        Blocks(match &self.0 {
            Storage::Owned(v) => Storage::Owned(v.clone()),
            Storage::Mapped { map, bytes, .. } => Storage::Mapped {
                map: Arc::clone(map),
                bytes: bytes.clone(),
                values: PhantomData,
            },
        })
    }
}

impl<T: Pod + PartialEq> PartialEq for Blocks<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Pod + fmt::Debug> fmt::Debug for Blocks<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn map_of(bytes: &[u8]) -> Arc<Mmap> {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        // SAFETY: a private temporary file nothing else writes.
        Arc::new(unsafe { Mmap::map(&file) }.unwrap())
    }

    #[test]
    fn mapped_values_read_as_encoded_and_slice_without_copying() {
        let values: Vec<f32> = (0..8).map(|v| v as f32 * 0.5).collect();
        let mut bytes = vec![0u8; 4];
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        let map = map_of(&bytes);
        let blocks = Blocks::<f32>::mapped(&map, 4..bytes.len()).expect("aligned f32s map");
        assert!(blocks.is_mapped());
        assert_eq!(&*blocks, values.as_slice());
        assert_eq!(blocks.as_ptr() as usize, map.as_ptr() as usize + 4);
        let middle = blocks.slice(2..5);
        assert!(middle.is_mapped());
        assert_eq!(&*middle, &values[2..5]);
        assert_eq!(middle.as_ptr(), blocks[2..].as_ptr());
        assert_eq!(blocks.clone().as_ptr(), blocks.as_ptr());
    }

    #[test]
    fn ranges_that_cannot_be_read_in_place_are_refused() {
        let map = map_of(&[0u8; 64]);
        // Misaligned for f32, a partial value, beyond the end.
        assert!(Blocks::<f32>::mapped(&map, 2..10).is_none());
        assert!(Blocks::<f32>::mapped(&map, 4..10).is_none());
        assert!(Blocks::<f32>::mapped(&map, 32..68).is_none());
        // A block type aligned to 2 may start at any even offset.
        assert!(Blocks::<BlockQ4_0>::mapped(&map, 2..2 + 2 * Q4_0_BYTES).is_some());
        assert!(Blocks::<BlockQ4_0>::mapped(&map, 1..1 + Q4_0_BYTES).is_none());
    }

    #[test]
    fn owned_values_slice_into_copies() {
        let blocks = Blocks::from(vec![1.0f32, 2.0, 3.0, 4.0]);
        let part = blocks.slice(1..3);
        assert!(!part.is_mapped());
        assert_eq!(&*part, &[2.0, 3.0]);
        assert_ne!(part.as_ptr(), blocks[1..].as_ptr());
    }
}
