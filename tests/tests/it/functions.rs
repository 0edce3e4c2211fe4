//! Functions end to end, on real Docker and Redis: exec and runtime modes, environments reused
//! and never shared, failures that retire them, the limits, asynchronous and mapped calls.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Client, Stack, StackOpts, eventually};

/// A Debian template (python3, for the runtime) beside the busybox ones.
fn stack_opts(warm: u32) -> StackOpts {
    let extra = "[templates.deb]\nimage = \"sandpool/debian:bookworm\"\nexec = \"agent\"\nworkdir = \"/work\"\n\
                 cpus = 1.0\nmemory_mb = 256\npids = 1024\nwarm = 2\nidle_timeout = \"10m\"\nmax_lifetime = \"1h\"\n";
    StackOpts { warm, extra_toml: extra.into(), ..Default::default() }
}

/// An answer's body as bytes and the headers that matter here.
struct Invoked {
    status: u16,
    body: Vec<u8>,
    headers: reqwest::header::HeaderMap,
}

impl Invoked {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn header(&self, name: &str) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string()
    }
    fn environment(&self) -> String {
        self.header("x-sandpool-environment")
    }
}

async fn invoke_raw(stack: &Stack, tenant: &str, path: &str, body: Vec<u8>) -> Invoked {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", stack.url))
        .bearer_auth(stack.token(tenant))
        .body(body)
        .send()
        .await
        .expect("gateway answers");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    Invoked { status, headers, body: resp.bytes().await.expect("body").to_vec() }
}

async fn invoke(stack: &Stack, tenant: &str, name: &str, payload: Value) -> Invoked {
    invoke_raw(stack, tenant, &format!("/v1/functions/{name}/invoke"), payload.to_string().into_bytes()).await
}

async fn deploy(c: &Client, name: &str, def: Value) -> Value {
    let a = c.call(Method::PUT, &format!("/v1/functions/{name}"), Some(def)).await;
    assert!(a.status == 201 || a.status == 200, "deploy {name}: {} {:?}", a.status, a.body);
    a.body
}

/// A runtime-mode function of the module `source`: the image holds no test module, so the
/// handler writes it from the function's env, then runs the Python runtime on it.
fn python_handler(source: &str, function: &str) -> Value {
    let boot = format!(
        "import os,sys,runpy; open('/tmp/h.py','w').write(os.environ['SRC']); sys.path.insert(0,'/tmp'); \
         sys.argv=['sandpool_runtime','h:{function}']; runpy.run_module('sandpool_runtime', run_name='__main__')"
    );
    json!({"template": "deb", "mode": "runtime", "handler": ["python3", "-c", boot], "env": {"SRC": source}})
}

const HANDLERS: &str = r#"
import json, os, time
calls = 0
def echo(event):
    global calls
    calls += 1
    return {"event": event, "calls": calls, "pid": os.getpid()}
def boom(event):
    if event == "raise":
        raise ValueError("bad input")
    if event == "exit":
        os._exit(3)
    if event == "sleep":
        time.sleep(30)
    return "fine"
