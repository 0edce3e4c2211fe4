//! Logs and traces of a sandpool process: the global `tracing` subscriber (an `EnvFilter`, the
//! fmt log on stderr, and, when an OTLP endpoint is configured, a `tracing-opentelemetry`
//! layer exporting spans over OTLP/HTTP protobuf in batches), W3C trace-context propagation
//! over HTTP headers, and the trace id of a span for the access log.
//!
//! Traces are off unless an endpoint is given. The standard `OTEL_*` variables apply on top:
//! `OTEL_SERVICE_NAME` (else the name passed to `init`), `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is), `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_TRACES_SAMPLER(_ARG)` and `OTEL_BSP_*` (batching).

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::field::{Field, Visit};
use tracing::span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::FormattedFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The log filter when `RUST_LOG` is not set.
pub const DEFAULT_FILTER: &str = "info,bollard=warn,hyper=warn";

/// Flushes the spans still buffered and shuts the exporter down when dropped (at process exit,
/// outside the async runtime: the flush blocks for at most the exporter's timeout).
#[must_use = "dropping the guard stops trace export"]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("sandpool: flush traces: {e}");
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `key=value` text (colours only on a terminal).
    #[default]
    Text,
    /// One JSON object a line (`timestamp`, `level`, `target`, `fields`, `span`: the current
    /// span's fields, e.g. tenant and session), for log collectors.
    Json,
}

/// Installs the global subscriber: `RUST_LOG` (else [`DEFAULT_FILTER`]), the log in `format`,
/// and span export to `otlp_endpoint` (the OTLP/HTTP base URL, e.g. `http://127.0.0.1:4318`;
/// spans go to `<base>/v1/traces`) when one is given. A bad exporter configuration is logged
/// and the process goes on without traces. Call once, before the runtime starts.
pub fn init(service_name: &str, otlp_endpoint: Option<&str>, format: LogFormat) -> Guard {
    install(service_name, otlp_endpoint, DEFAULT_FILTER, format)
}

/// `init` with text logs and another filter when `RUST_LOG` is not set (a benchmark logs
/// warnings only).
pub fn init_with(service_name: &str, otlp_endpoint: Option<&str>, default_filter: &str) -> Guard {
    install(service_name, otlp_endpoint, default_filter, LogFormat::Text)
}

fn install(service_name: &str, otlp_endpoint: Option<&str>, default_filter: &str, format: LogFormat) -> Guard {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let (provider, failed) = match otlp_endpoint.map(|e| provider(service_name, e)) {
        Some(Ok(p)) => (Some(p), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("sandpool")));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    tracing_subscriber::registry().with(filter).with(log_layer(format, ansi, std::io::stdout)).with(otel).init();
    match (&provider, failed, otlp_endpoint) {
        (Some(_), _, Some(endpoint)) => tracing::info!(endpoint, "exporting traces over OTLP/HTTP"),
        (_, Some(e), _) => tracing::error!(error = %e, "traces are off: the OTLP exporter could not be set up"),
        _ => {}
    }
    Guard { provider }
}

/// The log layer of `format`, writing to `writer` (stdout in a process, a buffer in tests).
fn log_layer<S, W>(format: LogFormat, ansi: bool, writer: W) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    match format {
        // Colours only on a terminal: log files and collectors get plain `key=value` text.
        LogFormat::Text => {
            Box::new(tracing_subscriber::fmt::layer().with_ansi(ansi).fmt_fields(LogFields).with_writer(writer))
        }
        // The current span's fields (tenant, session, trace id) ride on every line; the list
        // of enclosing spans would repeat them on every line of a request.
        LogFormat::Json => Box::new(
            tracing_subscriber::fmt::layer().json().with_current_span(true).with_span_list(false).with_writer(writer),
        ),
    }
}

fn provider(service_name: &str, endpoint: &str) -> Result<SdkTracerProvider, String> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http().with_protocol(Protocol::HttpBinary);
    // The signal's own variable wins over the base endpoint, as the OTLP spec says.
    if std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none() {
        exporter = exporter.with_endpoint(traces_url(endpoint));
    }
    let exporter = exporter.build().map_err(|e| e.to_string())?;
    let name = std::env::var("OTEL_SERVICE_NAME").ok().filter(|n| !n.is_empty());
    let resource = Resource::builder().with_service_name(name.unwrap_or_else(|| service_name.to_string())).build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(provider)
}

