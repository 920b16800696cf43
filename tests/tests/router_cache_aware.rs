//! Cache-aware routing end to end: the router rebuilds the workers' tokenisation from the
//! recipe they publish, follows each replica's prefix-cache events, and sends a prompt to the
//! replica that holds its blocks; a replaced worker and a restarted router start from the
//! workers' snapshots, never from a stale view. A prefix that several prompts share is
//! copied to an idle replica, and the prompts that start from it then split between the two.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use kube::api::ListParams;
use npufleet_contract::env as worker_env;
use npufleet_contract::headers;
use npufleet_tests::cluster::Cluster;
use npufleet_tests::fleet::{RunningRouter, Testbed, wait_serving};
use npufleet_tests::operator::RunningOperator;
use npufleet_tests::{service, wait};
use serde_json::{Value, json};

const MANAGER: &str = "router-cache-aware-test";
const MODEL: &str = npufleet_tests::service::SMOLLM2;

/// A system prompt of about 300 tokens, unique to `name`.
fn system_prompt(name: &str) -> String {
    (0..14)
        .map(|rule| {
            format!("Rule {rule} of desk {name}: answer politely, briefly and in plain words. ")
        })
        .collect()
}

fn chat_with(system: &str, question: &str) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
    })
}

/// The router's `npufleet_router_prompt_blocks_total` by its `cached` label.
fn prompt_blocks(metrics: &str) -> BTreeMap<String, f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with("npufleet_router_prompt_blocks_total{"))
        .filter_map(|l| {
            let cached = l.split("cached=\"").nth(1)?.split('"').next()?.to_owned();
            Some((cached, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// Sends `body` through the router: the replica that answered, and how many of the prompt's
/// blocks the router found cached there and not (from its metrics, before and after).
async fn send(router: &RunningRouter, body: &Value) -> Result<(String, f64, f64)> {
    let before = prompt_blocks(&router.metrics().await?);
    let response = reqwest::Client::new()
        .post(router.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await?;
    ensure!(response.status().is_success(), "{}", response.text().await?);
    let replica = response.headers()[headers::REPLICA].to_str()?.to_owned();
    response.bytes().await?;
    let after = prompt_blocks(&router.metrics().await?);
    let delta = |label: &str| {
        after.get(label).copied().unwrap_or(0.0) - before.get(label).copied().unwrap_or(0.0)
    };
    Ok((replica, delta("true"), delta("false")))
}

/// Sends `body` until the router places it by its token blocks (its recipe may still be on
/// its way); returns that first placement.
async fn send_until_placed_by_blocks(
    router: &RunningRouter,
    body: &Value,
) -> Result<(String, f64, f64)> {
    wait::until(
        "the router to place prompts by their token blocks",
        Duration::from_secs(60),
        || async {
            let sent = send(router, body).await?;
            Ok((sent.1 + sent.2 > 0.0).then_some(sent))
        },
    )
    .await
}

/// A test bed on loopback subnet `subnet` with the operator and two serving replicas of a
/// cache-aware InferenceService `chat`.
async fn two_serving_replicas(
    c: &'static Cluster,
    client: &kube::Client,
    test: &str,
    subnet: u8,
) -> Result<(Testbed, RunningOperator)> {
    let bed = Testbed::start(c, client, test, subnet, MANAGER).await?;
    let operator = bed.start_operator()?;
    bed.apply_smollm2(
        "chat",
        json!({
            "replicas": 2,
            "engine": {"drainSeconds": 5},
            "routing": {"policy": "cache-aware"},
            "template": {"env": service::worker_env(&[(worker_env::IGNORE_EOS, "true")])},
        }),
    )
    .await?;
    wait_serving(&bed.pods(), 2, Duration::from_secs(120)).await?;
    Ok((bed, operator))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_go_where_their_blocks_are_cached_across_worker_and_router_restarts() -> Result<()>
{
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let (bed, _operator) = two_serving_replicas(c, &client, "router-cache", 86).await?;
        // Without prefix copies, desk A's prompts stay with the replica that computed it.
        let no_copies = ["--copy-shared-prefixes", "false"];
        let mut router = RunningRouter::start(c, "router-cache", &bed.namespace, &no_copies).await?;

        // Once the router has the workers' recipe, a new system prompt finds nothing cached;
        // every later request with it goes to the replica that computed it, and finds it
        // cached there.
        let probe = chat_with(&system_prompt("Z"), "Probe?");
        send_until_placed_by_blocks(&router, &probe).await?;
        let desk_a = system_prompt("A");
        let (holder, cached, missed) = send(&router, &chat_with(&desk_a, "Question 0?")).await?;
        eprintln!("first placement on {holder}: {cached} blocks cached, {missed} not");
        ensure!(cached == 0.0, "nothing held desk A yet, but {cached} blocks were found cached");
        let blocks = cached + missed;
        ensure!(blocks >= 10.0, "a 300-token prompt has at least 10 blocks of 16: {blocks}");
        for i in 1..6 {
            let (replica, cached, missed) = send(&router, &chat_with(&desk_a, &format!("Question {i}?"))).await?;
            ensure!(replica == holder, "request {i} went to {replica}, not to {holder}, which holds its prefix");
            ensure!(cached >= blocks - 2.0, "request {i}: {cached} of {} blocks cached", cached + missed);
        }

        // The holder's worker dies and its pod is replaced: its cache is gone, and the router
        // must not place desk A's prompts by what it held.
        let holder_uid = bed.pods().get(&holder).await?.uid();
        let holder_pid = bed
            .agent
            .pid(&format!("{}/{holder}", bed.namespace))
            .with_context(|| format!("no process for {holder}"))?;
        // SAFETY: a worker process this test's node agent started.
        assert_eq!(unsafe { libc::kill(holder_pid as i32, libc::SIGKILL) }, 0);
        wait::until("the holder's pod to be replaced and both to serve", Duration::from_secs(180), || async {
            let pods = bed.pods().list(&ListParams::default()).await?;
            let ready: Vec<String> = pods
                .items
                .iter()
                .filter(|p| {
                    p.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|conds| {
                        conds.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                    })
                })
                .map(|p| p.name_any())
                .collect();
            let replaced = !pods.items.iter().any(|p| p.uid() == holder_uid);
            Ok((ready.len() == 2 && replaced).then_some(()))
        })
        .await?;
        let (after_restart, cached, _) = send(&router, &chat_with(&desk_a, "After the restart?")).await?;
        ensure!(cached == 0.0, "the router still placed desk A by the dead worker's cache ({cached} blocks on {after_restart})");
        let (again, cached, _) = send(&router, &chat_with(&desk_a, "And again?")).await?;
        ensure!(again == after_restart && cached >= blocks - 2.0, "the new holder's events were not followed: {again}, {cached} blocks");

        // A router that starts now learns both caches from the workers' snapshots: its first
        // placement by blocks already finds desk A cached, though no new block is stored.
        drop(router);
        router = RunningRouter::start(c, "router-cache-2", &bed.namespace, &no_copies).await?;
        send_until_placed_by_blocks(&router, &probe).await?;
        let (replica, cached, missed) = send(&router, &chat_with(&desk_a, "From the new router?")).await?;
        ensure!(
            replica == after_restart && cached >= blocks - 2.0,
            "the restarted router placed desk A on {replica} with {cached} of {} blocks cached",
            cached + missed
        );
        Ok(())
    })
    .await
}

/// The router's `npufleet_router_prefix_copies_total` with `outcome`.
fn prefix_copies(metrics: &str, outcome: &str) -> f64 {
    let label = format!("outcome=\"{outcome}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("npufleet_router_prefix_copies_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A question long enough to fill a block of its own past the system prompt, so the holder's
/// cache shows the prompts going on from it differently.
fn long_question(i: usize) -> String {
    format!(
        "Question {i}: which of the rivers of the valley should the team of this desk visit next, for how many days, and why?"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_system_prompt_is_copied_to_an_idle_replica_and_its_chats_split() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let (bed, _operator) = two_serving_replicas(c, &client, "router-copy", 88).await?;
        let router = RunningRouter::start(c, "router-copy", &bed.namespace, &[]).await?;
        send_until_placed_by_blocks(&router, &chat_with(&system_prompt("Z"), "Probe?")).await?;

        // One at a time, every replica idle: the first prompts under the system prompt go to
        // the replica that computed it, the cheapest place for each of them alone.
        let desk = system_prompt("S");
        let (holder, _, _) = send(&router, &chat_with(&desk, &long_question(0))).await?;
        let (second, cached, _) = send(&router, &chat_with(&desk, &long_question(1))).await?;
        ensure!(
            second == holder && cached >= 10.0,
            "the second prompt went to {second} with {cached} blocks cached, not to {holder}"
        );
        let ended =
            |metrics: &str| prefix_copies(metrics, "done") + prefix_copies(metrics, "failed");
        let before = ended(&router.metrics().await?);

        // The third finds two prompts going on from the system prompt at the holder: the
        // idle replica computes it meanwhile.
        send(&router, &chat_with(&desk, &long_question(2))).await?;
        let metrics = wait::until(
            "the idle replica to compute the shared prefix",
            Duration::from_secs(60),
            || async {
                let metrics = router.metrics().await?;
                Ok((ended(&metrics) > before).then_some(metrics))
            },
        )
        .await?;
        ensure!(
            prefix_copies(&metrics, "failed") == 0.0,
            "a prefix copy failed: {metrics}"
        );

        // From then on the prompts under it split between the replicas, each finding the
        // system prompt cached (once the copy's cache events have arrived).
        let other = wait::until(
            "a prompt under the system prompt to go to the other replica, cached",
            Duration::from_secs(60),
            {
                let (router, desk, holder) = (&router, &desk, &holder);
                let mut i = 3;
                move || {
                    i += 1;
                    let body = chat_with(desk, &long_question(i));
                    async move {
                        let (replica, cached, _) = send(router, &body).await?;
                        Ok((replica != *holder && cached >= 10.0).then_some(replica))
                    }
                }
            },
        )
        .await?;
        eprintln!("prompts under one system prompt split between {holder} and {other}");
        Ok(())
    })
    .await
}
