//! The public API's OpenAPI 3.1 document, generated from the code. Each handler carries its
//! `#[utoipa::path]` (path, parameters, body, success answers); `app` registers every public
//! route from those declarations (`utoipa_axum::routes!`), so a route and its entry are one
//! declaration; `errors_of` names the error codes each operation can answer, whose statuses
//! come from `http_util::status_of`, the mapping the server itself answers with. `document`
//! puts the three together; `GET /openapi.json` serves it and `GET /docs` renders it with a
//! page of our own (no UI crate: those fetch their assets at build time or from a CDN).

use std::sync::LazyLock;

use axum::body::Bytes;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use utoipa::OpenApi;
use wire::ErrorCode::{self, *};

/// The parts of the document no handler declares: its title, the tags in reading order, the
/// bearer scheme, and the WebSocket messages (a socket's frames are not an HTTP body, but a
/// client author needs their schemas).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "sandpool",
        description = "Pooled, stateful sandboxes for agentic RL: sessions, commands, files, \
                       persistent shells, snapshots, functions, quotas. Every call but the health checks \
                       needs `Authorization: Bearer <JWT>`. Every error answers with an \
                       `ErrorBody` whose `code` fixes the status; 429 and 503 carry \
                       `Retry-After`.",
        license(name = "Apache-2.0")
    ),
    tags(
        (name = "sessions", description = "Open, find, keep, pause and end sessions."),
        (name = "commands", description = "Run commands in a session's sandbox: one call, or streamed over a WebSocket."),
        (name = "files", description = "Read and write files and directories in a session's sandbox."),
        (name = "shells", description = "Persistent shells: state (cwd, variables, functions) carried from one command to the next."),
        (name = "snapshots", description = "A session's filesystem as a private template, and forks from it."),
        (name = "templates", description = "What sandboxes can be made from."),
        (name = "functions", description = "Functions: invocations in warm environments reused per function (exec or runtime mode), synchronous, asynchronous or mapped over a batch."),
        (name = "reservations", description = "Declare a burst ahead so the pool is warm for it."),
        (name = "quotas", description = "Nested limits on principal paths and what is in use."),
        (name = "egress", description = "Named egress policies: what a session on the egress network may connect to."),
        (name = "operations", description = "Health, readiness, pools, this document."),
    ),
    components(schemas(wire::ErrorCode, wire::quotas::Dimension, wire::ws::ClientMsg, wire::ws::ServerMsg, wire::GoneReason, Binary))
)]
pub struct Base;

/// Raw bytes (file contents, a directory's tar).
pub struct Binary;

