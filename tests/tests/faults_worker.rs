//! Workers that die or hang, on the real control plane: the operator's worker pods run as real
//! processes (SmolLM2 on CPU) under the test node agent, and the tests signal those processes
//! directly, as a crash (SIGKILL) or a hang (SIGSTOP) would. Each test prints its figures.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::ListParams;
use npufleet_contract::env as worker_env;
use npufleet_contract::pods;
use npufleet_tests::fleet::{Router, Testbed, serving_addresses};
use npufleet_tests::{cluster, service, wait};
use serde_json::json;
use tokio::sync::Mutex;

const MANAGER: &str = "faults-worker-test";
/// How long a client waits for any one answer before giving up: the deadline no client may be
/// left hanging past.
const CLIENT_DEADLINE: Duration = Duration::from_secs(10);
/// A killed worker's streaming client must see its error within this.
const KILL_NOTICE_PROMISE: Duration = Duration::from_secs(2);
/// A hung worker must be out of the routing before a client's deadline passes. Unloaded it
/// takes the probe's 1 s timeout, its 250 ms period, the status update and one routing refresh
/// (about 1.4 s, printed); the bound leaves room for two cores that the other tests' workers
/// keep busy.
const HANG_UNROUTED_PROMISE: Duration = CLIENT_DEADLINE;

/// A namespace with a node agent, the operator, and a CPU InferenceService `chat` of
/// `replicas` SmolLM2 workers serving.
struct Fleet {
    bed: Testbed,
    _operator: npufleet_tests::operator::RunningOperator,
}

impl std::ops::Deref for Fleet {
    type Target = Testbed;

    fn deref(&self) -> &Testbed {
        &self.bed
    }
}

impl Fleet {
    /// `env`: settings for the workers beside one compute thread each.
    async fn start(test: &str, subnet: u8, replicas: i32, env: &[(&str, &str)]) -> Result<Fleet> {
        let c = cluster::shared();
        let bed = Testbed::start(c, &c.client().await?, test, subnet, MANAGER).await?;
        let operator = bed.start_operator()?;
        bed.apply_smollm2(
            "chat",
            json!({"replicas": replicas, "template": {"env": service::worker_env(env)}}),
        )
        .await?;
        bed.wait_serving(replicas as usize).await?;
        Ok(Fleet {
            bed,
            _operator: operator,
        })
    }

    /// The serving pod at `address`, and its worker's process id.
    async fn worker_at(&self, address: &str) -> Result<(String, i32)> {
        let pods = self.pods().list(&ListParams::default()).await?;
        let pod = pods
            .items
            .iter()
            .find(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_deref()) == Some(address))
            .with_context(|| format!("no pod at {address}"))?;
        let key = format!("{}/{}", self.namespace, pod.name_any());
        let pid = self
            .agent
            .pid(&key)
            .with_context(|| format!("the node agent runs no {key}"))?;
        Ok((pod.name_any(), pid as i32))
    }
}

