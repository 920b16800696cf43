//! The paged key/value cache: per layer, `num_blocks` blocks of `block_size` positions, each
//! position holding `n_kv_heads × head_dim` keys and as many values, in f16 or f32.

use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

use crate::backend::{KvData, KvDtype, PagedKv};

pub struct KvCache {
    layers: Vec<LayerCache>,
    dtype: KvDtype,
    num_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

struct LayerCache {
    k: Values,
    v: Values,
}

enum Values {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Values {
    /// Zeroed through the allocator, so pages no sequence has written stay unmapped and
    /// out of the resident set.
    fn zeroed(dtype: KvDtype, len: usize) -> Values {
        match dtype {
            KvDtype::F16 => Values::F16(vec![0u16; len].reinterpret_into()),
            KvDtype::F32 => Values::F32(vec![0.0; len]),
        }
    }

    /// Writes `x` at `at`, rounded to the storage type.
    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            Values::F16(v) => v[at..at + x.len()].convert_from_f32_slice(x),
            Values::F32(v) => v[at..at + x.len()].copy_from_slice(x),
        }
    }

    fn data(&self) -> KvData<'_> {
        match self {
            Values::F16(v) => KvData::F16(v),
            Values::F32(v) => KvData::F32(v),
        }
    }
}

impl KvCache {
    /// `n_kv_heads` is the number this rank holds.
    pub fn new(
        dtype: KvDtype,
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> KvCache {
        let len = num_blocks * block_size * n_kv_heads * head_dim;
        KvCache {
            layers: (0..n_layers)
                .map(|_| LayerCache {
                    k: Values::zeroed(dtype, len),
                    v: Values::zeroed(dtype, len),
                })
                .collect(),
            dtype,
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
        }
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes of one block across all layers, keys and values.
    pub fn bytes_per_block(&self) -> usize {
        self.layers.len()
            * 2
            * self.block_size
            * self.n_kv_heads
            * self.head_dim
            * self.dtype.size()
    }

    pub fn bytes(&self) -> usize {
        self.bytes_per_block() * self.num_blocks
    }

    /// Stores the keys and values of positions `start_pos..` (one `n_kv_heads × head_dim`
    /// row each) of one sequence in layer `layer`, converted to the cache's type once here.
    pub(crate) fn store(
        &mut self,
        layer: usize,
        block_table: &[u32],
        start_pos: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let slot = self.n_kv_heads * self.head_dim;
        let cache = &mut self.layers[layer];
        for (i, (k, v)) in k.chunks_exact(slot).zip(v.chunks_exact(slot)).enumerate() {
            let pos = start_pos + i;
            let block = block_table[pos / self.block_size] as usize;
            let at = (block * self.block_size + pos % self.block_size) * slot;
            cache.k.write(at, k);
            cache.v.write(at, v);
        }
    }

    pub(crate) fn paged<'a>(&'a self, layer: usize, block_table: &'a [u32]) -> PagedKv<'a> {
        let cache = &self.layers[layer];
        PagedKv {
            k: cache.k.data(),
            v: cache.v.data(),
            block_table,
            block_size: self.block_size,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }
}
