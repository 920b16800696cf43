//! The model layer on the real SmolLM2-135M-Instruct GGUF file: parsing, tokenizer, chat
//! template, agreement with an independent numpy forward pass, batching and bad input.

mod model_support;

use std::sync::OnceLock;

use model_support::*;
use npufleet_contract::prompt::PromptTokenizer;
use npufleet_worker::api::ChatMessage;
use npufleet_worker::backend::KvDtype;
use npufleet_worker::model::gguf::{GgufFile, TensorType, Value};
use npufleet_worker::model::{
    ForwardError, Model, PrecisionPolicy, SequenceChunk, StreamDecoder, WeightPrecision,
};

/// One model for the whole file: loading dequantises every layer.
fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        load(
            &smollm2_path(),
            PrecisionPolicy::Auto {
                int8_max_prompt_tokens: 64,
            },
        )
    })
}

#[test]
fn gguf_header_metadata_and_tensors_parse() {
    let file = GgufFile::open(&smollm2_path()).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.tensors.len(), 272);
    assert_eq!(
        file.get("general.architecture"),
        Some(&Value::String("llama".into()))
    );
    assert_eq!(
        file.get("llama.block_count").and_then(Value::as_u64),
        Some(30)
    );
    let embd = &file.tensors["token_embd.weight"];
    assert_eq!(
        (embd.dims.as_slice(), embd.ty),
        ([576u64, 49152].as_slice(), TensorType::Q8_0)
    );
    assert_eq!(file.tensors["blk.0.ffn_down.weight"].ty, TensorType::Q4_1);
    let cfg = model().config();
    assert_eq!(
        (
            cfg.n_layers,
            cfg.dim,
            cfg.ffn_dim,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
            cfg.context_length
        ),
        (30, 576, 1536, 9, 3, 64, 49152, 8192)
    );
    assert_eq!(
        (cfg.rope_theta, cfg.rms_eps, cfg.add_bos),
        (100000.0, 1e-5, false)
    );
    assert!(
        cfg.eos_token_ids.contains(&2),
        "<|im_end|> ends generation: {:?}",
        cfg.eos_token_ids
    );
}

#[test]
fn tokenizer_known_encodings_and_round_trip() {
    let tok = model().tokenizer();
    let id = |t: &str| {
        tok.token_id(t)
            .unwrap_or_else(|| panic!("{t} in vocabulary"))
    };
    assert_eq!(
        tok.encode("Hello, world!"),
        vec![id("Hello"), id(","), id("Ġworld"), id("!")]
    );
    // The smollm pre-tokenizer splits digits one by one.
    assert_eq!(tok.encode("2024"), vec![id("2"), id("0"), id("2"), id("4")]);
    assert_eq!(tok.encode("<|im_start|>user"), vec![1, id("user")]);
    assert_eq!(tok.encode(""), Vec::<u32>::new());
    for text in [
        "héllo wörld 😀 日本語\n\ttabs  and  spaces",
        "fn main() { println!(\"hi\"); }",
        " leading space",
    ] {
        let ids = tok.encode(text);
        assert_eq!(tok.decode(&ids), text);
        let mut stream = StreamDecoder::new();
        let mut pieces = String::new();
        for &i in &ids {
            let piece = stream.push(tok, i);
            assert!(
                !piece.contains('\u{fffd}'),
                "a character was split: {piece:?}"
            );
            pieces.push_str(&piece);
        }
        pieces.push_str(&stream.finish());
        assert_eq!(pieces, text);
    }
    assert_eq!(tok.token_bytes(u32::MAX), None);
    assert_eq!(tok.decode(&[u32::MAX, id("Hello")]), "Hello");
}

