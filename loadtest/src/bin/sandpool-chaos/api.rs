//! Calls to the deployment and what each is counted as (`Outcome`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde::Serialize;
use serde_json::{Value, json};
use tests::rand_hex;

use crate::{CALL_DEADLINE, MAX_WAIT_S};

/// What a call came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Outcome {
    Ok,
    /// 429 or 503 with Retry-After: the platform said "not now".
    Refused,
    /// The session ended, and the answer says why (404 `session_gone`, 502 `sandbox_failed`).
    Ended,
    /// The gateway died while the call was in flight (no answer): expected of a killed gateway.
    ConnectionLost,
    /// Any other error answer (4xx/5xx) that is not an invariant broken.
    Failed,
    // Violations:
    /// Past its deadline.
    Hung,
    /// 429/503 without Retry-After.
    NoRetryAfter,
    /// 500: a bug.
    Internal,
    /// 404 `not_found` for a session this client holds: the platform forgot it.
    UnknownSession,
    /// 200 with the wrong content (an echo that does not echo, a file that differs).
    WrongAnswer,
    /// No gateway could be reached (only one is ever killed at a time).
    NoGateway,
}

impl Outcome {
    pub(crate) fn violation(self) -> bool {
        self >= Outcome::Hung
    }
}

pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) body: Value,
    pub(crate) bytes: Vec<u8>,
    pub(crate) retry_after: Option<f64>,
}

/// Counters and findings, shared by every task of the run.
#[derive(Default)]
pub(crate) struct Record {
    pub(crate) t0: Option<Instant>,
    pub(crate) calls: BTreeMap<String, BTreeMap<Outcome, u64>>,
    pub(crate) violations: Vec<Value>,
    /// sandbox id -> the session it was granted to.
    pub(crate) grants: HashMap<String, String>,
    /// Episodes: started, completed (every step answered, deleted), and the rest.
    pub(crate) episodes: BTreeMap<&'static str, u64>,
    /// Sessions this client opened and has not seen end: id -> tenant.
    pub(crate) open: HashMap<String, String>,
    /// Creates whose gateway died under them, per tenant: each may have left a session the
    /// client never heard of (it lives until its idle timeout; RELIABILITY.md, open).
    pub(crate) lost_creates: HashMap<String, usize>,
}

impl Record {
    pub(crate) fn at_s(&self) -> f64 {
        self.t0.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0)
    }

    pub(crate) fn violation(&mut self, what: &str, detail: String) {
        let at_s = (self.at_s() * 10.0).round() / 10.0;
        eprintln!("VIOLATION at {at_s} s: {what}: {detail}");
        self.violations.push(json!({"at_s": at_s, "what": what, "detail": detail}));
    }
}

/// The outcome of an answer that is not the call's success.
pub(crate) fn classify(r: &Reply) -> Outcome {
    let code = r.body["code"].as_str().unwrap_or("");
    match r.status {
        429 | 503 if r.retry_after.is_some() => Outcome::Refused,
        429 | 503 => Outcome::NoRetryAfter,
        404 if code == "session_gone" => Outcome::Ended,
        // The session ended (its record says why), or its sandbox is gone and the ending is
        // on its way (the node saw the container die before the record was written).
        502 if code == "sandbox_failed" => Outcome::Ended,
        404 if code == "not_found" => Outcome::UnknownSession,
        500 => Outcome::Internal,
        _ => Outcome::Failed,
    }
}

#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) http: reqwest::Client,
    pub(crate) gateways: Arc<Vec<String>>,
    pub(crate) tokens: Arc<HashMap<String, String>>,
    pub(crate) rec: Arc<Mutex<Record>>,
}

