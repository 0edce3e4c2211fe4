//! A fork bomb in a session: the calls that follow it are served, or, while the sandbox has no
//! process to spare (the bomb still runs until its timeout, or its processes are being
//! reaped), told to retry with 503 `sandbox_busy` and Retry-After; never 502.

use std::time::Duration;

use serde_json::{Value, json};
use tests::{Answer, Client, Stack, StackOpts};

use crate::FILL;

/// Makes `call` until it is not a 503: each 503 must be `sandbox_busy` with Retry-After, and
/// the sandbox must be served again within 30 s; no answer may be a 502. Returns the answer
/// and how many 503s came before it.
async fn served(what: &str, call: impl AsyncFn() -> Answer) -> (Answer, u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut busy = 0;
    loop {
        let a = call().await;
        assert_ne!(a.status, 502, "{what}: 502 after the fork bomb: {:?}", a.body);
        if a.status != 503 {
            return (a, busy);
        }
        busy += 1;
        assert_busy(what, &a);
        let retry: u64 = a
            .headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{what}: 503 without Retry-After: {:?}", a.body));
        assert!(tokio::time::Instant::now() < deadline, "{what}: still busy after 30 s");
        eprintln!("{what}: 503 sandbox_busy, retry after {retry} s: {}", a.body["message"]);
        tokio::time::sleep(Duration::from_secs(retry.min(2))).await;
    }
}

/// `PUT` of a file, answered as status and JSON body.
async fn write(c: &Client, sid: &str, path: &str, data: &[u8]) -> Answer {
    let r = c
        .http
        .put(format!("{}/v1/sessions/{sid}/files/{path}", c.url))
        .bearer_auth(&c.token)
        .body(data.to_vec())
        .send()
        .await
        .expect("gateway answers");
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    let body = r.json::<Value>().await.unwrap_or(Value::Null);
    Answer { status, body, headers }
}

/// Busy answers are 503 `sandbox_busy` with Retry-After.
fn assert_busy(what: &str, a: &Answer) {
    assert_eq!((a.status, a.body["code"].as_str()), (503, Some("sandbox_busy")), "{what}: {:?}", a.body);
    assert!(a.headers.contains_key("retry-after"), "{what}: 503 without Retry-After: {:?}", a.body);
}

