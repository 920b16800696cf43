//! The routing benchmarks (`make bench-router`; minutes, so not in `make test`): the real
//! control plane, the operator, the node agent running SmolLM2 workers, and the router as its
//! own process. [`routing_benchmark`] measures, on three workers, for round-robin, least-load,
//! prefix-affinity (the prompt's leading bytes hashed) and cache-aware (the workers' own cache
//! events), throughput, time to first token and each replica's prefix-cache hits on five
//! traces: shared system prompts that the caches cannot all hold, shared system prompts that
//! every cache can hold, multi-turn conversations that outnumber what a cache holds (each
//! with its own system prompt, then all under one), and prompts that share nothing; then
//! the time from a request at zero replicas to its first token against the worker's own
//! ready time.
//! [`router_cost_benchmark`] measures the router's cost against talking to one worker directly
//! (`cargo test --release -p npufleet-tests --test router_bench router_cost -- --ignored
//! --nocapture` runs it alone). Each prints markdown tables; the two never run at once.
//!
//! Each replica's KV cache is held to `KV_CACHE_BLOCKS`, less than the trace's system prompts
//! take together: the regime where routing decides whether a prefix is still cached (with room
//! for every prefix everywhere, any policy hits once the caches are warm).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_contract::env as worker_env;
use npufleet_contract::ports::HTTP_PORT;
use npufleet_crds::{InferenceService, RoutingPolicy};
use npufleet_tests::fleet::{RunningRouter, Testbed, sse_error, sse_has_text, worker_metrics};
use npufleet_tests::{cluster, paths, service, wait};
use serde_json::{Value, json};

const MANAGER: &str = "router-bench";
const MODEL: &str = npufleet_tests::service::SMOLLM2;
const REPLICAS: usize = 3;
/// 128 blocks of 16 positions per replica: room for about two of the shared trace's system
/// prompts beside the requests in flight, not for all of them.
const KV_CACHE_BLOCKS: &str = "128";
const SYSTEM_PROMPTS: usize = 6;
/// System prompts of the trace whose prompts every replica's cache can hold at once (three of
/// about 25 blocks, beside the requests in flight).
const SYSTEM_PROMPTS_THAT_FIT: usize = 3;
/// Conversations of the multi-turn trace, each with its own system prompt: about twice what one
/// replica's cache holds, and what the three hold together only when each keeps its own. Not a
/// multiple of [`REPLICAS`]: the trace goes turn by turn, and round-robin would otherwise send
/// every turn of a chat to the same replica by the accident of its order.
const CONVERSATIONS: usize = 10;
const TURNS: usize = 6;
/// Sentences of about 22 tokens: a system prompt of about 400 tokens.
const SYSTEM_PROMPT_SENTENCES: usize = 18;
const CLIENTS: usize = 6;
const REQUESTS_PER_RUN: usize = 60;
const MAX_TOKENS: u32 = 8;
/// The seed of the open-loop runs' arrival times.
const OPEN_LOOP_SEED: u64 = 20_261_206;
/// The open-loop rates, requests a second: one every policy keeps up with on the chats, and
/// one between what byte-hash affinity (about 3) and cache-aware routing (5 to 6) served of
/// them with six closed-loop clients.
const OPEN_LOOP_RATES: [f64; 2] = [2.0, 4.0];
/// Open-loop runs of each trace and policy at each rate, interleaved and pooled.
const OPEN_LOOP_ROUNDS: usize = 3;
const POLICIES: [RoutingPolicy; 4] = [
    RoutingPolicy::RoundRobin,
    RoutingPolicy::LeastLoad,
    RoutingPolicy::PrefixAffinity,
    RoutingPolicy::CacheAware,
];

/// The engine a benchmark's replicas run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// This project's worker, with its KV cache held to [`KV_CACHE_BLOCKS`].
    Worker,
    /// llama.cpp's own `llama-server` as the generic runtime: no cache events, so
    /// `cache-aware` is the byte-hash policy there and is not run twice. Each of its two
    /// slots keeps the last prompt it served, so a replica holds two prompts at most.
    LlamaServer,
}

impl Engine {
    fn policies(self) -> &'static [RoutingPolicy] {
        match self {
            Engine::Worker => &POLICIES,
            Engine::LlamaServer => &POLICIES[..3],
        }
    }

    fn spec(self, replicas: usize) -> Value {
        match self {
            Engine::Worker => bench_spec(replicas),
            Engine::LlamaServer => service::merged(
                service::llama_server_runtime(),
                json!({"replicas": replicas, "engine": {"drainSeconds": 5}}),
            ),
        }
    }

    /// Every answer runs to max_tokens, so runs differ only in where requests went (the
    /// worker is told by its environment, llama-server per request).
    fn body(self, mut body: Value) -> Value {
        if self == Engine::LlamaServer {
            body["ignore_eos"] = json!(true);
        }
        body
    }

    /// The replica's cache counters: prefix-cache hit and queried tokens and prompt tokens
    /// for the worker; for llama-server, which counts no hits, the prompt tokens it evaluated
    /// (those its slot did not hold) as the third.
    async fn counters(self, http: &reqwest::Client, address: &str) -> Result<[f64; 3]> {
        Ok(match self {
            Engine::Worker => {
                let metrics = worker_metrics(http, address).await?;
                [
                    series_sum(&metrics, "vllm:prefix_cache_hits_total"),
                    series_sum(&metrics, "vllm:prefix_cache_queries_total"),
                    series_sum(&metrics, "vllm:prompt_tokens_total"),
                ]
            }
            Engine::LlamaServer => {
                let port = service::LLAMA_SERVER_PORT;
                let metrics = http
                    .get(format!("http://{address}:{port}/metrics"))
                    .send()
                    .await?
                    .error_for_status()?
                    .text()
                    .await?;
                [
                    0.0,
                    0.0,
                    series_sum(&metrics, "llamacpp:prompt_tokens_total"),
                ]
            }
        })
    }
}

