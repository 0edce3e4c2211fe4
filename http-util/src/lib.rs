//! The HTTP error type and JSON extractor shared by the gateway and the pool-manager, so
//! every error of every service has the same `{"code", "message"}` body and status rules:
//! the caller's mistake is 4xx, a sandbox or node failure 502/504, overload 429/503 with
//! Retry-After, our own bug 500. A 5xx answer never carries internal details: its cause is
//! logged once, here, under a request id that the answer quotes: the id of the request being
//! handled (`with_request_id`, set by each service's request middleware), else a new one.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use wire::{ErrorBody, ErrorCode};

/// The one place an error code gets its HTTP status.
pub fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::BadRequest
        | ErrorCode::InvalidPath
        | ErrorCode::UnknownTemplate
        | ErrorCode::ImageNotFound
        | ErrorCode::IsDirectory => StatusCode::BAD_REQUEST,
        ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorCode::Forbidden => StatusCode::FORBIDDEN,
        ErrorCode::NotFound | ErrorCode::SessionGone => StatusCode::NOT_FOUND,
        ErrorCode::Conflict | ErrorCode::StaleFence | ErrorCode::ShellGone => StatusCode::CONFLICT,
        ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::TooManyRequests | ErrorCode::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::Unavailable | ErrorCode::NodeFull | ErrorCode::NodeUnavailable | ErrorCode::SandboxBusy => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        ErrorCode::BadGateway
        | ErrorCode::ImagePullFailed
        | ErrorCode::SandboxFailed
        | ErrorCode::FunctionCrashed
        | ErrorCode::Unknown => StatusCode::BAD_GATEWAY,
        ErrorCode::GatewayTimeout | ErrorCode::FunctionTimeout => StatusCode::GATEWAY_TIMEOUT,
        ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Every error an HTTP handler can answer with: a code (which fixes the status), a message
/// for the caller, and for 5xx a detail that is logged and never sent.
#[derive(Debug)]
pub struct ApiError {
    /// What went wrong, as the API names it; it fixes the status.
    pub code: ErrorCode,
    /// Said to the caller: names the field or the limit at fault.
    pub message: String,
    /// Seconds for `Retry-After` (429 and 503).
    pub retry_after_s: Option<u64>,
    /// The cause, for the log only.
    pub detail: Option<String>,
    /// On `quota_exceeded`: the limit that refused (sent beside `code` and `message`).
    pub quota: Option<wire::QuotaDenied>,
}

impl ApiError {
    /// An error of `code` with `message`, nothing else.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), retry_after_s: None, detail: None, quota: None }
    }

    /// Adds a cause for the log (never sent to the caller).
    pub fn with_detail(mut self, detail: impl Into<String>) -> ApiError {
        self.detail = Some(detail.into());
        self
    }

    /// 400: the request is malformed or names something invalid.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::BadRequest, message)
    }

    /// 401: no credentials, or credentials that do not verify.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Unauthorized, message)
    }

    /// 403: the caller is known but may not do this.
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Forbidden, message)
    }

    /// 404: no such thing, or not the caller's to see.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::NotFound, message)
    }

    /// 429 with `Retry-After`: too many requests now; retry after `retry_after_s`.
    pub fn too_many_requests(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        ApiError { retry_after_s: Some(retry_after_s), ..ApiError::new(ErrorCode::TooManyRequests, message) }
    }

    /// 429 `quota_exceeded`: `denied` names the dimension, level, limit and usage.
    pub fn quota_exceeded(denied: wire::QuotaDenied, retry_after_s: Option<u64>) -> ApiError {
        let message = format!(
            "quota exceeded: {} of {:?} would go over its limit of {} ({} in use)",
            denied.dimension.as_str(),
            denied.path,
            denied.limit,
            denied.used
        );
        ApiError { retry_after_s, quota: Some(denied), ..ApiError::new(ErrorCode::QuotaExceeded, message) }
    }

    /// 503 with `Retry-After`: the service cannot serve this now; retry after `retry_after_s`.
    pub fn unavailable(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        ApiError { retry_after_s: Some(retry_after_s), ..ApiError::new(ErrorCode::Unavailable, message) }
    }

    /// 502: `message` for the caller; `detail` (Docker's or an agent's words) for the log.
    pub fn bad_gateway(message: impl Into<String>, detail: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::BadGateway, message).with_detail(detail)
    }

    /// 504: a sandbox or node did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::GatewayTimeout, message)
    }

    /// 500: our own bug. The caller sees a plain message; `detail` goes to the log.
    pub fn internal(detail: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Internal, "internal error").with_detail(detail)
    }

    /// The HTTP status of this error's code.
    pub fn status(&self) -> StatusCode {
        status_of(self.code)
    }

    /// The body as sent (without the request id, which `into_response` adds to 5xx).
    pub fn body(&self) -> ErrorBody {
        ErrorBody { code: self.code, message: self.message.clone(), request_id: None, quota: self.quota.clone() }
    }

    /// Rebuilds an error another sandpool service answered with. Its 4xx codes pass through;
    /// a refused internal call or the node's own bug is a failure of the node (502).
    pub fn from_remote(status: StatusCode, body: Option<ErrorBody>, node: &str) -> ApiError {
        let Some(body) = body else {
            return ApiError::bad_gateway(format!("node {node} failed"), format!("node {node} answered {status}"));
        };
        let quoted = body.request_id.map(|r| format!(" (node request id {r})")).unwrap_or_default();
        match body.code {
            ErrorCode::Unauthorized | ErrorCode::Forbidden | ErrorCode::Internal | ErrorCode::Unknown => {
                ApiError::bad_gateway(format!("node {node} failed"), format!("node {node}: {status}{quoted}"))
            }
            code => {
                let mut e = ApiError::new(code, body.message).with_detail(format!("node {node}{quoted}"));
                if matches!(
                    code,
                    ErrorCode::TooManyRequests
                        | ErrorCode::Unavailable
                        | ErrorCode::ImagePullFailed
                        | ErrorCode::SandboxBusy
                ) {
                    e.retry_after_s = Some(1);
                }
                e
            }
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)?;
        if let Some(d) = &self.detail {
            write!(f, " ({d})")?;
        }
        Ok(())
    }
}

