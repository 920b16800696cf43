//! The engines an InferenceService can run, and which of each engine's Prometheus series say
//! how loaded a replica is. The operator's autoscaler, its external-metrics API, the router's
//! least-load policy and the shipped prometheus-adapter rules all read load through this one
//! table, so an engine this project did not write scales and routes like its own worker.

use serde::{Deserialize, Serialize};

/// Which engine serves the model.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// This project's worker: the Open Inference Protocol over gRPC, the OpenAI HTTP API, and
    /// its load pushed over the `WorkerLoad` stream.
    #[default]
    Npufleet,
    /// vLLM with the vllm-ascend plugin (`vllm serve`), the OpenAI HTTP API and `vllm:*` series.
    VllmAscend,
    /// Huawei's MindIE Service (`mindie_llm_server`), its OpenAI-compatible HTTP API and
    /// unprefixed metric names.
    Mindie,
    /// Any OpenAI-compatible HTTP server, with its image, command, port and metric names given
    /// in the InferenceService.
    Generic,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Npufleet => "npufleet",
            Engine::VllmAscend => "vllm-ascend",
            Engine::Mindie => "mindie",
            Engine::Generic => "generic",
        }
    }

    /// Whether the engine publishes its prefix cache's changes (`WorkerLoad.WatchKvEvents`)
    /// and its prompt tokenisation, which cache-aware routing needs. vLLM publishes KV events
    /// over ZeroMQ in its own format, and vllm-ascend not yet; MindIE none.
    pub fn publishes_cache_events(self) -> bool {
        self == Engine::Npufleet
    }

    /// The HTTP port the engine serves the OpenAI API on by default (`None`: it must be given).
    pub fn default_http_port(self) -> Option<u16> {
        match self {
            Engine::Npufleet => Some(crate::ports::HTTP_PORT),
            // `vllm serve --port`'s default.
            Engine::VllmAscend => Some(8000),
            // MindIE Server's `config.json` `ServerConfig.port` default.
            Engine::Mindie => Some(MINDIE_HTTP_PORT),
            Engine::Generic => None,
        }
    }

    /// Where the engine answers 200 once it can serve: `/health` is what vLLM, llama.cpp's
    /// server and most OpenAI-compatible servers answer on.
    pub fn default_readiness_path(self) -> &'static str {
        match self {
            Engine::Npufleet => "/v2/health/ready",
            // MindIE's management port serves the KServe v2 health paths.
            Engine::Mindie => "/v2/health/ready",
            Engine::VllmAscend | Engine::Generic => "/health",
        }
    }

    /// The series that carry each load signal, as the engine names them (`None`: the
    /// InferenceService must name them, or the engine has no load signal and is scaled and
    /// routed on the router's own counts).
    pub fn default_load_metrics(self) -> Option<LoadMetrics> {
        match self {
            // The worker exports vLLM's names; the operator and the router read the same
            // numbers from its `WorkerLoad` stream, which needs no scrape.
            Engine::Npufleet | Engine::VllmAscend => Some(LoadMetrics {
                port: None,
                path: METRICS_PATH.to_string(),
                waiting: Some(VLLM_WAITING.to_string()),
                running: Some(VLLM_RUNNING.to_string()),
                kv_cache_usage: Some(VLLM_KV_CACHE_USAGE.to_string()),
            }),
            Engine::Mindie => Some(LoadMetrics {
                port: Some(MINDIE_METRICS_PORT),
                path: METRICS_PATH.to_string(),
                waiting: Some("num_requests_waiting".to_string()),
                running: Some("num_requests_running".to_string()),
                // MindIE publishes no KV-cache fraction under a documented name.
                kv_cache_usage: None,
            }),
            Engine::Generic => None,
        }
    }
}

pub const METRICS_PATH: &str = "/metrics";
pub const VLLM_WAITING: &str = "vllm:num_requests_waiting";
pub const VLLM_RUNNING: &str = "vllm:num_requests_running";
pub const VLLM_KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
/// llama.cpp's `llama-server --metrics` series: requests waiting for a slot, and being served.
/// Not an engine of its own (it runs as `generic`), but the shipped prometheus-adapter rules
/// know these names, and so must a `generic` InferenceService that runs it.
pub const LLAMA_CPP_WAITING: &str = "llamacpp:requests_deferred";
pub const LLAMA_CPP_RUNNING: &str = "llamacpp:requests_processing";
/// MindIE Server's service (inference) port, `ServerConfig.port`.
pub const MINDIE_HTTP_PORT: u16 = 1025;
/// MindIE Server's management port (`ServerConfig.managementPort`): health probes.
pub const MINDIE_MANAGEMENT_PORT: u16 = 1026;
/// MindIE Server's metrics port (`ServerConfig.metricsPort`), `/metrics` when
/// `MIES_SERVICE_MONITOR_MODE=1`.
pub const MINDIE_METRICS_PORT: u16 = 1027;

/// Where a replica's load is published and under which series names.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct LoadMetrics {
    /// The port `/metrics` is served on, when it is not the HTTP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The Prometheus text endpoint.
    #[serde(default = "default_metrics_path")]
    pub path: String,
    /// Requests queued, not yet started (a gauge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// Requests being generated (a gauge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<String>,
    /// Fraction of the KV cache in use, 0-1 (a gauge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_usage: Option<String>,
}

fn default_metrics_path() -> String {
    METRICS_PATH.to_string()
}

/// How the operator and the router learn a replica's load.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LoadSource {
    /// The worker pushes it over its `WorkerLoad` gRPC stream.
    WorkerStream,
    /// Scraped from the engine's Prometheus endpoint.
    Scrape(LoadMetrics),
    /// The engine says nothing: the router's own counts of held and in-flight requests stand
    /// in for it.
    RouterCounts,
}

