//! The paged key/value cache: per layer, `num_blocks` blocks of `block_size` positions, each
//! position holding `n_kv_heads × head_dim` keys and as many values (f32).

use crate::backend::PagedKv;

pub struct KvCache {
    layers: Vec<LayerCache>,
    num_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// `n_kv_heads` is the number this rank holds.
    pub fn new(
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
                    k: vec![0.0; len],
                    v: vec![0.0; len],
                })
                .collect(),
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
        }
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
            * std::mem::size_of::<f32>()
    }

    pub fn bytes(&self) -> usize {
        self.bytes_per_block() * self.num_blocks
    }

    /// Stores the keys and values of positions `start_pos..` (one `n_kv_heads × head_dim`
    /// row each) of one sequence in layer `layer`.
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
            cache.k[at..at + slot].copy_from_slice(k);
            cache.v[at..at + slot].copy_from_slice(v);
        }
    }

    pub(crate) fn paged<'a>(&'a self, layer: usize, block_table: &'a [u32]) -> PagedKv<'a> {
        let cache = &self.layers[layer];
        PagedKv {
            k: &cache.k,
            v: &cache.v,
            block_table,
            block_size: self.block_size,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }
}
