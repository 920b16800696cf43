//! Generated random-weight models in both real formats: the loaders, the rotary layouts,
//! every weight storage, and tensor-parallel sharding.

mod model_support;

use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};

use model_support::*;
use npufleet_worker::api::ChatMessage;
use npufleet_worker::backend::KvDtype;
use npufleet_worker::collective::{Collective, CollectiveError};
use npufleet_worker::model::{LoadOptions, Model, PrecisionPolicy, SequenceChunk, WeightPrecision};
use npufleet_worker_testkit::testmodel::{
    GenTestModelArgs, TestModelFormat, TestWeightType, write_into,
};

/// A GGUF file of [`spec`]'s model with `weight_type` weights, written into `dir`.
fn gguf_model(dir: &std::path::Path, weight_type: TestWeightType) -> std::path::PathBuf {
    let args = GenTestModelArgs {
        weight_type,
        ..spec(TestModelFormat::Gguf)
    };
    write_into(dir, args).unwrap()
}

fn spec(format: TestModelFormat) -> GenTestModelArgs {
    GenTestModelArgs {
        layers: 2,
        dim: 64,
        heads: 4,
        kv_heads: 2,
        vocab: 320,
        seed: 42,
        ..GenTestModelArgs::new("unused".into(), format)
    }
}

fn prompt_logits(model: &Model, tokens: &[u32], precision: WeightPrecision) -> Vec<f32> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut kv = model.new_kv_cache(blocks, BLOCK, KvDtype::F32);
    let table: Vec<u32> = (0..blocks as u32).collect();
    model
        .forward(
            &mut kv,
            &[SequenceChunk {
                tokens,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                precision,
            }],
        )
        .unwrap()
        .remove(0)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn gguf_and_safetensors_of_one_seed_are_the_same_model() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let gguf = load(
        &write_into(d1.path(), spec(TestModelFormat::Gguf)).unwrap(),
        PrecisionPolicy::Fp32,
    );
    let st = load(
        &write_into(d2.path(), spec(TestModelFormat::Safetensors)).unwrap(),
        PrecisionPolicy::Fp32,
    );
    assert_eq!(gguf.config(), st.config());
    let text = "hello world, the cat sat on the mat 123";
    let ids = gguf.tokenizer().encode(text);
    assert_eq!(
        ids,
        st.tokenizer().encode(text),
        "both tokenizers split the same way"
    );
    assert!(ids.len() < text.len(), "merges apply: {ids:?}");
    assert_eq!(gguf.tokenizer().decode(&ids), text);
    let chat = [ChatMessage {
        role: "user".into(),
        content: "hi".into(),
    }];
    let rendered = gguf.tokenizer().apply_chat_template(&chat, true).unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        rendered,
        st.tokenizer().apply_chat_template(&chat, true).unwrap()
    );
    // The GGUF file stores Q/K in the adjacent-pair rotary layout, safetensors in the
    // half-split one; equal logits mean both are handled.
    let (a, b) = (
        prompt_logits(&gguf, &ids, WeightPrecision::Full),
        prompt_logits(&st, &ids, WeightPrecision::Full),
    );
    assert!(max_diff(&a, &b) < 1e-4, "{}", max_diff(&a, &b));
    let spread =
        a.iter().copied().fold(f32::MIN, f32::max) - a.iter().copied().fold(f32::MAX, f32::min);
    assert!(spread > 0.1, "random logits are not degenerate");
}

