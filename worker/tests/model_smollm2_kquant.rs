//! SmolLM2 re-quantised by llama.cpp into the k-quant file types
//! (`tests/setup/kquant-models.sh`) against the independent numpy forward pass, which
//! dequantises with the `gguf` package: the f32 path must decode what numpy decodes, and the
//! int8 path, which runs the k-quant kernels on the file's own blocks, must agree on nearly
//! every next token.

mod model_support;

use model_support::*;
use npufleet_worker::model::gguf::{GgufFile, TensorType};
use npufleet_worker::model::{PrecisionPolicy, WeightPrecision};

const PROMPTS: [&str; 2] = [
    "The capital of France is",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
];
const GEN: usize = 16;

/// Loads the `file_type` file, checks it holds `types`, and compares it with numpy.
fn agrees_with_numpy(file_type: &str, types: &[TensorType]) {
    let path = setup_path_with("kquant-models.sh", &[file_type]);
    let file = GgufFile::open(&path).unwrap();
    for ty in types {
        assert!(
            file.tensors.values().any(|t| t.ty == *ty),
            "{file_type} holds {ty:?} tensors"
        );
    }
    let model = load(
        &path,
        PrecisionPolicy::Auto {
            int8_max_prompt_tokens: 64,
        },
    );
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| model.tokenizer().encode(p))
        .collect();
    let reference = numpy_reference(&path, &prompts, GEN);
    let (mut positions, mut int8_same) = (0, 0);
    for (prompt, steps) in prompts.iter().zip(&reference) {
        let want: Vec<u32> = steps.iter().map(|s| s.token).collect();
        let full = greedy(&model, prompt, GEN, WeightPrecision::Full).0;
        eprintln!(
            "{file_type} {:?} → {:?}",
            model.tokenizer().decode(prompt),
            model.tokenizer().decode(&full)
        );
        assert_eq!(full, want, "{file_type}: f32 greedy decoding follows numpy");
        let int8 = forced_logits(&model, prompt, &want, WeightPrecision::Int8);
        for (logits, step) in int8.iter().zip(steps) {
            positions += 1;
            int8_same += usize::from(argmax(logits) == step.token);
        }
    }
    let rate = int8_same as f64 / positions as f64;
    eprintln!("{file_type}: int8 top-1 agreement with numpy {int8_same}/{positions}");
    assert!(rate >= 0.9, "{file_type}: int8 top-1 agreement {rate:.3}");
}

#[test]
fn q4_k_m_agrees_with_numpy() {
    agrees_with_numpy(
        "Q4_K_M",
        &[
            TensorType::Q4K,
            TensorType::Q6K,
            TensorType::Q5_0,
            TensorType::Q8_0,
        ],
    );
}

#[test]
fn q5_k_m_agrees_with_numpy() {
    agrees_with_numpy(
        "Q5_K_M",
        &[TensorType::Q5K, TensorType::Q6K, TensorType::Q5_1],
    );
}

#[test]
fn q6_k_agrees_with_numpy() {
    agrees_with_numpy("Q6_K", &[TensorType::Q6K, TensorType::Q8_0]);
}