impl utoipa::PartialSchema for Binary {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl utoipa::ToSchema for Binary {}

/// The error codes an operation can answer with beyond those of every authenticated call
/// (`unauthorized`, `internal`, `unavailable`) and of every call with a body
/// (`payload_too_large`). A new route forces an entry here: the
/// document test fails on an operation missing from this table.
pub fn errors_of(operation: &str) -> Option<&'static [ErrorCode]> {
    // What a call on an existing session can meet: the id is unknown or ended, the node or
    // the sandbox failed or did not answer, another gateway fenced the lease.
    const SESSION: &[ErrorCode] =
        &[NotFound, SessionGone, NodeUnavailable, BadGateway, SandboxFailed, GatewayTimeout, StaleFence];
    // The same for a call that uses the sandbox (counts against the call rate).
    const CALL: &[ErrorCode] = &[
        BadRequest,
        NotFound,
        SessionGone,
        NodeUnavailable,
        BadGateway,
        SandboxFailed,
        SandboxBusy,
        GatewayTimeout,
        StaleFence,
        QuotaExceeded,
    ];
    // A download over the template's limit is 413 (the body limit of uploads is added below).
    const READ: &[ErrorCode] = &[
        BadRequest,
        InvalidPath,
        IsDirectory,
        NotFound,
        SessionGone,
        NodeUnavailable,
        BadGateway,
        SandboxFailed,
        SandboxBusy,
        GatewayTimeout,
        StaleFence,
        QuotaExceeded,
        PayloadTooLarge,
    ];
    // Every other file call: the same but the last.
    const FILE: &[ErrorCode] = READ.split_last().expect("READ is not empty").1;
    const FILE_OP: &[ErrorCode] = &[
        BadRequest,
        InvalidPath,
        NotFound,
        Conflict,
        SessionGone,
        NodeUnavailable,
        BadGateway,
        SandboxFailed,
        SandboxBusy,
        GatewayTimeout,
        StaleFence,
        QuotaExceeded,
    ];
    const SHELL: &[ErrorCode] = &[
        BadRequest,
        NotFound,
        SessionGone,
        Conflict,
        ShellGone,
        NodeUnavailable,
        BadGateway,
        SandboxFailed,
        SandboxBusy,
        GatewayTimeout,
        StaleFence,
        QuotaExceeded,
        TooManyRequests,
    ];
    const CREATE: &[ErrorCode] = &[
        BadRequest,
        UnknownTemplate,
        Conflict,
        QuotaExceeded,
        Forbidden,
        TooManyRequests,
        NodeFull,
        BadGateway,
        ImagePullFailed,
    ];
    const QUOTA: &[ErrorCode] = &[BadRequest, Forbidden];
    const PORT: &[ErrorCode] = &[
        BadRequest,
        Forbidden,
        NotFound,
        SessionGone,
        Conflict,
        TooManyRequests,
        QuotaExceeded,
        NodeUnavailable,
        BadGateway,
        SandboxFailed,
        SandboxBusy,
        GatewayTimeout,
        StaleFence,
    ];
    const SIGNED_PORT: &[ErrorCode] = &[
        BadRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        SessionGone,
        Conflict,
        TooManyRequests,
        QuotaExceeded,
        Unavailable,
        NodeUnavailable,
        BadGateway,
        SandboxFailed,
        SandboxBusy,
        GatewayTimeout,
        StaleFence,
        Internal,
    ];
    Some(match operation {
        "create_session" => CREATE,
        "list_sessions" | "list_egress_policies" | "list_templates" | "list_functions" => &[BadRequest],
        "delete_sessions" => &[BadRequest],
        "set_egress_policy" => &[BadRequest, Forbidden, Conflict],
        "delete_egress_policy" => &[Forbidden, Conflict, NotFound],
        "set_session_egress" => {
            &[BadRequest, NotFound, SessionGone, Forbidden, BadGateway, SandboxFailed, GatewayTimeout, StaleFence]
        }
        "get_session" | "delete_session" | "keepalive_session" | "resume_session" | "pause_session" => SESSION,
        "pause_sessions" | "resume_sessions" => &[BadRequest, BadGateway, GatewayTimeout],
        "exec" | "open_websocket" => CALL,
        "create_ws_ticket" => SESSION,
        "read_file" => READ,
        "write_file" | "list_dir" | "list_workdir" | "path_exists" => FILE,
        // A directory not empty, a target or a file in the way already there.
        "remove_file" | "rename_file" | "make_dir" => FILE_OP,
        "open_shell" | "list_shells" | "close_shell" | "run_in_shell" | "interrupt_shell" => SHELL,
        "snapshot_session" => &[NotFound, SessionGone, BadGateway, SandboxFailed, GatewayTimeout, QuotaExceeded],
        "fork_session" => &[
            BadRequest,
            NotFound,
            SessionGone,
            Conflict,
            BadGateway,
            SandboxFailed,
            GatewayTimeout,
            QuotaExceeded,
            TooManyRequests,
        ],
        "usage" => &[],
        "delete_template" => &[Forbidden, NotFound],
        "get_template" => &[NotFound],
        "create_template" => &[
            BadRequest,
            Forbidden,
            UnknownTemplate,
            ImageNotFound,
            ImagePullFailed,
            Conflict,
            QuotaExceeded,
            BadGateway,
        ],
        "prefetch_images" => &[BadRequest, UnknownTemplate, Forbidden, ImageNotFound, ImagePullFailed, BadGateway],
        "list_images" => &[Forbidden],
        "put_function" => &[BadRequest, UnknownTemplate, QuotaExceeded],
        "get_function" | "delete_function" => &[NotFound],
        "invoke_function" | "map_function" => &[
            BadRequest,
            NotFound,
            PayloadTooLarge,
            TooManyRequests,
            QuotaExceeded,
            Forbidden,
            NodeFull,
            Unavailable,
            FunctionTimeout,
            FunctionCrashed,
            BadGateway,
            SandboxFailed,
            GatewayTimeout,
        ],
        "get_invocation" => &[NotFound],
        "create_reservation" => &[BadRequest, UnknownTemplate, QuotaExceeded, Forbidden],
        "pools" | "verify_quotas" => &[Forbidden, BadRequest],
        "get_quota" | "set_quota" | "delete_quota" => QUOTA,
        "healthz" | "readyz" | "openapi" | "docs" => &[],
        "sign_port_url" => &[BadRequest, Forbidden, NotFound, SessionGone, NodeUnavailable],
        // A port's answers are its server's own; these are the gateway's and the node's. A
        // signed URL's have no bearer token, but a ticket that can be refused all the same.
        op if crate::ports::is_port_operation(op) == Some(false) => PORT,
        op if crate::ports::is_port_operation(op) == Some(true) => SIGNED_PORT,
        _ => return None,
    })
}

