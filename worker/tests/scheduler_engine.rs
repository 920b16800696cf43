//! The continuous-batching engine on the real SmolLM2-135M-Instruct file: batching does not
//! change results, the prefix cache is reused, the queue bound, cancellation, preemption,
//! stop conditions, drain and input validation behave as the `Engine` contract says.

mod model_support;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use npufleet_worker::api::{
    Engine, EngineState, FinishReason, GenerateRequest, GenerationEvent, GenerationStream,
    LoadSnapshot, Prompt, SamplingParams, SubmitError,
};
use npufleet_worker::engine::{self, EngineConfig, EngineHandle, KvCacheSize};
use npufleet_worker::model::{LoadOptions, Model, PrecisionPolicy};

use model_support::{Outcome, collect_within, smollm2_path};

const DEADLINE: Duration = Duration::from_secs(180);

/// SmolLM2-135M-Instruct (Q4_1 GGUF), fetched into the cache by the set-up script.
fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(smollm2_path).clone()
}

fn start(cfg: EngineConfig) -> Arc<EngineHandle> {
    let model = Model::load(
        &model_path(),
        LoadOptions {
            policy: PrecisionPolicy::Int8,
            threads: 0,
            collective: None,
            backend: None,
        },
    )
    .expect("loading SmolLM2");
    let engine = engine::start(model, cfg).expect("starting the engine");
    wait_for(&engine, |e| e.state() == EngineState::Ready, "engine ready");
    engine
}

fn config() -> EngineConfig {
    EngineConfig {
        warmup_iterations: 2,
        ..EngineConfig::default()
    }
}

/// Waits until the engine's load report satisfies `done`.
fn wait_load(engine: &EngineHandle, done: impl Fn(&LoadSnapshot) -> bool, what: &str) {
    wait_for(engine, |e| done(&e.load()), what);
}

fn wait_for(engine: &EngineHandle, done: impl Fn(&EngineHandle) -> bool, what: &str) {
    let deadline = Instant::now() + DEADLINE;
    while !done(engine) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads a stream to its end; panics on a failure event or a stream that ends early.
fn collect(stream: GenerationStream) -> Outcome {
    collect_within(stream, DEADLINE)
}

/// Three characters from the middle of `text`, to stop a generation at.
fn middle_piece(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect()
}

/// Submits `request` and reads its answer to the end.
fn run(engine: &EngineHandle, request: GenerateRequest) -> Outcome {
    collect(engine.submit(request).expect("submit"))
}

/// The field a refused submit blames and the message.
fn invalid_param<T: std::fmt::Debug>(result: Result<T, SubmitError>) -> (&'static str, String) {
    match result {
        Err(SubmitError::Invalid {
            message,
            param: Some(param),
        }) => (param, message),
        other => panic!("expected Invalid naming a field, got {other:?}"),
    }
}

/// The message of a submit refused as invalid, checked to blame `param`.
fn refused(engine: &EngineHandle, request: GenerateRequest, param: &str) -> String {
    let (blamed, message) = invalid_param(engine.submit(request));
    assert_eq!(blamed, param, "{message}");
    message
}

fn request(id: &str, prompt: &str, params: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        id: id.into(),
        prompt: Prompt::Text(prompt.into()),
        params,
        priority: 0,
    }
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ..SamplingParams::default()
    }
}

/// Greedy, ending at any of `stop`.
fn stopping_at(stop: Vec<String>, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        stop,
        ..greedy(max_tokens)
    }
}

/// Greedy, ending on the token `stop_id`.
fn ending_on(stop_id: u32, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        stop_token_ids: vec![stop_id],
        ..greedy(max_tokens)
    }
}

fn sampled(max_tokens: u32, seed: u64) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn run_alone(engine: &EngineHandle, requests: &[GenerateRequest]) -> Vec<Outcome> {
    requests.iter().map(|r| run(engine, r.clone())).collect()
}

fn run_together(engine: &EngineHandle, requests: &[GenerateRequest]) -> Vec<Outcome> {
    let streams: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submit"))
        .collect();
    streams.into_iter().map(collect).collect()
}

const SYSTEM: &str = "<|im_start|>system\nYou are a concise assistant who answers questions about \
    geography, history and science in one or two short sentences, without lists.<|im_end|>\n";

