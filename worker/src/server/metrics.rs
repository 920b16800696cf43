//! Prometheus metrics under the names vLLM made the de-facto standard (`vllm:*`, label
//! `model_name`), npufleet's own engine metrics, and accelerator telemetry.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use npufleet_contract::proto::load_report_latency_bounds;
use npufleet_contract::proto::npufleet::v1::LatencyHistogram;
use prometheus::core::Metric;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
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
    kv_cache_usage: Gauge,
    gpu_cache_usage: Gauge,
    cache_config_info: GaugeVec,
    latency: RequestHistograms,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    request_success: IntCounterVec,
    preemptions: IntCounter,
    steps_interrupted: IntCounter,
    batch_size: IntGauge,
    prefix_cache_hits: IntCounter,
    prefix_cache_queries: IntCounter,
    warmup_complete: IntGauge,
    requests_rejected: IntCounterVec,
    thermal_zone_temperature: GaugeVec,
    npu: NpuChipGauges,
    npu_chips: Mutex<Vec<NpuChip>>,
}

/// The per-request histograms, observed as a request's tokens go out and when it finishes.
struct RequestHistograms {
    time_to_first_token: Histogram,
    /// The same in the load report's finer buckets; not a series of its own.
    time_to_first_token_reported: Histogram,
    inter_token_latency: Histogram,
    time_per_output_token: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    e2e_latency: Histogram,
    queue_time: Histogram,
}

/// npu-exporter's per-chip series, refreshed from the latest `npu-smi` reading.
struct NpuChipGauges {
    temperature: GaugeVec,
    utilization: GaugeVec,
    hbm_used: GaugeVec,
    hbm_total: GaugeVec,
    power: GaugeVec,
    health: GaugeVec,
}

/// Creates each series and registers it at once, so no series can be left unregistered.
struct Registrar<'a> {
    registry: Registry,
    model_name: &'a str,
}

impl Registrar<'_> {
    fn register<C: prometheus::core::Collector + Clone + 'static>(&self, collector: C) -> C {
        self.registry
            .register(Box::new(collector.clone()))
            .expect("metric names are unique");
        collector
    }

    fn opts(&self, name: &str, help: &str) -> Opts {
        Opts::new(name, help).const_label("model_name", self.model_name)
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::with_opts(self.opts(name, help)).expect("valid counter"))
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::with_opts(self.opts(name, help)).expect("valid gauge"))
    }

    fn fraction(&self, name: &str, help: &str) -> Gauge {
        self.register(Gauge::with_opts(self.opts(name, help)).expect("valid gauge"))
    }

    fn labelled_gauge(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.register(GaugeVec::new(self.opts(name, help), labels).expect("valid gauge"))
    }

    fn labelled_counter(&self, name: &str, help: &str, label: &str) -> IntCounterVec {
        self.register(IntCounterVec::new(self.opts(name, help), &[label]).expect("valid counter"))
    }

    /// A series without the model label: the labels name the zone or chip instead.
    fn gauge_without_model_label(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.register(GaugeVec::new(Opts::new(name, help), labels).expect("valid gauge"))
    }

    fn chip_gauge(&self, name: &str, help: &str) -> GaugeVec {
        self.gauge_without_model_label(name, help, &["id", "model_name"])
    }

    fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        let opts = HistogramOpts::new(name, help)
            .const_label("model_name", self.model_name)
            .buckets(buckets.to_vec());
        self.register(Histogram::with_opts(opts).expect("valid histogram options"))
    }
}