#[test]
fn chat_template_renders_chatml() {
    let tok = model().tokenizer();
    let msg = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    assert_eq!(
        tok.apply_chat_template(&[msg("user", "Hi")], true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        tok.apply_chat_template(&[msg("system", "Be brief."), msg("user", "Hi")], false)
            .unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

/// A router rebuilding the tokenizer from the worker's published recipe gets the worker's
/// own token ids, so the prefix-cache blocks it names are the ones the worker caches.
#[test]
fn the_published_prompt_recipe_tokenises_as_the_worker_does() {
    let model = model();
    let tok = model.tokenizer();
    let recipe = tok.recipe(model.config(), "smollm2", 16).unwrap();
    let wire = serde_json::to_string(&recipe).unwrap();
    let router = PromptTokenizer::from_recipe(serde_json::from_str(&wire).unwrap()).unwrap();
    let msg = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    let chats = [
        vec![msg("user", "Hi")],
        vec![
            msg("system", "You answer in French. Numbers: 12345, 3.14159."),
            msg(
                "user",
                "Name three rivers of Europe, with their lengths in km.",
            ),
            msg("assistant", "Le Rhin, le Danube et la Loire."),
            msg("user", "Et en Asie ?  Des fleuves chinois : 长江, 黄河 !"),
        ],
    ];
    for chat in &chats {
        let text = tok.apply_chat_template(chat, true).unwrap();
        assert_eq!(
            router.chat_tokens(chat).unwrap(),
            tok.encode_prompt(model.config(), &text)
        );
    }
    for text in PROMPTS
        .iter()
        .copied()
        .chain(["  leading spaces\t\ttabs\n\n<|im_end|>", ""])
    {
        assert_eq!(
            router.text_tokens(text).unwrap(),
            tok.encode_prompt(model.config(), text),
            "{text:?}"
        );
    }
}

const PROMPTS: [&str; 5] = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
];
const GEN: usize = 32;
/// f32 against numpy f32: both compute the same dequantised weights, only the summation
/// order differs.
const LOGIT_TOLERANCE: f32 = 2e-2;

/// The prompts in token ids and the numpy reference's greedy steps after each.
fn prompts_and_reference(model: &Model) -> (Vec<Vec<u32>>, Vec<Vec<RefStep>>) {
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| model.tokenizer().encode(p))
        .collect();
    let reference = numpy_reference(&smollm2_path(), &prompts, GEN);
    (prompts, reference)
}

#[test]
fn f32_path_matches_numpy_reference_and_int8_agrees_on_top1() {
    let model = model();
    let (prompts, reference) = prompts_and_reference(model);
    let (mut positions, mut f32_same, mut int8_same, mut max_diff) = (0, 0, 0, 0f32);
    for (prompt, steps) in prompts.iter().zip(&reference) {
        let forced: Vec<u32> = steps.iter().map(|s| s.token).collect();
        let full = forced_logits(model, prompt, &forced, WeightPrecision::Full);
        let int8 = forced_logits(model, prompt, &forced, WeightPrecision::Int8);
        for ((s, f), q) in steps.iter().zip(&full).zip(&int8) {
            positions += 1;
            max_diff = max_diff.max(top_logits_diff(f, s, LOGIT_TOLERANCE, "SmolLM2"));
            // A different argmax is only acceptable as a tie within the tolerance.
            let pick = argmax(f);
            if pick == s.token {
                f32_same += 1;
            } else {
                assert!(
                    (f[pick as usize] - f[s.token as usize]).abs() <= LOGIT_TOLERANCE,
                    "f32 argmax {pick} vs numpy {}",
                    s.token
                );
            }
            int8_same += usize::from(argmax(q) == s.token);
        }
        let greedy_full = greedy(model, prompt, GEN, WeightPrecision::Full).0;
        let greedy_text = model.tokenizer().decode(&greedy_full);
        eprintln!("{:?} → {greedy_text:?}", model.tokenizer().decode(prompt));
        assert_eq!(
            greedy_full, forced,
            "free-running f32 greedy decoding follows numpy"
        );
    }
    let int8_rate = int8_same as f64 / positions as f64;
    eprintln!(
        "numpy agreement over {positions} positions: f32 top-1 {f32_same}, max |Δlogit| {max_diff:.2e}; int8 top-1 {int8_same} ({:.1}%)",
        int8_rate * 100.0
    );
    assert!(positions >= 5 * GEN);
    assert!(int8_rate >= 0.95, "int8 top-1 agreement {int8_rate:.3}");
}

/// The f16 KV cache `serve` stores by default, against numpy's f32 forward pass: with f32
/// weights it must agree on the teacher-forced top-1 and the free-running greedy tokens at
/// least as well as the int8 weights do with an f32 cache.
#[test]
fn f16_kv_cache_agrees_with_numpy_at_least_as_well_as_int8() {
    let model = model();
    let (prompts, reference) = prompts_and_reference(model);
    let (mut positions, mut f16_same, mut int8_same, mut max_diff) = (0, 0, 0, 0f32);
    let (mut f16_greedy, mut int8_greedy) = (0, 0);
    for (prompt, steps) in prompts.iter().zip(&reference) {
        let forced: Vec<u32> = steps.iter().map(|s| s.token).collect();
        let f16 = forced_logits_kv(model, prompt, &forced, WeightPrecision::Full, KvDtype::F16);
        let int8 = forced_logits(model, prompt, &forced, WeightPrecision::Int8);
        for ((s, h), q) in steps.iter().zip(&f16).zip(&int8) {
            positions += 1;
            for (&id, &want) in s.top_ids.iter().zip(&s.top_logits) {
                max_diff = max_diff.max((h[id as usize] - want).abs());
            }
            f16_same += usize::from(argmax(h) == s.token);
            int8_same += usize::from(argmax(q) == s.token);
        }
        // Tokens generated before the first one numpy would not have picked.
        let agreed = |tokens: Vec<u32>| {
            tokens
                .iter()
                .zip(&forced)
                .take_while(|(a, b)| a == b)
                .count()
        };
        f16_greedy += agreed(greedy_kv(model, prompt, GEN, WeightPrecision::Full, KvDtype::F16).0);
        int8_greedy += agreed(greedy(model, prompt, GEN, WeightPrecision::Int8).0);
    }
    eprintln!(
        "numpy agreement over {positions} positions: f16 KV top-1 {f16_same}, max |Δlogit| {max_diff:.2e}, greedy {f16_greedy}; int8 weights top-1 {int8_same}, greedy {int8_greedy}"
    );
    assert!(positions >= 5 * GEN);
    assert!(
        f16_same >= int8_same,
        "f16 KV top-1 {f16_same} vs int8 {int8_same}"
    );
    assert!(
        f16_greedy >= int8_greedy,
        "f16 KV greedy {f16_greedy} vs int8 {int8_greedy}"
    );
}

/// Runs `chunks` as one batch and each on its own, in one chunk; the logits must be the same
/// bits.
#[test]
fn mixed_batch_equals_separate_runs() {
    let model = model();
    let tok = model.tokenizer();
    let a = tok.encode("The quick brown fox jumps over the lazy dog");
    let b = tok.encode("Hello");
    let c = tok.encode("One, two, three, four, five, six, seven");
    // Sequence A prefilled up to its last token already (compared with a one-shot prefill);
    // B fresh; C (int8) prefilled in two chunks.
    let mut kv = model.new_kv_cache(12, BLOCK, KvDtype::F32);
    let (ta, tb, tc): (Vec<u32>, Vec<u32>, Vec<u32>) = (vec![5, 1], vec![7], vec![2, 9]);
    let chunk = |tokens, start_pos, table, precision| SequenceChunk {
        tokens,
        start_pos,
        block_table: table,
        want_logits: true,
        precision,
    };
    let full = WeightPrecision::Full;
    let int8 = WeightPrecision::Int8;
    let split = a.len() - 1;
    let cs = 5;
    model
        .forward(
            &mut kv,
            &[
                chunk(&a[..split], 0, &ta, full),
                chunk(&c[..cs], 0, &tc, int8),
            ],
        )
        .unwrap();
    let batched = model
        .forward(
            &mut kv,
            &[
                chunk(&a[split..], split, &ta, full),
                chunk(&b, 0, &tb, full),
                chunk(&c[cs..], cs, &tc, int8),
            ],
        )
        .unwrap();
    let mut kv2 = model.new_kv_cache(12, BLOCK, KvDtype::F32);
    let alone = [
        model
            .forward(&mut kv2, &[chunk(&a, 0, &ta, full)])
            .unwrap()
            .remove(0),
        model
            .forward(&mut kv2, &[chunk(&b, 0, &tb, full)])
            .unwrap()
            .remove(0),
        model
            .forward(&mut kv2, &[chunk(&c, 0, &tc, int8)])
            .unwrap()
            .remove(0),
    ];
    assert_eq!(batched.len(), 3);
    for (i, (x, y)) in batched.iter().zip(&alone).enumerate() {
        let differing = x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits());
        assert_eq!(
            differing.count(),
            0,
            "chunk {i}: batched and separate logits differ"
        );
    }
}