/// What the service `bench` sets beside [`service::smollm2`]'s defaults.
fn bench_spec(replicas: usize) -> Value {
    json!({
        "replicas": replicas,
        "engine": {"drainSeconds": 5},
        // Every answer runs to max_tokens, so runs differ only in where requests went.
        "template": {"env": service::worker_env(&[
            (worker_env::IGNORE_EOS, "true"),
            ("NPUFLEET_KV_CACHE_BLOCKS", KV_CACHE_BLOCKS),
        ])},
    })
}

/// The sum of a Prometheus series over its labels, in `metrics` text.
fn series_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A system prompt of about 400 tokens; `tag` makes it unique to one run, so every run starts
/// with cold caches whatever the run before it left cached.
fn system_prompt(tag: &str, n: usize) -> String {
    let mut text = format!("You are assistant {n} of run {tag}, serving the team of desk {n}. ");
    for rule in 0..SYSTEM_PROMPT_SENTENCES {
        text.push_str(&format!(
            "Rule {rule}: answer questions about topic {n}-{rule} politely, briefly and in plain words. "
        ));
    }
    text
}

#[derive(Clone, Copy)]
enum Trace {
    /// Each request one of `prompts` system prompts and a short question.
    SharedPrefix { prompts: usize },
    /// [`CONVERSATIONS`] chats of [`TURNS`] turns, each turn's prompt the chat so far; the
    /// conversations take turns, so a chat comes back after every other one has spoken.
    MultiTurn,
    /// [`CONVERSATIONS`] chats of [`TURNS`] turns under one system prompt, as one chat
    /// application's users are, with answers of about 60 tokens: what tells the chats apart
    /// is their history, past the leading bytes the byte-hash policy keys on.
    SharedSystemChats,
    /// Prompts as long as the shared ones, unique from their first token.
    NoSharedPrefix,
}

impl Trace {
    /// Multi-turn chats, [`CONVERSATIONS`] openings first, then each later turn in turn.
    fn is_chats(self) -> bool {
        matches!(self, Trace::MultiTurn | Trace::SharedSystemChats)
    }

    fn name(self) -> String {
        match self {
            Trace::SharedPrefix { prompts } if prompts == SYSTEM_PROMPTS_THAT_FIT => {
                format!("{prompts} shared prompts, every cache holds all")
            }
            Trace::SharedPrefix { prompts } => format!("{prompts} shared prompts, evicting"),
            Trace::MultiTurn => format!("{CONVERSATIONS} chats × {TURNS} turns, evicting"),
            Trace::SharedSystemChats => {
                format!("{CONVERSATIONS} chats × {TURNS} turns, one system prompt, evicting")
            }
            Trace::NoSharedPrefix => "no shared prefix".to_owned(),
        }
    }

    /// The trace's requests, in order: chat bodies that stream. `tag` makes every prompt
    /// unique to one run.
    fn bodies(self, tag: &str) -> Vec<Value> {
        let chat = |messages: Value| json!({"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": true});
        match self {
            Trace::SharedPrefix { prompts } => {
                let systems: Vec<String> = (0..prompts).map(|n| system_prompt(tag, n)).collect();
                (0..REQUESTS_PER_RUN)
                    .map(|i| {
                        // A fixed shuffle of the system prompts, so consecutive requests differ.
                        let system = &systems[(i * 5 + i / prompts) % prompts];
                        chat(json!([
                            {"role": "system", "content": system},
                            {"role": "user", "content": format!("Question {i}: name a river.")},
                        ]))
                    })
                    .collect()
            }
            Trace::MultiTurn => chats(
                |c| system_prompt(tag, c),
                |turn, c| format!("Question {turn} of chat {c}: name a river."),
                |turn, c| format!("The river {turn} of chat {c} is the Loire."),
            )
            .into_iter()
            .map(chat)
            .collect(),
            Trace::SharedSystemChats => {
                let system = system_prompt(tag, 0);
                chats(
                    |_| system.clone(),
                    |turn, c| format!("Question {turn} of chat {c}: which river should the team of desk {c} visit next, and why?"),
                    |turn, c| format!("For chat {c}, stop {turn}: the Loire, since its valley of castles suits a walking trip of a few days. Start at Orléans, follow the river west through Blois and Amboise, and end at Tours, where trains run back {turn} times a day."),
                )
                .into_iter()
                .map(chat)
                .collect()
            }
            Trace::NoSharedPrefix => (0..REQUESTS_PER_RUN)
                .map(|i| {
                    chat(json!([
                        {"role": "system", "content": system_prompt(&format!("{tag}-{i}"), i)},
                        {"role": "user", "content": format!("Question {i}: name a river.")},
                    ]))
                })
                .collect(),
        }
    }
}