/// Operations that need no credentials.
const PUBLIC: &[&str] = &["healthz", "readyz", "openapi", "docs"];

/// The finished document: the handlers' declarations and `Base`, with the error answers of
/// every operation added, wildcard segments (`{*path}`, axum's) written as OpenAPI's `{path}`,
/// and the bearer scheme required everywhere but on the public operations.
pub fn document(api: utoipa::openapi::OpenApi) -> Value {
    let mut doc = serde_json::to_value(&api).expect("an OpenAPI document serializes");
    let paths = doc["paths"].as_object_mut().map(std::mem::take).unwrap_or_default();
    let mut renamed = Map::new();
    for (path, mut item) in paths {
        for (_, op) in item.as_object_mut().into_iter().flatten() {
            let id = op["operationId"].as_str().unwrap_or_default().to_string();
            let Some(codes) = errors_of(&id) else { continue };
            // A signed URL's ticket stands in for the bearer token (a 401 all the same).
            let public = PUBLIC.contains(&id.as_str()) || crate::ports::is_port_operation(&id) == Some(true);
            let mut all: Vec<ErrorCode> = codes.to_vec();
            if !public {
                all.extend([Unauthorized, Internal, Unavailable]);
            }
            if id == "readyz" {
                all.push(Unavailable);
            }
            // Any body may be over the body limit.
            if op.get("requestBody").is_some() {
                all.push(PayloadTooLarge);
            }
            let responses = op["responses"].as_object_mut().expect("every operation has responses");
            for (status, codes) in by_status(&all) {
                responses.insert(status.to_string(), error_response(status, &codes));
            }
            if !public {
                op["security"] = json!([{ "bearer": [] }]);
            }
        }
        renamed.insert(path.replace("{*", "{"), item);
    }
    doc["paths"] = Value::Object(renamed);
    doc["components"]["schemas"]["ErrorBody"] = json!({
        "type": "object",
        "description": "Every error answer's body. `code` fixes the HTTP status; on `quota_exceeded`, the fields of the limit that refused the request sit beside it.",
        "required": ["code", "message"],
        "properties": {
            "code": { "$ref": "#/components/schemas/ErrorCode" },
            "message": { "type": "string", "description": "For humans; names the offending field where there is one." },
            "request_id": { "type": "string", "description": "On 5xx answers: quote it to the operators, whose log holds the cause under this id." },
            "dimension": { "$ref": "#/components/schemas/Dimension" },
            "path": { "type": "string", "description": "The level of the caller's path whose limit is reached." },
            "limit": { "type": "number" },
            "used": { "type": "number" }
        }
    });
    doc["components"]["securitySchemes"] = json!({
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "JWT",
            "description": "HS256 or RS256 JWT: `sub` is the principal path (`acme/rl/ppo-7`), `exp` required; `scope: admin` for operator calls."
        }
    });
    doc["components"]["headers"] = json!({
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "schema": { "type": "integer", "minimum": 1 }
        }
    });
    doc
}

/// Codes grouped by their HTTP status, statuses ascending, codes in first-seen order.
fn by_status(codes: &[ErrorCode]) -> Vec<(u16, Vec<ErrorCode>)> {
    let mut out: Vec<(u16, Vec<ErrorCode>)> = Vec::new();
    for &c in codes {
        let status = http_util::status_of(c).as_u16();
        match out.iter_mut().find(|(s, _)| *s == status) {
            Some((_, v)) if !v.contains(&c) => v.push(c),
            Some(_) => {}
            None => out.push((status, vec![c])),
        }
    }
    out.sort_by_key(|(s, _)| *s);
    out
}

