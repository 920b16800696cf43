//! Replays bursty load traces on a simulated fleet with a model warm-up delay and compares
//! the built-in queue-depth autoscaler with HPA- and KPA-equivalent policies; then replays
//! the token-level benchmark traces (short and long prompts on an NPU-like fleet; chat then
//! documents on one-thread CPU workers, the benchmark on real workers simulated) under the
//! latency objectives and under queue depth at several targets.

use clap::Parser;
use npufleet_operator::autoscaler::policy::PolicyConfig;
use npufleet_operator::autoscaler::sim::{FleetModel, Trace, compare, tokens};

#[derive(Parser, Debug)]
#[command(about = "Compare scaling policies on simulated bursty traces")]
struct Args {
    /// Seconds from asking for a replica group to it serving.
    #[arg(long, default_value_t = 30.0)]
    warm_up: f64,
    /// Seconds one request takes once in the batch.
    #[arg(long, default_value_t = 2.0)]
    service_time: f64,
    /// Requests a replica group runs at once.
    #[arg(long, default_value_t = 8)]
    batch: u32,
    /// Arrival-to-completion latency objective, seconds.
    #[arg(long, default_value_t = 6.0)]
    slo: f64,
    /// Waiting + running requests per replica group every policy aims for.
    #[arg(long, default_value_t = 6.0)]
    target: f64,
    #[arg(long, default_value_t = 20)]
    max_replicas: u32,
    /// Seconds simulated per trace.
    #[arg(long, default_value_t = 900.0)]
    duration: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    for (what, value) in [
        ("--warm-up", args.warm_up),
        ("--service-time", args.service_time),
        ("--slo", args.slo),
        ("--duration", args.duration),
    ] {
        anyhow::ensure!(
            value.is_finite() && value > 0.0,
            "{what} must be a positive number of seconds, got {value}"
        );
    }
    anyhow::ensure!(args.batch > 0, "--batch must be at least 1");
    let model = FleetModel {
        warm_up: args.warm_up,
        batch: args.batch,
        service_time: args.service_time,
        latency_slo: args.slo,
        initial_replicas: 1,
        duration: args.duration,
    };
    let config = PolicyConfig {
        target_queue_per_replica: args.target,
        max_replicas: args.max_replicas,
        ..PolicyConfig::default()
    };
    config.validate()?;
    let capacity = f64::from(args.batch) / args.service_time;
    // Every trace starts after two minutes at a low rate, so that no policy is still in
    // the panic mode it starts in.
    let traces = [
        (
            "step 2→16 req/s for 240 s",
            Trace::Step {
                base: 2.0,
                peak: 16.0,
                start: 120.0,
                end: 360.0,
            },
        ),
        (
            "spike 2→24 req/s for 30 s",
            Trace::Step {
                base: 2.0,
                peak: 24.0,
                start: 120.0,
                end: 150.0,
            },
        ),
        (
            "sine 2..18 req/s, 300 s period",
            Trace::Sine {
                mean: 10.0,
                amplitude: 8.0,
                period: 300.0,
                start: 120.0,
            },
        ),
    ];

    println!(
        "Fleet: warm-up {} s, batch {}, {} s per request ({capacity:.1} req/s per replica), \
         SLO {} s, target {} requests per replica, max {} replicas, {} s per trace.\n",
        args.warm_up,
        args.batch,
        args.service_time,
        args.slo,
        args.target,
        args.max_replicas,
        args.duration
    );
    println!(
        "| trace | policy | first scale-up after queue builds (s) | requests over SLO | replica-seconds | max replicas | p99 latency (s) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (name, trace) in &traces {
        for (policy, outcome) in compare(&model, trace, &config)? {
            let first = outcome
                .time_to_first_scale_up
                .map_or_else(|| "never".to_owned(), |t| format!("{t:.1}"));
            println!(
                "| {name} | {policy} | {first} | {} / {} ({:.1} %) | {:.0} | {} | {:.1} |",
                outcome.over_slo,
                outcome.requests,
                100.0 * outcome.over_slo as f64 / outcome.requests.max(1) as f64,
                outcome.replica_seconds,
                outcome.max_replicas,
                outcome.p99_latency
            );
        }
    }
    objectives_table(args.max_replicas);
    Ok(())
}