/// The messages of [`CONVERSATIONS`] chats of [`TURNS`] turns, turn by turn (a chat comes
/// back after every other one has spoken): chat `c`'s system prompt, then for each earlier
/// turn its question and answer, then this turn's question.
fn chats(
    system: impl Fn(usize) -> String,
    question: impl Fn(usize, usize) -> String,
    answer: impl Fn(usize, usize) -> String,
) -> Vec<Value> {
    (0..TURNS)
        .flat_map(|turn| (0..CONVERSATIONS).map(move |c| (turn, c)))
        .map(|(turn, c)| {
            let mut messages = vec![json!({"role": "system", "content": system(c)})];
            for earlier in 0..turn {
                messages.push(json!({"role": "user", "content": question(earlier, c)}));
                messages.push(json!({"role": "assistant", "content": answer(earlier, c)}));
            }
            messages.push(json!({"role": "user", "content": question(turn, c)}));
            Value::Array(messages)
        })
        .collect()
}

/// One streamed request's time to its first generated text and to its end.
async fn stream_once(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<(Duration, Duration)> {
    stream_request(http.post(url).json(body)).await
}

/// [`stream_once`] for a request built with its own headers.
async fn stream_request(request: reqwest::RequestBuilder) -> Result<(Duration, Duration)> {
    let started = Instant::now();
    let response = request.send().await?;
    let status = response.status();
    ensure!(
        status.is_success(),
        "HTTP {status}: {}",
        response.text().await?
    );
    let mut stream = response.bytes_stream();
    let mut first = None;
    let mut text = String::new();
    while let Some(bytes) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&bytes?));
        if first.is_none() && sse_has_text(&text) {
            first = Some(started.elapsed());
        }
    }
    ensure!(sse_error(&text).is_none(), "the stream failed: {text}");
    Ok((
        first.with_context(|| format!("no generated text in {text}"))?,
        started.elapsed(),
    ))
}

struct RunResult {
    elapsed: Duration,
    ttft: Vec<Duration>,
    latency: Vec<Duration>,
}

/// `clients` closed-loop clients send `bodies` (each once, in order) to `url`.
async fn run_trace(url: &str, bodies: Vec<Value>, clients: usize) -> Result<RunResult> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let bodies = Arc::new(bodies);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (http, url, bodies, next) =
                (http.clone(), url.to_owned(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(body) = bodies.get(i) else { break };
                    samples.push(stream_once(&http, &url, body).await?);
                }
                anyhow::Ok(samples)
            })
        })
        .collect();
    let mut result = RunResult {
        elapsed: Duration::ZERO,
        ttft: Vec::new(),
        latency: Vec::new(),
    };
    for task in tasks {
        for (ttft, latency) in task.await?? {
            result.ttft.push(ttft);
            result.latency.push(latency);
        }
    }
    result.elapsed = started.elapsed();
    Ok(result)
}

/// Sends `bodies` in order to `url` at the arrival times of a Poisson process of `rate`
/// requests a second (seeded), each as it comes due whether or not the ones before have been
/// answered: a service's users do not wait for each other, so a policy that falls behind
/// builds a queue instead of slowing its clients down.
async fn run_open(url: &str, bodies: Vec<Value>, rate: f64) -> Result<RunResult> {
    use rand::{Rng, SeedableRng};
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(OPEN_LOOP_SEED);
    let mut due = Duration::ZERO;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for body in bodies {
        tokio::time::sleep_until((started + due).into()).await;
        let (http, url) = (http.clone(), url.to_owned());
        tasks.push(tokio::spawn(async move {
            stream_once(&http, &url, &body).await
        }));
        let gap = -(1.0 - rng.random::<f64>()).ln() / rate;
        due += Duration::from_secs_f64(gap);
    }
    let mut result = RunResult {
        elapsed: Duration::ZERO,
        ttft: Vec::new(),
        latency: Vec::new(),
    };
    for task in tasks {
        let (ttft, latency) = task.await??;
        result.ttft.push(ttft);
        result.latency.push(latency);
    }
    result.elapsed = started.elapsed();
    Ok(result)
}

/// [`Engine::counters`] so far, per replica address.
async fn cache_counters(
    engine: Engine,
    http: &reqwest::Client,
    addresses: &[String],
) -> Result<BTreeMap<String, [f64; 3]>> {
    let mut counters = BTreeMap::new();
    for address in addresses {
        counters.insert(address.clone(), engine.counters(http, address).await?);
    }
    Ok(counters)
}

async fn set_spec(services: &Api<InferenceService>, spec: Value) -> Result<()> {
    services
        .patch(
            "bench",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await?;
    Ok(())
}

/// Sets the routing policy and waits until the router picks by it.
async fn use_policy(
    services: &Api<InferenceService>,
    router: &RunningRouter,
    policy: RoutingPolicy,
) -> Result<()> {
    set_spec(services, json!({"routing": {"policy": policy.as_str()}})).await?;
    let http = reqwest::Client::new();
    let url = router.url("/v1/chat/completions");
    let probe = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": true});
    let label = format!("policy=\"{}\"", policy.as_str());
    wait::until(
        &format!("the router routing by {}", policy.as_str()),
        Duration::from_secs(30),
        || async {
            let before = router.metrics().await?;
            stream_once(&http, &url, &probe).await?;
            let after = router.metrics().await?;
            let picks = |m: &str| {
                m.lines()
                    .filter(|l| l.starts_with("npufleet_router_picks_total{") && l.contains(&label))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>()
            };
            Ok((picks(&after) > picks(&before)).then_some(()))
        },
    )
    .await
}

/// Held by each benchmark: two at once would measure each other.
static ONE_BENCHMARK_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A namespace with a node agent for `replicas` workers of [`service`], the operator and the
/// router, once every worker serves.
/// How a table's requests are sent.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// This many clients, each sending its next request when its last one is answered.
    Closed(usize),
    /// Arrivals at this rate (requests a second) whatever the answers ([`run_open`]).
    Open(f64),
}

