//! The latency objectives against queue depth on real workers (`make bench-autoscaler`;
//! minutes, so not in `make test`): the real control plane, the operator's built-in
//! autoscaler, SmolLM2 workers run by the node agent and the router as its own process. One
//! seeded trace (the simulator's generator over `sim::tokens::CPU_PHASES`: quiet chat, then
//! busy chat, then documents) is replayed through the router
//! under each mode; per mode, the share of requests meeting the TTFT and TPOT objectives,
//! replica-seconds (ready serving replicas, sampled each half second), when the fleet first
//! grew and the requests failed. `sim::tokens::cpu_benchmark` is the same run simulated.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use kube::api::{ListParams, Patch, PatchParams};
use npufleet_contract::pods;
use npufleet_crds::{DEFAULT_TARGET_QUEUE_DEPTH, DEFAULT_WARMUP_ITERATIONS};
use npufleet_operator::autoscaler::objectives::Target;
use npufleet_operator::autoscaler::sim::tokens::{
    CPU_MAX_REPLICAS, CPU_PHASES, Request, SEED, TAIL_SECONDS, cpu_benchmark,
};
use npufleet_tests::fleet::{RunningRouter, Testbed, sse_error, sse_has_text};
use npufleet_tests::{cluster, service};
use serde_json::{Value, json};

const MANAGER: &str = "autoscaling-bench";

/// A prompt of about `tokens` tokens (one a word) that shares no prefix with another request's.
fn prompt(n: usize, tokens: u32) -> String {
    let words = [
        "the", "river", "runs", "past", "old", "mill", "and", "under", "stone", "bridge",
    ];
    let mut text = format!("Request {n}:");
    for i in 0..tokens.saturating_sub(4) as usize {
        text.push(' ');
        text.push_str(words[i % words.len()]);
    }
    text
}

/// One request's time to first token and time per output token after it.
struct Timing {
    ttft: f64,
    tpot: Option<f64>,
}

async fn replay(http: &reqwest::Client, url: &str, n: usize, request: Request) -> Result<Timing> {
    let body = json!({
        "model": service::SMOLLM2,
        "messages": [{"role": "user", "content": prompt(n, request.prompt)}],
        "max_tokens": request.output,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let response = http.post(url).json(&body).send().await?;
    ensure!(
        response.status().is_success(),
        "HTTP {}: {}",
        response.status(),
        response.text().await?
    );
    let mut stream = response.bytes_stream();
    let (mut text, mut first) = (String::new(), None);
    while let Some(bytes) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&bytes?));
        if first.is_none() && sse_has_text(&text) {
            first = Some(started.elapsed());
        }
    }
    ensure!(sse_error(&text).is_none(), "the stream failed: {text}");
    let total = started.elapsed().as_secs_f64();
    let ttft = first.map_or(total, |f| f.as_secs_f64());
    let tokens = text
        .split("\"completion_tokens\":")
        .nth(1)
        .and_then(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(1.0);
    Ok(Timing {
        ttft,
        tpot: (tokens > 1.0).then(|| (total - ttft) / (tokens - 1.0)),
    })
}

struct ModeRun {
    ttft_met: f64,
    tpot_met: f64,
    replica_seconds: f64,
    grew_at: Option<f64>,
    failed: usize,
    most: usize,
}

