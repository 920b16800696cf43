//! GGUF weights read in place from the file's memory map instead of copied at load: which
//! tensors are (those used as stored), which are copies (reordered rows, converted formats,
//! tensor-parallel column slices, k-quant matrices repacked for the kernels), and that the
//! in-place values are the ones decoding the file's bytes gives.

mod model_support;

use model_support::*;
use npufleet_worker::backend::{Matrix, WeightData, quant};
use npufleet_worker::model::gguf::{GgufFile, TensorType};
use npufleet_worker::model::weights::{Linear, TensorSource, Weights};
use npufleet_worker::model::{Model, PrecisionPolicy};

fn auto() -> PrecisionPolicy {
    PrecisionPolicy::Auto {
        int8_max_prompt_tokens: 64,
    }
}

fn address(m: &Matrix) -> usize {
    match &m.data {
        WeightData::F32(v) => v.as_ptr().addr(),
        WeightData::F16(v) => v.as_ptr().addr(),
        WeightData::Q4_0(v) => v.as_ptr().addr(),
        WeightData::Q4_1(v) => v.as_ptr().addr(),
        WeightData::Q5_0(v) => v.as_ptr().addr(),
        WeightData::Q5_1(v) => v.as_ptr().addr(),
        WeightData::Q8_0(v) => v.as_ptr().addr(),
        WeightData::Q4K(v) => v.as_ptr().addr(),
        WeightData::Q4KX8(v) => v.as_ptr().addr(),
        WeightData::Q5K(v) => v.as_ptr().addr(),
        WeightData::Q6K(v) => v.as_ptr().addr(),
        WeightData::Q6KX8(v) => v.as_ptr().addr(),
    }
}

/// Formats the engine converts at load, so they can never be read in place.
fn converted(ty: TensorType) -> bool {
    ty == TensorType::Bf16
}

/// Each layer's linear weights with the GGUF tensor they were loaded from.
fn linears(w: &Weights) -> Vec<(String, &Linear)> {
    let mut out = Vec::new();
    for (i, l) in w.layers.iter().enumerate() {
        for (t, lin) in [
            ("attn_q", &l.wq),
            ("attn_k", &l.wk),
            ("attn_v", &l.wv),
            ("attn_output", &l.wo),
            ("ffn_gate", &l.w_gate),
            ("ffn_up", &l.w_up),
            ("ffn_down", &l.w_down),
        ] {
            out.push((format!("blk.{i}.{t}.weight"), lin));
        }
    }
    out
}

/// Under the `auto` policy a block-quantised layer holds its blocks once, in the quantised
/// storage; returns those blocks and whether the file stored the tensor in a format the
/// engine converts.
fn held_blocks<'a>(file: &GgufFile, name: &str, lin: &'a Linear) -> (&'a Matrix, bool) {
    let q = lin
        .quant
        .as_ref()
        .expect("block weights are held quantised");
    assert!(
        lin.full.is_none(),
        "{name}: no full-precision copy of block weights"
    );
    (q, converted(file.tensors[name].ty))
}

#[test]
fn every_gguf_tensor_the_engine_uses_as_stored_is_the_files_bytes_in_place() {
    let path = smollm2_path();
    let file = GgufFile::open(&path).unwrap();
    let mut types = Vec::new();
    for (name, info) in &file.tensors {
        let m = file.matrix(name).unwrap().unwrap();
        let bytes = file.tensor_bytes(info);
        assert!(m.is_mapped(), "{name} ({:?}) is read in place", info.ty);
        assert_eq!(address(&m), bytes.as_ptr().addr(), "{name}");
        // The in-place blocks read as the field-by-field decoding of the same bytes.
        let same = match &m.data {
            WeightData::Q4_0(v) => **v == *quant::parse_q4_0(bytes),
            WeightData::Q4_1(v) => **v == *quant::parse_q4_1(bytes),
            WeightData::Q8_0(v) => **v == *quant::parse_q8_0(bytes),
            WeightData::F32(v) => v
                .iter()
                .zip(bytes.chunks_exact(4))
                .all(|(x, b)| x.to_bits() == u32::from_le_bytes(b.try_into().unwrap())),
            other => panic!("{name}: unexpected storage {other:?}"),
        };
        assert!(same, "{name} reads as decoded");
        types.push(info.ty);
    }
    for ty in [TensorType::Q4_1, TensorType::Q8_0, TensorType::F32] {
        assert!(types.contains(&ty), "the file holds {ty:?} tensors");
    }

    // A column-parallel slice is a narrower view; a row-parallel one gathers a copy.
    let down = file.matrix("blk.0.ffn_down.weight").unwrap().unwrap();
    let rows = down.select_rows(down.rows / 2..down.rows);
    assert!(rows.is_mapped());
    assert_eq!(rows.to_f32(), down.to_f32()[down.rows / 2 * down.cols..]);
    let cols = down.select_cols(0..down.cols / 2);
    assert!(!cols.is_mapped());
}

