//! The operator itself failing, with the operator binary on the local control plane (KWOK
//! nodes, kube-controller-manager's garbage collector, Volcano's PodGroup API served):
//!
//! - two replicas, one leading: the leader is SIGKILLed in the middle of a scale-up and the
//!   standby takes over; the figure is the time from the kill to its first applied change;
//! - both replicas answer the external metrics API alike, leader or not, on real workers, and
//!   the standby keeps answering through its takeover when the leader is killed;
//! - one replica SIGKILLed at random moments while InferenceServices are created, scaled,
//!   changed and deleted, and started again.
//!
//! After each, the cluster holds exactly what the services ask for: every rank's pod, rank
//! tables, PodGroups, Services and budget, all controlled by the live service, and nothing of a
//! deleted one ([`Inventory`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use npufleet_crds::InferenceService;
use npufleet_operator::external_metrics::{QUEUE_DEPTH, SERVICE_LABEL};
use npufleet_operator::leader::{LEASE_NAME, LEASE_SECONDS};
use npufleet_operator::resources::services as children;
use npufleet_tests::fleet::{Load, RunningRouter, Testbed};
use npufleet_tests::inventory::Inventory;
use npufleet_tests::process::Process;
use npufleet_tests::{cluster, crd, net, operator, service, wait};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

const MANAGER: &str = "faults-operator-test";
const TIMEOUT: Duration = Duration::from_secs(90);
/// How long a new leader's external metrics are watched after it takes the lead: several
/// autoscaler ticks.
const LEAD_WATCHED: Duration = Duration::from_secs(5);

/// The two kinds of fleet the operator makes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// One CPU pod per group, run by KWOK.
    Cpu,
    /// Tensor-parallel groups of two Ascend pods on CCE: a rank table and a Volcano PodGroup
    /// per group (nothing schedules them here; the reconcile is what is under test).
    Cce,
}

impl Kind {
    fn uses_group_objects(self) -> bool {
        self == Self::Cce
    }
}

#[derive(Clone, Debug)]
struct Desired {
    kind: Kind,
    replicas: i32,
    max_unavailable: i32,
}

fn manifest(namespace: &str, name: &str, desired: &Desired) -> Result<InferenceService> {
    let mut spec = json!({
        "model": {"name": name},
        "replicas": desired.replicas,
        "disruptionBudget": {"maxUnavailable": desired.max_unavailable},
    });
    if desired.kind == Kind::Cce {
        spec["accelerator"] = json!({"type": "ascend910", "platform": "cce", "devicesPerPod": 2});
        spec["parallelism"] = json!({"tensor": 4});
    }
    service::unread(namespace, name, spec)
}

/// A namespace of its own with the CRDs the operator uses.
async fn setup(c: &cluster::Cluster, client: &Client, test: &str) -> Result<String> {
    let namespace = c.namespace(client, test).await?;
    crd::install_inference_service(client, MANAGER).await?;
    crd::serve_volcano_pod_groups(client, MANAGER).await?;
    Ok(namespace)
}

/// Whether the cluster holds exactly what `desired` asks for: `None` when it does, else what
/// differs. A name missing from `desired` was deleted and must have left nothing.
async fn divergence(
    client: &Client,
    namespace: &str,
    desired: &BTreeMap<String, Option<Desired>>,
) -> Result<Option<String>> {
    let services: Api<InferenceService> = Api::namespaced(client.clone(), namespace);
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), namespace);
    for (name, want) in desired {
        let live = services.get_opt(name).await?;
        let found = Inventory::read(
            client,
            namespace,
            name,
            live.as_ref().and_then(|s| s.uid()).as_deref(),
            true,
        )
        .await?;
        let expected = match (want, &live) {
            (None, None) => Inventory::default(),
            (None, Some(_)) => return Ok(Some(format!("{name} still exists"))),
            (Some(_), None) => return Ok(Some(format!("{name} does not exist"))),
            (Some(want), Some(service)) => {
                anyhow::ensure!(
                    service.spec.replicas == want.replicas,
                    "{name}: spec.replicas {} where the test asked for {}",
                    service.spec.replicas,
                    want.replicas
                );
                let group_objects = want.kind.uses_group_objects();
                Inventory::expected(service, group_objects, group_objects)
            }
        };
        if found != expected {
            return Ok(Some(format!(
                "{name}: found {found:?}, expected {expected:?}"
            )));
        }
        if let Some(service) = &live {
            let desired = npufleet_operator::fleet::desired_groups(service);
            let budget = budgets
                .get(&children::disruption_budget(service, desired).name_any())
                .await?;
            let want = children::disruption_budget(service, desired)
                .spec
                .and_then(|s| s.min_available);
            let got = budget.spec.and_then(|s| s.min_available);
            if got != want {
                return Ok(Some(format!(
                    "{name}: budget minAvailable {got:?}, expected {want:?}"
                )));
            }
        }
    }
    Ok(None)
}