def state(event):
    if event == "write":
        open("/tmp/secret", "w").write("A's data")
        return "written"
    return os.path.exists("/tmp/secret")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_mode_runs_the_handler_per_invocation_and_reuses_its_environment() {
    let stack = Stack::start(stack_opts(2)).await;
    let c = stack.client("acme");
    // Reads the payload from stdin, counts its invocations in the environment's /tmp.
    let script = "n=$(cat /tmp/n 2>/dev/null || echo 0); n=$((n+1)); echo $n > /tmp/n; \
                  p=$(cat); [ \"$p\" = '\"fail\"' ] && { echo oops >&2; exit 4; }; printf '{\"n\":%s,\"got\":%s}' $n \"$p\"";
    let def = deploy(&c, "count", json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", script]})).await;
    assert_eq!((def["version"].as_u64(), def["mode"].as_str()), (Some(1), Some("exec")));

    let first = invoke(&stack, "acme", "count", json!({"a": 1})).await;
    assert_eq!(first.status, 200, "{:?}", String::from_utf8_lossy(&first.body));
    assert_eq!(first.json(), json!({"n": 1, "got": {"a": 1}}));
    assert_eq!(first.header("x-sandpool-start"), "cold");
    let second = invoke(&stack, "acme", "count", json!(2)).await;
    assert_eq!((second.json()["n"].as_u64(), second.header("x-sandpool-start").as_str()), (Some(2), "warm"));
    assert_eq!(second.environment(), first.environment(), "the environment is reused");
    assert!(second.header("x-sandpool-duration-ms").parse::<f64>().unwrap() > 0.0);

    // An environment whose session is deleted behind the function's back: invocations go on
    // (a sandbox being removed may serve one more), in a new environment within a few.
    assert_eq!(c.delete(&second.environment()).await, 204);
    let mut moved = false;
    for _ in 0..5 {
        let r = invoke(&stack, "acme", "count", json!(0)).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        if r.environment() != second.environment() {
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(moved, "invocations stayed in a deleted environment");

    // A non-zero exit is the function's error; its environment is retired with its state.
    let failed = invoke(&stack, "acme", "count", json!("fail")).await;
    assert_eq!(failed.status, 200);
    assert_eq!(failed.header("x-sandpool-function-error"), "unhandled");
    let err = failed.json();
    assert_eq!((err["type"].as_str(), err["exit_code"].as_i64()), (Some("ExitStatus"), Some(4)), "{err}");
    assert!(err["log"].as_str().unwrap().contains("oops"));
    let failed_in = failed.environment();
    let after = invoke(&stack, "acme", "count", json!(3)).await;
    assert_eq!(after.json()["n"].as_u64(), Some(1), "nothing of the failed invocation's environment survives");
    assert_ne!(after.environment(), failed_in);

    // The function and its environments, as the owner sees them.
    let got = c.call(Method::GET, "/v1/functions/count", None).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body["environments"]["total"].as_u64(), Some(1), "{:?}", got.body);
    let listed = c.call(Method::GET, "/v1/functions", None).await;
    assert_eq!(listed.body["functions"].as_array().map(Vec::len), Some(1));
    assert_eq!(c.call(Method::DELETE, "/v1/functions/count", None).await.status, 204);
    assert_eq!(invoke(&stack, "acme", "count", json!(1)).await.status, 404);
    // Its environment ends with it.
    let env = after.environment();
    let ended = eventually(Duration::from_secs(5), || async {
        (c.call(Method::GET, &format!("/v1/sessions/{env}"), None).await.status == 404).then_some(())
    });
    assert!(ended.await.is_some(), "the deleted function's environment lives on");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_mode_keeps_a_worker_and_replaces_it_after_errors_crashes_and_timeouts() {
    let stack = Stack::start(stack_opts(0)).await;
    let c = stack.client("acme");
    deploy(&c, "echo", python_handler(HANDLERS, "echo")).await;
    let cold = invoke(&stack, "acme", "echo", json!({"x": 1})).await;
    assert_eq!(cold.status, 200, "{}", String::from_utf8_lossy(&cold.body));
    assert_eq!(cold.header("x-sandpool-start"), "cold");
    let warm = invoke(&stack, "acme", "echo", json!([1, 2])).await;
    assert_eq!(warm.header("x-sandpool-start"), "warm");
    let (a, b) = (cold.json(), warm.json());
    assert_eq!((a["calls"].as_u64(), b["calls"].as_u64()), (Some(1), Some(2)), "one worker, module state kept");
    assert_eq!(a["pid"], b["pid"], "a warm invocation spawns nothing");
    assert_eq!(b["event"], json!([1, 2]));

    let mut def = python_handler(HANDLERS, "boom");
    def["timeout_ms"] = json!(1500);
    deploy(&c, "boom", def).await;
    let fine = invoke(&stack, "acme", "boom", json!("ok")).await;
    assert_eq!(fine.json(), json!("fine"));
    // An exception: 200, the runtime's report, and a fresh environment next.
    let raised = invoke(&stack, "acme", "boom", json!("raise")).await;
    assert_eq!((raised.status, raised.header("x-sandpool-function-error").as_str()), (200, "handled"));
    let e = raised.json();
    assert_eq!((e["type"].as_str(), e["message"].as_str()), (Some("ValueError"), Some("bad input")), "{e}");
    assert!(e["traceback"].as_array().is_some_and(|t| !t.is_empty()));
    assert_eq!(raised.environment(), fine.environment(), "the failed invocation ran where the good one did");
    let next = invoke(&stack, "acme", "boom", json!("ok")).await;
    assert_eq!(next.status, 200);
    assert_ne!(next.environment(), fine.environment(), "an environment that failed is never reused");
    // The worker dies mid-invocation: 502, and the next invocation succeeds elsewhere.
    let crashed = invoke(&stack, "acme", "boom", json!("exit")).await;
    assert_eq!(crashed.status, 502);
    assert_eq!(crashed.json()["code"], "function_crashed");
    let next = invoke(&stack, "acme", "boom", json!("ok")).await;
    assert_eq!((next.status, next.json()), (200, json!("fine")));
    // Past its timeout: 504, the worker killed, its environment replaced.
    let t0 = std::time::Instant::now();
    let slow = invoke(&stack, "acme", "boom", json!("sleep")).await;
    assert_eq!((slow.status, slow.json()["code"].as_str()), (504, Some("function_timeout")));
    assert!(t0.elapsed() < Duration::from_secs(10), "the timeout took {:?}", t0.elapsed());
    let after = invoke(&stack, "acme", "boom", json!("ok")).await;
    assert_eq!(after.status, 200);
    assert_ne!(after.environment(), slow.environment());

    // A handler that cannot start (the runtime's report of its import) is an unhandled error.
    deploy(&c, "missing", python_handler(HANDLERS, "nope")).await;
    let bad = invoke(&stack, "acme", "missing", json!(1)).await;
    assert_eq!((bad.status, bad.header("x-sandpool-function-error").as_str()), (200, "unhandled"));
    assert!(bad.json()["message"].as_str().unwrap_or_default().contains("nope"), "{:?}", bad.json());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environments_are_never_shared_across_functions_or_principals() {
    let stack = Stack::start(stack_opts(0)).await;
    let c = stack.client("acme");
    deploy(&c, "a", python_handler(HANDLERS, "state")).await;
    deploy(&c, "b", python_handler(HANDLERS, "state")).await;
    assert_eq!(invoke(&stack, "acme", "a", json!("write")).await.json(), json!("written"));
    assert_eq!(invoke(&stack, "acme", "a", json!("read")).await.json(), json!(true), "A's own state is kept");
    for _ in 0..3 {
        assert_eq!(invoke(&stack, "acme", "b", json!("read")).await.json(), json!(false), "B sees A's file");
    }
    // Another principal, even a sibling under the same tenant, has no function "a".
    for other in ["globex", "acme/team"] {
        assert_eq!(invoke(&stack, other, "a", json!("read")).await.status, 404);
        assert_eq!(stack.client(other).call(Method::GET, "/v1/functions/a", None).await.status, 404);
        assert_eq!(stack.client(other).call(Method::DELETE, "/v1/functions/a", None).await.status, 404);
    }
    // Its own function of the same name is its own.
    deploy(&stack.client("globex"), "a", python_handler(HANDLERS, "state")).await;
    assert_eq!(invoke(&stack, "globex", "a", json!("read")).await.json(), json!(false));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_bad_definitions_concurrency_and_payloads() {
    let stack = Stack::start(stack_opts(2)).await;
    let c = stack.client("acme");
    for (def, field) in [
        (json!({"template": "bb", "mode": "exec", "handler": []}), "handler"),
        (json!({"template": "nope", "mode": "exec", "handler": ["true"]}), "template"),
        (json!({"template": "bbd", "mode": "exec", "handler": ["true"]}), "template"),
        (json!({"template": "bb", "mode": "exec", "handler": ["true"], "timeout_ms": 0}), "timeout_ms"),
        (json!({"template": "bb", "mode": "exec", "handler": ["true"], "max_concurrency": 0}), "max_concurrency"),
        (
            json!({"template": "bb", "mode": "exec", "handler": ["true"], "min_warm": 9, "max_concurrency": 2}),
            "min_warm",
        ),
        (json!({"template": "bb", "mode": "lambda", "handler": ["true"]}), "mode"),
        (json!({"template": "bb", "mode": "exec", "handler": ["true"], "memory": 1}), "memory"),
    ] {
        let a = c.call(Method::PUT, "/v1/functions/f", Some(def)).await;
        assert_eq!(a.status, 400, "{field}: {:?}", a.body);
        assert!(a.body["message"].as_str().unwrap().contains(field), "{field}: {:?}", a.body);
    }
    assert_eq!(c.call(Method::PUT, "/v1/functions/Bad%20Name", Some(json!({}))).await.status, 400);

    // One environment at most: a second invocation while one runs answers 429 + Retry-After.
    deploy(
        &c,
        "slow",
        json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", "sleep 2; echo done"], "max_concurrency": 1}),
    )
    .await;
    let s2 = stack.url.clone();
    let token = stack.token("acme");
    let running = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("{s2}/v1/functions/slow/invoke"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let busy = invoke(&stack, "acme", "slow", json!(1)).await;
    assert_eq!(busy.status, 429, "{}", String::from_utf8_lossy(&busy.body));
    assert!(busy.headers.contains_key("retry-after"));
    // Asked to, a call waits (bounded) for the slot instead.
    let t0 = std::time::Instant::now();
    let waited = invoke_raw(&stack, "acme", "/v1/functions/slow/invoke?max_wait_ms=10000", b"1".to_vec()).await;
    assert_eq!(waited.status, 200, "{}", String::from_utf8_lossy(&waited.body));
    assert!(t0.elapsed() > Duration::from_millis(800), "it did not wait for the running one");
    assert_eq!(running.await.unwrap(), 200);
    // A slot frees when its invocation ends.
    assert_eq!(invoke(&stack, "acme", "slow", json!(1)).await.status, 200);
    let bad_wait = invoke_raw(&stack, "acme", "/v1/functions/slow/invoke?max_wait_ms=60001", b"1".to_vec()).await;
    assert_eq!(bad_wait.status, 400);

    // The payload cap (6 MiB by default): 413.
    let big = invoke_raw(&stack, "acme", "/v1/functions/slow/invoke", vec![b'x'; (6 << 20) + 1]).await;
    assert_eq!(big.status, 413);
    assert_eq!(big.json()["code"], "payload_too_large");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_invocations_and_maps_with_failures() {
    let stack = Stack::start(stack_opts(2)).await;
    let c = stack.client("acme");
    // Doubles a number; fails on a negative one.
    let script = "p=$(cat); [ \"$p\" -lt 0 ] && { echo negative >&2; exit 1; }; echo $((p * 2))";
    deploy(
        &c,
        "double",
        json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", script], "max_concurrency": 3}),
    )
    .await;

    let accepted = invoke_raw(&stack, "acme", "/v1/functions/double/invoke?async=true", b"21".to_vec()).await;
    assert_eq!(accepted.status, 202);
    let id = accepted.json()["invocation_id"].as_str().unwrap().to_string();
    let done = eventually(Duration::from_secs(20), || async {
        let a = c.call(Method::GET, &format!("/v1/invocations/{id}"), None).await;
        (a.body["state"] == "done").then_some(a.body)
    })
    .await
    .expect("the asynchronous invocation finished");
    assert_eq!((done["status"].as_u64(), done["result"].clone()), (Some(200), json!(42)), "{done}");
    // Another principal cannot read it; an unknown id is 404.
    assert_eq!(stack.client("acme/x").call(Method::GET, &format!("/v1/invocations/{id}"), None).await.status, 404);
    assert_eq!(c.call(Method::GET, &format!("/v1/invocations/{}", "0".repeat(32)), None).await.status, 404);
    assert_eq!(c.call(Method::GET, "/v1/invocations/..%2Fx", None).await.status, 404);

    // A map: results in input order, streamed as NDJSON, the failures among them.
    let batch: Vec<i64> = vec![1, 2, -3, 4, 5, -6, 7, 8, 9, 10];
    let mapped = invoke_raw(&stack, "acme", "/v1/functions/double/map", serde_json::to_vec(&batch).unwrap()).await;
    assert_eq!(mapped.status, 200);
    assert_eq!(mapped.header("content-type"), "application/x-ndjson");
    let lines: Vec<Value> =
        String::from_utf8(mapped.body).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), batch.len());
    for (i, (line, n)) in lines.iter().zip(&batch).enumerate() {
        assert_eq!(line["index"].as_u64(), Some(i as u64));
        assert_eq!(line["status"].as_u64(), Some(200), "{line}");
        if *n < 0 {
            assert_eq!(line["function_error"], "unhandled", "{line}");
            assert_eq!(line["result"]["exit_code"], 1);
        } else {
            assert_eq!(line["result"], json!(n * 2), "{line}");
        }
    }
    // NDJSON in works the same; a malformed batch is 400.
    let nd = invoke_raw(&stack, "acme", "/v1/functions/double/map", b"3\n4\n".to_vec()).await;
    let results: Vec<Value> = String::from_utf8(nd.body)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["result"].clone())
        .collect();
    assert_eq!(results, vec![json!(6), json!(8)]);
    assert_eq!(invoke_raw(&stack, "acme", "/v1/functions/double/map", b"[1,".to_vec()).await.status, 400);
    // Never more environments than its concurrency.
    let f = c.call(Method::GET, "/v1/functions/double", None).await;
    assert!(f.body["environments"]["total"].as_u64().unwrap() <= 3, "{:?}", f.body);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_scales_to_zero_when_idle_and_back() {
    let stack = Stack::start(stack_opts(2)).await;
    let c = stack.client("acme");
    deploy(&c, "quick", json!({"template": "bb", "mode": "exec", "handler": ["cat"], "env_idle_s": 1})).await;
    let first = invoke(&stack, "acme", "quick", json!("a")).await;
    assert_eq!(first.status, 200);
    let env = first.environment();
    // Idle past env_idle_s, the environment's session ends by itself.
    let gone = eventually(Duration::from_secs(10), || async {
        (c.call(Method::GET, &format!("/v1/sessions/{env}"), None).await.status == 404).then_some(())
    });
    assert!(gone.await.is_some(), "the idle environment did not end");
    let back = invoke(&stack, "acme", "quick", json!("b")).await;
    assert_eq!((back.status, back.header("x-sandpool-start").as_str()), (200, "cold"));
    assert_ne!(back.environment(), env);
    assert_eq!(back.json(), json!("b"));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_warm_environments_are_made_ahead_and_kept() {
    let stack = Stack::start(stack_opts(2)).await;
    let c = stack.client("acme");
    let def = json!({"template": "bb", "mode": "exec", "handler": ["cat"], "min_warm": 2, "env_idle_s": 2});
    deploy(&c, "ready", def).await;
    let idle = |want: u64| {
        let c = c.clone();
        async move {
            let f = c.call(Method::GET, "/v1/functions/ready", None).await;
            (f.body["environments"]["idle"].as_u64() == Some(want)).then_some(())
        }
    };
    assert!(eventually(Duration::from_secs(10), || idle(2)).await.is_some(), "the keeper made no environments");
    let first = invoke(&stack, "acme", "ready", json!("x")).await;
    assert_eq!((first.status, first.header("x-sandpool-start").as_str()), (200, "warm"));
    // Past env_idle_s they are still there: the keeper keeps min_warm warm.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(eventually(Duration::from_secs(3), || idle(2)).await.is_some(), "min_warm environments ended");
    assert_eq!(invoke(&stack, "acme", "ready", json!("y")).await.header("x-sandpool-start"), "warm");
    // Without a floor (a new version retires the old ones) and without load: none.
    deploy(&c, "ready", json!({"template": "bb", "mode": "exec", "handler": ["cat"], "env_idle_s": 1})).await;
    assert!(eventually(Duration::from_secs(10), || idle(0)).await.is_some(), "no scale to zero");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environments_count_against_the_owners_quota() {
    let stack = Stack::start(stack_opts(2)).await;
    let admin = stack.admin_client();
    assert_eq!(admin.call(Method::PUT, "/v1/quotas/capped", Some(json!({"sessions": 1}))).await.status, 200);
    let c = stack.client("capped");
    for name in ["one", "two"] {
        deploy(&c, name, json!({"template": "bb", "mode": "exec", "handler": ["cat"]})).await;
    }
    // The first function's environment is the one session the quota allows.
    let first = invoke(&stack, "capped", "one", json!(1)).await;
    assert_eq!(first.status, 200);
    let usage = c.call(Method::GET, "/v1/usage", None).await;
    assert_eq!(usage.body["levels"][0]["usage"]["sessions"].as_u64(), Some(1), "{:?}", usage.body);
    // So neither another function's environment nor a session fits; the warm one still serves.
    let second = invoke(&stack, "capped", "two", json!(2)).await;
    assert_eq!((second.status, second.json()["code"].as_str()), (429, Some("quota_exceeded")));
    let session = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
    assert_eq!(session.status, 429);
    assert_eq!(invoke(&stack, "capped", "one", json!(3)).await.status, 200);
    // Deleting the function ends its environment and gives the session back.
    assert_eq!(c.call(Method::DELETE, "/v1/functions/one", None).await.status, 204);
    let freed = eventually(Duration::from_secs(10), || async {
        let u = c.call(Method::GET, "/v1/usage", None).await;
        (u.body["levels"][0]["usage"]["sessions"].as_u64() == Some(0)).then_some(())
    });
    assert!(freed.await.is_some(), "the deleted function's environment still holds the quota");
    assert_eq!(invoke(&stack, "capped", "two", json!(4)).await.status, 200);
    stack.shutdown().await;
}

/// Little's law end to end: under load the keeper makes environments ahead of demand (more
/// than the invocations ever in flight at once), and after it the function scales to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keeper_sizes_a_function_by_its_load_and_scales_it_to_zero_after() {
    let stack = Stack::start(stack_opts(4)).await;
    let c = stack.client("acme");
    let def = json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", "sleep 1; cat"],
                     "max_concurrency": 8, "env_idle_s": 3});
    deploy(&c, "busy", def).await;
    // Four clients back to back: at most 4 in flight, about 4 invocations a second of 1 s, so
    // L ≈ 4 and the keeper's target round(4 × 1.5) = 6 (5 or more while a loaded machine adds
    // up to 0.2 s to each call).
    let until = std::time::Instant::now() + Duration::from_secs(7);
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (url, token) = (stack.url.clone(), stack.token("acme"));
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                while std::time::Instant::now() < until {
                    let r = http.post(format!("{url}/v1/functions/busy/invoke")).bearer_auth(&token).body("x");
                    assert_eq!(r.send().await.unwrap().status(), 200);
                }
            })
        })
        .collect();
    let total = || async {
        let f = c.call(Method::GET, "/v1/functions/busy", None).await;
        f.body["environments"]["total"].as_u64().unwrap_or(0)
    };
    let ahead = eventually(Duration::from_secs(8), || async { (total().await >= 5).then_some(()) }).await;
    for client in clients {
        client.await.unwrap();
    }
    assert!(ahead.is_some(), "the keeper made no environment beyond the 4 in flight: {}", total().await);
    // Without load its target falls to 0: idle environments end at env_idle_s.
    let zero = eventually(Duration::from_secs(20), || async { (total().await == 0).then_some(()) }).await;
    assert!(zero.is_some(), "still {} environments long after the load", total().await);
    stack.shutdown().await;
}