/// The latency objectives against queue depth on the token-level benchmark.
fn objectives_table(max_replicas: u32) {
    let (fleet, _, duration) = tokens::benchmark();
    let objective = |t: Option<npufleet_operator::autoscaler::objectives::Target>| {
        t.map_or_else(
            || "none".to_owned(),
            |t| format!("p{} {} ms", t.quantile * 100.0, t.seconds * 1000.0),
        )
    };
    println!(
        "\nLatency objectives: TTFT {}, TPOT {}. Trace: Poisson 2 req/s, 8 req/s from 120 s to \
         360 s, {duration} s; prompts 80 % uniform 64..=512 and 20 % uniform 2,000..=4,000 \
         tokens, outputs uniform 32..=256 (seed {}). Groups: prefill {} s + {} s a position, \
         decode {} s + {} s a sequence, {} positions a step, batch {}, warm-up {} s.\n",
        objective(fleet.targets.ttft),
        objective(fleet.targets.tpot),
        tokens::SEED,
        fleet.prefill.intercept,
        fleet.prefill.slope,
        fleet.decode.intercept,
        fleet.decode.slope,
        fleet.step_tokens,
        fleet.max_batch,
        fleet.warm_up,
    );
    table(tokens::compare(max_replicas));
    let (fleet, requests) = tokens::cpu_benchmark();
    let phases: Vec<String> = tokens::CPU_PHASES
        .iter()
        .map(|p| {
            format!(
                "{} s at {} req/s with prompts of {}..={} tokens and outputs of {}..={}",
                p.seconds,
                p.rate,
                p.mix.short_prompt.0.min(p.mix.long_prompt.0),
                p.mix.short_prompt.1.max(p.mix.long_prompt.1),
                p.mix.output.0,
                p.mix.output.1
            )
        })
        .collect();
    println!(
        "\nThe benchmark on real workers, simulated: TTFT {}, TPOT {}; {} requests: {}; groups: \
         prefill {} s + {} s a position and {} s a position per earlier position, decode {} s \
         + {} s a sequence, warm-up {} s; 1 to {} groups.\n",
        objective(fleet.targets.ttft),
        objective(fleet.targets.tpot),
        requests.len(),
        phases.join(", then "),
        fleet.prefill.intercept,
        fleet.prefill.slope,
        fleet.attention,
        fleet.decode.intercept,
        fleet.decode.slope,
        fleet.warm_up,
        tokens::CPU_MAX_REPLICAS,
    );
    table(tokens::compare_on(
        &fleet,
        &requests,
        tokens::CPU_MAX_REPLICAS,
    ));
    search_table(&fleet);
}

/// How far below queue depth the objectives get on two CPU groups over a grid of variants of
/// the benchmark trace, with both lines the workers were fitted to.
fn search_table(fleet: &tokens::Fleet) {
    const SHOWN: usize = 5;
    let fifth = tokens::fifth_run_lines(fleet);
    let fifth_lines = format!(
        "the fifth real run's lines (decode {} s + {} s a sequence, prefill {} s + {} s a position)",
        fifth.decode.intercept, fifth.decode.slope, fifth.prefill.intercept, fifth.prefill.slope
    );
    for (lines, fleet) in [
        ("the lines above".to_owned(), fleet.clone()),
        (fifth_lines, fifth),
    ] {
        let searched = tokens::cpu_search(&fleet, tokens::CPU_MAX_REPLICAS);
        let traces = searched.len();
        let mut rows: Vec<(f64, tokens::SearchRow)> = searched
            .into_iter()
            .filter_map(|row| Some((row.ratio()?, row)))
            .collect();
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let quarter = rows.iter().filter(|(ratio, _)| *ratio <= 0.75).count();
        println!(
            "\nVariants of the benchmark trace on 1 to {} groups with {lines}: {} of {} traces where \
             both modes meet the objectives for at least {} % of requests; the objectives spend a \
             quarter fewer replica-seconds than the cheapest such queue-depth target on {quarter}. \
             The {SHOWN} where they spend least against it:\n",
            tokens::CPU_MAX_REPLICAS,
            rows.len(),
            traces,
            100.0 * tokens::ATTAINMENT,
        );
        println!(
            "| chat req/s | chat answer tokens | documents req/s | objectives: met, replica-seconds | cheapest queue depth: target, met, replica-seconds | ratio |"
        );
        println!("|---:|---|---:|---|---|---:|");
        for (ratio, row) in rows.iter().take(SHOWN) {
            let (target, queue) = row.cheapest_queue.as_ref().expect("a ratio has both");
            println!(
                "| {} | {}..={} | {} | {:.1} %, {:.0} | {target}, {:.1} %, {:.0} | {ratio:.2} |",
                row.chat_rate,
                row.chat_output.0,
                row.chat_output.1,
                row.documents_rate,
                100.0 * row.objectives.attainment(),
                row.objectives.replica_seconds,
                100.0 * queue.attainment(),
                queue.replica_seconds,
            );
        }
    }
}

fn table(outcomes: Vec<(String, tokens::Outcome)>) {
    println!(
        "| mode | TTFT met | TPOT met | replica-seconds | scale-up reaction (s) | failed requests | max replicas |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (mode, o) in outcomes {
        let reaction = o
            .scale_up_reaction
            .map_or_else(|| "never".to_owned(), |t| format!("{t:.1}"));
        println!(
            "| {mode} | {:.1} % | {:.1} % | {:.0} | {reaction} | {} / {} | {} |",
            100.0 * o.ttft_met,
            100.0 * o.tpot_met,
            o.replica_seconds,
            o.failed,
            o.requests,
            o.max_replicas
        );
    }
}
