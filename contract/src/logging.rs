//! How every npufleet process logs and traces: text for people, or one JSON object per line
//! for a log pipeline (`RUST_LOG` filters, `info` by default); and, when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) names a collector,
//! the spans exported over OTLP (HTTP/protobuf), each request's in its caller's W3C trace.

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::trace::TraceParent;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The environment variables that turn OTLP export on (OpenTelemetry's own names).
const OTLP_ENDPOINT_ENV: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// Keeps the OTLP export running; dropping it sends the spans still buffered.
#[must_use = "dropping it stops the trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("sending the last spans failed: {error}");
        }
    }
}

/// Installs the global subscriber for the process `service`. A second call (tests running a
/// server in-process more than once) keeps the first.
pub fn init(format: LogFormat, service: &'static str) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let provider = otlp_provider(service);
    let otlp = provider
        .as_ref()
        .map(|provider| tracing_opentelemetry::layer().with_tracer(provider.tracer(service)));
    let registry = tracing_subscriber::registry().with(filter).with(otlp);
    let _already_set = match format {
        LogFormat::Json => registry
            .with(tracing_subscriber::fmt::layer().json().flatten_event(true))
            .try_init(),
        LogFormat::Text => registry.with(tracing_subscriber::fmt::layer()).try_init(),
    };
    Telemetry { provider }
}

/// The OTLP exporter, when the environment names a collector. A collector that cannot be
/// reached costs spans, never requests: the batch processor drops what it cannot send.
fn otlp_provider(service: &'static str) -> Option<SdkTracerProvider> {
    let configured = OTLP_ENDPOINT_ENV
        .iter()
        .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()));
    if !configured {
        return None;
    }
    // The blocking HTTP client may not be built on an async runtime's thread.
    let exporter = std::thread::spawn(|| {
        opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
    })
    .join()
    .map_err(|_| "the exporter's set-up panicked".to_string())
    .and_then(|built| built.map_err(|error| error.to_string()));
    match exporter {
        Ok(exporter) => Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(
                    opentelemetry_sdk::Resource::builder()
                        .with_service_name(service)
                        .build(),
                )
                .build(),
        ),
        Err(error) => {
            eprintln!("OTLP trace export is off: {error}");
            None
        }
    }
}

/// Makes `span` a child of the caller's span that `parent` names, so the exported trace
/// joins the caller's (the log lines carry the trace id themselves).
pub fn follow(span: &tracing::Span, parent: &TraceParent) {
    let caller = SpanContext::new(
        TraceId::from_bytes(parent.trace_id.to_be_bytes()),
        SpanId::from_bytes(parent.parent_id.to_be_bytes()),
        TraceFlags::new(parent.flags),
        true,
        TraceState::default(),
    );
    // Fails only for a span that has already started exporting: it keeps its own parent.
    let _kept = span.set_parent(opentelemetry::Context::new().with_remote_span_context(caller));
}

/// The `traceparent` the next hop gets: `trace` with `span` as the parent when `span` is
/// exported, so the next hop's span hangs under it; `trace` as it is otherwise.
pub fn next_hop(span: &tracing::Span, trace: &TraceParent) -> TraceParent {
    let context = span.context();
    let exported = context.span().span_context().clone();
    if exported.is_valid() {
        TraceParent {
            parent_id: u64::from_be_bytes(exported.span_id().to_bytes()),
            ..*trace
        }
    } else {
        *trace
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry_sdk::trace::InMemorySpanExporter;

    use super::*;

    const CALLER: TraceParent = TraceParent {
        trace_id: 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736,
        parent_id: 0x00f0_67aa_0ba9_02b7,
        flags: crate::trace::SAMPLED,
    };

    #[test]
    fn an_exported_span_joins_the_callers_trace_and_parents_the_next_hop() {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let hop = tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("request");
            follow(&span, &CALLER);
            next_hop(&span, &CALLER)
        });
        let spans = exporter.get_finished_spans().unwrap();
        let [span] = spans.as_slice() else {
            panic!("one span exported: {spans:?}")
        };
        assert_eq!(
            span.span_context.trace_id(),
            TraceId::from_bytes(CALLER.trace_id.to_be_bytes())
        );
        assert_eq!(
            span.parent_span_id,
            SpanId::from_bytes(CALLER.parent_id.to_be_bytes())
        );
        assert_eq!(hop.trace_id, CALLER.trace_id);
        assert_eq!(
            hop.parent_id,
            u64::from_be_bytes(span.span_context.span_id().to_bytes()),
            "the next hop hangs under this span, not beside it"
        );
    }

    #[test]
    fn without_export_the_next_hop_gets_the_callers_traceparent() {
        let span = tracing::info_span!("request");
        follow(&span, &CALLER);
        assert_eq!(next_hop(&span, &CALLER), CALLER);
    }
}