fn signal(pid: i32, signal: i32) {
    // SAFETY: signalling a worker process this test's node agent started.
    let sent = unsafe { libc::kill(pid, signal) };
    assert_eq!(sent, 0, "signal {signal} to {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_gives_its_client_a_clean_error_promptly() -> Result<()> {
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::start("faults-kill", 61, 1, &[(worker_env::IGNORE_EOS, "true")]).await?;
        let address = serving_addresses(&fleet.pods()).await?.remove(0);
        let (pod, pid) = fleet.worker_at(&address).await?;

        let http = reqwest::Client::new();
        let response = http
            .post(format!("http://{address}:8000/v1/completions"))
            .json(&json!({
                "model": "smollm2",
                "prompt": "Write a long story about a lighthouse keeper and the sea.",
                "max_tokens": 400,
                "temperature": 0.0,
                "stream": true,
            }))
            .send()
            .await?;
        assert!(response.status().is_success(), "{}", response.status());
        let mut body = response.bytes_stream();
        let mut received = String::new();
        // Kill once tokens are flowing; the worker ignores end-of-sequence tokens, so the
        // 400-token answer cannot end before the kill.
        while received.matches("data: ").count() < 3 {
            let chunk = body
                .next()
                .await
                .context("the stream ended before the kill")??;
            received.push_str(&String::from_utf8_lossy(&chunk));
        }
        signal(pid, libc::SIGKILL);
        let killed = Instant::now();
        let ending = tokio::time::timeout(CLIENT_DEADLINE, async {
            loop {
                match body.next().await {
                    Some(Ok(chunk)) => received.push_str(&String::from_utf8_lossy(&chunk)),
                    Some(Err(error)) => break Ok(error),
                    None => break Err(()),
                }
            }
        })
        .await
        .context("the streaming client was left hanging after its worker was killed")?;
        let noticed = killed.elapsed();
        let error = match ending {
            Ok(error) => error,
            Err(()) => bail!("the stream ended as if complete after the kill: {received}"),
        };
        assert!(
            !received.contains("[DONE]"),
            "a cut stream must not look finished: {received}"
        );
        eprintln!(
            "SIGKILL mid-stream ({pod}): the client saw {error} after {:.1} ms",
            noticed.as_secs_f64() * 1e3
        );
        assert!(noticed < KILL_NOTICE_PROMISE, "noticed after {noticed:?}");
        Ok(())
    })
    .await
}

/// A routing change and the moment it was in place: a pick that begins later sees it.
type RoutingChange = (Instant, Vec<String>);

/// Closed-loop clients with a deadline per request, routed to the serving workers; records who
/// answered and what failed.
#[derive(Default)]
struct DeadlineLoad {
    router: Router,
    stop: AtomicBool,
    log: Mutex<Vec<Attempt>>,
}

/// One request: the address it went to, when its routing began (a pick that begins after a
/// routing change sees it), how long it took, and its outcome.
type Attempt = (String, Instant, Duration, Result<(), String>);