/// `<base>/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` is read.
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// Makes `span` the child of the W3C `traceparent` in `headers`, if there is a valid one (and
/// traces are on). Call before the span is first entered.
pub fn set_parent(span: &tracing::Span, headers: &http::HeaderMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Adds `span`'s W3C `traceparent` (and `tracestate`) to outgoing `headers` (nothing when traces
/// are off).
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeaderInjector(headers)));
    }
}

/// The trace id of `span` (32 hex digits), if traces are on.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// The log's field formatter: `name=value` like the default one, without the `otel.*` fields
/// (span names and kinds for the exporter; noise in a log line) and `log.*` ones.
struct LogFields;

impl<'w> FormatFields<'w> for LogFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> std::fmt::Result {
        let mut v = LogVisitor { writer: &mut writer, seen: false, result: Ok(()) };
        fields.record(&mut v);
        v.result
    }

    fn add_fields(&self, current: &'w mut FormattedFields<Self>, fields: &span::Record<'_>) -> std::fmt::Result {
        let mut more = String::new();
        self.format_fields(Writer::new(&mut more), fields)?;
        if !more.is_empty() {
            if !current.fields.is_empty() {
                current.fields.push(' ');
            }
            current.fields.push_str(&more);
        }
        Ok(())
    }
}

struct LogVisitor<'a, 'w> {
    writer: &'a mut Writer<'w>,
    seen: bool,
    result: std::fmt::Result,
}

impl Visit for LogVisitor<'_, '_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let name = field.name();
        if self.result.is_err() || name.starts_with("otel.") || name.starts_with("log.") {
            return;
        }
        let sep = if self.seen { " " } else { "" };
        self.seen = true;
        self.result = match name {
            "message" => write!(self.writer, "{sep}{value:?}"),
            name => write!(self.writer, "{sep}{}={value:?}", name.strip_prefix("r#").unwrap_or(name)),
        };
    }
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::from_str(&value)) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_is_appended_to_the_base_endpoint() {
        assert_eq!(traces_url("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(traces_url("http://collector:4318/"), "http://collector:4318/v1/traces");
    }

    #[test]
    fn without_the_layer_nothing_is_injected_and_there_is_no_trace_id() {
        let span = tracing::info_span!("x");
        let mut h = http::HeaderMap::new();
        inject(&span, &mut h);
        assert!(h.is_empty());
        assert_eq!(trace_id(&span), None);
    }

    #[test]
    fn log_lines_leave_out_the_otel_fields() {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = buf.clone();
        let make = move || Sink(sink.clone());
        tracing::subscriber::with_default(
            tracing_subscriber::registry().with(log_layer(LogFormat::Text, false, make)),
            || {
                let span = tracing::info_span!(
                    "request",
                    otel.name = "GET /x",
                    otel.kind = "server",
                    route = "/x",
                    tenant = tracing::field::Empty
                );
                span.record("otel.status_code", "ERROR");
                span.record("tenant", "acme");
                span.in_scope(|| tracing::info!(status = 200, "done"));
            },
        );
        let out = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        assert!(out.contains("request{route=\"/x\" tenant=\"acme\"}: "), "{out}");
        assert!(out.contains("done status=200"), "{out}");
        assert!(!out.contains("otel"), "{out}");
    }

    #[test]
    fn json_logs_are_one_object_a_line_with_the_span_fields() {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = buf.clone();
        let layer = log_layer(LogFormat::Json, false, move || Sink(sink.clone()));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            let span = tracing::info_span!("request", tenant = "acme", session = "n1.s1");
            span.in_scope(|| tracing::warn!(status = 503, "node down"));
        });
        let out = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1, "{out}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).expect("a JSON object");
        assert_eq!(v["level"], "WARN", "{v}");
        assert_eq!(v["fields"]["message"], "node down", "{v}");
        assert_eq!(v["fields"]["status"], 503, "{v}");
        assert_eq!(v["span"]["tenant"], "acme", "{v}");
        assert_eq!(v["span"]["name"], "request", "{v}");
        assert!(v["timestamp"].is_string(), "{v}");
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_traceparent_round_trips_through_headers() {
        use opentelemetry::trace::TracerProvider as _;
        let provider = SdkTracerProvider::builder().build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("t")));
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        tracing::subscriber::with_default(subscriber, || {
            let client = tracing::info_span!("client");
            let mut h = http::HeaderMap::new();
            inject(&client, &mut h);
            let tp = h["traceparent"].to_str().unwrap().to_string();
            let id = trace_id(&client).expect("a trace id");
            assert!(tp.contains(&id), "{tp} names trace {id}");
            let server = tracing::info_span!("server");
            set_parent(&server, &h);
            assert_eq!(trace_id(&server).as_deref(), Some(id.as_str()), "the server span joins the trace");
        });
    }
}
