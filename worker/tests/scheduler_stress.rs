//! Many concurrent requests on a small random-weight model, through every scheduler path at
//! once (queueing behind a full batch, chunked prefill, preemption, both weight precisions,
//! the prefix cache), must give each request exactly what it gives when run alone.

mod model_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use npufleet_worker::api::{
    Engine, EngineState, FinishReason, GenerateRequest, GenerationStream, Prompt, SamplingParams,
};
use npufleet_worker::engine::{self, EngineConfig, EngineHandle, KvCacheSize};
use npufleet_worker::model::{LoadOptions, Model, PrecisionPolicy};
use npufleet_worker_testkit::testmodel::{GenTestModelArgs, TestModelFormat, write_into};

use model_support::collect_within;

const DEADLINE: Duration = Duration::from_secs(120);

fn start(model_dir: &std::path::Path, cfg: EngineConfig) -> Arc<EngineHandle> {
    let path = write_into(
        model_dir,
        GenTestModelArgs {
            context: 256,
            ..GenTestModelArgs::new(model_dir.into(), TestModelFormat::Gguf)
        },
    )
    .expect("writing the test model");
    let model = Model::load(
        &path,
        LoadOptions {
            // Prompts up to 12 tokens run int8, longer ones f32.
            policy: PrecisionPolicy::Auto {
                int8_max_prompt_tokens: 12,
            },
            threads: 1,
            collective: None,
            backend: None,
        },
    )
    .expect("loading the test model");
    let engine = engine::start(model, cfg).expect("starting the engine");
    let deadline = Instant::now() + DEADLINE;
    while engine.state() != EngineState::Ready {
        assert!(Instant::now() < deadline, "engine not ready");
        std::thread::sleep(Duration::from_millis(2));
    }
    engine
}

/// Token ids and finish reason of one request.
fn collect(stream: GenerationStream) -> (Vec<u32>, FinishReason) {
    let outcome = collect_within(stream, DEADLINE);
    assert_eq!(
        outcome.usage.completion_tokens as usize,
        outcome.tokens.len()
    );
    (outcome.tokens, outcome.reason)
}

fn requests() -> Vec<GenerateRequest> {
    // A shared 20-token head makes later prompts hit the prefix cache.
    let head: Vec<u32> = (0..20).map(|i| 300 + i * 7 % 150).collect();
    (0..24u32)
        .map(|i| {
            let len = 1 + (i as usize * 11) % 57;
            let mut prompt: Vec<u32> = if i % 3 == 0 { head.clone() } else { Vec::new() };
            prompt.extend((0..len as u32).map(|j| (i * 31 + j * 17) % 509 + 3));
            let sampled = i % 2 == 1;
            GenerateRequest {
                id: format!("r{i}"),
                prompt: Prompt::Tokens(prompt),
                params: SamplingParams {
                    max_tokens: Some(4 + (i * 7) % 27),
                    temperature: if sampled { 1.0 } else { 0.0 },
                    top_k: if sampled { 40 } else { 0 },
                    top_p: if sampled { 0.9 } else { 1.0 },
                    seed: Some(u64::from(i % 5)),
                    ..SamplingParams::default()
                },
                priority: 0,
            }
        })
        .collect()
}

#[test]
fn every_request_gets_its_solo_result_under_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let requests = requests();

    let roomy = start(
        dir.path(),
        EngineConfig {
            block_size: 4,
            warmup_iterations: 1,
            ..EngineConfig::default()
        },
    );
    let alone: Vec<_> = requests
        .iter()
        .map(|r| collect(roomy.submit(r.clone()).expect("submit")))
        .collect();
    drop(roomy);

    let loaded = start(
        dir.path(),
        EngineConfig {
            max_batch_size: 8,
            max_num_batched_tokens: 32,
            block_size: 4,
            kv_cache: KvCacheSize::Blocks(48),
            warmup_iterations: 1,
            ..EngineConfig::default()
        },
    );
    let streams: Vec<_> = requests
        .iter()
        .map(|r| loaded.submit(r.clone()).expect("submit"))
        .collect();
    let together: Vec<_> = streams.into_iter().map(collect).collect();

    for ((request, solo), batched) in requests.iter().zip(&alone).zip(&together) {
        assert_eq!(solo, batched, "request {}", request.id);
    }
    let load = loaded.load();
    assert!(load.preemptions_total > 0, "no preemption: {load:?}");
    assert!(load.prefix_cache_hits_total > 0, "no prefix hit: {load:?}");
    assert!(load.steps_total > 0);
}