impl DeadlineLoad {
    fn start(self: &Arc<Self>, clients: usize) -> Vec<tokio::task::JoinHandle<()>> {
        let http = reqwest::Client::builder()
            .timeout(CLIENT_DEADLINE)
            .build()
            .expect("HTTP client");
        (0..clients)
            .map(|_| {
                let (load, http) = (self.clone(), http.clone());
                tokio::spawn(async move {
                    while !load.stop.load(Ordering::Relaxed) {
                        let routed = Instant::now();
                        let Some(address) = load.router.pick(Duration::from_millis(250)).await
                        else {
                            continue;
                        };
                        let started = Instant::now();
                        let outcome = async {
                            let response = http
                                .post(format!("http://{address}:8000/v1/chat/completions"))
                                .json(&json!({
                                    "model": "smollm2",
                                    "messages": [{"role": "user", "content": "Name a river."}],
                                    "max_tokens": 8,
                                }))
                                .send()
                                .await
                                .map_err(|e| e.to_string())?;
                            if !response.status().is_success() {
                                return Err(format!("HTTP {}", response.status()));
                            }
                            response
                                .bytes()
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        }
                        .await;
                        load.router.release(&address).await;
                        load.log
                            .lock()
                            .await
                            .push((address, routed, started.elapsed(), outcome));
                    }
                })
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_stops_being_ready_and_used_and_no_client_waits_past_its_deadline()
-> Result<()> {
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::start("faults-hang", 62, 2, &[]).await?;
        let pods = fleet.pods();
        let services = fleet.services();
        let load = Arc::new(DeadlineLoad::default());
        let changes: Arc<Mutex<Vec<RoutingChange>>> = Arc::default();
        let routing = {
            let (load, pods, changes) = (load.clone(), pods.clone(), changes.clone());
            tokio::spawn(async move {
                loop {
                    if let Ok(addresses) = serving_addresses(&pods).await {
                        let changed = changes.lock().await.last().is_none_or(|(_, a)| *a != addresses);
                        load.router.set_addresses(addresses.clone()).await;
                        if changed {
                            changes.lock().await.push((Instant::now(), addresses));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        let clients = load.start(4);
        wait::until("both workers answering", Duration::from_secs(60), || async {
            let log = load.log.lock().await;
            let answered: std::collections::HashSet<&String> =
                log.iter().filter(|e| e.3.is_ok()).map(|e| &e.0).collect();
            Ok((answered.len() == 2).then_some(()))
        })
        .await?;

        let hung_address = serving_addresses(&pods).await?.remove(0);
        let (hung_pod, pid) = fleet.worker_at(&hung_address).await?;
        signal(pid, libc::SIGSTOP);
        let stopped = Instant::now();
        let not_ready = wait::until("the hung worker's pod not Ready", Duration::from_secs(30), || async {
            let pod = pods.get(&hung_pod).await?;
            Ok((!pods::serves(&pod)).then(|| stopped.elapsed()))
        })
        .await?;
        let routed_after = wait::until("the hung worker out of the routing", Duration::from_secs(30), || async {
            let changes = changes.lock().await;
            let last = changes.last().filter(|(_, a)| !a.contains(&hung_address));
            Ok(last.map(|(at, _)| *at))
        })
        .await?;
        let unrouted = routed_after.duration_since(stopped);
        let uncounted = wait::until("the service counting one ready replica", Duration::from_secs(30), || async {
            let ready = services.get("chat").await?.status.map_or(0, |s| s.ready_replicas);
            Ok((ready == 1).then(|| stopped.elapsed()))
        })
        .await?;
        // The remaining worker carries the load: wait for a few rounds of answers from it,
        // then let every client finish its request in hand (bounded by the deadline).
        wait::until("rounds answered by the remaining worker", Duration::from_secs(60), || async {
            let log = load.log.lock().await;
            let answered = log.iter().filter(|e| e.1 > routed_after && e.3.is_ok()).count();
            Ok((answered >= 8).then_some(()))
        })
        .await?;
        load.stop.store(true, Ordering::Relaxed);
        for client in clients {
            client.await?;
        }
        routing.abort();
        signal(pid, libc::SIGCONT);

        let log = load.log.lock().await;
        let lost: Vec<_> = log.iter().filter(|e| e.3.is_err()).collect();
        let sent_to_hung_after_unrouted = log
            .iter()
            .filter(|e| e.0 == hung_address && e.1 > routed_after)
            .count();
        let longest = log.iter().map(|e| e.2).max().unwrap_or_default();
        let answered_after = log.iter().filter(|e| e.1 > routed_after && e.3.is_ok()).count();
        eprintln!(
            "SIGSTOP ({hung_pod}): not Ready after {:.2} s, out of the routing after {:.2} s, \
             readyReplicas 1 after {:.2} s; {} requests in all, {} lost (caught in the hung worker \
             and failed at the {} s client deadline), {answered_after} answered by the other worker \
             since, longest wait {:.2} s",
            not_ready.as_secs_f64(),
            unrouted.as_secs_f64(),
            uncounted.as_secs_f64(),
            log.len(),
            lost.len(),
            CLIENT_DEADLINE.as_secs(),
            longest.as_secs_f64(),
        );
        assert!(unrouted < HANG_UNROUTED_PROMISE, "out of the routing after {unrouted:?}");
        assert_eq!(sent_to_hung_after_unrouted, 0, "requests still sent to the hung worker");
        assert!(
            longest <= CLIENT_DEADLINE + Duration::from_secs(1),
            "a client waited {longest:?}"
        );
        // Only what was already in the hung worker is lost: at most one request per client.
        assert!(lost.len() <= 4, "lost: {lost:?}");
        for (address, _, _, outcome) in &lost {
            assert_eq!(address, &hung_address, "a request to the healthy worker failed: {outcome:?}");
        }
        Ok(())
    })
    .await
}
