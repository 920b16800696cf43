//! Prometheus metrics under the names vLLM made the de-facto standard (`vllm:*`, label
//! `model_name`), npufleet's own engine metrics, and accelerator telemetry.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::api::{EngineState, FinishReason, LoadSnapshot, RequestTimings, Usage};
use crate::server::telemetry::{self, NpuChip};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const INTER_TOKEN_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's token-count buckets (1, 2, 5 per decade) up to a 128k context.
const TOKEN_COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

pub struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_cache_usage: prometheus::Gauge,
    gpu_cache_usage: prometheus::Gauge,
    cache_config_info: GaugeVec,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    time_per_output_token: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    e2e_latency: Histogram,
    queue_time: Histogram,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    request_success: IntCounterVec,
    preemptions: IntCounter,
    batch_size: IntGauge,
    prefix_cache_hits: IntCounter,
    prefix_cache_queries: IntCounter,
    warmup_complete: IntGauge,
    requests_rejected: IntCounterVec,
    thermal_zone_temperature: GaugeVec,
    npu_temperature: GaugeVec,
    npu_utilization: GaugeVec,
    npu_hbm_used: GaugeVec,
    npu_hbm_total: GaugeVec,
    npu_power: GaugeVec,
    npu_health: GaugeVec,
    npu_chips: Mutex<Vec<NpuChip>>,
}

fn model_opts(name: &str, help: &str, model_name: &str) -> Opts {
    Opts::new(name, help).const_label("model_name", model_name)
}

