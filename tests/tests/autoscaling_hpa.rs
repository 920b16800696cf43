//! `mode: hpa` on the real control plane: the operator's external metrics server is
//! registered through a real `APIService`, kube-apiserver's aggregator proxies to it over
//! TLS, and kube-controller-manager's HPA controller scales an `InferenceService` through its
//! `scale` subresource on `npufleet_queue_depth`, up, holding while the load cannot be read,
//! and then down. The queue depth is published straight into the server's store here (the
//! part the autoscaler loop plays); the built-in test reads it from real workers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use npufleet_crds::InferenceService;
use npufleet_operator::autoscaler::hpa;
use npufleet_operator::external_metrics::{
    MetricsServer, MetricsStore, QUEUE_DEPTH, SERVICE_LABEL, ServiceLoad, TlsSettings, tls,
};
use npufleet_tests::{cluster, operator, wait};
use serde_json::json;

const MANAGER: &str = "autoscaling-hpa-test";

const METRICS_SERVICE: &str = "npufleet-external-metrics";

/// Serves the store on the host's address and registers it as the cluster's
/// `v1beta1.external.metrics.k8s.io` the way the chart and the operator do: a Service and an
/// APIService with no `insecureSkipTLSVerify`, a CA and serving certificate the operator
/// keeps in a Secret and writes into the APIService's `caBundle`, and the aggregator's
/// request-header CA read from `kube-system/extension-apiserver-authentication`.
async fn register_metrics_server(
    client: &kube::Client,
    namespace: &str,
    store: MetricsStore,
) -> Result<(
    tokio::task::JoinHandle<()>,
    std::net::SocketAddr,
    tls::ServingCertificate,
)> {
    let certificate =
        operator::external_metrics_certificate(client, METRICS_SERVICE, namespace).await?;
    // A second operator replica (or a restart) serves the same certificate.
    let again = operator::external_metrics_certificate(client, METRICS_SERVICE, namespace).await?;
    assert_eq!(
        again, certificate,
        "a second replica made another certificate"
    );
    let client_auth = wait::until(
        "the request-header CA in kube-system/extension-apiserver-authentication",
        Duration::from_secs(30),
        || async { Ok(Some(tls::ClientAuth::from_cluster(client).await?)) },
    )
    .await?;
    let settings = TlsSettings {
        cert_pem: certificate.cert_pem.clone(),
        key_pem: certificate.key_pem.clone(),
        client_auth: Some(client_auth),
    };
    // Endpoints may not be loopback addresses: serve on the host's own address.
    let host = npufleet_tests::monitoring::host_address()?;
    let server = MetricsServer::bind((host, 0).into(), store, &settings).await?;
    let addr = server.local_addr()?;
    let port = addr.port();
    let task = tokio::spawn(server.run());

    let apply = PatchParams::apply(MANAGER).force();
    let service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "npufleet-external-metrics", "namespace": namespace},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port}]},
    });
    Api::<Service>::namespaced(client.clone(), namespace)
        .patch("npufleet-external-metrics", &apply, &Patch::Apply(service))
        .await?;
    let endpoints = json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "npufleet-external-metrics", "namespace": namespace},
        "subsets": [{
            "addresses": [{"ip": host.to_string()}],
            "ports": [{"name": "https", "port": port}],
        }],
    });
    Api::<Endpoints>::namespaced(client.clone(), namespace)
        .patch(
            "npufleet-external-metrics",
            &apply,
            &Patch::Apply(endpoints),
        )
        .await?;
    let api_service = json!({
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
        "spec": {
            "group": "external.metrics.k8s.io", "version": "v1beta1",
            "groupPriorityMinimum": 100, "versionPriority": 100,
            "service": {"name": METRICS_SERVICE, "namespace": namespace, "port": 443},
        },
    });
    let api_services: Api<APIService> = Api::all(client.clone());
    api_services
        .patch(
            "v1beta1.external.metrics.k8s.io",
            &apply,
            &Patch::Apply(api_service),
        )
        .await?;
    anyhow::ensure!(
        tls::publish_ca_bundle(client, &certificate.ca_pem).await?,
        "the APIService was not found to publish the caBundle into"
    );
    wait::until(
        "the external metrics APIService Available",
        Duration::from_secs(60),
        || async {
            let svc = api_services.get("v1beta1.external.metrics.k8s.io").await?;
            let conditions = svc.status.and_then(|s| s.conditions).unwrap_or_default();
            let available = conditions
                .iter()
                .any(|c| c.type_ == "Available" && c.status == "True");
            if available {
                Ok(Some(()))
            } else {
                anyhow::bail!("conditions: {conditions:?}")
            }
        },
    )
    .await?;
    Ok((task, addr, certificate))
}