impl Load {
    /// Told apart in the prompts, so one table's runs never find another's in the caches.
    fn tag(self) -> String {
        match self {
            Load::Closed(clients) => format!("c{clients}-"),
            Load::Open(rate) => format!("o{rate}-"),
        }
    }
}

struct Bench {
    services: Api<InferenceService>,
    pods: Api<Pod>,
    router: RunningRouter,
    addresses: Vec<String>,
    _bed: Testbed,
    _operator: npufleet_tests::operator::RunningOperator,
}

impl Bench {
    async fn start(name: &str, subnet: u8, replicas: usize, engine: Engine) -> Result<Bench> {
        let c = cluster::shared();
        let client = c.client().await?;
        let bed = match engine {
            Engine::Worker => Testbed::start(c, &client, name, subnet, MANAGER).await?,
            Engine::LlamaServer => {
                let llama_server = tokio::task::spawn_blocking(paths::llama_server).await??;
                let programs = [("llama-server", llama_server)];
                Testbed::start_with_programs(c, &client, name, subnet, MANAGER, &programs).await?
            }
        };
        let operator = bed.start_operator()?;
        let router =
            RunningRouter::start(c, name, &bed.namespace, &["--wake-interval-seconds", "1"])
                .await?;
        bed.apply_smollm2("bench", engine.spec(replicas)).await?;
        let addresses = bed.wait_serving(replicas).await?;
        Ok(Bench {
            services: bed.services(),
            pods: bed.pods(),
            router,
            addresses,
            _bed: bed,
            _operator: operator,
        })
    }

    /// Each of `engine`'s policies on each trace: one table row per run.
    async fn policy_table(&self, engine: Engine) -> Result<()> {
        let traces = [
            Trace::SharedPrefix {
                prompts: SYSTEM_PROMPTS,
            },
            Trace::SharedPrefix {
                prompts: SYSTEM_PROMPTS_THAT_FIT,
            },
            Trace::MultiTurn,
            Trace::SharedSystemChats,
            Trace::NoSharedPrefix,
        ];
        self.table(engine, &traces, Load::Closed(CLIENTS), 1).await
    }

    /// Under `title`, [`Bench::table`] for this project's worker with arrivals at `rate`.
    async fn open_loop_table(
        &self,
        title: &str,
        traces: &[Trace],
        rate: f64,
        rounds: usize,
    ) -> Result<()> {
        println!(
            "\n### {title}: {REPLICAS} SmolLM2-135M replicas (1 thread, {KV_CACHE_BLOCKS} KV blocks each), Poisson arrivals at {rate} req/s (seed {OPEN_LOOP_SEED}), {rounds} interleaved runs of {REQUESTS_PER_RUN} requests per policy, pooled, {MAX_TOKENS} tokens per answer\n"
        );
        self.table(Engine::Worker, traces, Load::Open(rate), rounds)
            .await
    }

