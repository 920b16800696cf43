//! `spec.autoscaling.objectives` end to end on the real control plane:
//! - real workers (SmolLM2 on CPU, run by the node agent) under a burst of long prompts: the
//!   autoscaler learns their step times from their load reports, predicts the time to first
//!   token one replica would give, says in status and in the `ObjectivesMet` condition that
//!   the objective is missed, and scales up to the count it predicts meets it, while the
//!   queue-depth policy under the same burst never scales (four clients queue at most four
//!   requests, under its default target of five);
//! - workers whose load cannot be read (Ready pods where nothing listens): the count holds,
//!   with `ScalingActive=False` reason `MetricsUnavailable`, and never falls;
//! - under `mode: hpa`, where the objectives size the fleet in the external metric an HPA
//!   reads: what they learned of the workers' step times is kept in status too, and an
//!   operator that restarts carries on from it.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Patch, PatchParams};
use npufleet_crds::InferenceService;
use npufleet_operator::autoscaler::{
    METRICS_UNAVAILABLE, OBJECTIVE_MISSED, OBJECTIVES_MET, SCALING_ACTIVE,
};
use npufleet_tests::fleet::{
    Load, RunningRouter, Testbed, unreachable_node, unreachable_placement,
};
use npufleet_tests::operator::{OperatedNamespace, ReplicaWatch};
use npufleet_tests::{service, wait};
use serde_json::json;

const MANAGER: &str = "autoscaling-objectives-test";
const CLIENTS: u32 = 4;