/// Waits until the cluster holds exactly what `desired` asks for; returns how long it took.
async fn converge(
    client: &Client,
    namespace: &str,
    desired: &BTreeMap<String, Option<Desired>>,
    operator: &mut Process,
) -> Result<Duration> {
    let started = Instant::now();
    let converged = wait::until("the fleet to converge", TIMEOUT, || async {
        match divergence(client, namespace, desired).await? {
            None => Ok(Some(started.elapsed())),
            Some(difference) => anyhow::bail!("{difference}"),
        }
    })
    .await;
    operator.ensure_running()?;
    converged.with_context(|| operator.log_tail(30))
}

/// How long the Lease held in `namespace` has left, by its last renewal.
async fn lease_left(client: &Client, namespace: &str) -> Result<Duration> {
    let lease = Api::<Lease>::namespaced(client.clone(), namespace)
        .get(LEASE_NAME)
        .await?;
    let spec = lease.spec.context("Lease spec")?;
    let renewed = spec.renew_time.context("renewTime")?.0;
    let seconds = i64::from(
        spec.lease_duration_seconds
            .context("leaseDurationSeconds")?,
    );
    let expires = renewed + k8s_openapi::jiff::SignedDuration::from_secs(seconds);
    let left = k8s_openapi::jiff::Timestamp::now().duration_until(expires);
    Ok(Duration::try_from(left).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_replica_takes_over_a_scale_up_when_the_leader_is_killed() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let ns = setup(c, &client, "faults-operator-takeover").await?;
        let mut leader = operator::spawn_replica(c, &ns, "operator-takeover-a", None)?;
        operator::wait_leader(&client, &ns, "operator-takeover-a", TIMEOUT).await?;
        let mut standby = operator::spawn_replica(c, &ns, "operator-takeover-b", None)?;
        let standby_log = standby.log_path().to_path_buf();
        wait::until("the second replica standing by", TIMEOUT, || async {
            let log = std::fs::read_to_string(&standby_log)?;
            Ok(log.contains("waiting to lead").then_some(()))
        })
        .await?;
        standby.ensure_running()?;

        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        let mut desired = Desired {
            kind: Kind::Cce,
            replicas: 1,
            max_unavailable: 1,
        };
        operator::apply(&services, MANAGER, &manifest(&ns, "chat", &desired)?).await?;
        let want = |d: &Desired| BTreeMap::from([("chat".to_owned(), Some(d.clone()))]);
        converge(&client, &ns, &want(&desired), &mut leader).await?;

        // Kill the leader once the scale-up has begun: part of it made, the rest the
        // standby's to finish.
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        desired.replicas = 10;
        operator::scale(&services, "chat", desired.replicas).await?;
        let made_at_kill = wait::until("the scale-up under way", TIMEOUT, || async {
            let made = pods.list(&ListParams::default()).await?.items.len();
            Ok((made > 2).then_some(made))
        })
        .await?;
        let left = lease_left(&client, &ns).await?;
        leader.kill();
        let killed = Instant::now();
        // A change after the kill, which only the standby can apply.
        desired.replicas = 12;
        operator::scale(&services, "chat", desired.replicas).await?;
        let names = |list: Vec<Pod>| -> std::collections::BTreeSet<String> {
            list.into_iter().map(|p| p.name_any()).collect()
        };
        let before = names(pods.list(&ListParams::default()).await?.items);
        let first_applied = wait::until("the standby's first applied change", TIMEOUT, || async {
            let now = names(pods.list(&ListParams::default()).await?.items);
            Ok((!now.is_subset(&before)).then(|| killed.elapsed()))
        })
        .await?;
        converge(&client, &ns, &want(&desired), &mut standby).await?;
        let converged = killed.elapsed();
        let holder = operator::leader(&client, &ns).await?;
        eprintln!(
            "takeover: kill → first applied change {:.1} s (the lease had {:.1} s left of \
             {LEASE_SECONDS} s; {made_at_kill} of 20 pods made at the kill); converged to 12 \
             groups {:.1} s after the kill",
            first_applied.as_secs_f64(),
            left.as_secs_f64(),
            converged.as_secs_f64(),
        );
        assert_eq!(holder.as_deref(), Some("operator-takeover-b"));
        // The standby waits out the dead leader's lease, and must act promptly after it.
        assert!(
            first_applied < left + Duration::from_secs(5),
            "first change {first_applied:?} after the kill, with {left:?} left on the lease"
        );
        assert!(
            first_applied < Duration::from_secs(LEASE_SECONDS + 5),
            "takeover took {first_applied:?}"
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_and_standby_serve_the_same_external_metrics() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "faults-operator-metrics", 71, MANAGER).await?;
        crd::serve_volcano_pod_groups(&client, MANAGER).await?;
        let ns = bed.namespace.clone();
        let leader_addr = net::free_addr()?;
        let mut leader =
            operator::spawn_replica(c, &ns, "operator-metrics-a", Some(leader_addr))?;
        operator::wait_leader(&client, &ns, "operator-metrics-a", TIMEOUT).await?;
        let standby_addr = net::free_addr()?;
        let _standby =
            operator::spawn_replica(c, &ns, "operator-metrics-b", Some(standby_addr))?;

        bed.apply_smollm2(
            "chat",
            // The HPA has the one count to keep: the metric is what is under test.
            json!({"autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 1, "targetQueueDepth": 1}}),
        )
        .await?;
        bed.wait_serving(1).await?;

        let router = RunningRouter::start(c, "router-faults-operator", &ns, &[]).await?;
        let load = Load::through(&router);
        load.start(
            3,
            "/v1/chat/completions",
            service::chat("Name three rivers in Europe.", 48),
        );
        let selector = format!("{SERVICE_LABEL}=chat");
        let both = || async {
            let mut values = Vec::new();
            for addr in [leader_addr, standby_addr] {
                let items =
                    operator::external_metric(c, &client, addr, &ns, QUEUE_DEPTH, &selector)
                        .await?;
                anyhow::ensure!(items.len() == 1, "{addr} answered {items:?}");
                values.push(items[0]["value"].as_str().unwrap_or_default().to_owned());
            }
            Ok(values)
        };
        // Each replica reads the workers on its own tick: wait for a moment both agree.
        let under_load = wait::until("both replicas reporting the load", TIMEOUT, || async {
            let values = both().await?;
            anyhow::ensure!(values[0] == values[1], "leader {}, standby {}", values[0], values[1]);
            anyhow::ensure!(values[0] != "0", "no queue yet");
            Ok(Some(values[0].clone()))
        })
        .await?;
        load.stop().await?;
        wait::until("both replicas reporting the idle fleet", TIMEOUT, || async {
            let values = both().await?;
            Ok((values == ["0", "0"]).then_some(()))
        })
        .await?;
        assert_eq!(load.failed(), 0, "{:?}", load.failures().await);

        // Taking the lead, the standby drops its own collection and fills the operator's
        // shared cache from scratch: its answers must not lapse while that cache fills.
        leader.kill();
        let killed = Instant::now();
        let mut samples = tokio::time::interval(Duration::from_millis(100));
        let mut answered = 0;
        let mut led = None;
        while led.is_none_or(|at: Instant| at.elapsed() < LEAD_WATCHED) {
            anyhow::ensure!(killed.elapsed() < TIMEOUT, "the standby did not take the lead");
            samples.tick().await;
            let items =
                operator::external_metric(c, &client, standby_addr, &ns, QUEUE_DEPTH, &selector)
                    .await?;
            anyhow::ensure!(
                items.len() == 1,
                "{:.1} s after the leader's kill ({}), the standby answered {items:?}",
                killed.elapsed().as_secs_f64(),
                if led.is_some() { "leading" } else { "standing by" },
            );
            answered += 1;
            if led.is_none()
                && operator::leader(&client, &ns).await?.as_deref() == Some("operator-metrics-b")
            {
                led = Some(Instant::now());
            }
        }
        eprintln!(
            "external metrics: leader and standby both report {QUEUE_DEPTH} = {under_load} \
             under 3 clients and 0 idle; {} requests, {} failed; after the leader's kill the \
             standby answered all {answered} queries, through its takeover and {} s of leading",
            load.sent(),
            load.failed(),
            LEAD_WATCHED.as_secs()
        );
        Ok(())
    })
    .await
}

/// Creates, scales, changes and deletes InferenceServices while SIGKILLing the operator at
/// random moments, `rounds` times; after each restart the fleet must converge. Prints each
/// round's convergence time and the seed that reproduces the run.
async fn restarts_at_random_points(test: &str, rounds: usize) -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let ns = setup(c, &client, test).await?;
        let identity = format!("{test}-operator");
        let mut operator = operator::spawn_replica(c, &ns, &identity, None)?;
        operator::wait_leader(&client, &ns, &identity, TIMEOUT).await?;
        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);

        let seed = std::env::var("NPUFLEET_CHAOS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(rand::random::<u64>);
        eprintln!("{test}: seed {seed} (NPUFLEET_CHAOS_SEED reproduces the run)");
        let mut rng = StdRng::seed_from_u64(seed);
        let names = ["alpha", "beta", "gamma", "delta"];
        let mut desired: BTreeMap<String, Option<Desired>> = BTreeMap::new();
        let mut times = Vec::new();
        for round in 0..rounds {
            let ops = rng.random_range(1..=4);
            let kill_after = rng.random_range(0..ops);
            let mut done = Vec::new();
            for op in 0..ops {
                let live: Vec<String> = desired
                    .iter()
                    .filter(|(_, d)| d.is_some())
                    .map(|(n, _)| n.clone())
                    .collect();
                let choice = if live.is_empty() { 0 } else { rng.random_range(0..4) };
                if choice == 0 && live.len() < names.len() {
                    let free: Vec<&str> = names
                        .iter()
                        .copied()
                        .filter(|n| !live.iter().any(|l| l == n))
                        .collect();
                    let name = free[rng.random_range(0..free.len())];
                    let want = Desired {
                        kind: if rng.random_bool(0.5) { Kind::Cce } else { Kind::Cpu },
                        replicas: rng.random_range(0..=3),
                        max_unavailable: rng.random_range(0..=2),
                    };
                    operator::apply(&services, MANAGER, &manifest(&ns, name, &want)?).await?;
                    done.push(format!("create {name} ({:?} x{})", want.kind, want.replicas));
                    desired.insert(name.to_owned(), Some(want));
                } else if !live.is_empty() {
                    let name = live[rng.random_range(0..live.len())].clone();
                    let want = desired.get_mut(&name).and_then(Option::as_mut).context("live")?;
                    match choice {
                        1 => {
                            want.replicas = rng.random_range(0..=3);
                            operator::scale(&services, &name, want.replicas).await?;
                            done.push(format!("scale {name} to {}", want.replicas));
                        }
                        2 => {
                            want.max_unavailable = (want.max_unavailable + 1) % 3;
                            let change = json!({"spec": {"disruptionBudget": {"maxUnavailable": want.max_unavailable}}});
                            services
                                .patch(&name, &PatchParams::default(), &Patch::Merge(change))
                                .await?;
                            done.push(format!("change {name}'s budget"));
                        }
                        _ => {
                            services.delete(&name, &DeleteParams::default()).await?;
                            done.push(format!("delete {name}"));
                            desired.insert(name, None);
                        }
                    }
                }
                if op == kill_after {
                    // Where the kill lands in the reconciles these changes started is the
                    // point of the test, so it comes after a random delay; nothing waits on it.
                    let delay = Duration::from_millis(rng.random_range(0..800));
                    tokio::time::sleep(delay).await;
                    // SIGKILL and start again at once, as the kubelet restarts a container;
                    // the changes after it meet an operator still starting.
                    operator.restart()?;
                    done.push(format!("kill after {} ms", delay.as_millis()));
                }
            }
            let took = converge(&client, &ns, &desired, &mut operator)
                .await
                .with_context(|| format!("round {round}: {}", done.join(", ")))?;
            eprintln!(
                "{test}: round {round}: {}; converged {:.1} s after the last change",
                done.join(", "),
                took.as_secs_f64()
            );
            times.push(took);
        }
        times.sort();
        eprintln!(
            "{test}: {rounds} kills, convergence after the last change: median {:.1} s, max {:.1} s",
            times[times.len() / 2].as_secs_f64(),
            times.last().copied().unwrap_or_default().as_secs_f64()
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_converges_after_restarts_at_random_points() -> Result<()> {
    restarts_at_random_points("faults-operator-restarts", 3).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes: run by make chaos"]
async fn the_fleet_converges_after_many_restarts_at_random_points() -> Result<()> {
    restarts_at_random_points("faults-operator-chaos", 25).await
}
