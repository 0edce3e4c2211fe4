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
        assert_eq!(a.body["code"], "sandbox_busy", "{what}: {:?}", a.body);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_fork_bomb_are_served_or_told_to_retry_never_502() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    let c = stack.client("bomber");
    let sid = c.create("bb").await["session_id"].as_str().expect("session id").to_string();
    let big = format!("echo {} | wc -c", "x".repeat(300 * 1024));
    // The classic bomb returns at once and leaves its children to the exec's timeout. The
    // others fill the sandbox's pids (the template's 1024) with sleepers, and wait (with shell
    // builtins only) until the pids controller counts them all: the second then returns and its
    // sleepers keep every pid until its timeout, so the calls in between find none to spare;
    // the third spins on, so the exec itself times out and its tree is killed.
    let filler = "(while :; do sleep 100 & done 2>/dev/null) & \
        until { read n </sys/fs/cgroup/pids/pids.current || read n </sys/fs/cgroup/pids.current; } 2>/dev/null \
        && [ \"$n\" -ge 1020 ]; do :; done";
    let bombs = [
        ("b(){ b|b& }; b".to_string(), 2000),
        (filler.to_string(), 4000),
        (format!("{filler}; while :; do :; done"), 4000),
    ];
    for (round, (bomb, timeout_ms)) in bombs.iter().enumerate() {
        let (a, _) =
            served("bomb", async || c.exec(&sid, json!({"cmd": ["sh", "-c", bomb], "timeout_ms": timeout_ms})).await)
                .await;
        assert_eq!(a.status, 200, "round {round}: the bomb: {:?}", a.body);
        assert_eq!(a.body["timed_out"], round == 2, "round {round}: {:?}", a.body["timed_out"]);
        let (a, busy) = served("echo", async || c.exec(&sid, json!({"cmd": ["echo", "alive"]})).await).await;
        assert_eq!((a.status, a.body["stdout"].as_str()), (200, Some("alive\n")), "round {round}: {:?}", a.body);
        if round == 1 {
            assert!(busy > 0, "the sandbox had no pid to spare, yet the echo ran at once");
        }
        let (a, _) = served("write", async || write(&c, &sid, "after.txt", b"still here").await).await;
        assert_eq!(a.status, 204, "round {round}: write: {:?}", a.body);
        let (a, _) = served("300 KB command", async || c.exec(&sid, json!({"cmd": ["sh", "-c", &big]})).await).await;
        assert_eq!(a.status, 200, "round {round}: {:?}", a.body);
        assert_eq!(a.body["stdout"].as_str().map(str::trim), Some(&*(300 * 1024 + 1).to_string()), "{:?}", a.body);
        let (a, _) = served("cat", async || c.exec(&sid, json!({"cmd": ["cat", "after.txt"]})).await).await;
        assert_eq!(a.body["stdout"], "still here", "round {round}: {:?}", a.body);
    }
    // Nothing of the bombs is left once their timeouts passed.
    let left = tests::eventually(Duration::from_secs(10), || async {
        let a = c.exec(&sid, json!({"cmd": "ps -o pid= | wc -l"})).await;
        let n: u32 = a.body["stdout"].as_str()?.trim().parse().ok()?;
        (n < 10).then_some(n)
    })
    .await;
    assert!(left.is_some(), "the bombs' processes outlived their timeouts");
    stack.shutdown().await;
}