impl Api {
    /// One call through gateway `gw` (the other if `gw` cannot be connected to), bounded by
    /// `deadline`. `Err` carries the outcome when there is no answer.
    pub(crate) async fn call(
        &self,
        gw: usize,
        tenant: &str,
        method: Method,
        path: &str,
        body: Option<Body>,
        deadline: Duration,
    ) -> Result<Reply, Outcome> {
        // The request id the gateways' access logs (and the nodes') carry: a hang names it.
        let request_id = rand_hex(8);
        let tried = Mutex::new(Vec::new());
        let attempt = async {
            for i in 0..self.gateways.len() {
                let url = &self.gateways[(gw + i) % self.gateways.len()];
                tried.lock().unwrap().push(url.clone());
                let mut req = self
                    .http
                    .request(method.clone(), format!("{url}{path}"))
                    .bearer_auth(&self.tokens[tenant])
                    .header("x-request-id", &request_id);
                match &body {
                    Some(Body::Json(v)) => req = req.json(v),
                    Some(Body::Bytes(b)) => req = req.body(b.clone()),
                    None => {}
                }
                match req.send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let retry_after = resp
                            .headers()
                            .get(reqwest::header::RETRY_AFTER)
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<f64>().ok());
                        let bytes = match resp.bytes().await {
                            Ok(b) => b.to_vec(),
                            Err(_) => return Err(Outcome::ConnectionLost),
                        };
                        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                        return Ok(Reply { status, body, bytes, retry_after });
                    }
                    // Nothing listens there: the next gateway, as a load balancer would.
                    Err(e) if e.is_connect() => continue,
                    Err(_) => return Err(Outcome::ConnectionLost),
                }
            }
            Err(Outcome::NoGateway)
        };
        match tokio::time::timeout(deadline, attempt).await {
            Ok(r) => r,
            Err(_) => {
                let tried = tried.lock().unwrap().join(", then ");
                eprintln!("  no answer within {deadline:?}: {method} {path}, request {request_id}, via {tried}");
                Err(Outcome::Hung)
            }
        }
    }

    /// Counts a call's outcome under `kind`; a violation is recorded with `detail`.
    pub(crate) fn count(&self, kind: &str, outcome: Outcome, detail: impl FnOnce() -> String) {
        let mut r = self.rec.lock().unwrap();
        *r.calls.entry(kind.to_string()).or_default().entry(outcome).or_default() += 1;
        if outcome.violation() {
            r.violation(&format!("{kind}: {outcome:?}"), detail());
        } else if outcome == Outcome::Failed {
            // Not an invariant broken, but not an answer a fault explains either: say which.
            eprintln!("[{:.1} s] {kind} failed: {}", r.at_s(), detail());
        }
    }

    /// A call on a session: its outcome, counted, with the reply when it was a success.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn session_call(
        &self,
        kind: &str,
        gw: usize,
        tenant: &str,
        method: Method,
        path: &str,
        body: Option<Body>,
        ok: u16,
    ) -> (Outcome, Option<Reply>) {
        self.checked_call(kind, gw, tenant, method, path, body, ok, |_| None).await
    }

    /// `session_call` whose success is also checked: `wrong` names what is wrong with a reply
    /// of status `ok` (then the outcome is `WrongAnswer`), or `None` when it is right.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn checked_call(
        &self,
        kind: &str,
        gw: usize,
        tenant: &str,
        method: Method,
        path: &str,
        body: Option<Body>,
        ok: u16,
        wrong: impl FnOnce(&Reply) -> Option<String>,
    ) -> (Outcome, Option<Reply>) {
        match self.call(gw, tenant, method.clone(), path, body, CALL_DEADLINE).await {
            Ok(r) if r.status == ok => {
                let wrong = wrong(&r);
                let o = if wrong.is_some() { Outcome::WrongAnswer } else { Outcome::Ok };
                self.count(kind, o, || format!("{method} {path}: {}", wrong.unwrap_or_default()));
                (o, Some(r))
            }
            Ok(r) => {
                let o = classify(&r);
                self.count(kind, o, || format!("{method} {path}: {} {}", r.status, r.body));
                (o, Some(r))
            }
            Err(o) => {
                self.count(kind, o, || format!("{method} {path}"));
                (o, None)
            }
        }
    }

    /// Runs `echo <word>` and checks the answer: Ok only when it echoed.
    pub(crate) async fn echo(
        &self,
        kind: &str,
        gw: usize,
        tenant: &str,
        sid: &str,
        word: &str,
    ) -> (Outcome, Option<Reply>) {
        let path = format!("/v1/sessions/{sid}/exec");
        let body = Body::Json(json!({"cmd": format!("echo {word}"), "timeout_ms": 10_000}));
        let wrong = |r: &Reply| {
            let right = r.body["stdout"].as_str() == Some(&format!("{word}\n")) && r.body["exit_code"] == 0;
            (!right).then(|| format!("echo {word} answered {}", r.body))
        };
        self.checked_call(kind, gw, tenant, Method::POST, &path, Some(body), 200, wrong).await
    }

    /// Writes `data` to `path` in the session and reads it back.
    pub(crate) async fn file_roundtrip(
        &self,
        gw: usize,
        tenant: &str,
        sid: &str,
        path: &str,
        data: Vec<u8>,
    ) -> Outcome {
        let url = format!("/v1/sessions/{sid}/files/{path}");
        let (o, _) =
            self.session_call("put_file", gw, tenant, Method::PUT, &url, Some(Body::Bytes(data.clone())), 204).await;
        if o != Outcome::Ok {
            return o;
        }
        self.read_back(gw, tenant, sid, path, &data).await
    }

    pub(crate) async fn read_back(&self, gw: usize, tenant: &str, sid: &str, path: &str, data: &[u8]) -> Outcome {
        let url = format!("/v1/sessions/{sid}/files/{path}");
        match self.call(gw, tenant, Method::GET, &url, None, CALL_DEADLINE).await {
            Ok(r) if r.status == 200 => {
                let o = if r.bytes == data { Outcome::Ok } else { Outcome::WrongAnswer };
                self.count("get_file", o, || {
                    format!("{sid}: {path} read back {} bytes, {} written", r.bytes.len(), data.len())
                });
                o
            }
            Ok(r) => {
                let o = classify(&r);
                self.count("get_file", o, || format!("{sid}: {} {}", r.status, r.body));
                o
            }
            Err(o) => {
                self.count("get_file", o, || format!("{sid}: get {path}"));
                o
            }
        }
    }

    /// Opens a session of `template`; `(session, sandbox)` on success. A sandbox granted before is
    /// recorded as a double grant.
    pub(crate) async fn create(&self, gw: usize, tenant: &str, template: &str) -> Option<(String, String)> {
        let body = json!({"template": template, "max_wait_s": MAX_WAIT_S, "labels": {"chaos": "1"}});
        let deadline = CALL_DEADLINE + Duration::from_secs(MAX_WAIT_S);
        let r = match self.call(gw, tenant, Method::POST, "/v1/sessions", Some(Body::Json(body)), deadline).await {
            Ok(r) => r,
            Err(o) => {
                self.count("create", o, || format!("{tenant}: create"));
                if o == Outcome::ConnectionLost {
                    *self.rec.lock().unwrap().lost_creates.entry(tenant.to_string()).or_default() += 1;
                }
                return None;
            }
        };
        if r.status != 201 {
            let o = match classify(&r) {
                // Creates have no session to be unknown: a 404 is some other failure.
                Outcome::UnknownSession | Outcome::Ended => Outcome::Failed,
                o => o,
            };
            self.count("create", o, || format!("{tenant}: {} {}", r.status, r.body));
            return None;
        }
        self.count("create", Outcome::Ok, String::new);
        let sid = r.body["session_id"].as_str().unwrap_or_default().to_string();
        let sandbox = r.body["sandbox_id"].as_str().unwrap_or_default().to_string();
        let node = r.body["node"].as_str().unwrap_or_default().to_string();
        let mut rec = self.rec.lock().unwrap();
        rec.open.insert(sid.clone(), tenant.to_string());
        if let Some(before) = rec.grants.insert(sandbox.clone(), sid.clone()) {
            rec.violation("double grant", format!("sandbox {sandbox} on {node} went to {before} and to {sid}"));
        }
        Some((sid, sandbox))
    }

    /// Claims the sandbox for this session: an owner file that must not exist yet.
    pub(crate) async fn claim(&self, gw: usize, tenant: &str, sid: &str, sandbox: &str) -> Outcome {
        let cmd = format!(
            "if [ -e /tmp/.chaos-owner ]; then cat /tmp/.chaos-owner; exit 3; fi; echo {sid} > /tmp/.chaos-owner; echo {sid}"
        );
        let path = format!("/v1/sessions/{sid}/exec");
        let body = Body::Json(json!({"cmd": cmd, "timeout_ms": 10_000}));
        match self.call(gw, tenant, Method::POST, &path, Some(body), CALL_DEADLINE).await {
            Ok(r) if r.status == 200 && r.body["exit_code"] == 3 => {
                self.count("claim", Outcome::WrongAnswer, String::new);
                let owner = r.body["stdout"].as_str().unwrap_or("").trim().to_string();
                self.rec.lock().unwrap().violation(
                    "double grant",
                    format!("sandbox {sandbox} of session {sid} was already claimed by {owner}"),
                );
                Outcome::WrongAnswer
            }
            Ok(r) if r.status == 200 => {
                let right = r.body["stdout"].as_str() == Some(&format!("{sid}\n"));
                let o = if right { Outcome::Ok } else { Outcome::WrongAnswer };
                self.count("claim", o, || format!("{sid}: claim answered {}", r.body));
                o
            }
            Ok(r) => {
                let o = classify(&r);
                self.count("claim", o, || format!("{sid}: {} {}", r.status, r.body));
                o
            }
            Err(o) => {
                self.count("claim", o, || format!("{sid}: claim"));
                o
            }
        }
    }

    /// Ends a session, retrying while the platform says "not now" (for up to a minute).
    pub(crate) async fn delete(&self, gw: usize, tenant: &str, sid: &str) -> Outcome {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let path = format!("/v1/sessions/{sid}");
            let (o, r) = self.session_call("delete", gw, tenant, Method::DELETE, &path, None, 204).await;
            match o {
                Outcome::Ok | Outcome::Ended => {
                    self.rec.lock().unwrap().open.remove(sid);
                    return o;
                }
                Outcome::Refused | Outcome::ConnectionLost if Instant::now() < until => {
                    let wait = r.and_then(|r| r.retry_after).unwrap_or(1.0).clamp(0.2, 3.0);
                    tokio::time::sleep(Duration::from_secs_f64(wait)).await;
                }
                o => return o,
            }
        }
    }
}