/// One error answer: `ErrorBody` with `code` narrowed to the codes this status carries here.
fn error_response(status: u16, codes: &[ErrorCode]) -> Value {
    let description: Vec<String> = codes.iter().map(|c| format!("`{c}`: {}", c.meaning())).collect();
    let names: Vec<&str> = codes.iter().map(|c| c.as_str()).collect();
    let mut resp = json!({
        "description": description.join("; "),
        "content": { "application/json": { "schema": {
            "allOf": [
                { "$ref": "#/components/schemas/ErrorBody" },
                { "type": "object", "properties": { "code": { "type": "string", "enum": names } } }
            ]
        } } }
    });
    if status == 429 || status == 503 {
        resp["headers"] = json!({ "Retry-After": { "$ref": "#/components/headers/Retry-After" } });
    }
    resp
}

/// `GET /openapi.json`, rendered once.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", operation_id = "openapi", summary = "This document", responses((status = 200, description = "This document.", content_type = "application/json")))]
pub async fn serve_document() -> Response {
    static DOC: LazyLock<Bytes> = LazyLock::new(|| {
        let (_, api) = crate::routes().split_for_parts();
        Bytes::from(serde_json::to_vec(&document(api)).expect("a JSON value serializes"))
    });
    let mut resp = DOC.clone().into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The docs page: a self-contained page that renders `/openapi.json` (works offline).
#[utoipa::path(get, path = "/docs", tag = "operations", operation_id = "docs", summary = "The API reference page", responses((status = 200, description = "The API reference as a web page.", content_type = "text/html")))]
pub async fn docs() -> Response {
    let mut resp = include_str!("docs.html").into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Value {
        document(crate::routes().split_for_parts().1)
    }

    #[test]
    fn every_operation_names_its_errors() {
        let doc = doc();
        if let Ok(out) = std::env::var("SANDPOOL_OPENAPI_OUT") {
            std::fs::write(out, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
        }
        let mut ids = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            assert!(!path.contains('*'), "{path}: a wildcard left in");
            for (method, op) in item.as_object().unwrap() {
                let id = op["operationId"].as_str().unwrap_or_else(|| panic!("{method} {path}: no operationId"));
                assert!(errors_of(id).is_some(), "{method} {path} ({id}): add its error codes to errors_of");
                ids.push(id.to_string());
            }
        }
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "operation ids are unique");
    }

    /// The other direction: a route registered any other way than `routes!` in `routes()`
    /// would be served but missing from the document, so no source of the gateway may.
    #[test]
    fn routes_are_registered_only_with_their_declaration() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        // Spelled out at run time, so this test's own source does not match.
        let calls: Vec<String> =
            ["route", "route_service", "nest", "nest_service", "merge"].iter().map(|m| format!(".{m}(")).collect();
        // Every source file, in the modules' folders too.
        let mut files = Vec::new();
        let mut dirs = vec![dir];
        while let Some(d) = dirs.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else {
                    files.push(path);
                }
            }
        }
        assert!(files.iter().any(|p| p.ends_with("functions/invoke.rs")), "the walk reaches the folders");
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap();
            for call in &calls {
                assert!(
                    !text.contains(call.as_str()),
                    "{}: `{call}` adds a route that /openapi.json would not show; declare it with \
                     #[utoipa::path] and register it with routes! in lib.rs `routes()`",
                    path.display()
                );
            }
        }
    }

    #[test]
    fn the_document_is_complete_and_its_errors_are_the_servers() {
        let doc = doc();
        let create = &doc["paths"]["/v1/sessions"]["post"];
        assert_eq!(
            create["requestBody"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/CreateSession"
        );
        let quota = &create["responses"]["429"];
        let codes = &quota["content"]["application/json"]["schema"]["allOf"][1]["properties"]["code"]["enum"];
        assert_eq!(codes, &json!(["quota_exceeded", "too_many_requests"]));
        assert!(quota["headers"]["Retry-After"].is_object());
        assert!(doc["paths"]["/healthz"]["get"].get("security").is_none());
        assert_eq!(doc["paths"]["/v1/usage"]["get"]["security"], json!([{ "bearer": [] }]));
        // A body-less call is never answered 413.
        assert!(doc["paths"]["/v1/sessions/{id}"]["get"]["responses"].get("413").is_none());
        for name in ["ErrorBody", "ErrorCode", "ClientMsg", "ServerMsg", "Binary"] {
            assert!(doc["components"]["schemas"][name].is_object(), "{name}");
        }
    }
}