    /// Each of `engine`'s policies on each of `traces` under `load`, `rounds` times: a row per
    /// trace and policy, its figures pooled over the rounds. The policies take turns within a
    /// round, in an order that rotates from round to round, so drift in the machine's speed
    /// falls on all of them alike; a single run's p90 of 60 requests moves by half a second.
    async fn table(
        &self,
        engine: Engine,
        traces: &[Trace],
        load: Load,
        rounds: usize,
    ) -> Result<()> {
        let Bench {
            services,
            router,
            addresses,
            ..
        } = self;
        let http = reqwest::Client::new();
        let policies = engine.policies();
        // Under arrivals at a rate, one more row: the trace's requests one at a time under
        // cache-aware routing, with no queue and no neighbour computing. A prompt that no
        // cache can hold (a new chat's) is no faster under any policy than it is here, which
        // bounds how far any policy's p90 can fall when such prompts are a tenth of the trace.
        let alone = matches!(load, Load::Open(_)).then_some(policies.len());
        let rows = policies.len() + usize::from(alone.is_some());
        let name = |p: usize| {
            if Some(p) == alone {
                "one at a time, cache-aware"
            } else {
                policies[p].as_str()
            }
        };
        let mut pooled: BTreeMap<(usize, usize), Pooled> = BTreeMap::new();
        for round in 0..rounds {
            for (t, &trace) in traces.iter().enumerate() {
                for turn in 0..rows {
                    let p = (turn + round) % rows;
                    let policy = policies
                        .get(p)
                        .copied()
                        .unwrap_or(RoutingPolicy::CacheAware);
                    use_policy(services, router, policy).await?;
                    let before = cache_counters(engine, &http, addresses).await?;
                    let tag = if Some(p) == alone {
                        "alone"
                    } else {
                        policy.as_str()
                    };
                    let bodies: Vec<Value> = trace
                        .bodies(&format!("{}{t}-{tag}-r{round}", load.tag()))
                        .into_iter()
                        .map(|body| engine.body(body))
                        .collect();
                    let url = router.url("/v1/chat/completions");
                    let requests = bodies.len();
                    let mut run = match load {
                        _ if Some(p) == alone => run_trace(&url, bodies, 1).await?,
                        Load::Closed(clients) => run_trace(&url, bodies, clients).await?,
                        Load::Open(rate) => run_open(&url, bodies, rate).await?,
                    };
                    let after = cache_counters(engine, &http, addresses).await?;
                    let cell = pooled.entry((t, p)).or_default();
                    cell.requests += requests;
                    cell.elapsed += run.elapsed;
                    cell.round_p90
                        .push(ms(percentile(&mut run.ttft.clone(), 90.0)));
                    // In arrival order (one client, or arrivals at a rate): the chats'
                    // later turns, which a cache can serve, apart from their openings.
                    if trace.is_chats() && (Some(p) == alone || matches!(load, Load::Open(_))) {
                        cell.later_turns
                            .extend_from_slice(&run.ttft[CONVERSATIONS..]);
                    }
                    cell.ttft.append(&mut run.ttft);
                    cell.delta.resize(addresses.len(), [0.0; 3]);
                    for (sum, a) in cell.delta.iter_mut().zip(addresses) {
                        for k in 0..3 {
                            sum[k] += after[a][k] - before[a][k];
                        }
                    }
                }
            }
        }
        println!(
            "| trace | policy | req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | p90 by round ms | p90 of later turns ms | prompt tokens/req | prefix-cache hit tokens per replica | hit rate per replica | hit rate | imbalance |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for ((t, p), mut cell) in pooled {
            let delta = &cell.delta;
            let (hit, queried, prompt) = delta
                .iter()
                .fold((0.0, 0.0, 0.0), |t, d| (t.0 + d[0], t.1 + d[1], t.2 + d[2]));
            let (hits, rates, rate) = if engine == Engine::Worker {
                let hits: Vec<String> = delta.iter().map(|d| format!("{:.0}", d[0])).collect();
                let rates: Vec<String> = delta
                    .iter()
                    .map(|d| format!("{:.0}%", if d[1] > 0.0 { 100.0 * d[0] / d[1] } else { 0.0 }))
                    .collect();
                let rate = if queried > 0.0 {
                    100.0 * hit / queried
                } else {
                    0.0
                };
                (hits.join(" / "), rates.join(" / "), format!("{rate:.0}%"))
            } else {
                ("–".to_owned(), "–".to_owned(), "–".to_owned())
            };
            // The busiest replica's prompt tokens against the mean: 1.00 is an even spread.
            let busiest = delta.iter().map(|d| d[2]).fold(0.0, f64::max);
            let imbalance = busiest / (prompt / delta.len() as f64).max(1.0);
            let by_round: Vec<String> = cell
                .round_p90
                .iter()
                .map(|p90| format!("{p90:.0}"))
                .collect();
            let later = if cell.later_turns.is_empty() {
                "–".to_owned()
            } else {
                format!("{:.0}", ms(percentile(&mut cell.later_turns, 90.0)))
            };
            println!(
                "| {} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {} | {later} | {:.0} | {hits} | {rates} | {rate} | {imbalance:.2} |",
                traces[t].name(),
                name(p),
                cell.requests as f64 / cell.elapsed.as_secs_f64(),
                ms(percentile(&mut cell.ttft, 50.0)),
                ms(percentile(&mut cell.ttft, 90.0)),
                ms(percentile(&mut cell.ttft, 99.0)),
                by_round.join(", "),
                prompt / cell.requests as f64,
            );
        }
        Ok(())
    }
}

/// One trace and policy's runs, pooled over the rounds.
#[derive(Default)]
struct Pooled {
    requests: usize,
    elapsed: Duration,
    ttft: Vec<Duration>,
    round_p90: Vec<f64>,
    /// TTFTs of the chats' turns after their first: what a cache can serve. A chat's first
    /// turn is its system prompt and question, which no cache holds (with a system prompt
    /// of each chat's own); a sixth of the trace, they decide its p90 under every policy.
    later_turns: Vec<Duration>,
    /// Per replica: prefix-cache hit tokens, tokens looked up, prompt tokens.
    delta: Vec<[f64; 3]>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes on a 2-core machine: run by make bench-router"]
async fn routing_benchmark() -> Result<()> {
    let _alone = ONE_BENCHMARK_AT_A_TIME.lock().await;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let bench = Bench::start("router-bench", 81, REPLICAS, Engine::Worker).await?;
        println!("\n### Routing policies: {REPLICAS} SmolLM2-135M replicas (1 thread, {KV_CACHE_BLOCKS} KV blocks each), {CLIENTS} streaming clients, {REQUESTS_PER_RUN} requests per run, {MAX_TOKENS} tokens per answer\n");
        bench.policy_table(Engine::Worker).await?;
        wake_from_zero(&bench.services, &bench.pods, &bench.router).await?;
        Ok(())
    })
    .await
}

/// The traces whose requests share prefixes past what the caches hold, and the one sharing
/// nothing, with requests arriving at fixed rates instead of from closed-loop clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes on a 2-core machine: run by make bench-router"]
async fn open_loop_routing_benchmark() -> Result<()> {
    let _alone = ONE_BENCHMARK_AT_A_TIME.lock().await;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let bench = Bench::start("router-bench-open", 85, REPLICAS, Engine::Worker).await?;
        let traces = [
            Trace::MultiTurn,
            Trace::SharedSystemChats,
            Trace::NoSharedPrefix,
        ];
        for rate in OPEN_LOOP_RATES {
            bench
                .open_loop_table(
                    "Routing policies, open loop",
                    &traces,
                    rate,
                    OPEN_LOOP_ROUNDS,
                )
                .await?;
        }
        Ok(())
    })
    .await
}