impl RequestHistograms {
    fn register(r: &Registrar) -> Self {
        RequestHistograms {
            time_to_first_token: r.histogram(
                "vllm:time_to_first_token_seconds",
                "Time from receiving a request to handing its first generated token to the connection.",
                TTFT_BUCKETS,
            ),
            time_to_first_token_reported: Histogram::with_opts(
                HistogramOpts::new("time_to_first_token_reported", "unregistered")
                    .buckets(load_report_latency_bounds()),
            )
            .expect("valid histogram options"),
            inter_token_latency: r.histogram(
                "vllm:inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request.",
                INTER_TOKEN_BUCKETS,
            ),
            time_per_output_token: r.histogram(
                "vllm:time_per_output_token_seconds",
                "Time between consecutive generated tokens of a request (the older name of \
                 vllm:inter_token_latency_seconds).",
                INTER_TOKEN_BUCKETS,
            ),
            request_prompt_tokens: r.histogram(
                "vllm:request_prompt_tokens",
                "Prompt tokens of each finished request.",
                TOKEN_COUNT_BUCKETS,
            ),
            request_generation_tokens: r.histogram(
                "vllm:request_generation_tokens",
                "Generated tokens of each finished request.",
                TOKEN_COUNT_BUCKETS,
            ),
            e2e_latency: r.histogram(
                "vllm:e2e_request_latency_seconds",
                "Time from submission to the end of a request.",
                REQUEST_BUCKETS,
            ),
            queue_time: r.histogram(
                "vllm:request_queue_time_seconds",
                "Time a request waited before entering the running batch.",
                REQUEST_BUCKETS,
            ),
        }
    }
}

impl NpuChipGauges {
    fn register(r: &Registrar) -> Self {
        NpuChipGauges {
            temperature: r.chip_gauge(
                "npu_chip_info_temperature",
                "NPU chip temperature in degrees Celsius.",
            ),
            utilization: r.chip_gauge(
                "npu_chip_info_utilization",
                "NPU AI core utilisation in percent.",
            ),
            hbm_used: r.chip_gauge(
                "npu_chip_info_hbm_used_memory",
                "NPU device memory in use, MB.",
            ),
            hbm_total: r.chip_gauge("npu_chip_info_hbm_total_memory", "NPU device memory, MB."),
            power: r.chip_gauge("npu_chip_info_power", "NPU chip power draw in watts."),
            health: r.chip_gauge(
                "npu_chip_info_health_status",
                "1 when the NPU chip reports healthy, else 0.",
            ),
        }
    }