fn chat(question: &str) -> String {
    format!("{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
}

fn mixed_requests() -> Vec<GenerateRequest> {
    vec![
        request("a", &chat("What is the capital of France?"), greedy(12)),
        request("b", "Once upon a time", sampled(16, 7)),
        request(
            "c",
            &chat("Explain in simple words why the sky is blue during the day and red at sunset."),
            sampled(10, 42),
        ),
        request("d", "1, 2, 3, 4,", greedy(20)),
        request("e", "The quick brown fox", sampled(8, 7)),
    ]
}

fn tokens_of(outcomes: &[Outcome]) -> Vec<Vec<u32>> {
    outcomes.iter().map(|o| o.tokens.clone()).collect()
}

#[test]
fn batched_results_equal_unbatched_results() {
    let requests = mixed_requests();
    // A small step budget forces the long prompts through several chunked-prefill steps
    // mixed with the other requests' decodes.
    let batched_engine = start(EngineConfig {
        max_num_batched_tokens: 24,
        ..config()
    });
    let together = run_together(&batched_engine, &requests);
    drop(batched_engine);
    let alone = run_alone(&start(config()), &requests);

    assert_eq!(tokens_of(&together), tokens_of(&alone));
    for (outcome, request) in together.iter().zip(&requests) {
        assert_eq!(
            outcome.usage.completion_tokens as usize,
            outcome.tokens.len(),
            "{}",
            request.id
        );
        assert!(!outcome.tokens.is_empty(), "{}", request.id);
    }
    // Seeds matter: "b" and "e" share a seed but not a prompt; the same seed and prompt
    // with another seed gives another continuation.
    let reseeded = run(
        &start(config()),
        request("b", "Once upon a time", sampled(16, 8)),
    );
    assert_ne!(reseeded.tokens, alone[1].tokens);
    assert!(
        alone[0].text.contains("Paris"),
        "greedy answer: {:?}",
        alone[0].text
    );
}

#[test]
fn prefix_cache_serves_a_repeated_system_prompt() {
    let engine = start(config());
    let prompt = chat("Name a large desert.");
    let first = run(&engine, request("1", &prompt, greedy(8)));
    let second = run(&engine, request("2", &prompt, greedy(8)));
    let other = run(
        &engine,
        request("3", &chat("Name a long river."), greedy(8)),
    );

    assert_eq!(first.usage.cached_prompt_tokens, 0);
    let prompt_tokens = first.usage.prompt_tokens;
    // Everything but the last partial block (and at least the last token) is reused.
    assert!(
        second.usage.cached_prompt_tokens >= prompt_tokens - 16
            && second.usage.cached_prompt_tokens < prompt_tokens,
        "{:?}",
        second.usage
    );
    assert_eq!(second.usage.cached_prompt_tokens % 16, 0);
    assert_eq!(second.tokens, first.tokens);
    assert_eq!(second.text, first.text);
    // A different question after the same system prompt reuses the system prompt's blocks.
    assert!(other.usage.cached_prompt_tokens >= 32, "{:?}", other.usage);

    let load = engine.load();
    assert_eq!(
        load.prefix_cache_hits_total,
        u64::from(second.usage.cached_prompt_tokens + other.usage.cached_prompt_tokens)
    );
    assert_eq!(
        load.prefix_cache_queries_total,
        u64::from(
            first.usage.prompt_tokens + second.usage.prompt_tokens + other.usage.prompt_tokens
        )
    );
}

#[test]
fn the_warm_up_times_prompt_chunks_and_decodes_at_several_sizes_apart_from_serving() {
    let engine = start(EngineConfig {
        warmup_iterations: 40,
        ..config()
    });
    let load = engine.load();
    let (prefill, decode) = (load.warmup_prefill_steps, load.warmup_decode_steps);
    for (kind, sums) in [("prefill", prefill), ("decode", decode)] {
        assert!(sums.steps >= 10 && sums.seconds > 0.0, "{kind}: {sums:?}");
        let mean = sums.size as f64 / sums.steps as f64;
        let variance = sums.size_squared / sums.steps as f64 - mean * mean;
        assert!(variance > 1.0 / 4.0, "{kind} sizes do not spread: {sums:?}");
    }
    assert_eq!(
        (load.prefill_steps.steps, load.decode_steps.steps),
        (0, 0),
        "the warm-up is not counted as serving"
    );
}

#[test]
fn prefix_templates_are_computed_during_warm_up() {
    let engine = start(EngineConfig {
        prefix_templates: vec![SYSTEM.to_owned()],
        ..config()
    });
    // The template's blocks stay referenced while idle.
    assert!(engine.load().kv_cache_usage > 0.0);
    let template_tokens = engine.tokenize(SYSTEM).expect("tokenize").len();
    assert!(template_tokens >= 16, "{template_tokens}");
    let outcome = run(
        &engine,
        request("t", &chat("Name a tall mountain."), greedy(4)),
    );
    // Every full block of the template is served from the cache on the first request.
    assert_eq!(
        outcome.usage.cached_prompt_tokens as usize,
        template_tokens / 16 * 16,
        "{:?}",
        outcome.usage
    );
}

#[test]
fn a_full_queue_refuses_at_once() {
    let engine = start(EngineConfig {
        max_batch_size: 1,
        queue_limit: 2,
        ignore_eos: true,
        ..config()
    });
    let long = || request("long", "Count to one thousand:", greedy(2000));
    let running = engine.submit(long()).expect("first request");
    wait_for(
        &engine,
        |e| e.load().running == 1,
        "the first request to run",
    );
    let waiting: Vec<_> = (0..2)
        .map(|_| engine.submit(long()).expect("fits in the queue"))
        .collect();
    assert_eq!(engine.load().waiting, 2);

    let asked = Instant::now();
    let refused = engine.submit(long());
    assert!(asked.elapsed() < Duration::from_millis(100));
    assert_eq!(refused.err(), Some(SubmitError::QueueFull { limit: 2 }));

    // Dropping the streams cancels everything, queued or running.
    drop(running);
    drop(waiting);
    wait_load(
        &engine,
        |load| load.running == 0 && load.waiting == 0,
        "cancelled requests to leave",
    );
}

#[test]
fn cancelling_a_running_request_frees_its_blocks() {
    let engine = start(EngineConfig {
        ignore_eos: true,
        ..config()
    });
    let mut stream = engine
        .submit(request("c", &chat("Write a long story."), greedy(2000)))
        .expect("submit");
    let first = stream.blocking_recv().expect("a first event");
    assert!(matches!(first, GenerationEvent::Token { .. }));
    wait_for(
        &engine,
        |e| e.load().kv_cache_usage > 0.0,
        "the running request's blocks to show",
    );
    drop(stream);
    wait_load(
        &engine,
        |load| load.running == 0 && load.kv_cache_usage == 0.0,
        "the cancelled request's blocks to be freed",
    );
    let generated = engine.load().generation_tokens_total;
    assert!(generated < 2000, "generation went on after cancelling");
}

#[test]
fn preemption_under_a_tiny_kv_cache_still_completes_every_request() {
    let requests: Vec<_> = (0..4)
        .map(|i| {
            request(
                &i.to_string(),
                &format!("Item {i}: the weather today is"),
                greedy(24),
            )
        })
        .collect();
    let roomy = start(EngineConfig {
        block_size: 4,
        ignore_eos: true,
        ..config()
    });
    let expected = run_alone(&roomy, &requests);
    drop(roomy);

    // 24 blocks of 4 positions: each request needs about 9 blocks, all four need 36.
    let tight = start(EngineConfig {
        block_size: 4,
        kv_cache: KvCacheSize::Blocks(24),
        ignore_eos: true,
        ..config()
    });
    let outcomes = run_together(&tight, &requests);
    assert_eq!(tokens_of(&outcomes), tokens_of(&expected));
    assert!(outcomes.iter().all(|o| o.reason == FinishReason::Length));
    assert!(tight.load().preemptions_total > 0, "{:?}", tight.load());
    wait_for(
        &tight,
        |e| e.load().kv_cache_usage == 0.0,
        "every block to be released",
    );
}

/// Whether `stream` has no event ready now.
fn nothing_yet(stream: &mut GenerationStream) -> bool {
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    stream.poll_recv(&mut context).is_pending()
}

fn with_priority(mut request: GenerateRequest, priority: i32) -> GenerateRequest {
    request.priority = priority;
    request
}

#[test]
fn a_higher_priority_takes_a_full_batchs_place_and_a_waiting_lower_ones_turn() {
    let engine = start(EngineConfig {
        max_batch_size: 1,
        ignore_eos: true,
        ..config()
    });
    let question = request("high", &chat("Name a colour."), greedy(6));
    let alone = run(&engine, question.clone());
    wait_load(
        &engine,
        |load| load.requests_finished_total == 1,
        "its count",
    );
    let long = || request("low", "Count to one thousand:", greedy(2000));
    let mut running = engine.submit(long()).expect("a low-priority request");
    running.blocking_recv().expect("its first token");
    let waiting = engine.submit(long()).expect("a second, waiting");

    let high = run(&engine, with_priority(question, 5));
    assert_eq!(
        high.tokens, alone.tokens,
        "preemption changed nothing of its answer"
    );
    wait_load(
        &engine,
        |load| load.requests_finished_total >= 2,
        "its count",
    );
    let load = engine.load();
    assert_eq!(
        load.requests_finished_total, 2,
        "only the high-priority request finished: {load:?}"
    );
    assert!(load.preemptions_total >= 1, "{load:?}");
    drop((running, waiting));
    wait_load(
        &engine,
        |load| load.running == 0 && load.waiting == 0,
        "the low-priority requests to leave",
    );
}

#[test]
fn lower_priorities_sit_out_the_steps_of_a_higher_prompt() {
    let engine = start(EngineConfig {
        ignore_eos: true,
        ..config()
    });
    let mut lows: Vec<_> = (0..2)
        .map(|i| {
            engine
                .submit(request(
                    &format!("low{i}"),
                    &chat("Write a long story."),
                    greedy(2000),
                ))
                .expect("a low-priority request")
        })
        .collect();
    // A second token each: the step that gives it only decodes, and began after every
    // earlier step's counters were published.
    for low in &mut lows {
        for _ in 0..2 {
            low.blocking_recv().expect("a token");
        }
    }
    let before = engine.load().prefill_steps;
    let high = run(
        &engine,
        with_priority(request("high", &chat("Name a colour."), greedy(2)), 1),
    );
    let after = engine.load().prefill_steps;
    let computed = u64::from(high.usage.prompt_tokens - high.usage.cached_prompt_tokens);
    assert_eq!(
        (after.steps - before.steps, after.size - before.size),
        (1, computed),
        "the prompt ran in one step of its own, no decode beside it"
    );
    drop(lows);
}

#[test]
fn a_higher_priority_stops_a_lower_step_that_later_runs_again_unchanged() {
    // The whole long prompt in one step, long enough to be running when the urgent request
    // arrives.
    let cfg = EngineConfig {
        max_num_batched_tokens: 2048,
        long_prefill_token_threshold: 0,
        ..config()
    };
    let numbers: String = (0..300).map(|i| format!("{i}, ")).collect();
    let long = || request("low", &format!("Continue: {numbers}"), greedy(3));
    let alone = run(&start(cfg.clone()), long());
    assert!(
        (500..2048).contains(&alone.usage.prompt_tokens),
        "a long prompt that fits one step: {:?}",
        alone.usage
    );

    let engine = start(cfg);
    let mut low = engine.submit(long()).expect("a low-priority request");
    // Admission and the step's start happen under one lock: once the queue is empty the step
    // runs.
    wait_load(&engine, |load| load.waiting == 0, "the long prompt's step");
    let mut high = engine
        .submit(with_priority(
            request("high", &chat("Name a colour."), greedy(2)),
            1,
        ))
        .expect("a high-priority request");
    high.blocking_recv().expect("its first token");
    assert!(
        nothing_yet(&mut low),
        "the long prompt's step was stopped before it gave a token"
    );
    assert!(engine.load().steps_interrupted_total >= 1);
    let low = collect(low);
    assert_eq!(
        low.tokens, alone.tokens,
        "the step run again gives the same answer"
    );
}

#[test]
fn beside_a_higher_prioritys_decodes_a_lower_prompt_advances_in_small_chunks() {
    let engine = start(EngineConfig {
        max_num_batched_tokens: 2048,
        long_prefill_token_threshold: 0,
        ignore_eos: true,
        ..config()
    });
    let mut high = engine
        .submit(with_priority(
            request("high", &chat("Name a colour."), greedy(12)),
            1,
        ))
        .expect("a high-priority request");
    high.blocking_recv()
        .expect("its first token: it decodes from now on");
    let numbers: String = (0..300).map(|i| format!("{i}, ")).collect();
    let mut low = engine
        .submit(request("low", &format!("Continue: {numbers}"), greedy(2)))
        .expect("a low-priority request");
    // The budget would take the whole prompt in the next step; in small chunks it is not
    // done before the high priority's eleven decodes are.
    collect(high);
    assert!(
        nothing_yet(&mut low),
        "the long prompt finished beside the higher priority's decodes"
    );
    let low = collect(low);
    assert!(low.usage.prompt_tokens > 12 * 32, "{:?}", low.usage);
}

/// A prompt of about 300 tokens.
fn long_prompt() -> String {
    let numbers: String = (0..120).map(|i| format!("{i}, ")).collect();
    format!("Continue: {numbers}")
}

#[test]
fn a_long_prompt_runs_in_chunks_of_the_threshold_and_whole_without_one() {
    for (threshold, chunk) in [(128, 128), (0, usize::MAX)] {
        let engine = start(EngineConfig {
            long_prefill_token_threshold: threshold,
            ..config()
        });
        let before = engine.load().prefill_steps;
        let long = run(&engine, request("long", &long_prompt(), greedy(1)));
        let after = engine.load().prefill_steps;
        let computed = u64::from(long.usage.prompt_tokens - long.usage.cached_prompt_tokens);
        assert!(computed > 128 && computed <= 512, "{:?}", long.usage);
        assert_eq!(
            (after.steps - before.steps, after.size - before.size),
            (computed.div_ceil(chunk.min(512) as u64), computed),
            "threshold {threshold}"
        );
    }
}

#[test]
fn a_short_prompt_queued_behind_a_long_one_is_admitted_first() {
    let engine = start(EngineConfig {
        max_batch_size: 1,
        ignore_eos: true,
        ..config()
    });
    let mut holder = engine
        .submit(request("holder", "Count to one thousand:", greedy(2000)))
        .expect("a request holding the only place in the batch");
    holder.blocking_recv().expect("its first token");
    let long_at = Instant::now();
    let long = engine
        .submit(request("long", &long_prompt(), greedy(2)))
        .expect("a long prompt");
    let short_at = Instant::now();
    let short = engine
        .submit(request("short", &chat("Name a colour."), greedy(2)))
        .expect("a short prompt");
    drop(holder);
    let (long, short) = (collect(long), collect(short));
    let admitted = |at: Instant, outcome: &Outcome| at + outcome.timings.queued;
    assert!(
        admitted(short_at, &short) < admitted(long_at, &long),
        "the short prompt took the freed place first: short {:?}, long {:?}",
        short.timings,
        long.timings
    );
}

#[test]
fn beside_a_short_prompt_a_long_one_advances_in_small_chunks() {
    let engine = start(EngineConfig {
        max_num_batched_tokens: 64,
        ignore_eos: true,
        ..config()
    });
    let long_at = Instant::now();
    let long = engine
        .submit(request("long", &long_prompt(), greedy(2)))
        .expect("a long prompt");
    // Admitted with its first 64 positions; four more steps to go at that budget.
    wait_load(
        &engine,
        |load| load.waiting == 0,
        "the long prompt's first step",
    );
    let short_at = Instant::now();
    let short = engine
        .submit(request("short", &chat("Name a colour."), greedy(2)))
        .expect("a short prompt");
    let (long, short) = (collect(long), collect(short));
    assert!(
        long.usage.prompt_tokens > 4 * 64 && short.usage.prompt_tokens < 64,
        "a prompt of five steps or more and one that fits a step: {:?}, {:?}",
        long.usage,
        short.usage
    );
    // First come, the long prompt's chunks would take each step's budget, and the short
    // prompt would get its first token in the long one's last step.
    assert!(
        short_at + short.timings.total < long_at + long.timings.first_token,
        "the short answer was done before the long prompt's first token: short {:?}, long {:?}",
        short.timings,
        long.timings
    );
}

#[test]
fn stop_strings_and_stop_tokens_end_generation() {
    let engine = start(config());
    let prompt = "Here is a list of fruits: apple, banana,";
    let free = run(&engine, request("free", prompt, greedy(24)));
    assert!(free.text.len() > 12, "{:?}", free.text);

    // A stop string taken from the middle of the free-running text.
    let stop = middle_piece(&free.text);
    let cut = &free.text[..free.text.find(&stop).expect("stop string occurs")];
    let stopped = run(
        &engine,
        request(
            "stop",
            prompt,
            stopping_at(vec![stop.clone(), "\u{1F600}never".into()], 24),
        ),
    );
    assert_eq!(stopped.reason, FinishReason::Stop);
    assert_eq!(stopped.text, cut, "stop string {stop:?}");
    assert!(!stopped.text.contains(&stop));

    // A stop token id: generation ends on it and its text is not returned.
    let stop_id = free.tokens[3];
    let by_token = run(&engine, request("stop-id", prompt, ending_on(stop_id, 24)));
    let first_at = free
        .tokens
        .iter()
        .position(|&t| t == stop_id)
        .expect("present");
    assert_eq!(by_token.reason, FinishReason::Stop);
    assert_eq!(by_token.tokens, free.tokens[..=first_at]);
    assert_eq!(by_token.usage.completion_tokens as usize, first_at + 1);
    assert!(free.text.starts_with(&by_token.text));
    assert!(by_token.text.len() < free.text.len());

    // The model's end-of-sequence token ends a chat answer.
    let answer = run(&engine, request("eos", &chat("Say hello."), greedy(200)));
    assert_eq!(answer.reason, FinishReason::Stop);
    assert!(!answer.text.contains("<|im_end|>"), "{:?}", answer.text);
}

#[test]
fn min_tokens_and_ignore_eos_hold_off_the_end() {
    let engine = start(config());
    let question = chat("Say hello.");
    let answer = run(&engine, request("eos", &question, greedy(200)));
    assert_eq!(answer.reason, FinishReason::Stop);
    let answered = answer.tokens.len();

    // The end-of-sequence id is never sampled before min_tokens: the answer goes on past it
    // and agrees with the free answer up to where that one ended.
    let min_tokens = answered as u32 + 10;
    let longer = run(
        &engine,
        request(
            "min",
            &question,
            SamplingParams {
                min_tokens,
                ..greedy(200)
            },
        ),
    );
    assert!(
        longer.usage.completion_tokens >= min_tokens,
        "{} tokens, min_tokens {min_tokens}",
        longer.usage.completion_tokens
    );
    assert_eq!(longer.tokens[..answered - 1], answer.tokens[..answered - 1]);
    assert_ne!(longer.tokens[answered - 1], answer.tokens[answered - 1]);
    assert!(!longer.text.contains("<|im_"), "{:?}", longer.text);

    // ignore_eos: exactly max_tokens, and the special tokens it passes are no text.
    let all = run(
        &engine,
        request(
            "ignore",
            &question,
            SamplingParams {
                ignore_eos: true,
                ..greedy(40)
            },
        ),
    );
    assert_eq!(all.reason, FinishReason::Length);
    assert_eq!(all.usage.completion_tokens, 40);
    assert!(answered < 40, "the free answer has {answered} tokens");
    assert_eq!(all.tokens[answered - 1], answer.tokens[answered - 1]);
    assert!(!all.text.contains("<|im_"), "{:?}", all.text);

    // A stop id and a stop string are held off the same way.
    let prompt = "Here is a list of fruits: apple, banana,";
    let free = run(&engine, request("free", prompt, greedy(24)));
    let stop_id = free.tokens[3];
    let held = run(
        &engine,
        request(
            "held-id",
            prompt,
            SamplingParams {
                min_tokens: 10,
                ..ending_on(stop_id, 24)
            },
        ),
    );
    assert!(held.tokens.len() > 10, "{:?}", held.tokens);
    assert!(!held.tokens[..10].contains(&stop_id));
    let stop: String = free.text.chars().skip(4).take(3).collect();
    let held = run(
        &engine,
        request(
            "held-string",
            prompt,
            SamplingParams {
                stop: vec![stop],
                min_tokens: 24,
                ..greedy(24)
            },
        ),
    );
    assert_eq!(held.reason, FinishReason::Length);
    assert_eq!(held.text, free.text);
}

#[test]
fn a_stop_string_cancels_its_sequence_in_the_engine_core() {
    // Without end-of-sequence ids only the stop string can end the request before 2000
    // tokens, and it is matched outside the core, which must then drop the sequence.
    let engine = start(EngineConfig {
        ignore_eos: true,
        ..config()
    });
    let prompt = "Here is a list of fruits: apple, banana,";
    let free = run(&engine, request("free", prompt, greedy(24)));
    let stop = middle_piece(&free.text);
    let generated_before = engine.load().generation_tokens_total;
    let stopped = run(
        &engine,
        request("stop", prompt, stopping_at(vec![stop.clone()], 2000)),
    );
    assert_eq!(stopped.reason, FinishReason::Stop);
    assert_eq!(
        stopped.text,
        &free.text[..free.text.find(&stop).expect("stop string occurs")]
    );
    assert_eq!(stopped.tokens, free.tokens[..stopped.tokens.len()]);
    assert_eq!(
        stopped.usage.completion_tokens as usize,
        stopped.tokens.len()
    );
    wait_load(
        &engine,
        |load| load.running == 0 && load.kv_cache_usage == 0.0,
        "the stopped sequence to leave the core",
    );
    let generated = engine.load().generation_tokens_total - generated_before;
    assert!(
        generated < 2000,
        "the core generated {generated} tokens after the stop string ended the request"
    );
}

#[test]
fn generation_without_max_tokens_fills_the_room_left_and_more_is_refused() {
    // 8 blocks of 4 positions: sequences hold at most 32 tokens.
    let engine = start(EngineConfig {
        block_size: 4,
        kv_cache: KvCacheSize::Blocks(8),
        ignore_eos: true,
        ..config()
    });
    let prompt: Vec<u32> = (100..110).collect();
    let outcome = collect(
        engine
            .submit(GenerateRequest {
                id: "fill".into(),
                prompt: Prompt::Tokens(prompt.clone()),
                params: SamplingParams {
                    max_tokens: None,
                    ..SamplingParams::default()
                },
                priority: 0,
            })
            .expect("submit"),
    );
    assert_eq!(outcome.reason, FinishReason::Length);
    assert_eq!(outcome.usage.prompt_tokens, 10);
    assert_eq!(outcome.usage.completion_tokens, 22);
    assert!(outcome.timings.first_token <= outcome.timings.total);
    assert!(outcome.timings.queued <= outcome.timings.first_token);

    // Asking for more than the room left is a mistake the client hears about.
    let message = refused(
        &engine,
        GenerateRequest {
            id: "too-many".into(),
            prompt: Prompt::Tokens(prompt.clone()),
            params: SamplingParams {
                max_tokens: Some(23),
                ..SamplingParams::default()
            },
            priority: 0,
        },
        "max_tokens",
    );
    assert!(
        message.contains("max_tokens is 23") && message.contains("at most 22"),
        "{message}"
    );

    let message = refused(
        &engine,
        GenerateRequest {
            id: "long".into(),
            prompt: Prompt::Tokens((0..32).collect()),
            params: SamplingParams::default(),
            priority: 0,
        },
        "prompt",
    );
    assert!(
        message.contains("32") && message.contains("KV cache"),
        "{message}"
    );
}

#[test]
fn drain_finishes_accepted_work_and_refuses_new_work() {
    let engine = start(config());
    let streams: Vec<_> = mixed_requests()
        .into_iter()
        .take(3)
        .map(|r| engine.submit(r).expect("submit"))
        .collect();
    engine.begin_drain();
    assert_eq!(engine.state(), EngineState::Draining);
    assert_eq!(
        engine.submit(request("late", "Hello", greedy(4))).err(),
        Some(SubmitError::Draining)
    );
    for stream in streams {
        let outcome = collect(stream);
        assert!(!outcome.tokens.is_empty());
    }
    wait_for(&engine, |e| e.state() == EngineState::Drained, "drained");
}

#[test]
fn submits_during_warm_up_are_refused() {
    let model = Model::load(
        &model_path(),
        LoadOptions {
            policy: PrecisionPolicy::Int8,
            threads: 1,
            collective: None,
            backend: None,
        },
    )
    .expect("loading SmolLM2");
    let engine = engine::start(
        model,
        EngineConfig {
            warmup_iterations: 1_000_000,
            ..EngineConfig::default()
        },
    )
    .expect("start");
    let refused = engine.submit(request("early", "Hello", greedy(4)));
    match refused {
        Err(SubmitError::WarmingUp { done, total }) => {
            assert_eq!(total, 1_000_000);
            assert!(done < total);
        }
        other => panic!("expected WarmingUp, got {other:?}"),
    }
    assert!(matches!(engine.state(), EngineState::WarmingUp { .. }));
    // Dropping the handle stops the warm-up.
}

#[test]
fn bad_requests_are_rejected_with_the_problem_named() {
    let engine = start(config());
    let vocab = engine.model_info().vocab_size;
    let context = engine.model_info().context_length;
    // The message, checked to name the field it blames.
    let invalid = |params: SamplingParams, prompt: Prompt| -> String {
        let (param, message) = invalid_param(engine.submit(GenerateRequest {
            id: "bad".into(),
            prompt,
            params,
            priority: 0,
        }));
        assert!(message.contains(param), "{param}: {message}");
        message
    };
    let text = || Prompt::Text("Hello".into());

    let m = invalid(
        SamplingParams {
            temperature: -0.5,
            ..greedy(4)
        },
        text(),
    );
    assert!(m.contains("temperature"), "{m}");
    let m = invalid(
        SamplingParams {
            temperature: f32::NAN,
            ..greedy(4)
        },
        text(),
    );
    assert!(m.contains("temperature"), "{m}");
    for top_p in [0.0, 1.5, f32::NAN] {
        let m = invalid(SamplingParams { top_p, ..greedy(4) }, text());
        assert!(m.contains("top_p"), "{m}");
    }
    let m = invalid(greedy(0), text());
    assert!(m.contains("max_tokens"), "{m}");
    let m = invalid(greedy(4), Prompt::Text(String::new()));
    assert!(m.contains("empty"), "{m}");
    let m = invalid(greedy(4), Prompt::Tokens(Vec::new()));
    assert!(m.contains("empty"), "{m}");
    let m = invalid(greedy(4), Prompt::Tokens(vec![1, 2, vocab as u32]));
    assert!(
        m.contains(&vocab.to_string()) && m.contains("position 2"),
        "{m}"
    );
    let m = invalid(greedy(4), Prompt::Tokens(vec![1; context + 5]));
    assert!(
        m.contains(&(context + 5).to_string()) && m.contains(&context.to_string()),
        "{m}"
    );
    let m = invalid(
        SamplingParams {
            stop: vec![String::new()],
            ..greedy(4)
        },
        text(),
    );
    assert!(m.contains("stop"), "{m}");
    let m = invalid(
        SamplingParams {
            stop_token_ids: vec![u32::MAX],
            ..greedy(4)
        },
        text(),
    );
    assert!(m.contains("stop_token_ids"), "{m}");
    let m = invalid(
        SamplingParams {
            min_tokens: 5,
            ..greedy(4)
        },
        text(),
    );
    assert!(
        m.contains("min_tokens") && m.contains("max_tokens 4"),
        "{m}"
    );
    let m = invalid(
        SamplingParams {
            min_tokens: context as u32,
            max_tokens: None,
            ..greedy(4)
        },
        text(),
    );
    assert!(m.contains("min_tokens") && m.contains("at most"), "{m}");
    for params in [
        SamplingParams {
            repetition_penalty: -1.0,
            ..greedy(4)
        },
        SamplingParams {
            frequency_penalty: 3.0,
            ..greedy(4)
        },
        SamplingParams {
            min_p: -0.5,
            ..greedy(4)
        },
    ] {
        invalid(params, text());
    }

    // Nothing was queued, and a good request still works.
    assert_eq!(engine.load().waiting, 0);
    let ok = run(&engine, request("ok", "Hello", greedy(2)));
    assert_eq!(ok.tokens.len(), 2);
}