impl LoadSource {
    /// The source for `engine`, with `metrics` (from the InferenceService) in place of the
    /// engine's own names when given.
    pub fn of(engine: Engine, metrics: Option<&LoadMetrics>) -> LoadSource {
        if engine == Engine::Npufleet {
            return LoadSource::WorkerStream;
        }
        match metrics.cloned().or_else(|| engine.default_load_metrics()) {
            Some(metrics) if metrics.has_signal() => LoadSource::Scrape(metrics),
            _ => LoadSource::RouterCounts,
        }
    }
}

/// One replica's load as its engine reported it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScrapedLoad {
    pub waiting: u32,
    pub running: u32,
    pub kv_cache_usage: f64,
}

impl LoadMetrics {
    /// Whether the engine says anything about its load: without it the fleet is routed and
    /// scaled on the router's own counts of held and in-flight requests.
    pub fn has_signal(&self) -> bool {
        self.waiting.is_some() || self.running.is_some()
    }

    /// Reads the configured series out of a Prometheus text exposition. Series with several
    /// label sets (one per model or engine) are summed; a configured series that is absent is
    /// an error, never a zero, so a scrape of the wrong port or an engine started without its
    /// metrics never reads as an idle replica.
    pub fn read(&self, exposition: &str) -> Result<ScrapedLoad, String> {
        let value = |name: &Option<String>| -> Result<Option<f64>, String> {
            let Some(name) = name else { return Ok(None) };
            sum_series(exposition, name)
                .map(Some)
                .ok_or_else(|| format!("the engine's metrics have no {name} series"))
        };
        let count = |v: Option<f64>| v.map_or(0, |v| v.max(0.0).round() as u32);
        Ok(ScrapedLoad {
            waiting: count(value(&self.waiting)?),
            running: count(value(&self.running)?),
            kv_cache_usage: value(&self.kv_cache_usage)?.unwrap_or(0.0),
        })
    }
}

/// The sum of every sample of `name` in a Prometheus text exposition (`None` when there is
/// none). Comments, other series and unparsable values are skipped.
pub fn sum_series(exposition: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name{labels} value [timestamp]` or `name value [timestamp]`, not `name_suffix ...`.
        let rest = if let Some(labelled) = rest.strip_prefix('{') {
            match labelled.rfind('}') {
                Some(end) => &labelled[end + 1..],
                None => continue,
            }
        } else if rest.starts_with([' ', '\t']) {
            rest
        } else {
            continue;
        };
        if let Some(Ok(value)) = rest.split_whitespace().next().map(str::parse::<f64>)
            && value.is_finite()
        {
            *total.get_or_insert(0.0) += value;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scrape of llama.cpp's `llama-server --metrics` (as its 0.3.16-era server writes it).
    const LLAMA_SERVER: &str = "\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1024
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
";

    fn llama_server() -> LoadMetrics {
        LoadMetrics {
            port: None,
            path: METRICS_PATH.into(),
            waiting: Some(LLAMA_CPP_WAITING.into()),
            running: Some(LLAMA_CPP_RUNNING.into()),
            kv_cache_usage: None,
        }
    }

    #[test]
    fn a_named_series_is_read_and_others_ignored() {
        let load = llama_server().read(LLAMA_SERVER).unwrap();
        assert_eq!(
            load,
            ScrapedLoad {
                waiting: 5,
                running: 2,
                kv_cache_usage: 0.0
            }
        );
    }

    #[test]
    fn labelled_samples_are_summed_and_prefixes_do_not_match() {
        let text = "vllm:num_requests_waiting{model_name=\"a\"} 3\n\
                    vllm:num_requests_waiting{model_name=\"b\",engine=\"0\"} 4.0 1700000000\n\
                    vllm:num_requests_waiting_total 99\n\
                    vllm:num_requests_running{model_name=\"a\"} 1\n\
                    vllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n";
        let load = Engine::VllmAscend
            .default_load_metrics()
            .unwrap()
            .read(text)
            .unwrap();
        assert_eq!((load.waiting, load.running), (7, 1));
        assert!((load.kv_cache_usage - 0.25).abs() < 1e-6);
    }

    #[test]
    fn a_missing_series_is_an_error_not_an_idle_replica() {
        let error = llama_server()
            .read("llamacpp:requests_processing 0\n")
            .unwrap_err();
        assert!(error.contains("llamacpp:requests_deferred"), "{error}");
        assert!(llama_server().read("").is_err());
    }

    /// The prometheus-adapter rules CCE's HPA reads name every engine's queue series.
    #[test]
    fn the_shipped_adapter_rules_name_every_engines_series() {
        let rules = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/cce/adapter-rules.yaml"),
        )
        .unwrap();
        let mut names = vec![LLAMA_CPP_WAITING.to_string(), LLAMA_CPP_RUNNING.to_string()];
        for engine in [Engine::Npufleet, Engine::VllmAscend, Engine::Mindie] {
            let metrics = engine.default_load_metrics().unwrap();
            names.extend(metrics.waiting.into_iter().chain(metrics.running));
        }
        for name in names {
            let alternatives = rules
                .lines()
                .filter(|l| l.contains("__name__=~"))
                .flat_map(|l| l.split(['"', '|']))
                .any(|alternative| alternative == name);
            assert!(
                alternatives,
                "deploy/cce/adapter-rules.yaml does not name {name}"
            );
        }
    }

    #[test]
    fn an_engine_without_series_names_has_no_signal() {
        assert!(!LoadMetrics::default().has_signal());
        assert!(Engine::Mindie.default_load_metrics().unwrap().has_signal());
        assert_eq!(Engine::Generic.default_load_metrics(), None);
    }
}
