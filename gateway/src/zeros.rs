//! The gateway's series that start at 0 (`telemetry::zeros`): for each configured template,
//! sessions created and refused by code, checkout and queue-wait histograms; quota and
//! function refusals, invocations by mode, start and outcome; the ledger scripts' errors; its
//! WebSocket gauges; and each route of the API with the status its success answers.

use config::Config;
use telemetry::metrics::template_label;
use telemetry::names;
use telemetry::zeros::zeros;
use wire::functions::FunctionMode;
use wire::internal::Outcome;
use wire::quotas::Dimension;

/// The `code` of `SESSION_REJECTIONS` (`create::rejected`'s causes).
pub(crate) const REJECTION_CODES: [&str; 6] = ["queue_full", "deadline", "unhealthy", "no_node", "node_full", "quota"];

pub(crate) fn register(config: &Config) {
    let mut templates: Vec<&str> = config.templates.keys().map(|t| template_label(t)).collect();
    templates.sort_unstable();
    templates.dedup();
    let starts = ["warm", "cold"];
    zeros(names::SESSIONS_CREATED, &[("template", &templates), ("start", &starts)]);
    zeros(names::SESSION_CHECKOUT, &[("template", &templates), ("start", &starts)]);
    zeros(names::SESSION_QUEUE_WAIT, &[("template", &templates)]);
    zeros(names::SESSION_REJECTIONS, &[("template", &templates), ("code", &REJECTION_CODES)]);
    // `isolation`: a class the path may not use (`quotas::refused`).
    let dimensions: Vec<&str> = Dimension::ALL.iter().map(|d| d.as_str()).chain(["isolation"]).collect();
    zeros(names::QUOTA_REFUSALS, &[("dimension", &dimensions)]);

    let modes = [FunctionMode::Exec.as_str(), FunctionMode::Runtime.as_str()];
    let outcomes: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    zeros(names::FUNCTION_INVOCATIONS, &[("mode", &modes), ("start", &starts), ("outcome", &outcomes)]);
    // A call that failed before the function ran (`functions::invoke_one`).
    zeros(names::FUNCTION_INVOCATIONS, &[("mode", &modes), ("start", &["none"]), ("outcome", &["error"])]);
    zeros(names::FUNCTION_DURATION, &[("mode", &modes), ("start", &starts)]);
    zeros(names::FUNCTION_ENVIRONMENTS_MADE, &[("why", &["demand", "keeper"])]);
    zeros(names::FUNCTION_REFUSALS, &[("reason", &["concurrency"])]);

    zeros(names::REDIS_ERRORS, &[("script", ledger::SCRIPT_NAMES)]);
    zeros(names::REDIS_DURATION, &[("script", ledger::SCRIPT_NAMES)]);
    zeros(names::WS_OPEN, &[("service", &["gateway"])]);
    zeros(names::WS_BYTES, &[("service", &["gateway"]), ("direction", &["in", "out"])]);

    for (route, method, status) in routes() {
        let status = status.to_string();
        zeros(
            names::HTTP_REQUESTS,
            &[
                ("service", &["gateway"]),
                ("route", &[route.as_str()]),
                ("method", &[method]),
                ("status", &[status.as_str()]),
            ],
        );
        zeros(names::HTTP_DURATION, &[("service", &["gateway"]), ("route", &[route.as_str()]), ("method", &[method])]);
    }
}

/// Each route of the API (its template, as `MatchedPath` has it), method, and the status of its
/// success (the lowest 1xx/2xx its OpenAPI operation declares).
fn routes() -> Vec<(String, &'static str, u16)> {
    use utoipa::openapi::HttpMethod;
    let (_, api) = crate::routes().split_for_parts();
    let mut out = Vec::new();
    for (path, item) in &api.paths.paths {
        let ops = [
            (HttpMethod::Get, &item.get),
            (HttpMethod::Put, &item.put),
            (HttpMethod::Post, &item.post),
            (HttpMethod::Delete, &item.delete),
            (HttpMethod::Patch, &item.patch),
        ];
        for (method, op) in ops {
            let Some(op) = op else { continue };
            let ok = op.responses.responses.keys().filter_map(|s| s.parse::<u16>().ok()).filter(|s| *s < 300).min();
            if let Some(status) = ok {
                out.push((path.clone(), method_label(method), status));
            }
        }
    }
    out
}

fn method_label(m: utoipa::openapi::HttpMethod) -> &'static str {
    use utoipa::openapi::HttpMethod;
    match m {
        HttpMethod::Get => "GET",
        HttpMethod::Put => "PUT",
        HttpMethod::Post => "POST",
        HttpMethod::Delete => "DELETE",
        HttpMethod::Patch => "PATCH",
        HttpMethod::Head => "HEAD",
        HttpMethod::Options => "OPTIONS",
        HttpMethod::Trace => "other",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_has_a_success_status() {
        let routes = super::routes();
        assert!(routes.len() >= 30, "{routes:?}");
        assert!(routes.iter().any(|(p, m, s)| p == "/v1/sessions" && *m == "POST" && *s == 200), "{routes:?}");
        assert!(routes.iter().any(|(p, m, s)| p == "/healthz" && *m == "GET" && *s == 204), "{routes:?}");
    }
}