/// A random id naming one request in the log and in its answer.
pub fn request_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

tokio::task_local! {
    static REQUEST_ID: String;
}

/// Runs `fut` (a request's handling) with `id` as its request id: 5xx answers built inside it
/// quote this id rather than a new one. The services' request middleware calls this.
pub async fn with_request_id<F: std::future::Future>(id: String, fut: F) -> F::Output {
    REQUEST_ID.scope(id, fut).await
}

/// The id of the request being handled, if inside `with_request_id`.
pub fn current_request_id() -> Option<String> {
    REQUEST_ID.try_with(String::clone).ok()
}

/// A request id a caller (or the gateway, towards a node) sent in `x-request-id`, if it is
/// usable: 1 to 64 characters of letters, digits, '-', '_', '.', ':'.
pub fn incoming_request_id(headers: &axum::http::HeaderMap) -> Option<String> {
    let v = headers.get(REQUEST_ID_HEADER)?.to_str().ok()?;
    let ok = !v.is_empty()
        && v.len() <= 64
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    ok.then(|| v.to_string())
}

/// Logs, under `sandpool::access`, a request whose handling was dropped before it answered
/// (its caller hung up or gave up waiting): otherwise such a request would leave no line at
/// all, and a hang could not be traced. Made when the handling starts; [`Unanswered::answered`]
/// disarms it.
pub struct Unanswered {
    method: axum::http::Method,
    route: String,
    request_id: String,
    started: std::time::Instant,
    armed: bool,
}

impl Unanswered {
    /// Armed for one request: logs it at drop unless `answered` is called first.
    pub fn new(method: &axum::http::Method, route: &str, request_id: &str) -> Unanswered {
        Unanswered {
            method: method.clone(),
            route: route.to_string(),
            request_id: request_id.to_string(),
            started: std::time::Instant::now(),
            armed: true,
        }
    }

    /// The request got its answer: nothing is logged at drop.
    pub fn answered(mut self) {
        self.armed = false;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(
                target: "sandpool::access",
                method = %self.method,
                route = %self.route,
                waited_ms = self.started.elapsed().as_millis() as u64,
                request_id = %self.request_id,
                "request dropped before its answer (the caller went away)",
            );
        }
    }
}

