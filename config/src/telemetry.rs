//! `[telemetry]` and `[log]`: the metrics listener, the OTLP endpoint and the log format.

use std::net::SocketAddr;

use serde::Deserialize;

use crate::{ConfigError, invalid, parse_addr};

/// Prometheus' registry lists 9464 for OpenTelemetry-style exporters; loopback by default.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawTelemetry {
    /// Where this process serves `GET /metrics`; "off" for nowhere.
    metrics_listen: Option<String>,
    /// OTLP/HTTP endpoint for traces (`OTEL_EXPORTER_OTLP_ENDPOINT` overrides); none: no traces.
    otlp_endpoint: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLog {
    /// "text" (the default) or "json".
    format: Option<String>,
}

/// `[telemetry]`, validated.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// Where this process serves Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// Where traces go (OTLP over HTTP), if anywhere.
    pub otlp_endpoint: Option<String>,
}

/// `[log]`, validated.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// Text or JSON lines.
    pub format: LogFormat,
}

/// How a process writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// `key=value` text: for people.
    Text,
    /// One JSON object a line: for log collectors (Loki, Elasticsearch, Cloud Logging).
    Json,
}

/// `[telemetry]`; `OTEL_EXPORTER_OTLP_ENDPOINT` wins over the file's endpoint.
pub(crate) fn validate_telemetry(raw: RawTelemetry) -> Result<TelemetryConfig, ConfigError> {
    Ok(TelemetryConfig {
        metrics_listen: match raw.metrics_listen.as_deref().unwrap_or(DEFAULT_METRICS_LISTEN) {
            "off" => None,
            a => Some(parse_addr("telemetry.metrics_listen", a)?),
        },
        otlp_endpoint: std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .or(raw.otlp_endpoint)
            .filter(|e| !e.is_empty()),
    })
}

/// `[log]`.
pub(crate) fn validate_log(raw: RawLog) -> Result<LogConfig, ConfigError> {
    Ok(LogConfig {
        format: match raw.format.as_deref().unwrap_or("text") {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(invalid("log.format", format!("{other:?} is not \"text\" or \"json\""))),
        },
    })
}