fn condition(service: &InferenceService, type_: &str) -> Option<Condition> {
    service
        .status
        .as_ref()?
        .autoscaling
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

/// A prompt of about 700 tokens, long next to the chat prompts of the other tests and a
/// noticeable prefill for SmolLM2 on two cores, that starts with `n` so that no two share a
/// prefix the workers' prefix cache could serve.
fn long_prompt(n: u64) -> String {
    let sentence = "The river runs past the old mill, under the stone bridge and out to the sea. ";
    format!(
        "Text {n}: {}Summarise the text above in one sentence.",
        sentence.repeat(40)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_long_prompts_scales_up_to_meet_the_time_to_first_token() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "autoscaling-objectives", 46, MANAGER).await?;
        let _operator = bed.start_operator()?;
        bed.apply_smollm2(
            "chat",
            json!({
                "replicas": 1,
                "engine": {"drainSeconds": 60},
                "autoscaling": {
                    "mode": "builtin", "minReplicas": 1, "maxReplicas": 3,
                    "objectives": {"ttft": {"percentile": 90, "target": "300ms"}},
                },
            }),
        )
        .await?;
        bed.wait_serving(1).await?;

        let router = RunningRouter::start(c, "router-objectives", &bed.namespace, &[]).await?;
        let load = Load::through(&router);
        let services = bed.services();
        let started = Instant::now();
        load.start_varied(
            CLIENTS,
            "/v1/chat/completions",
            std::sync::Arc::new(|n| service::chat(&long_prompt(n), 8)),
        );

        // The objective is predicted missed with one replica, the count implied rises and
        // the autoscaler asks for it.
        let (missed, status) = wait::until(
            "ObjectivesMet=False and a scale-up on the objectives",
            Duration::from_secs(90),
            || async {
                let service = services.get("chat").await?;
                let autoscaling = service
                    .status
                    .as_ref()
                    .and_then(|s| s.autoscaling.clone())
                    .unwrap_or_default();
                let missed = condition(&service, OBJECTIVES_MET).filter(|c| c.status == "False");
                let implied = autoscaling
                    .objectives
                    .as_ref()
                    .and_then(|o| o.replicas_implied)
                    .unwrap_or(0);
                match missed {
                    Some(missed) if service.spec.replicas >= 2 && implied >= 2 => {
                        Ok(Some((missed, autoscaling)))
                    }
                    _ => anyhow::bail!(
                        "spec.replicas {}, status.autoscaling {autoscaling:?}",
                        service.spec.replicas
                    ),
                }
            },
        )
        .await?;
        let decided_in = started.elapsed();
        assert_eq!(missed.reason, OBJECTIVE_MISSED);
        assert!(
            missed.message.starts_with("with 1 ready replica groups: ttft p90 ")
                && missed.message.contains("target 300ms"),
            "{}",
            missed.message
        );
        let objectives = status.objectives.context("no status.autoscaling.objectives")?;
        let ttft = objectives.ttft.clone().context("no ttft prediction")?;
        assert_eq!((ttft.percentile, ttft.target_seconds), (90.0, 0.3));
        assert!(
            ttft.predicted_seconds.is_none_or(|p| p > 0.3),
            "{ttft:?} while ObjectivesMet=False"
        );
        assert!(objectives.arrival_rate.is_some_and(|r| r > 0.0), "{objectives:?}");
        assert!(
            objectives.mean_prompt_tokens.is_some_and(|p| p > 300.0),
            "{objectives:?}"
        );
        // The steps seen so far are kept, whether or not enough for a fit yet (a prefill
        // step of SmolLM2 on two cores takes over a second).
        let capacity = status.capacity.context("no status.autoscaling.capacity")?;
        assert!(
            capacity.prefill.steps > 0.0 && capacity.prefill.seconds_sum > 0.0,
            "{capacity:?}"
        );
        let events =
            npufleet_tests::operator::events(&client, &bed.namespace, "chat", OBJECTIVE_MISSED)
                .await?;
        assert!(!events.is_empty(), "no {OBJECTIVE_MISSED} event");

        bed.wait_serving_at_least(2, "a second replica serving under the burst")
            .await?;
        load.stop().await?;
        eprintln!(
            "scale-up decided {:.1} s after the burst began; {} requests, {} failed; {objectives:?}; {capacity:?}",
            decided_in.as_secs_f64(),
            load.sent(),
            load.failed()
        );
        assert_eq!(load.failed(), 0, "failed requests: {:?}", load.failures().await);

        // The same burst under the queue-depth policy at its default target: four clients
        // never queue more than four requests, under the target of five, so it never scales,
        // though each prompt waits seconds for its first token.
        services
            .patch(
                "chat",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 1, "autoscaling": {
                    "mode": "builtin", "minReplicas": 1, "maxReplicas": 3,
                    "targetQueueDepth": 5, "objectives": null,
                }}})),
            )
            .await?;
        bed.wait_scaled_to("chat", (1, 1), "back to one replica under queue depth").await?;
        let replicas = ReplicaWatch::start(&services, "chat");
        let load = Load::through(&router);
        load.start_varied(
            CLIENTS,
            "/v1/chat/completions",
            std::sync::Arc::new(|n| service::chat(&long_prompt(1_000_000 + n), 8)),
        );
        // Twice as long as the objectives took to decide, and at least as long as the queue
        // policy's own window, with a request answered on the way.
        let watched = (decided_in * 2).max(Duration::from_secs(20));
        let until = Instant::now() + watched;
        let deepest = std::sync::Mutex::new(0.0_f64);
        wait::until("the queue-depth run to last as long", watched + Duration::from_secs(30), || async {
            let queue = services
                .get("chat")
                .await?
                .status
                .and_then(|s| s.autoscaling)
                .and_then(|a| a.queue_depth)
                .unwrap_or(0.0);
            let mut deepest = deepest.lock().expect("not poisoned");
            *deepest = deepest.max(queue);
            Ok((Instant::now() >= until && load.sent() > 0).then_some(()))
        })
        .await?;
        load.stop().await?;
        let deepest = *deepest.lock().expect("not poisoned");
        eprintln!(
            "queue depth at target 5 over {:.1} s of the same burst: deepest queue {deepest}, most replicas {}",
            watched.as_secs_f64(),
            replicas.max()
        );
        assert_eq!(replicas.max(), 1, "queue depth scaled the burst too (deepest queue {deepest})");
        assert_eq!(load.failed(), 0, "failed requests: {:?}", load.failures().await);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_whose_load_cannot_be_read_hold_the_objectives_count_and_say_why() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let node = "unreachable-objectives";
        unreachable_node(&client, node, 9).await?;
        let operated = OperatedNamespace::start(c, &client, "objectives-unread", MANAGER).await?;
        let manifest = service::unread_smollm2(
            &operated.namespace,
            "chat",
            json!({
                "replicas": 3,
                "autoscaling": {
                    "mode": "builtin", "minReplicas": 1, "maxReplicas": 5,
                    "objectives": {"tpot": {"target": "80ms"}},
                },
                "scheduling": unreachable_placement(node),
            }),
        )?;
        npufleet_tests::operator::apply(&operated.services, MANAGER, &manifest).await?;
        let services = &operated.services;

        let unread = wait::until("ScalingActive=False", Duration::from_secs(45), || async {
            let service = services.get("chat").await?;
            match condition(&service, SCALING_ACTIVE) {
                Some(c) if c.status == "False" && c.message.starts_with("the load of 3 of 3") => {
                    Ok(Some(c))
                }
                other => anyhow::bail!("ScalingActive {other:?}"),
            }
        })
        .await?;
        assert_eq!(unread.reason, METRICS_UNAVAILABLE);
        assert!(unread.message.contains("127.78.9."), "{}", unread.message);

        // Longer than the test policy's stable window and scale-down delay together.
        let hold = Duration::from_secs(15);
        let since = Instant::now();
        wait::until("the count to hold while nothing is read", hold * 2, || async {
            let service = services.get("chat").await?;
            let desired = service
                .status
                .as_ref()
                .and_then(|s| s.autoscaling.as_ref())
                .and_then(|a| a.desired_replicas);
            if (service.spec.replicas, desired) != (3, Some(3)) {
                return Err(wait::fatal(anyhow::anyhow!(
                    "spec.replicas {}, status.autoscaling.desiredReplicas {desired:?} after {:?}",
                    service.spec.replicas,
                    since.elapsed()
                )));
            }
            Ok((since.elapsed() >= hold).then_some(()))
        })
        .await?;
        let service = services.get("chat").await?;
        assert_eq!(
            condition(&service, OBJECTIVES_MET),
            None,
            "a prediction from no readings"
        );
        Ok(())
    })
    .await
}