/// The calls a tenant makes after a bomb: each is served (after 503s, if the sandbox is still
/// cleaning up), and the session works as before.
async fn calls_after(c: &Client, sid: &str, round: &str) {
    let big = format!("echo {} | wc -c", "x".repeat(300 * 1024));
    let (a, _) = served("echo", async || c.exec(sid, json!({"cmd": ["echo", "alive"]})).await).await;
    assert_eq!((a.status, a.body["stdout"].as_str()), (200, Some("alive\n")), "{round}: {:?}", a.body);
    let (a, _) = served("write", async || write(c, sid, "after.txt", b"still here").await).await;
    assert_eq!(a.status, 204, "{round}: write: {:?}", a.body);
    let (a, _) = served("300 KB command", async || c.exec(sid, json!({"cmd": ["sh", "-c", &big]})).await).await;
    assert_eq!(a.status, 200, "{round}: {:?}", a.body);
    assert_eq!(a.body["stdout"].as_str().map(str::trim), Some(&*(300 * 1024 + 1).to_string()), "{:?}", a.body);
    let (a, _) = served("cat", async || c.exec(sid, json!({"cmd": ["cat", "after.txt"]})).await).await;
    assert_eq!(a.body["stdout"], "still here", "{round}: {:?}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_fork_bomb_are_served_or_told_to_retry_never_502() {
    // `bb` is the default busybox template (1024 pids, 128 MiB); `few` has room for its pids'
    // worth of sleepers in its memory, so they fill its pids rather than its memory.
    let extra_toml = format!(
        "[templates.few]\nimage = \"{}\"\nworkdir = \"/work\"\ncpus = 0.5\nmemory_mb = 256\npids = 128\nwarm = 1\n",
        tests::BUSYBOX_IMAGE
    );
    let stack = Stack::start(StackOpts { warm: 1, extra_toml, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    stack.wait_idle("few", 1, FILL).await;
    let c = stack.client("bomber");
    let sid = c.create("bb").await["session_id"].as_str().expect("session id").to_string();
    let full = c.create("few").await["session_id"].as_str().expect("session id").to_string();

    // The classic bomb: its shell returns at once, its children run on (and fill the
    // sandbox's 1024 pids) until the exec's timeout kills everything holding its output.
    let (a, _) =
        served("bomb", async || c.exec(&sid, json!({"cmd": ["sh", "-c", "b(){ b|b& }; b"], "timeout_ms": 2000})).await)
            .await;
    assert_eq!(a.status, 200, "the bomb: {:?}", a.body);
    calls_after(&c, &sid, "after the classic bomb").await;

    // Sleepers take every pid (the filler's shell dies at its first failed fork, freeing one)
    // while the exec's shell spins on builtins until its timeout kills the tree. Calls made
    // meanwhile are served or refused as busy, never 502: the agent reuses its threads, so a
    // command may get the one free pid, and then its own fork fails (ash: "can't fork").
    // Either way the call saw the sandbox full. (In `bb`, 1024 sleepers need about all of its
    // 128 MiB: a fork may fail for memory first, and the filler die before the pids are full.)
    let bomb = "(while :; do sleep 100 & done 2>/dev/null) & while :; do :; done";
    let running = {
        let (c, full) = (c.clone(), full.clone());
        // 20 s: on a loaded machine (the sandbox has 0.5 of a core, shared with the spinning
        // shell, and less when the host is busy) its 128 pids may take many seconds to fill.
        tokio::spawn(async move { c.exec(&full, json!({"cmd": ["sh", "-c", bomb], "timeout_ms": 20_000})).await })
    };
    // The filler dies at its first failed fork, freeing its own pid; a call made meanwhile
    // would free its pids after it, and the sandbox would have room again with nobody to fill
    // it. So the calls start once the sandbox is full, as the host sees it.
    let sandbox = c.call(reqwest::Method::GET, &format!("/v1/sessions/{full}"), None).await.body["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_string();
    let init = tests::container_pid(&sandbox).expect("the sandbox's container runs");
    let filled = tests::eventually(Duration::from_secs(15), || async {
        let (current, max) = tests::cgroup_pids(init).ok()?;
        (current + 1 >= max).then_some(current)
    })
    .await;
    assert!(filled.is_some(), "the filler did not fill the sandbox's pids within 15 s: {:?}", tests::cgroup_pids(init));
    let mut saw_full = 0;
    let mut answers = std::collections::BTreeMap::<String, u32>::new();
    while !running.is_finished() {
        let a = c.exec(&full, json!({"cmd": ["sh", "-c", "echo alive; true & wait"]})).await;
        if a.status != 200 {
            assert_busy("a call while the sandbox is full", &a);
            saw_full += 1;
        } else if a.body["stderr"].as_str().is_some_and(|e| e.contains("can't fork")) {
            saw_full += 1;
        }
        let kind = format!(
            "{} {} {} {}",
            a.status,
            a.body["exit_code"],
            a.body["stdout"].as_str().unwrap_or_default().trim(),
            a.body["stderr"].as_str().unwrap_or_default()
        );
        *answers.entry(kind).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a = running.await.expect("the bomb's call");
    assert_eq!((a.status, &a.body["timed_out"]), (200, &json!(true)), "the bomb: {:?}", a.body);
    assert!(saw_full > 0, "no call found the sandbox full; the calls' answers: {answers:?}");
    calls_after(&c, &full, "after the timed-out bomb").await;

    // Nothing of the bombs is left once their timeouts passed.
    for s in [&sid, &full] {
        let left = tests::eventually(Duration::from_secs(10), || async {
            let a = c.exec(s, json!({"cmd": "ps -o pid= | wc -l"})).await;
            let n: u32 = a.body["stdout"].as_str()?.trim().parse().ok()?;
            (n < 10).then_some(n)
        })
        .await;
        assert!(left.is_some(), "the bombs' processes outlived their timeouts");
    }
    stack.shutdown().await;
}

/// A sandbox out of memory loses tenant code, never its agent: every command starts with the
/// highest OOM score (and what it starts inherits it) while the agent keeps its own. (A fork
/// bomb in a 128 MiB sandbox once took the agent, PID 1, and with it the session.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oom_killer_takes_tenant_code_before_the_agent() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    let c = stack.client("acme");
    let sid = c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string();
    let out = c
        .sh(&sid, "cat /proc/self/oom_score_adj; sh -c 'cat /proc/self/oom_score_adj'; cat /proc/1/oom_score_adj")
        .await;
    assert_eq!(out["stdout"], "1000\n1000\n0\n", "{out:?}");
    // The agent's own score is back after every spawn, however many run at once.
    let many = (0..8).map(|_| c.exec(&sid, json!({"cmd": "true"})));
    assert!(futures::future::join_all(many).await.iter().all(|a| a.status == 200));
    assert_eq!(c.sh(&sid, "cat /proc/1/oom_score_adj").await["stdout"], "0\n");
}