/// SIGTERM (the gateway's cancel) with asynchronous invocations in flight: the gateway stops
/// within `drain_grace + drain_timeout` with no background task left, and the invocations it
/// could not finish are recorded as cut (503 `unavailable`), so a caller polling them from
/// any gateway has a clear answer at once (before, they read `running` until their deadline,
/// minutes later, then `lost`), and their concurrency slots are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_asynchronous_invocations_within_drain_timeout() {
    let stack = Stack::start(stack_opts(2)).await;
    let c = stack.client("acme");
    let nap = json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", "sleep 60"], "timeout_ms": 120000, "max_concurrency": 3});
    deploy(&c, "nap", nap).await;

    // A second of it (the most) is the record grace: cut invocations record how they ended.
    let drain_timeout = Duration::from_secs(4);
    let mut cfg = (*stack.config).clone();
    cfg.gateway.drain_grace = Duration::ZERO;
    cfg.gateway.drain_timeout = drain_timeout;
    let cancel = tokio_util::sync::CancellationToken::new();
    let gw = gateway::start(std::sync::Arc::new(cfg), None, cancel.clone()).await.expect("start a gateway");
    let url = format!("http://{}", gw.addr);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let resp = reqwest::Client::new()
            .post(format!("{url}/v1/functions/nap/invoke?async=true"))
            .bearer_auth(stack.token("acme"))
            .body("1")
            .send()
            .await
            .expect("the gateway answers");
        assert_eq!(resp.status(), 202);
        let v: Value = resp.json().await.expect("a JSON answer");
        ids.push(v["invocation_id"].as_str().expect("an id").to_string());
    }
    let in_flight = || async {
        let f = c.call(Method::GET, "/v1/functions/nap", None).await;
        f.body["environments"]["in_flight"].as_u64()
    };
    eventually(Duration::from_secs(30), || async { (in_flight().await == Some(3)).then_some(()) })
        .await
        .expect("three invocations in flight");

    let t0 = std::time::Instant::now();
    cancel.cancel();
    let left = tokio::time::timeout(Duration::from_secs(20), gw.wait()).await.expect("the gateway stopped");
    let took = t0.elapsed();
    assert_eq!(left, 0, "background tasks still running after the drain");
    assert!(took < drain_timeout + Duration::from_secs(1), "the drain took {took:?}");

    for id in &ids {
        let a = c.call(Method::GET, &format!("/v1/invocations/{id}"), None).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.body["state"], "done", "{}", a.body);
        assert_eq!(a.body["status"], 503, "{}", a.body);
        assert_eq!(a.body["result"]["code"], "unavailable", "{}", a.body);
        assert!(a.body["result"]["message"].as_str().unwrap_or_default().contains("shut down"), "{}", a.body);
    }
    // What the cut invocations held went back before the gateway stopped.
    assert_eq!(in_flight().await, Some(0), "the function's slots are back");
}