pub(crate) enum Body {
    Json(Value),
    Bytes(Vec<u8>),
}

#[cfg(test)]
mod classify_tests {
    use super::*;

    pub(crate) fn reply(status: u16, code: &str, retry_after: Option<f64>) -> Reply {
        let body = json!({"code": code, "message": "m"});
        Reply { status, bytes: body.to_string().into_bytes(), body, retry_after }
    }

    #[test]
    pub(crate) fn refusals_need_retry_after_and_a_500_or_a_forgotten_session_is_a_violation() {
        assert_eq!(classify(&reply(429, "quota_exceeded", Some(1.0))), Outcome::Refused);
        assert_eq!(classify(&reply(503, "unavailable", Some(1.0))), Outcome::Refused);
        assert_eq!(classify(&reply(503, "unavailable", None)), Outcome::NoRetryAfter);
        assert_eq!(classify(&reply(404, "session_gone", None)), Outcome::Ended);
        assert_eq!(classify(&reply(502, "sandbox_failed", None)), Outcome::Ended);
        assert_eq!(classify(&reply(404, "not_found", None)), Outcome::UnknownSession);
        assert_eq!(classify(&reply(500, "internal", None)), Outcome::Internal);
        assert_eq!(classify(&reply(502, "bad_gateway", None)), Outcome::Failed);
        let violations = [
            Outcome::Hung,
            Outcome::NoRetryAfter,
            Outcome::Internal,
            Outcome::UnknownSession,
            Outcome::WrongAnswer,
            Outcome::NoGateway,
        ];
        for o in violations {
            assert!(o.violation(), "{o:?}");
        }
        for o in [Outcome::Ok, Outcome::Refused, Outcome::Ended, Outcome::ConnectionLost, Outcome::Failed] {
            assert!(!o.violation(), "{o:?}");
        }
    }
}