/// Last-row logits of `prompt` computed in chunks ending at each of `ends` (the last is the
/// prompt's length), one `forward` per chunk on a fresh cache: a prefix whose keys and
/// values come from earlier chunks is what a prefix-cache hit gives the engine.
fn chunked_logits(prompt: &[u32], ends: &[usize], precision: WeightPrecision) -> Vec<f32> {
    let model = model();
    let blocks = prompt.len().div_ceil(BLOCK);
    let mut kv = model.new_kv_cache(blocks, BLOCK, KvDtype::F32);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut start = 0;
    let mut logits = Vec::new();
    for &end in ends {
        logits = model
            .forward(
                &mut kv,
                &[SequenceChunk {
                    tokens: &prompt[start..end],
                    start_pos: start,
                    block_table: &table,
                    want_logits: true,
                    precision,
                }],
            )
            .expect("chunk")
            .remove(0);
        start = end;
    }
    logits
}

/// Temperature 0 must not depend on the prefix cache: the last prompt row's logits are the
/// same bits whether the first `split` tokens were computed in this request (one chunk) or
/// came from earlier chunks, for several split points and chunk sizes, at both precisions
/// the default `auto` policy serves.
#[test]
fn cached_prefix_gives_bitwise_identical_logits() {
    let prompt = model()
        .tokenizer()
        .encode("Quelle est la plus haute distinction honorifique française, et qui l'a créée ?");
    let n = prompt.len();
    assert!(n > 20, "prompt of {n} tokens");
    for precision in [WeightPrecision::Int8, WeightPrecision::Full] {
        let whole = chunked_logits(&prompt, &[n], precision);
        for split in [1, 5, BLOCK, n - 1] {
            for chunk in [1, 3, 8, 64] {
                // The prefix in chunks of `chunk`, the rest in one: a cache filled by
                // earlier requests or steps.
                let mut ends: Vec<usize> = (chunk..split).step_by(chunk).collect();
                ends.extend([split, n]);
                // The prefix in one chunk, the rest in chunks of `chunk`: a cache hit
                // followed by chunked prefill of the remainder.
                let mut rest: Vec<usize> = (split + chunk..n).step_by(chunk).collect();
                rest.insert(0, split);
                rest.push(n);
                for ends in [ends, rest] {
                    let got = chunked_logits(&prompt, &ends, precision);
                    let differing = whole
                        .iter()
                        .zip(&got)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differing, 0,
                        "{precision:?}: chunks ending at {ends:?} change {differing} logits"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let model = model();
    let mut kv = model.new_kv_cache(2, BLOCK, KvDtype::F32);
    let table = [0u32, 1];
    let run = |kv: &mut _, tokens: &[u32], start_pos: usize, table: &[u32]| {
        model
            .forward(
                kv,
                &[SequenceChunk {
                    tokens,
                    start_pos,
                    block_table: table,
                    want_logits: true,
                    precision: WeightPrecision::Int8,
                }],
            )
            .unwrap_err()
    };
    let err = run(&mut kv, &[1, 49152], 0, &table);
    assert!(
        matches!(err, ForwardError::InvalidToken { token: 49152, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("49152"));
    assert!(matches!(
        run(&mut kv, &[], 0, &table),
        ForwardError::EmptyChunk { .. }
    ));
    let err = run(&mut kv, &[1], 8192, &table);
    assert!(
        matches!(err, ForwardError::BeyondContext { end: 8193, .. }),
        "{err}"
    );
    assert!(matches!(
        run(&mut kv, &[1; 20], 15, &table),
        ForwardError::BlockTableTooShort { needed: 35, .. }
    ));
    assert!(matches!(
        run(&mut kv, &[1], 0, &[7]),
        ForwardError::InvalidBlock { block: 7, .. }
    ));
    let mut wrong = npufleet_worker::model::KvCache::new(KvDtype::F32, 2, 3, 64, 1, BLOCK);
    assert!(matches!(
        run(&mut wrong, &[1], 0, &[0]),
        ForwardError::KvCacheMismatch(_)
    ));
    assert!(model.forward(&mut kv, &[]).unwrap().is_empty());
}