/// Replays `requests` through the router with the fleet at one replica under `autoscaling`;
/// each request meets the objectives' targets or not.
async fn run_mode(
    bed: &Testbed,
    router: &RunningRouter,
    requests: &[Request],
    (ttft, tpot): (Target, Target),
    autoscaling: Value,
) -> Result<ModeRun> {
    let services = bed.services();
    services
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1, "autoscaling": autoscaling}})),
        )
        .await?;
    bed.wait_scaled_to("chat", (1, 1), "one replica before the run")
        .await?;
    let pod_api = bed.pods();
    let serving = Arc::new(AtomicUsize::new(1));
    let started = Instant::now();
    let duration: f64 = CPU_PHASES.iter().map(|p| p.seconds).sum();
    let sampler = tokio::spawn({
        let serving = serving.clone();
        async move {
            let (mut replica_seconds, mut first_up, mut most) = (0.0, None, 1);
            let mut ticks = tokio::time::interval(Duration::from_millis(500));
            for tick in 0_u64.. {
                ticks.tick().await;
                // What the objectives saw, every 10 s: the prediction, the measured TTFT
                // and the calibration between them.
                if tick % 20 == 0
                    && let Ok(service) = services.get("chat").await
                    && let Some(o) = service
                        .status
                        .as_ref()
                        .and_then(|s| s.autoscaling.as_ref())
                        .and_then(|a| a.objectives.clone())
                {
                    let capacity = service
                        .status
                        .as_ref()
                        .and_then(|s| s.autoscaling.as_ref())
                        .and_then(|a| a.capacity.as_ref())
                        .map(|c| {
                            format!(
                                "prefill {:.4} + {:.5}/pos, decode {:.4} + {:.5}/seq",
                                c.prefill.intercept_seconds,
                                c.prefill.seconds_per_unit,
                                c.decode.intercept_seconds,
                                c.decode.seconds_per_unit
                            )
                        });
                    eprintln!(
                        "  {:>5.1} s: {} req/s, implied {:?}, ttft {:?}, tpot {:?}, {capacity:?}",
                        started.elapsed().as_secs_f64(),
                        o.arrival_rate.unwrap_or_default(),
                        o.replicas_implied,
                        o.ttft
                            .map(|t| (t.predicted_seconds, t.measured_seconds, t.calibration)),
                        o.tpot.and_then(|t| t.predicted_seconds),
                    );
                }
                let Ok(list) = pod_api.list(&ListParams::default()).await else {
                    continue;
                };
                let now = list.items.iter().filter(|p| pods::serves(p)).count();
                serving.store(now, Ordering::Relaxed);
                replica_seconds += 0.5 * now as f64;
                most = most.max(now);
                let t = started.elapsed().as_secs_f64();
                if now > 1 && first_up.is_none() {
                    first_up = Some(t);
                }
                if t >= duration + TAIL_SECONDS {
                    break;
                }
            }
            (replica_seconds, first_up, most)
        }
    });
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    let url = router.url("/v1/chat/completions");
    let mut sent = tokio::task::JoinSet::new();
    for (n, request) in requests.iter().copied().enumerate() {
        tokio::time::sleep_until((started + Duration::from_secs_f64(request.arrival)).into()).await;
        let (http, url) = (http.clone(), url.clone());
        sent.spawn(async move { replay(&http, &url, n, request).await });
    }
    let (mut timings, mut failed) = (Vec::new(), 0);
    while let Some(done) = sent.join_next().await {
        match done? {
            Ok(timing) => timings.push(timing),
            Err(error) => {
                eprintln!("failed: {error:#}");
                failed += 1;
            }
        }
    }
    let (replica_seconds, grew_at, most) = sampler.await?;
    let share = |met: usize, of: usize| met as f64 / of.max(1) as f64;
    let with_tpot: Vec<f64> = timings.iter().filter_map(|t| t.tpot).collect();
    Ok(ModeRun {
        ttft_met: share(
            timings.iter().filter(|t| t.ttft <= ttft.seconds).count(),
            requests.len(),
        ),
        tpot_met: share(
            with_tpot.iter().filter(|&&t| t <= tpot.seconds).count(),
            with_tpot.len(),
        ),
        replica_seconds,
        grew_at,
        failed,
        most,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes on a 2-core machine: run by make bench-autoscaler"]
async fn objectives_against_queue_depth_on_real_workers() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "autoscaling-bench", 48, MANAGER).await?;
        let _operator = bed.start_operator()?;
        // The warm-up users run by default: it also times the passes the objectives' capacity
        // model starts from.
        let engine = json!({"drainSeconds": 10, "warmupIterations": DEFAULT_WARMUP_ITERATIONS});
        bed.apply_smollm2("chat", json!({"replicas": 1, "engine": engine})).await?;
        bed.wait_serving(1).await?;
        let router = RunningRouter::start(cluster::shared(), "router-autoscaling-bench", &bed.namespace, &[]).await?;
        let (fleet, requests) = cpu_benchmark();
        let targets = (
            fleet.targets.ttft.context("the benchmark has a TTFT objective")?,
            fleet.targets.tpot.context("the benchmark has a TPOT objective")?,
        );
        let objective = |t: Target| json!({"percentile": t.quantile * 100.0, "target": format!("{}ms", t.seconds * 1000.0)});
        let objectives = json!({
            "mode": "builtin", "minReplicas": 1, "maxReplicas": CPU_MAX_REPLICAS,
            "objectives": {"ttft": objective(targets.0), "tpot": objective(targets.1)},
        });
        let queue = |target: u32| json!({
            "mode": "builtin", "minReplicas": 1, "maxReplicas": CPU_MAX_REPLICAS,
            "targetQueueDepth": target, "objectives": null,
        });
        println!(
            "\n### Objectives against queue depth on real workers: SmolLM2-135M (1 thread a replica, 2 cores), {} requests (seed {SEED}; chat from {} s, documents from {} s), objectives TTFT p{} {} s and TPOT p{} {} ms, 1 to {CPU_MAX_REPLICAS} replicas\n",
            requests.len(),
            CPU_PHASES[0].seconds,
            CPU_PHASES[0].seconds + CPU_PHASES[1].seconds,
            targets.0.quantile * 100.0,
            targets.0.seconds,
            targets.1.quantile * 100.0,
            targets.1.seconds * 1000.0
        );
        println!("| mode | TTFT met | TPOT met | replica-seconds | first grew at | most replicas | failed |");
        println!("|---|---|---|---|---|---|---|");
        let mut failed = 0;
        for (name, autoscaling) in [
            ("objectives".to_owned(), objectives),
            ("queue depth 2".to_owned(), queue(2)),
            ("queue depth 4".to_owned(), queue(4)),
            (
                format!("queue depth {DEFAULT_TARGET_QUEUE_DEPTH} (the default)"),
                queue(DEFAULT_TARGET_QUEUE_DEPTH as u32),
            ),
            ("queue depth 6".to_owned(), queue(6)),
        ] {
            let run = run_mode(&bed, &router, &requests, targets, autoscaling).await?;
            println!(
                "| {name} | {:.1}% | {:.1}% | {:.0} | {} | {} | {} |",
                100.0 * run.ttft_met,
                100.0 * run.tpot_met,
                run.replica_seconds,
                run.grew_at.map_or("never".to_owned(), |s| format!("{s:.1} s")),
                run.most,
                run.failed
            );
            failed += run.failed;
        }
        ensure!(failed == 0, "{failed} requests failed");
        Ok(())
    })
    .await
}