fn histogram(name: &str, help: &str, model_name: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(
        HistogramOpts::new(name, help)
            .const_label("model_name", model_name)
            .buckets(buckets.to_vec()),
    )
    .expect("valid histogram options")
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let counter = |name: &str, help: &str| {
            IntCounter::with_opts(model_opts(name, help, model_name)).expect("valid counter")
        };
        let gauge = |name: &str, help: &str| {
            IntGauge::with_opts(model_opts(name, help, model_name)).expect("valid gauge")
        };
        let chip_gauge = |name: &str, help: &str| {
            GaugeVec::new(Opts::new(name, help), &["id", "model_name"]).expect("valid gauge")
        };
        let metrics = Metrics {
            registry: Registry::new(),
            running: gauge(
                "vllm:num_requests_running",
                "Requests in the running batch.",
            ),
            waiting: gauge(
                "vllm:num_requests_waiting",
                "Requests accepted and waiting to run.",
            ),
            kv_cache_usage: prometheus::Gauge::with_opts(model_opts(
                "vllm:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 means 100 percent).",
                model_name,
            ))
            .expect("valid gauge"),
            gpu_cache_usage: prometheus::Gauge::with_opts(model_opts(
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV-cache blocks in use (the older name of vllm:kv_cache_usage_perc).",
                model_name,
            ))
            .expect("valid gauge"),
            cache_config_info: GaugeVec::new(
                model_opts(
                    "vllm:cache_config_info",
                    "The KV cache's configuration in labels (value 1).",
                    model_name,
                ),
                &["block_size", "num_gpu_blocks"],
            )
            .expect("valid gauge"),
            time_to_first_token: histogram(
                "vllm:time_to_first_token_seconds",
                "Time from receiving a request to handing its first generated token to the connection.",
                model_name,
                TTFT_BUCKETS,
            ),
            inter_token_latency: histogram(
                "vllm:inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request.",
                model_name,
                INTER_TOKEN_BUCKETS,
            ),
            time_per_output_token: histogram(
                "vllm:time_per_output_token_seconds",
                "Time between consecutive generated tokens of a request (the older name of \
                 vllm:inter_token_latency_seconds).",
                model_name,
                INTER_TOKEN_BUCKETS,
            ),
            request_prompt_tokens: histogram(
                "vllm:request_prompt_tokens",
                "Prompt tokens of each finished request.",
                model_name,
                TOKEN_COUNT_BUCKETS,
            ),
            request_generation_tokens: histogram(
                "vllm:request_generation_tokens",
                "Generated tokens of each finished request.",
                model_name,
                TOKEN_COUNT_BUCKETS,
            ),
            e2e_latency: histogram(
                "vllm:e2e_request_latency_seconds",
                "Time from submission to the end of a request.",
                model_name,
                REQUEST_BUCKETS,
            ),
            queue_time: histogram(
                "vllm:request_queue_time_seconds",
                "Time a request waited before entering the running batch.",
                model_name,
                REQUEST_BUCKETS,
            ),
            prompt_tokens: counter("vllm:prompt_tokens_total", "Prompt tokens processed."),
            generation_tokens: counter("vllm:generation_tokens_total", "Tokens generated."),
            request_success: IntCounterVec::new(
                model_opts(
                    "vllm:request_success_total",
                    "Requests that finished successfully, by finish reason.",
                    model_name,
                ),
                &["finished_reason"],
            )
            .expect("valid counter"),
            preemptions: counter(
                "vllm:num_preemptions_total",
                "Requests preempted to free KV-cache blocks.",
            ),
            batch_size: gauge("npufleet_batch_size", "Sequences in the last engine step."),
            prefix_cache_hits: counter(
                "vllm:prefix_cache_hits_total",
                "Prompt tokens served from the prefix cache.",
            ),
            prefix_cache_queries: counter(
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
            ),
            warmup_complete: gauge(
                "npufleet_warmup_complete",
                "1 once warm-up has finished, else 0.",
            ),
            requests_rejected: IntCounterVec::new(
                model_opts(
                    "npufleet_requests_rejected_total",
                    "Requests refused or failed, by reason.",
                    model_name,
                ),
                &["reason"],
            )
            .expect("valid counter"),
            thermal_zone_temperature: GaugeVec::new(
                Opts::new(
                    "npufleet_thermal_zone_temperature_celsius",
                    "Temperature of a Linux thermal zone.",
                ),
                &["zone", "type"],
            )
            .expect("valid gauge"),
            npu_temperature: chip_gauge(
                "npu_chip_info_temperature",
                "NPU chip temperature in degrees Celsius.",
            ),
            npu_utilization: chip_gauge(
                "npu_chip_info_utilization",
                "NPU AI core utilisation in percent.",
            ),
            npu_hbm_used: chip_gauge(
                "npu_chip_info_hbm_used_memory",
                "NPU device memory in use, MB.",
            ),
            npu_hbm_total: chip_gauge("npu_chip_info_hbm_total_memory", "NPU device memory, MB."),
            npu_power: chip_gauge("npu_chip_info_power", "NPU chip power draw in watts."),
            npu_health: chip_gauge(
                "npu_chip_info_health_status",
                "1 when the NPU chip reports healthy, else 0.",
            ),
            npu_chips: Mutex::new(Vec::new()),
        };
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(metrics.running.clone()),
            Box::new(metrics.waiting.clone()),
            Box::new(metrics.kv_cache_usage.clone()),
            Box::new(metrics.gpu_cache_usage.clone()),
            Box::new(metrics.cache_config_info.clone()),
            Box::new(metrics.time_to_first_token.clone()),
            Box::new(metrics.inter_token_latency.clone()),
            Box::new(metrics.time_per_output_token.clone()),
            Box::new(metrics.request_prompt_tokens.clone()),
            Box::new(metrics.request_generation_tokens.clone()),
            Box::new(metrics.e2e_latency.clone()),
            Box::new(metrics.queue_time.clone()),
            Box::new(metrics.prompt_tokens.clone()),
            Box::new(metrics.generation_tokens.clone()),
            Box::new(metrics.request_success.clone()),
            Box::new(metrics.preemptions.clone()),
            Box::new(metrics.batch_size.clone()),
            Box::new(metrics.prefix_cache_hits.clone()),
            Box::new(metrics.prefix_cache_queries.clone()),
            Box::new(metrics.warmup_complete.clone()),
            Box::new(metrics.requests_rejected.clone()),
            Box::new(metrics.thermal_zone_temperature.clone()),
            Box::new(metrics.npu_temperature.clone()),
            Box::new(metrics.npu_utilization.clone()),
            Box::new(metrics.npu_hbm_used.clone()),
            Box::new(metrics.npu_hbm_total.clone()),
            Box::new(metrics.npu_power.clone()),
            Box::new(metrics.npu_health.clone()),
        ];
        for collector in collectors {
            metrics
                .registry
                .register(collector)
                .expect("metric names are unique");
        }
        metrics
    }

    /// Records the engine's timings and token counts of one successful request.
    pub fn observe_finished(&self, reason: FinishReason, timings: &RequestTimings, usage: &Usage) {
        self.request_success
            .with_label_values(&[reason.as_openai()])
            .inc();
        self.queue_time.observe(timings.queued.as_secs_f64());
        self.e2e_latency.observe(timings.total.as_secs_f64());
        self.request_prompt_tokens
            .observe(f64::from(usage.prompt_tokens));
        self.request_generation_tokens
            .observe(f64::from(usage.completion_tokens));
    }

    /// Records a request's first token as it is handed on, so a long or cancelled request's
    /// time to first token counts as soon as the client sees it.
    pub fn observe_first_token(&self, since_received: Duration) {
        self.time_to_first_token
            .observe(since_received.as_secs_f64());
    }

    pub fn observe_inter_token(&self, gap: Duration) {
        self.inter_token_latency.observe(gap.as_secs_f64());
        self.time_per_output_token.observe(gap.as_secs_f64());
    }

    pub fn count_rejected(&self, reason: &str) {
        self.requests_rejected.with_label_values(&[reason]).inc();
    }

    /// Remembers the latest `npu-smi` reading for the next scrape.
    pub fn set_npu_chips(&self, chips: Vec<NpuChip>) {
        *self.npu_chips.lock().unwrap_or_else(|e| e.into_inner()) = chips;
    }

    /// Brings the engine-derived series up to date and renders the text exposition format.
    pub fn render(&self, load: &LoadSnapshot, state: EngineState, thermal_root: &Path) -> String {
        self.running.set(load.running as i64);
        self.waiting.set(load.waiting as i64);
        self.kv_cache_usage.set(load.kv_cache_usage);
        self.gpu_cache_usage.set(load.kv_cache_usage);
        self.cache_config_info.reset();
        self.cache_config_info
            .with_label_values(&[
                load.block_size.to_string().as_str(),
                load.kv_blocks_total.to_string().as_str(),
            ])
            .set(1.0);
        self.batch_size.set(load.last_batch_size as i64);
        self.warmup_complete
            .set(i64::from(!matches!(state, EngineState::WarmingUp { .. })));
        // The engine keeps the running totals; counters only ever move forward to them.
        for (counter, total) in [
            (&self.prompt_tokens, load.prompt_tokens_total),
            (&self.generation_tokens, load.generation_tokens_total),
            (&self.preemptions, load.preemptions_total),
            (&self.prefix_cache_hits, load.prefix_cache_hits_total),
            (&self.prefix_cache_queries, load.prefix_cache_queries_total),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }

        self.thermal_zone_temperature.reset();
        for zone in telemetry::read_thermal_zones(thermal_root) {
            self.thermal_zone_temperature
                .with_label_values(&[zone.zone.as_str(), zone.kind.as_str()])
                .set(zone.celsius);
        }
        self.render_npu_chips();

        let mut text = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut text)
            .expect("text encoding into memory cannot fail");
        String::from_utf8(text).expect("the text format is UTF-8")
    }

    fn render_npu_chips(&self) {
        let chips = self.npu_chips.lock().unwrap_or_else(|e| e.into_inner());
        for gauge in [
            &self.npu_temperature,
            &self.npu_utilization,
            &self.npu_hbm_used,
            &self.npu_hbm_total,
            &self.npu_power,
            &self.npu_health,
        ] {
            gauge.reset();
        }
        for chip in chips.iter() {
            // npu-exporter numbers chips by NPU id and labels them with the chip model.
            let id = chip.npu_id.to_string();
            let labels = [id.as_str(), chip.name.as_str()];
            self.npu_temperature
                .with_label_values(&labels)
                .set(chip.temperature_celsius);
            self.npu_utilization
                .with_label_values(&labels)
                .set(chip.aicore_percent);
            self.npu_hbm_used
                .with_label_values(&labels)
                .set(chip.memory_used_mb);
            self.npu_hbm_total
                .with_label_values(&labels)
                .set(chip.memory_total_mb);
            if let Some(watts) = chip.power_watts {
                self.npu_power.with_label_values(&labels).set(watts);
            }
            self.npu_health
                .with_label_values(&labels)
                .set(f64::from(u8::from(chip.healthy)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_series_with_the_model_label() {
        let metrics = Metrics::new("smollm2");
        metrics.observe_finished(
            FinishReason::Length,
            &RequestTimings {
                queued: Duration::from_millis(5),
                first_token: Duration::from_millis(30),
                total: Duration::from_millis(300),
            },
            &Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                cached_prompt_tokens: 0,
            },
        );
        metrics.observe_first_token(Duration::from_millis(30));
        metrics.observe_inter_token(Duration::from_millis(20));
        let load = LoadSnapshot {
            waiting: 3,
            running: 2,
            kv_cache_usage: 0.25,
            kv_blocks_total: 640,
            block_size: 16,
            prefix_cache_queries_total: 12,
            prefix_cache_hits_total: 4,
            generation_tokens_total: 40,
            prompt_tokens_total: 12,
            ..Default::default()
        };
        let text = metrics.render(&load, EngineState::Ready, Path::new("/nonexistent"));
        for line in [
            "vllm:num_requests_running{model_name=\"smollm2\"} 2",
            "vllm:num_requests_waiting{model_name=\"smollm2\"} 3",
            "vllm:kv_cache_usage_perc{model_name=\"smollm2\"} 0.25",
            "vllm:gpu_cache_usage_perc{model_name=\"smollm2\"} 0.25",
            "vllm:cache_config_info{block_size=\"16\",model_name=\"smollm2\",num_gpu_blocks=\"640\"} 1",
            "vllm:prefix_cache_queries_total{model_name=\"smollm2\"} 12",
            "vllm:prefix_cache_hits_total{model_name=\"smollm2\"} 4",
            "vllm:time_per_output_token_seconds_count{model_name=\"smollm2\"} 1",
            "vllm:request_prompt_tokens_sum{model_name=\"smollm2\"} 7",
            "vllm:request_generation_tokens_sum{model_name=\"smollm2\"} 3",
            "vllm:generation_tokens_total{model_name=\"smollm2\"} 40",
            "vllm:prompt_tokens_total{model_name=\"smollm2\"} 12",
            "vllm:request_success_total{finished_reason=\"length\",model_name=\"smollm2\"} 1",
            "vllm:time_to_first_token_seconds_count{model_name=\"smollm2\"} 1",
            "vllm:inter_token_latency_seconds_count{model_name=\"smollm2\"} 1",
            "vllm:e2e_request_latency_seconds_count{model_name=\"smollm2\"} 1",
            "vllm:request_queue_time_seconds_count{model_name=\"smollm2\"} 1",
            "npufleet_warmup_complete{model_name=\"smollm2\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        // A later snapshot moves counters to the new totals, never backwards.
        let later = LoadSnapshot {
            generation_tokens_total: 50,
            ..load
        };
        let text = metrics.render(&later, EngineState::Draining, Path::new("/nonexistent"));
        assert!(text.contains("vllm:generation_tokens_total{model_name=\"smollm2\"} 50"));
    }

    #[test]
    fn exports_npu_chips_under_npu_exporter_names() {
        let metrics = Metrics::new("m");
        metrics.set_npu_chips(vec![NpuChip {
            npu_id: 3,
            chip_id: 0,
            name: "910B3".into(),
            healthy: true,
            power_watts: None,
            temperature_celsius: 41.0,
            aicore_percent: 55.0,
            memory_used_mb: 1000.0,
            memory_total_mb: 65536.0,
        }]);
        let text = metrics.render(
            &LoadSnapshot::default(),
            EngineState::WarmingUp { done: 0, total: 1 },
            Path::new("/nonexistent"),
        );
        assert!(text.contains("npu_chip_info_temperature{id=\"3\",model_name=\"910B3\"} 41"));
        assert!(text.contains("npu_chip_info_utilization{id=\"3\",model_name=\"910B3\"} 55"));
        assert!(text.contains("npu_chip_info_hbm_used_memory{id=\"3\",model_name=\"910B3\"} 1000"));
        assert!(!text.contains("npu_chip_info_power{"));
        assert!(text.contains("npufleet_warmup_complete{model_name=\"m\"} 0"));
    }
}