/// The trace sharing nothing alone, where cache-aware routing has nothing to gain and must lose
/// nothing: [`SHARING_NOTHING_ROUNDS`] interleaved rounds at the lower open-loop rate, pooled.
/// Three rounds in the open-loop table leave one slow round enough to move a pooled p99.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes on a 2-core machine: run by make bench-router"]
async fn sharing_nothing_routing_benchmark() -> Result<()> {
    let _alone = ONE_BENCHMARK_AT_A_TIME.lock().await;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let bench = Bench::start("router-bench-nothing", 87, REPLICAS, Engine::Worker).await?;
        bench
            .open_loop_table(
                "Routing policies on prompts that share nothing, open loop",
                &[Trace::NoSharedPrefix],
                OPEN_LOOP_RATES[0],
                SHARING_NOTHING_ROUNDS,
            )
            .await
    })
    .await
}

const SHARING_NOTHING_ROUNDS: usize = 5;

/// The same traces on an engine this project did not write: the policies that need no cache
/// events, on llama.cpp's `llama-server`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes on a 2-core machine: run by make bench-router"]
async fn generic_engine_routing_benchmark() -> Result<()> {
    let _alone = ONE_BENCHMARK_AT_A_TIME.lock().await;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let bench = Bench::start("router-bench-generic", 83, REPLICAS, Engine::LlamaServer).await?;
        println!("\n### Routing policies on llama.cpp's llama-server (generic runtime): {REPLICAS} SmolLM2-135M replicas (1 thread, 2 slots each), {CLIENTS} streaming clients, {REQUESTS_PER_RUN} requests per run, {MAX_TOKENS} tokens per answer; prompt tokens/req counts the tokens llama-server evaluated, those its slots did not hold\n");
        bench.policy_table(Engine::LlamaServer).await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a minute on a 2-core machine: run by make bench-router"]
async fn router_cost_benchmark() -> Result<()> {
    let _alone = ONE_BENCHMARK_AT_A_TIME.lock().await;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let bench = Bench::start("router-cost", 82, 1, Engine::Worker).await?;
        router_cost(&reqwest::Client::new(), &bench.router, &bench.addresses[0]).await
    })
    .await
}

/// Pairs of one-token requests, one straight to the worker and one through the router, whose
/// times to first token are compared; the first [`WARM_UP_PAIRS`] are not counted.
const ROUTER_COST_PAIRS: usize = 400;
const WARM_UP_PAIRS: usize = 20;
/// Rounds of the 32-stream throughput run per path, alternated.
const ROUTER_COST_ROUNDS: usize = 3;

/// The router's own cost: one client's requests one at a time (added latency), then 32
/// streams at once (throughput), each directly to the one worker and through the router.
async fn router_cost(http: &reqwest::Client, router: &RunningRouter, worker: &str) -> Result<()> {
    let short = |i: usize, max_tokens: u32| json!({"model": MODEL, "messages": [{"role": "user", "content": format!("Say {i}.")}], "max_tokens": max_tokens, "stream": true});
    let direct = format!("http://{worker}:{HTTP_PORT}/v1/chat/completions");
    let routed = router.url("/v1/chat/completions");
    // Both requests of a pair carry the same prompt, so they cost the worker the same; which
    // goes first alternates, so neither path is the one that finds the other's prompt cached,
    // and drift in the machine's load falls on both alike.
    let (mut direct_ttft, mut routed_ttft) = (Vec::new(), Vec::new());
    // The router's added time in each pair, by which path went first.
    let mut added: [Vec<f64>; 2] = Default::default();
    for i in 0..WARM_UP_PAIRS + ROUTER_COST_PAIRS {
        let body = short(i, 1);
        let (d, r) = if i % 2 == 0 {
            let d = stream_once(http, &direct, &body).await?.0;
            (d, stream_once(http, &routed, &body).await?.0)
        } else {
            let r = stream_once(http, &routed, &body).await?.0;
            (stream_once(http, &direct, &body).await?.0, r)
        };
        if i >= WARM_UP_PAIRS {
            direct_ttft.push(d);
            routed_ttft.push(r);
            added[i % 2].push(ms(r) - ms(d));
        }
    }
    let (mut direct_seconds, mut routed_seconds) = (0.0, 0.0);
    for round in 0..ROUTER_COST_ROUNDS {
        let bodies = |path: usize| -> Vec<Value> {
            (0..192)
                .map(|i| short(10_000 * (2 * round + path) + i, 16))
                .collect()
        };
        direct_seconds += run_trace(&direct, bodies(0), 32)
            .await?
            .elapsed
            .as_secs_f64();
        routed_seconds += run_trace(&routed, bodies(1), 32)
            .await?
            .elapsed
            .as_secs_f64();
    }
    // The second request of a pair may find what the first left cached; the mean of the two
    // orders' medians cancels that.
    let added_p50 = added
        .iter_mut()
        .map(|pairs| {
            pairs.sort_by(f64::total_cmp);
            pairs[pairs.len() / 2]
        })
        .sum::<f64>()
        / 2.0;
    let throughput = |seconds: f64| ROUTER_COST_ROUNDS as f64 * 192.0 * 16.0 / seconds;
    println!(
        "\n### The router's cost (one replica; {ROUTER_COST_PAIRS} pairs of one-token streams, then 32 streams of 16 tokens)\n"
    );
    println!("| path | TTFT p50 ms | TTFT p90 ms | tokens/s, 32 streams |");
    println!("|---|---|---|---|");
    for (path, ttft, seconds) in [
        ("worker directly", &mut direct_ttft, direct_seconds),
        ("through the router", &mut routed_ttft, routed_seconds),
    ] {
        println!(
            "| {path} | {:.2} | {:.2} | {:.1} |",
            ms(percentile(ttft, 50.0)),
            ms(percentile(ttft, 90.0)),
            throughput(seconds)
        );
    }
    println!(
        "| router's cost | {:+.2} (paired {added_p50:+.2}) | {:+.2} | {:+.1}% |",
        ms(percentile(&mut routed_ttft, 50.0)) - ms(percentile(&mut direct_ttft, 50.0)),
        ms(percentile(&mut routed_ttft, 90.0)) - ms(percentile(&mut direct_ttft, 90.0)),
        100.0 * (throughput(routed_seconds) / throughput(direct_seconds) - 1.0)
    );
    Ok(())
}