#[test]
fn a_loaded_llama_model_holds_its_weights_in_the_files_mapping() {
    let path = smollm2_path();
    let model: Model = load(&path, auto());
    let file = GgufFile::open(&path).unwrap();
    let w = model.weights();
    for (name, lin) in linears(w) {
        let (held, converted) = held_blocks(&file, &name, lin);
        assert!(!converted, "{name}");
        assert!(held.is_mapped(), "{name} is read in place");
    }
    assert!(w.token_embd.is_mapped());
    // The tied output head shares the embedding's blocks rather than copying them.
    let output = w.output.quant.as_ref().expect("q8_0 head held quantised");
    assert_eq!(address(output), address(&w.token_embd));
}

#[test]
fn every_block_format_of_the_kquant_files_is_read_in_place_or_repacked() {
    // Q4_K_M mixes Q5_0, Q8_0, Q4_K and Q6_K; Q5_K_M adds Q5_1 and Q5_K.
    let (mut formats, mut repacked) = (std::collections::BTreeSet::new(), 0);
    for mix in ["Q4_K_M", "Q5_K_M"] {
        let path = setup_path_with("kquant-models.sh", &[mix]);
        let model = load(&path, auto());
        let file = GgufFile::open(&path).unwrap();
        for (name, lin) in linears(model.weights()) {
            let (held, converted) = held_blocks(&file, &name, lin);
            assert!(!converted, "{mix} {name}");
            formats.insert(held.type_name());
            // Q4_K and Q6_K matrices of whole row groups are repacked for the grouped
            // kernels: a copy, holding the file's values.
            if let WeightData::Q4KX8(_) | WeightData::Q6KX8(_) = held.data {
                let stored = file.matrix(&name).unwrap().unwrap();
                assert!(!held.is_mapped(), "{mix} {name} is a repacked copy");
                let mut want = vec![0f32; stored.cols];
                let mut got = want.clone();
                for r in [0, 7, held.rows - 1] {
                    stored.row_to_f32(r, &mut want);
                    held.row_to_f32(r, &mut got);
                    assert_eq!(got, want, "{mix} {name} row {r}");
                }
                repacked += 1;
            } else {
                assert!(held.is_mapped(), "{mix} {name} is read in place");
            }
        }
    }
    assert!(
        repacked > 0,
        "the k-quant files' Q4_K and Q6_K layers are repacked"
    );
    assert_eq!(
        formats.into_iter().collect::<Vec<_>>(),
        ["q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0"]
    );
}

#[test]
fn reordered_qwen2_rotary_rows_are_copies() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = write_qwen2_model(&dir.path().join("q8_0.gguf"), &["--weights", "q8_0"]);
    let model = load(&path, auto());
    let file = GgufFile::open(&path).unwrap();
    for (name, lin) in linears(model.weights()) {
        let (held, _) = held_blocks(&file, &name, lin);
        let reordered = name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight");
        assert_eq!(held.is_mapped(), !reordered, "{name}");
    }
}

#[test]
fn safetensors_f32_and_f16_are_read_in_place_and_bf16_is_converted() {
    use npufleet_worker::model::weights::SafetensorsDir;
    use safetensors::{Dtype, tensor::TensorView};

    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let values: Vec<f32> = (0..32).map(|v| v as f32 / 4.0).collect();
    let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16_bytes: Vec<u8> = values
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let bf16_bytes: Vec<u8> = values[..8]
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let tensors = [
        (
            "model.embed_tokens.weight",
            TensorView::new(Dtype::F32, vec![4, 8], &f32_bytes).unwrap(),
        ),
        (
            "lm_head.weight",
            TensorView::new(Dtype::F16, vec![4, 8], &f16_bytes).unwrap(),
        ),
        (
            "model.norm.weight",
            TensorView::new(Dtype::BF16, vec![8], &bf16_bytes).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors")).unwrap();
    let src = SafetensorsDir::open(dir.path()).unwrap();
    let matrix = |name: &str| src.matrix(name).unwrap().unwrap();
    for (name, mapped) in [
        ("token_embd.weight", true),
        ("output.weight", true),
        ("output_norm.weight", false),
    ] {
        let m = matrix(name);
        assert_eq!(m.is_mapped(), mapped, "{name}");
        assert_eq!(m.to_f32(), values[..m.rows * m.cols], "{name}");
    }
}