async fn spec_replicas(api: &Api<InferenceService>, name: &str) -> Result<i32> {
    Ok(api.get(name).await?.spec.replicas)
}

/// Runs `kubectl` off the async threads: the metrics server must keep answering the
/// aggregator while kubectl waits for it.
async fn kubectl(args: Vec<String>) -> Result<std::process::Output> {
    let c = cluster::shared();
    Ok(tokio::task::spawn_blocking(move || c.kubectl().args(&args).output()).await??)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hpa_scales_an_inference_service_on_the_operators_external_metric() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let ns = c.namespace(&client, "autoscaling-hpa").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let store = MetricsStore::default();
        let (_server, server_addr, certificate) =
            register_metrics_server(&client, &ns, store.clone()).await?;

        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        let service: InferenceService = serde_json::from_value(json!({
            "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": ns, "labels": {"team": "search"}},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": "/models/smollm2.gguf"}},
                "replicas": 1,
                "accelerator": {"type": "cpu"},
                "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 5},
            }
        }))?;
        let service = wait::until("InferenceService create", Duration::from_secs(30), || async {
            Ok(Some(
                services
                    .patch("chat", &PatchParams::apply(MANAGER).force(), &Patch::Apply(&service))
                    .await?,
            ))
        })
        .await?;
        // What the reconcile reports; the HPA needs the selector to accept the target.
        services
            .patch_status(
                "chat",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"replicas": 1, "selector": "npufleet.io/inference-service=chat"}})),
            )
            .await?;

        let autoscaling = service.spec.autoscaling.clone().context("autoscaling set")?;
        let hpa = hpa::desired(&service, &autoscaling)?;
        let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), &ns);
        hpas.patch("chat", &PatchParams::apply(MANAGER).force(), &Patch::Apply(&hpa))
            .await?;

        let labels: BTreeMap<String, String> = service.labels().clone();
        let publish = |queue_depth| {
            store.update(&ns, "chat", &labels, ServiceLoad { queue_depth, kv_cache_usage: 0.0, objective_replicas: Err("no objectives".into()) })
        };

        // The aggregator reaches the server and the selector picks the service.
        publish(18);
        let path = format!(
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{QUEUE_DEPTH}?labelSelector={SERVICE_LABEL}%3Dchat"
        );
        // The aggregator's proxy can lag the APIService turning Available by a moment.
        let list: serde_json::Value =
            wait::until("kubectl get --raw on the external metric", Duration::from_secs(30), || async {
                let raw = kubectl(vec!["get".into(), "--raw".into(), path.clone()]).await?;
                anyhow::ensure!(
                    raw.status.success(),
                    "kubectl get --raw: {}",
                    String::from_utf8_lossy(&raw.stderr)
                );
                Ok(Some(serde_json::from_slice(&raw.stdout)?))
            })
            .await?;
        assert_eq!(list["kind"], "ExternalMetricValueList");
        assert_eq!(list["items"][0]["value"], "18");

        // The aggregator verifies the server against the operator's CA, not blindly.
        let registered = Api::<APIService>::all(client.clone())
            .get("v1beta1.external.metrics.k8s.io")
            .await?
            .spec
            .context("APIService spec")?;
        assert_ne!(registered.insecure_skip_tls_verify, Some(true));
        let bundle = registered.ca_bundle.context("no caBundle")?;
        assert_eq!(String::from_utf8(bundle.0)?, certificate.ca_pem);
        // Anyone else reaching the server's port gets 401 and no metric.
        let direct = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(certificate.ca_pem.as_bytes())?)
            .resolve(&format!("{METRICS_SERVICE}.{ns}.svc"), server_addr)
            .build()?
            .get(format!("https://{METRICS_SERVICE}.{ns}.svc:{}{path}", server_addr.port()))
            .send()
            .await?;
        assert_eq!(direct.status().as_u16(), 401);
        let refused: serde_json::Value = direct.json().await?;
        assert_eq!(refused["reason"], "Unauthorized", "{refused}");
        assert!(refused.get("items").is_none(), "{refused}");

        // 18 waiting + running at 5 per replica: ceil(18 / 5) = 4 groups.
        let started = Instant::now();
        let first_scale_up = std::cell::Cell::new(None);
        wait::until("the HPA to scale chat to 4", Duration::from_secs(60), || async {
            publish(18);
            let replicas = spec_replicas(&services, "chat").await?;
            if replicas > 1 && first_scale_up.get().is_none() {
                first_scale_up.set(Some(started.elapsed()));
            }
            if replicas == 4 { Ok(Some(())) } else { anyhow::bail!("spec.replicas = {replicas}") }
        })
        .await?;
        let scale_up = started.elapsed();
        let first_scale_up = first_scale_up.get().unwrap_or(scale_up);

        let shown = kubectl(vec!["get".into(), "hpa".into(), "chat".into(), "-n".into(), ns.clone()]).await?;
        let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
        assert!(shown.contains("/5 (avg)"), "kubectl get hpa shows no metric:\n{shown}");

        // The workers cannot be read: the metric is refused with the reason, never served as
        // zero, and the HPA holds at 4 and says why.
        let why = "the load of 4 of 4 serving workers could not be read; first: connection refused";
        store.withhold(&ns, "chat", &labels, why.to_owned());
        let condition = wait::until("the HPA to report it cannot get the metric", Duration::from_secs(30), || async {
            let status = hpas.get("chat").await?.status.context("no HPA status")?;
            let conditions = status.conditions.unwrap_or_default();
            let found = conditions.iter().find(|c| c.type_ == "ScalingActive" && c.status == "False").cloned();
            match found {
                Some(c) => Ok(Some(c)),
                None => anyhow::bail!("HPA conditions {conditions:?}"),
            }
        })
        .await?;
        assert_eq!(condition.reason.as_deref(), Some("FailedGetExternalMetric"));
        let message = condition.message.unwrap_or_default();
        assert!(message.contains(why), "{message}");
        // Past the controller's downscale stabilization (10 s) and then some syncs (2 s each):
        // a zero would have taken it to 1 by then.
        let held_since = Instant::now();
        let hold = Duration::from_secs(14);
        wait::until("the HPA to hold at 4 without the metric", hold * 2, || async {
            let replicas = spec_replicas(&services, "chat").await?;
            if replicas != 4 {
                return Err(wait::fatal(anyhow::anyhow!(
                    "spec.replicas {replicas} {:?} after the metric was refused",
                    held_since.elapsed()
                )));
            }
            Ok((held_since.elapsed() >= hold).then_some(()))
        })
        .await?;

        let started = Instant::now();
        wait::until("the HPA to scale chat back to 1", Duration::from_secs(90), || async {
            publish(0);
            let replicas = spec_replicas(&services, "chat").await?;
            if replicas == 1 { Ok(Some(())) } else { anyhow::bail!("spec.replicas = {replicas}") }
        })
        .await?;
        eprintln!(
            "HPA: first scale-up {:.1} s after the queue built, scale-up to 4 in {:.1} s, back to 1 in {:.1} s\n{shown}",
            first_scale_up.as_secs_f64(),
            scale_up.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        Ok(())
    })
    .await
}