/// A request sent while the fleet is at zero: the router holds it and asks for a wake-up
/// (the test stands in for the autoscaler and sets one replica); its first token against the
/// moment the new worker itself answers ready.
async fn wake_from_zero(
    services: &Api<InferenceService>,
    pods: &Api<Pod>,
    router: &RunningRouter,
) -> Result<()> {
    set_spec(services, json!({"replicas": 0})).await?;
    wait::until(
        "every worker pod gone",
        Duration::from_secs(120),
        || async {
            Ok(pods
                .list(&ListParams::default())
                .await?
                .items
                .is_empty()
                .then_some(()))
        },
    )
    .await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let started = Instant::now();
    let request = {
        let (http, url) = (http.clone(), router.url("/v1/chat/completions"));
        tokio::spawn(async move {
            let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": true});
            let sent = started.elapsed();
            anyhow::Ok(sent + stream_once(&http, &url, &body).await?.0)
        })
    };
    let asked = wait::until(
        "the router's wake-up request",
        Duration::from_secs(20),
        || async {
            let service = services.get("bench").await?;
            Ok(service
                .annotations()
                .contains_key(WAKE_REQUESTED_AT)
                .then(|| started.elapsed()))
        },
    )
    .await?;
    set_spec(services, json!({"replicas": 1})).await?;
    // The worker's own ready time: the first moment its readiness endpoint answers 200,
    // polled directly at its pod address.
    let probe = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()?;
    let worker_ready = wait::until("the new worker ready", Duration::from_secs(120), || async {
        let Some(ip) = pods
            .list(&ListParams::default().labels("npufleet.io/rank=0"))
            .await?
            .items
            .iter()
            .find_map(|p| p.status.as_ref()?.pod_ip.clone())
        else {
            return Ok(None);
        };
        let ready = probe
            .get(format!("http://{ip}:{HTTP_PORT}/v2/health/ready"))
            .send()
            .await;
        Ok(ready
            .is_ok_and(|r| r.status().is_success())
            .then(|| started.elapsed()))
    })
    .await?;
    let first_token = request.await??;
    println!("\n### From zero replicas\n");
    println!(
        "| wake-up asked | worker ready (its own /v2/health/ready) | first token | first token after worker ready |"
    );
    println!("|---|---|---|---|");
    println!(
        "| {:.2} s | {:.2} s | {:.2} s | {:.2} s |",
        asked.as_secs_f64(),
        worker_ready.as_secs_f64(),
        first_token.as_secs_f64(),
        (first_token.saturating_sub(worker_ready)).as_secs_f64()
    );
    Ok(())
}

/// Replicas of [`flow_control_benchmark`]: one a core, so that what the high-priority key
/// waits for is the fleet's load and not two workers sharing a core.
const FLOW_REPLICAS: usize = 2;
/// Places per replica under flow control, of which [`FLOW_RESERVED`] only the high priority
/// may take.
const FLOW_CONCURRENCY: u32 = 4;
const FLOW_RESERVED: u32 = 1;
const GOLD_KEY: &str = "gold-bench-key";
const BULK_KEY: &str = "bulk-bench-key";
/// How long each overload run offers its load.
const OVERLOAD_SECONDS: u64 = 40;

fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn short_chat(i: u64, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": format!("Question {i}: name a river in Europe.")}], "max_tokens": max_tokens, "stream": true})
}

/// What one key's requests met in a run.
#[derive(Default)]
struct KeyRun {
    ttft: Vec<Duration>,
    served: usize,
    refused: usize,
    failed: Vec<String>,
}

