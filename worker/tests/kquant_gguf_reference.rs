//! The k-quant dequantisers (and those of the fallback types `Q5_0`/`Q5_1`) against the
//! `gguf` Python package's own (numpy) dequantiser on the same bytes. Both compute each value as one f32 multiply (and one subtract) from the
//! same f32 scale products, so the results must be equal bit for bit.

mod model_support;

use std::process::Command;

use half::f16;
use model_support::{run_ok, setup_path};
use npufleet_worker::backend::kquant::{self, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K};
use npufleet_worker::backend::quant::{self, Q5_0_BYTES, Q5_1_BYTES, QK};

/// Random blocks whose f16 scales (at `scales`, byte offsets in a block) are finite and of
/// the size real files hold; every other byte is random, which is a valid block.
fn random_blocks(seed: u64, n: usize, block_bytes: usize, scales: &[usize]) -> Vec<u8> {
    let mut state = seed;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out: Vec<u8> = (0..n * block_bytes).map(|_| (next() >> 32) as u8).collect();
    for b in out.chunks_exact_mut(block_bytes) {
        for &at in scales {
            let v = (next() >> 40) as f32 / (1u64 << 24) as f32;
            let h = f16::from_f32((v + 0.01) * 0.05);
            b[at..at + 2].copy_from_slice(&h.to_bits().to_le_bytes());
        }
    }
    out
}

/// `gguf.quants.dequantize` of `bytes` as ggml type `type_name`, as f32 values.
fn gguf_dequantize(name: &str, bytes: &[u8], type_name: &str) -> Vec<f32> {
    let tmp = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let (input, output) = (
        tmp.join(format!("kquant-{name}.bin")),
        tmp.join(format!("kquant-{name}.f32")),
    );
    std::fs::write(&input, bytes).unwrap();
    let script = "import sys, numpy as np\n\
        from gguf.quants import dequantize\n\
        from gguf import GGMLQuantizationType as T\n\
        raw = np.fromfile(sys.argv[1], dtype=np.uint8)\n\
        dequantize(raw, T[sys.argv[2]]).astype(np.float32).tofile(sys.argv[3])\n";
    run_ok(
        Command::new(setup_path("python-env.sh"))
            .arg("-c")
            .arg(script)
            .arg(&input)
            .arg(type_name)
            .arg(&output),
        "gguf dequantize",
    );
    std::fs::read(&output)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn assert_bit_equal(name: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{name}: value count");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{name} value {i}: {a} vs gguf {b}"
        );
    }
}

const BLOCKS: usize = 64;

/// `BLOCKS` random super-blocks of `type_name` (seeded by `seed`, with f16 fields at
/// `f16_at`) dequantise through `ours` bit for bit as through the gguf package.
fn assert_k_quant_matches(
    seed: u64,
    block_bytes: usize,
    f16_at: &[usize],
    type_name: &str,
    ours: impl Fn(&[u8], &mut [f32]),
) {
    let bytes = random_blocks(seed, BLOCKS, block_bytes, f16_at);
    let mut values = vec![0f32; BLOCKS * QK_K];
    ours(&bytes, &mut values);
    let name = type_name.to_lowercase();
    assert_bit_equal(&name, &values, &gguf_dequantize(&name, &bytes, type_name));
}

#[test]
fn q4_k_dequantises_as_the_gguf_package_does() {
    assert_k_quant_matches(1, Q4_K_BYTES, &[0, 2], "Q4_K", |bytes, out| {
        kquant::dequantize_q4_k(&kquant::parse_q4_k(bytes), out)
    });
}

#[test]
fn q5_k_dequantises_as_the_gguf_package_does() {
    assert_k_quant_matches(2, Q5_K_BYTES, &[0, 2], "Q5_K", |bytes, out| {
        kquant::dequantize_q5_k(&kquant::parse_q5_k(bytes), out)
    });
}

#[test]
fn q6_k_dequantises_as_the_gguf_package_does() {
    assert_k_quant_matches(3, Q6_K_BYTES, &[208], "Q6_K", |bytes, out| {
        kquant::dequantize_q6_k(&kquant::parse_q6_k(bytes), out)
    });
}

/// The fallback types of k-quant files, `Q5_0` and `Q5_1`.
#[test]
fn q5_0_and_q5_1_dequantise_as_the_gguf_package_does() {
    let n = 4 * BLOCKS;
    let q5_0 = random_blocks(4, n, Q5_0_BYTES, &[0]);
    let mut ours = vec![0f32; n * QK];
    quant::dequantize_q5_0(&quant::parse_q5_0(&q5_0), &mut ours);
    assert_bit_equal("q5_0", &ours, &gguf_dequantize("q5_0", &q5_0, "Q5_0"));
    let q5_1 = random_blocks(5, n, Q5_1_BYTES, &[0, 2]);
    quant::dequantize_q5_1(&quant::parse_q5_1(&q5_1), &mut ours);
    assert_bit_equal("q5_1", &ours, &gguf_dequantize("q5_1", &q5_1, "Q5_1"));
}