#[test]
fn every_weight_storage_loads_and_tracks_f32() {
    let dir = tempfile::tempdir().unwrap();
    let reference = load(
        &write_into(dir.path(), spec(TestModelFormat::Gguf)).unwrap(),
        PrecisionPolicy::Fp32,
    );
    let ids = reference
        .tokenizer()
        .encode("once upon a time there was a little model");
    let want = prompt_logits(&reference, &ids, WeightPrecision::Full);
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
    for (ty, policy, tol) in [
        (TestWeightType::F32, PrecisionPolicy::Int8, 0.05),
        (TestWeightType::F32, PrecisionPolicy::Fp16, 0.01),
        (TestWeightType::F16, PrecisionPolicy::Fp32, 0.01),
        (TestWeightType::Q8_0, PrecisionPolicy::Int8, 0.05),
        (TestWeightType::Q4_1, PrecisionPolicy::Int8, 0.4),
        (
            TestWeightType::Q4_0,
            PrecisionPolicy::Auto {
                int8_max_prompt_tokens: 4,
            },
            0.4,
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let path = write_into(
            d.path(),
            GenTestModelArgs {
                weight_type: ty,
                ..spec(TestModelFormat::Gguf)
            },
        )
        .unwrap();
        let model = load(&path, policy);
        // The storage's own rounding, then the int8 activations on top of it.
        let full = prompt_logits(&model, &ids, WeightPrecision::Full);
        let int8 = prompt_logits(&model, &ids, WeightPrecision::Int8);
        let storage_error = max_diff(&full, &want) / scale;
        let int8_error = max_diff(&int8, &full) / scale;
        assert!(
            storage_error < tol,
            "{ty:?} under {policy:?}: relative error {storage_error}"
        );
        assert!(
            int8_error < 0.05,
            "{ty:?} under {policy:?}: int8 path differs by {int8_error}"
        );
    }
}

/// Both models give `text` exactly the same prompt logits at `precision`.
fn assert_same_logits(a: &Model, b: &Model, text: &str, precision: WeightPrecision) {
    let ids = a.tokenizer().encode(text);
    assert_eq!(
        prompt_logits(a, &ids, precision),
        prompt_logits(b, &ids, precision)
    );
}

/// `auto` with prompts of up to 4 tokens at int8, so longer ones take the full-precision path.
const INT8_UP_TO_4: PrecisionPolicy = PrecisionPolicy::Auto {
    int8_max_prompt_tokens: 4,
};

/// Under `auto`, a block-quantised file is held once: full-precision chunks widen its blocks
/// per tile instead of keeping an f32 copy, with exactly the results of the f32 copy.
#[test]
fn auto_holds_quantised_weights_once_and_widens_them_exactly() {
    let d = tempfile::tempdir().unwrap();
    let path = gguf_model(d.path(), TestWeightType::Q4_1);
    let auto = load(&path, INT8_UP_TO_4);
    let int8 = load(&path, PrecisionPolicy::Int8);
    let fp32 = load(&path, PrecisionPolicy::Fp32);
    assert_eq!(auto.weight_bytes(), int8.weight_bytes());
    assert!(fp32.weight_bytes() > 3 * auto.weight_bytes());
    // Decode reads the int8 blocks under `auto`, and one embedding row rather than the table.
    assert_eq!(auto.decode_weight_bytes(), int8.decode_weight_bytes());
    assert!(auto.decode_weight_bytes() < auto.weight_bytes());
    assert!(fp32.decode_weight_bytes() > 3 * auto.decode_weight_bytes());
    let text = "once upon a time there was a little model";
    assert_same_logits(&auto, &fp32, text, WeightPrecision::Full);
}

/// Under the default `auto`, every prompt runs at int8, so a float file's layers that have
/// an int8 copy drop their float storage; a limit on int8 prompts keeps it for the longer
/// ones.
#[test]
fn default_auto_holds_no_float_copy_it_never_reads() {
    let d = tempfile::tempdir().unwrap();
    let path = gguf_model(d.path(), TestWeightType::F32);
    let every_prompt_int8 = PrecisionPolicy::Auto {
        int8_max_prompt_tokens: usize::MAX,
    };
    assert_eq!(every_prompt_int8.precisions(), [WeightPrecision::Int8]);
    let default = load(&path, every_prompt_int8);
    let limited = load(&path, INT8_UP_TO_4);
    assert!(default.weight_bytes() < limited.weight_bytes());
    assert_same_logits(
        &default,
        &limited,
        "once upon a time",
        WeightPrecision::Int8,
    );
}

#[test]
fn corrupt_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_into(dir.path(), spec(TestModelFormat::Gguf)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let opts = || LoadOptions {
        policy: PrecisionPolicy::Fp32,
        threads: 1,
        collective: None,
        backend: None,
    };
    let err = format!("{:#}", Model::load(&cut, opts()).err().unwrap());
    assert!(err.contains("beyond the end of the file"), "{err}");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a model").unwrap();
    let err = format!("{:#}", Model::load(&junk, opts()).err().unwrap());
    assert!(err.contains("bad magic"), "{err}");
    let err = format!(
        "{:#}",
        Model::load(Path::new("/nonexistent/model.gguf"), opts())
            .err()
            .unwrap()
    );
    assert!(err.contains("opening"), "{err}");
}

/// An in-process all-reduce for the sharding test: every rank deposits its buffer, waits,
/// and sums all of them.
struct LocalGroup {
    world: usize,
    slots: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

struct LocalRank {
    rank: usize,
    group: Arc<LocalGroup>,
}

impl Collective for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.group.slots.lock().unwrap()[self.rank] = buf.to_vec();
        self.group.barrier.wait();
        {
            let slots = self.group.slots.lock().unwrap();
            buf.fill(0.0);
            for s in slots.iter() {
                for (b, v) in buf.iter_mut().zip(s) {
                    *b += v;
                }
            }
        }
        self.group.barrier.wait();
        Ok(())
    }

    fn all_gather(&self, _: &[f32], _: &mut [f32]) -> Result<(), CollectiveError> {
        Err(CollectiveError::Invalid("not used by the model".into()))
    }

    fn broadcast_bytes(&self, _: &mut Vec<u8>, _: usize) -> Result<(), CollectiveError> {
        Err(CollectiveError::Invalid("not used by the model".into()))
    }
}

#[test]
fn tensor_parallel_shards_reproduce_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = gguf_model(dir.path(), TestWeightType::Q8_0);
    let whole = load(
        &path,
        PrecisionPolicy::Auto {
            int8_max_prompt_tokens: 4,
        },
    );
    let ids = whole.tokenizer().encode("the quick brown fox");
    let world = 2;
    let group = Arc::new(LocalGroup {
        world,
        slots: Mutex::new(vec![Vec::new(); world]),
        barrier: Barrier::new(world),
    });
    for precision in [WeightPrecision::Full, WeightPrecision::Int8] {
        let want = prompt_logits(&whole, &ids, precision);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (group, path, ids) = (group.clone(), &path, &ids);
                    s.spawn(move || {
                        let collective: Arc<dyn Collective> = Arc::new(LocalRank { rank, group });
                        let opts = LoadOptions {
                            policy: PrecisionPolicy::Auto {
                                int8_max_prompt_tokens: 4,
                            },
                            threads: 1,
                            collective: Some(collective),
                            backend: None,
                        };
                        let model = Model::load(path, opts).unwrap();
                        assert_eq!(model.shard().world, world);
                        prompt_logits(&model, ids, precision)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            assert!(
                max_diff(r, &want) < 1e-3,
                "{precision:?}: shard logits differ by {}",
                max_diff(r, &want)
            );
        }
    }
}