    fn all(&self) -> [&GaugeVec; 6] {
        [
            &self.temperature,
            &self.utilization,
            &self.hbm_used,
            &self.hbm_total,
            &self.power,
            &self.health,
        ]
    }
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let r = Registrar {
            registry: Registry::new(),
            model_name,
        };
        Metrics {
            running: r.gauge(
                "vllm:num_requests_running",
                "Requests in the running batch.",
            ),
            waiting: r.gauge(
                "vllm:num_requests_waiting",
                "Requests accepted and waiting to run.",
            ),
            kv_cache_usage: r.fraction(
                "vllm:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 means 100 percent).",
            ),
            gpu_cache_usage: r.fraction(
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV-cache blocks in use (the older name of vllm:kv_cache_usage_perc).",
            ),
            cache_config_info: r.labelled_gauge(
                "vllm:cache_config_info",
                "The KV cache's configuration in labels (value 1).",
                &["block_size", "num_gpu_blocks"],
            ),
            latency: RequestHistograms::register(&r),
            prompt_tokens: r.counter("vllm:prompt_tokens_total", "Prompt tokens processed."),
            generation_tokens: r.counter("vllm:generation_tokens_total", "Tokens generated."),
            request_success: r.labelled_counter(
                "vllm:request_success_total",
                "Requests that finished successfully, by finish reason.",
                "finished_reason",
            ),
            preemptions: r.counter(
                "vllm:num_preemptions_total",
                "Requests preempted to free KV-cache blocks.",
            ),
            steps_interrupted: r.counter(
                "npufleet_steps_interrupted_total",
                "Engine steps stopped before their end for a higher-priority request.",
            ),
            batch_size: r.gauge("npufleet_batch_size", "Sequences in the last engine step."),
            prefix_cache_hits: r.counter(
                "vllm:prefix_cache_hits_total",
                "Prompt tokens served from the prefix cache.",
            ),
            prefix_cache_queries: r.counter(
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
            ),
            warmup_complete: r.gauge(
                "npufleet_warmup_complete",
                "1 once warm-up has finished, else 0.",
            ),
            requests_rejected: r.labelled_counter(
                "npufleet_requests_rejected_total",
                "Requests refused or failed, by reason.",
                "reason",
            ),
            thermal_zone_temperature: r.gauge_without_model_label(
                "npufleet_thermal_zone_temperature_celsius",
                "Temperature of a Linux thermal zone.",
                &["zone", "type"],
            ),
            npu: NpuChipGauges::register(&r),
            npu_chips: Mutex::new(Vec::new()),
            registry: r.registry,
        }
    }

    /// Records the engine's timings and token counts of one successful request.
    pub fn observe_finished(&self, reason: FinishReason, timings: &RequestTimings, usage: &Usage) {
        self.request_success
            .with_label_values(&[reason.as_openai()])
            .inc();
        self.latency
            .queue_time
            .observe(timings.queued.as_secs_f64());
        self.latency
            .e2e_latency
            .observe(timings.total.as_secs_f64());
        self.latency
            .request_prompt_tokens
            .observe(f64::from(usage.prompt_tokens));
        self.latency
            .request_generation_tokens
            .observe(f64::from(usage.completion_tokens));
    }

    /// Records a request's first token as it is handed on, so a long or cancelled request's
    /// time to first token counts as soon as the client sees it.
    pub fn observe_first_token(&self, since_received: Duration) {
        let seconds = since_received.as_secs_f64();
        self.latency.time_to_first_token.observe(seconds);
        self.latency.time_to_first_token_reported.observe(seconds);
    }

    /// The times to first token so far, as the load report carries them.
    pub fn time_to_first_token(&self) -> LatencyHistogram {
        let metric = self.latency.time_to_first_token_reported.metric();
        let histogram = metric.get_histogram();
        let buckets = histogram.get_bucket();
        LatencyHistogram {
            upper_bounds: buckets.iter().map(|b| b.upper_bound()).collect(),
            cumulative_counts: buckets.iter().map(|b| b.cumulative_count()).collect(),
            count: histogram.get_sample_count(),
        }
    }

    pub fn observe_inter_token(&self, gap: Duration) {
        self.latency.inter_token_latency.observe(gap.as_secs_f64());
        self.latency
            .time_per_output_token
            .observe(gap.as_secs_f64());
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
            (&self.steps_interrupted, load.steps_interrupted_total),
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
        for gauge in self.npu.all() {
            gauge.reset();
        }
        for chip in chips.iter() {
            // npu-exporter numbers chips by NPU id and labels them with the chip model.
            let id = chip.npu_id.to_string();
            let labels = [id.as_str(), chip.name.as_str()];
            let readings = [
                (&self.npu.temperature, Some(chip.temperature_celsius)),
                (&self.npu.utilization, Some(chip.aicore_percent)),
                (&self.npu.hbm_used, Some(chip.memory_used_mb)),
                (&self.npu.hbm_total, Some(chip.memory_total_mb)),
                (&self.npu.power, chip.power_watts),
                (&self.npu.health, Some(f64::from(u8::from(chip.healthy)))),
            ];
            for (gauge, value) in readings {
                if let Some(value) = value {
                    gauge.with_label_values(&labels).set(value);
                }
            }
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
    fn the_load_report_carries_the_time_to_first_token_histogram() {
        let metrics = Metrics::new("m");
        metrics.observe_first_token(Duration::from_millis(30));
        metrics.observe_first_token(Duration::from_secs(3000));
        let h = metrics.time_to_first_token();
        assert_eq!(h.upper_bounds, load_report_latency_bounds());
        // 30 ms lies between the bounds 25.1 ms and 31.6 ms; 3,000 s above the last.
        let at = |i: usize| h.cumulative_counts[i];
        assert_eq!((at(14), at(15), at(60), h.count), (0, 1, 1, 2));
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