/// One streamed request with `key`; a 429 counts as refused, anything else not 2xx as failed.
async fn keyed_request(
    http: &reqwest::Client,
    router: &str,
    key: &str,
    body: &Value,
    run: &tokio::sync::Mutex<KeyRun>,
) {
    let request = http
        .post(format!("{router}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body);
    let outcome = stream_request(request).await;
    let mut run = run.lock().await;
    match outcome {
        Ok((ttft, _)) => {
            run.ttft.push(ttft);
            run.served += 1;
        }
        Err(error) if error.to_string().starts_with("HTTP 429") => run.refused += 1,
        Err(error) => run.failed.push(format!("{error:#}")),
    }
}

/// The high-priority key's closed-loop client and, if `bulk_rate` is set, the low-priority
/// key's open-loop arrivals at that rate, for `seconds`.
async fn overload_run(
    router: &str,
    bulk_rate: Option<f64>,
    seconds: u64,
) -> Result<(KeyRun, KeyRun, Duration)> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(180))
        .build()?;
    let gold = Arc::new(tokio::sync::Mutex::new(KeyRun::default()));
    let bulk = Arc::new(tokio::sync::Mutex::new(KeyRun::default()));
    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let arrivals = bulk_rate.map(|rate| {
        let (http, router, bulk) = (http.clone(), router.to_owned(), bulk.clone());
        tokio::spawn(async move {
            let mut sent = tokio::task::JoinSet::new();
            let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            let mut i = 0u64;
            while Instant::now() < until {
                ticks.tick().await;
                i += 1;
                let (http, router, bulk) = (http.clone(), router.clone(), bulk.clone());
                sent.spawn(async move {
                    keyed_request(
                        &http,
                        &router,
                        BULK_KEY,
                        &short_chat(1_000_000 + i, MAX_TOKENS * 2),
                        &bulk,
                    )
                    .await
                });
            }
            while sent.join_next().await.is_some() {}
        })
    });
    let mut i = 0u64;
    while Instant::now() < until {
        i += 1;
        keyed_request(
            &http,
            router,
            GOLD_KEY,
            &short_chat(i, MAX_TOKENS * 2),
            &gold,
        )
        .await;
    }
    let elapsed = started.elapsed();
    if let Some(arrivals) = arrivals {
        arrivals.await?;
    }
    let take = |run: Arc<tokio::sync::Mutex<KeyRun>>| {
        Arc::try_unwrap(run)
            .ok()
            .expect("every request joined")
            .into_inner()
    };
    Ok((take(gold), take(bulk), elapsed))
}

/// Under twice the load the fleet can serve, a high-priority key against a low-priority one:
/// its time to first token against an idle fleet's, with and without flow control, and the
/// low-priority key's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes on a 2-core machine: run by make bench-router"]
async fn flow_control_benchmark() -> Result<()> {
    let _alone = ONE_BENCHMARK_AT_A_TIME.lock().await;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let bench = Bench::start("router-flow-bench", 84, FLOW_REPLICAS, Engine::Worker).await?;
        let flow_control = json!({
            "maxConcurrencyPerReplica": FLOW_CONCURRENCY,
            "reservedPerReplica": FLOW_RESERVED,
            "maxQueued": 64,
            "queueTtl": "30s",
            "keys": [
                {"name": "gold", "apiKeySha256": sha256_hex(GOLD_KEY), "priority": 10},
                {"name": "bulk", "apiKeySha256": sha256_hex(BULK_KEY), "priority": 0},
            ],
        });
        set_spec(&bench.services, json!({"routing": {"policy": "least-load", "flowControl": flow_control}})).await?;
        let router = bench.router.url("");

        // The fleet's capacity: as many closed-loop clients as it has places.
        let places = FLOW_REPLICAS * (FLOW_CONCURRENCY - FLOW_RESERVED) as usize;
        let bodies: Vec<Value> = (0..places as u64 * 8).map(|i| short_chat(2_000_000 + i, MAX_TOKENS * 2)).collect();
        let requests = bodies.len();
        let capacity_run = run_trace(&bench.router.url("/v1/chat/completions"), bodies, places).await?;
        let capacity = requests as f64 / capacity_run.elapsed.as_secs_f64();
        let (mut idle, _, _) = overload_run(&router, None, 15).await?;

        println!("\n### Flow control under 2× overload: {FLOW_REPLICAS} SmolLM2-135M replicas, {FLOW_CONCURRENCY} places each, {FLOW_RESERVED} reserved for the high priority; capacity {capacity:.2} req/s ({} tokens per answer); low-priority key arriving at {:.2} req/s for {OVERLOAD_SECONDS} s, one high-priority client in a closed loop\n", MAX_TOKENS * 2, 2.0 * capacity);
        println!("| run | high-priority TTFT p50 ms | p90 ms | p99 ms | vs idle p90 | high served | low served | low refused (429) | low share of served | failed |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let idle_p90 = percentile(&mut idle.ttft, 90.0);
        println!(
            "| idle fleet | {:.0} | {:.0} | {:.0} | 1.00 | {} | – | – | – | {} |",
            ms(percentile(&mut idle.ttft, 50.0)), ms(idle_p90), ms(percentile(&mut idle.ttft, 99.0)), idle.served, idle.failed.len()
        );
        let mut failures = idle.failed;
        for (label, spec) in [
            ("2× overload, flow control", json!({"flowControl": flow_control})),
            ("2× overload, no flow control", json!({"flowControl": null})),
        ] {
            set_spec(&bench.services, json!({"routing": spec})).await?;
            // The router follows the change within a watch event; one request makes sure.
            stream_once(&reqwest::Client::new(), &bench.router.url("/v1/chat/completions"), &short_chat(0, 1)).await?;
            let (mut gold, bulk, _) = overload_run(&router, Some(2.0 * capacity), OVERLOAD_SECONDS).await?;
            let p90 = percentile(&mut gold.ttft, 90.0);
            println!(
                "| {label} | {:.0} | {:.0} | {:.0} | {:.2} | {} | {} | {} | {:.0}% | {} |",
                ms(percentile(&mut gold.ttft, 50.0)), ms(p90), ms(percentile(&mut gold.ttft, 99.0)),
                p90.as_secs_f64() / idle_p90.as_secs_f64(), gold.served, bulk.served, bulk.refused,
                100.0 * bulk.served as f64 / (gold.served + bulk.served).max(1) as f64,
                gold.failed.len() + bulk.failed.len(),
            );
            failures.extend(gold.failed);
            failures.extend(bulk.failed);
        }
        ensure!(failures.is_empty(), "requests failed: {failures:?}");
        Ok(())
    })
    .await
}