/// The prefill steps `status.autoscaling.capacity` holds, once it holds any.
async fn prefill_steps(services: &kube::Api<InferenceService>) -> Result<Option<f64>> {
    let service = services.get("chat").await?;
    Ok(service
        .status
        .and_then(|s| s.autoscaling)
        .and_then(|a| a.capacity)
        .map(|c| c.prefill.steps))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_hpa_mode_the_learned_capacity_outlives_an_operator_restart() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "objectives-hpa", 49, MANAGER).await?;
        let operator = bed.start_operator()?;
        bed.apply_smollm2(
            "chat",
            json!({
                "replicas": 1,
                "autoscaling": {
                    "mode": "hpa", "minReplicas": 1, "maxReplicas": 2,
                    "objectives": {"ttft": {"percentile": 90, "target": "300ms"}},
                },
            }),
        )
        .await?;
        bed.wait_serving(1).await?;
        let router = RunningRouter::start(c, "router-objectives-hpa", &bed.namespace, &[]).await?;
        let http = reqwest::Client::new();
        let chat = router.url("/v1/chat/completions");
        let ask = |n: u64| {
            let (http, chat) = (http.clone(), chat.clone());
            async move {
                let answer = http
                    .post(&chat)
                    .json(&service::chat(&long_prompt(n), 2))
                    .send()
                    .await?;
                anyhow::ensure!(answer.status().is_success(), "{answer:?}");
                anyhow::Ok(())
            }
        };
        let services = bed.services();
        for n in 0..4 {
            ask(n).await?;
        }
        let before = wait::until(
            "status.autoscaling.capacity in hpa mode",
            Duration::from_secs(60),
            || async {
                Ok(prefill_steps(&services)
                    .await?
                    .filter(|&steps| steps >= 4.0))
            },
        )
        .await?;

        drop(operator);
        let _operator = bed.start_operator()?;
        for n in 4..6 {
            ask(n).await?;
        }
        let after = wait::until(
            "the restarted operator to write the capacity",
            Duration::from_secs(60),
            || async {
                Ok(prefill_steps(&services)
                    .await?
                    .filter(|&steps| steps != before))
            },
        )
        .await?;
        assert!(
            after > before,
            "the restarted operator started over: {before} prefill steps before, {after} after"
        );
        Ok(())
    })
    .await
}