/// The header every answer carries its request id in.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The segment of `path` at the place of `param` (e.g. `{id}`) in the route template `route`
/// (axum's `MatchedPath`): the session or sandbox a request is about, for its span and log.
pub fn path_param(route: &str, path: &str, param: &str) -> Option<String> {
    let at = route.split('/').position(|s| s == param)?;
    path.split('/').nth(at).filter(|s| !s.is_empty()).map(str::to_string)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut body = self.body();
        let mut rid = None;
        if status.is_server_error() {
            let id = current_request_id().unwrap_or_else(request_id);
            let detail = self.detail.as_deref().unwrap_or("");
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                tracing::error!(request_id = %id, code = ?self.code, %detail, "internal error");
            } else {
                tracing::warn!(request_id = %id, code = ?self.code, message = %self.message, %detail, "request failed");
            }
            body.request_id = Some(id.clone());
            rid = Some(id);
        }
        let mut resp = (status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after_s {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
        }
        if let Some(id) = rid.and_then(|id| HeaderValue::from_str(&id).ok()) {
            resp.headers_mut().insert(REQUEST_ID_HEADER, id);
        }
        resp
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        match r {
            JsonRejection::MissingJsonContentType(_) => {
                ApiError::bad_request("expected a JSON body with content-type: application/json")
            }
            JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::new(ErrorCode::PayloadTooLarge, "request body is too large")
            }
            JsonRejection::JsonSyntaxError(e) => ApiError::bad_request(format!("malformed JSON: {}", e.body_text())),
            JsonRejection::JsonDataError(e) => ApiError::bad_request(format!("invalid request: {}", e.body_text())),
            other => ApiError::bad_request(other.body_text()),
        }
    }
}

/// `axum::Json`, but a rejected body answers with our error shape.
pub struct Json<T>(pub T);

impl<S, T> FromRequest<S> for Json<T>
where
    axum::Json<T>: FromRequest<S, Rejection = JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(mut req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // The body is read as JSON whatever its content type says: `curl -d` sends a form
        // type, and a body that is not JSON is refused all the same (400 malformed JSON).
        let says_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.as_bytes().windows(4).any(|w| w.eq_ignore_ascii_case(b"json")));
        if !says_json {
            req.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Json(v))
    }
}

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// `axum::extract::Query`, but a rejected query string answers with our error shape.
pub struct Query<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for Query<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(Query(v)),
            Err(e) => Err(ApiError::bad_request(format!("query string: {}", e.body_text()))),
        }
    }
}

/// The JSON answer for a request no route matches.
pub async fn fallback_not_found() -> ApiError {
    ApiError::not_found("no such route")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_5xx_answer_carries_a_request_id_and_no_detail() {
        let resp =
            ApiError::bad_gateway("sandbox s1 failed", "docker: OCI runtime exec failed: secret path").into_response();
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        let header_id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.code, ErrorCode::BadGateway);
        assert_eq!(body.request_id.as_deref(), Some(header_id.as_str()));
        assert!(!String::from_utf8_lossy(&bytes).contains("OCI"), "the detail is not sent");
    }

    #[tokio::test]
    async fn inside_a_request_a_5xx_answer_quotes_that_requests_id() {
        let resp = with_request_id("req-42".into(), async { ApiError::internal("boom").into_response() }).await;
        assert_eq!(resp.headers()["x-request-id"], "req-42");
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.request_id.as_deref(), Some("req-42"));
        assert_eq!(current_request_id(), None, "the id is scoped to its request");
    }

    #[test]
    fn incoming_request_ids_are_honoured_only_when_tame() {
        let mut h = axum::http::HeaderMap::new();
        assert_eq!(incoming_request_id(&h), None);
        h.insert("x-request-id", HeaderValue::from_static("abc-123_x.y:z"));
        assert_eq!(incoming_request_id(&h).as_deref(), Some("abc-123_x.y:z"));
        h.insert("x-request-id", HeaderValue::from_static("has space"));
        assert_eq!(incoming_request_id(&h), None);
        h.insert("x-request-id", HeaderValue::from_str(&"a".repeat(65)).unwrap());
        assert_eq!(incoming_request_id(&h), None);
    }

    #[test]
    fn a_path_parameter_is_read_at_its_place_in_the_route() {
        let r = "/v1/sessions/{id}/exec";
        assert_eq!(path_param(r, "/v1/sessions/s-abc/exec", "{id}").as_deref(), Some("s-abc"));
        assert_eq!(path_param("/v1/sessions", "/v1/sessions", "{id}"), None);
        let r = "/v1/sessions/{id}/files/{*path}";
        assert_eq!(path_param(r, "/v1/sessions/x/files/a/b", "{id}").as_deref(), Some("x"));
    }

    #[test]
    fn remote_internal_errors_become_the_node_failing() {
        let body =
            ErrorBody { code: ErrorCode::Internal, message: "internal error".into(), request_id: None, quota: None };
        let e = ApiError::from_remote(StatusCode::INTERNAL_SERVER_ERROR, Some(body), "n1");
        assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
        let body = ErrorBody { code: ErrorCode::StaleFence, message: "stale".into(), request_id: None, quota: None };
        assert_eq!(ApiError::from_remote(StatusCode::CONFLICT, Some(body), "n1").code, ErrorCode::StaleFence);
        assert_eq!(ApiError::from_remote(StatusCode::BAD_GATEWAY, None, "n1").status(), StatusCode::BAD_GATEWAY);
    }
}
