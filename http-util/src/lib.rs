//! The HTTP error type and JSON extractor shared by the gateway and the pool-manager, so
//! every error of every service has the same `{"code", "message"}` body and status rules:
//! the caller's mistake is 4xx, a sandbox or node failure 502/504, overload 429/503 with
//! Retry-After, our own bug 500 (whose cause is logged once, here, and never sent).

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use wire::ErrorBody;

/// Every error an HTTP handler can answer with. Variants are HTTP meanings.
#[derive(Debug)]
pub enum ApiError {
    /// 400: a malformed request; the message names the field.
    BadRequest { code: &'static str, message: String },
    /// 401: missing, malformed, expired or wrongly signed credentials.
    Unauthorized(String),
    /// 403: authenticated, but not allowed.
    Forbidden(String),
    /// 404: no such thing for this caller (including another tenant's).
    NotFound { code: &'static str, message: String },
    /// 409: conflicts with the current state (e.g. a stale fencing token).
    Conflict { code: &'static str, message: String },
    /// 413: the body is larger than allowed.
    PayloadTooLarge(String),
    /// 429: the caller is over a limit; retry after the given seconds.
    TooManyRequests { message: String, retry_after_s: u64 },
    /// 503: we are out of capacity or a dependency is down; retry after the given seconds.
    Unavailable { message: String, retry_after_s: u64 },
    /// 502: a node or sandbox failed.
    BadGateway(String),
    /// 504: a node or sandbox did not answer in time.
    GatewayTimeout(String),
    /// 500: our own bug. The detail is logged, never sent.
    Internal(String),
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::BadRequest { code: "bad_request", message: message.into() }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::NotFound { code: "not_found", message: message.into() }
    }

    pub fn unavailable(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        ApiError::Unavailable { message: message.into(), retry_after_s }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::GatewayTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let (code, message) = match self {
            ApiError::BadRequest { code, message }
            | ApiError::NotFound { code, message }
            | ApiError::Conflict { code, message } => (*code, message.clone()),
            ApiError::Unauthorized(m) => ("unauthorized", m.clone()),
            ApiError::Forbidden(m) => ("forbidden", m.clone()),
            ApiError::PayloadTooLarge(m) => ("payload_too_large", m.clone()),
            ApiError::TooManyRequests { message, .. } => ("too_many_requests", message.clone()),
            ApiError::Unavailable { message, .. } => ("unavailable", message.clone()),
            ApiError::BadGateway(m) => ("bad_gateway", m.clone()),
            ApiError::GatewayTimeout(m) => ("gateway_timeout", m.clone()),
            ApiError::Internal(_) => ("internal", "internal error; it has been logged".to_string()),
        };
        ErrorBody { code: code.to_string(), message }
    }

    /// Rebuilds an error another sandpool service answered with (status + body).
    pub fn from_remote(status: StatusCode, body: ErrorBody) -> ApiError {
        let msg = body.message;
        match status.as_u16() {
            400 => ApiError::BadRequest { code: leak_code(&body.code), message: msg },
            401 | 403 => ApiError::Internal(format!("internal call refused ({status}): {msg}")),
            404 => ApiError::NotFound { code: leak_code(&body.code), message: msg },
            409 => ApiError::Conflict { code: leak_code(&body.code), message: msg },
            413 => ApiError::PayloadTooLarge(msg),
            429 => ApiError::TooManyRequests { message: msg, retry_after_s: 1 },
            503 => ApiError::Unavailable { message: msg, retry_after_s: 1 },
            504 => ApiError::GatewayTimeout(msg),
            500 => ApiError::BadGateway("the node failed".into()),
            _ => ApiError::BadGateway(msg),
        }
    }
}

/// Error codes are a small closed set; map a remote one back onto it.
fn leak_code(code: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "bad_request",
        "invalid_path",
        "unknown_template",
        "not_found",
        "session_gone",
        "stale_fence",
        "conflict",
        "is_directory",
    ];
    KNOWN.iter().copied().find(|k| *k == code).unwrap_or("error")
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let ApiError::Internal(detail) = &self {
            tracing::error!(%detail, "internal error");
        }
        let retry = match &self {
            ApiError::TooManyRequests { retry_after_s, .. } | ApiError::Unavailable { retry_after_s, .. } => {
                Some(*retry_after_s)
            }
            _ => None,
        };
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let Some(s) = retry {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
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
                ApiError::PayloadTooLarge("request body is too large".into())
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

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Json(v))
    }
}

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// The JSON answer for a request no route matches.
pub async fn fallback_not_found() -> ApiError {
    ApiError::not_found("no such route")
}
