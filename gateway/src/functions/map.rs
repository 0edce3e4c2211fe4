//! A function invoked over a batch (`/map`), answered as NDJSON in input order.

use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use http_util::ApiError;
use wire::ErrorCode;
use wire::functions::{Invocation, InvocationState};

use super::invoke::{Invoked, finish, invoke_waiting};
use super::{MAP_SLOT_WAIT, MAX_MAP_ITEMS, unknown};
use crate::errors::{self};
use crate::{AppState, Caller};

#[utoipa::path(post, path = "/v1/functions/{name}/map", tag = "functions", operation_id = "map_function", summary = "Invoke a function over a batch", params(("name" = String, Path, description = "The function's name.")), request_body(content = String, content_type = "application/json", description = "A JSON array of payloads, or NDJSON (one JSON payload per line); at most 10,000."), responses((status = 200, description = "NDJSON, one line per payload in input order, streamed as they finish: `{index, status, start?, duration_ms?, function_error?, result}` (an error's `result` is its error body).", content_type = "application/x-ndjson", body = String)))]
pub(crate) async fn map(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let items = parse_batch(&body)?;
    for (i, p) in items.iter().enumerate() {
        if p.len() as u64 > s.config.gateway.max_invoke_bytes {
            return Err(ApiError::new(ErrorCode::PayloadTooLarge, format!("payload {i} is over the invocation limit")));
        }
    }
    crate::quotas::call(&s, &caller)?;
    let def =
        s.ledger.function_get(&caller.tenant, &name).await.map_err(errors::ledger)?.ok_or_else(|| unknown(&name))?;
    let width = def.max_concurrency as usize;
    let lines = futures::stream::iter(items.into_iter().enumerate())
        .map(move |(index, payload)| {
            let (s, caller, name) = (s.clone(), caller.clone(), name.clone());
            async move {
                let done = invoke_waiting(&s, &caller, &name, payload, Instant::now() + MAP_SLOT_WAIT).await;
                let mut line = map_line(index, done);
                line.push('\n');
                Ok::<_, std::convert::Infallible>(Bytes::from(line))
            }
        })
        .buffered(width);
    let mut resp = Body::from_stream(lines).into_response();
    resp.headers_mut().insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    Ok(resp)
}

/// One payload's line of a map's answer.
fn map_line(index: usize, done: Result<Invoked, ApiError>) -> String {
    let mut inv = Invocation::new(String::new(), String::new(), InvocationState::Done, String::new());
    finish(&mut inv, done);
    let mut v = serde_json::json!({"index": index, "status": inv.status, "result": inv.result});
    let o = v.as_object_mut().expect("an object");
    if let Some(st) = inv.start {
        o.insert("start".into(), st.as_str().into());
    }
    if let Some(d) = inv.duration_ms {
        o.insert("duration_ms".into(), d.into());
    }
    if let Some(fe) = inv.function_error {
        o.insert("function_error".into(), fe.into());
    }
    if let Some(enc) = inv.result_encoding {
        o.insert("result_encoding".into(), enc.into());
    }
    v.to_string()
}

/// A map's payloads: a JSON array, or NDJSON; each becomes the JSON text of one invocation.
fn parse_batch(body: &[u8]) -> Result<Vec<Bytes>, ApiError> {
    let text = std::str::from_utf8(body).map_err(|_| ApiError::bad_request("the batch is not UTF-8"))?;
    let items: Vec<serde_json::Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("malformed JSON array: {e}")))?
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .map_err(|e| ApiError::bad_request(format!("line {}: malformed JSON: {e}", i + 1)))
            })
            .collect::<Result<_, _>>()?
    };
    if items.is_empty() || items.len() > MAX_MAP_ITEMS {
        return Err(ApiError::bad_request(format!("a batch holds 1 ..= {MAX_MAP_ITEMS} payloads")));
    }
    Ok(items.into_iter().map(|v| Bytes::from(v.to_string())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_a_json_array_or_ndjson() {
        let a = parse_batch(br#"[1, {"a": 2}, "x"]"#).unwrap();
        assert_eq!(a, vec![Bytes::from("1"), Bytes::from(r#"{"a":2}"#), Bytes::from(r#""x""#)]);
        let n = parse_batch(b"{\"a\":1}\n\n[2]\n").unwrap();
        assert_eq!(n, vec![Bytes::from(r#"{"a":1}"#), Bytes::from("[2]")]);
        assert!(parse_batch(b"[1,").unwrap_err().message.contains("malformed"));
        assert!(parse_batch(b"{\"a\":1}\nnope\n").unwrap_err().message.contains("line 2"));
        assert!(parse_batch(b"[]").is_err());
        assert!(parse_batch(b"").is_err());
    }
}
