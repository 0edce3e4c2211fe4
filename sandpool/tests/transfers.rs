//! File transfers stream through `sandpool up` (gateway and pool-manager in one process) with
//! bounded memory: a download over the template's limit is refused before a byte is sent, a
//! large one streams, and many large uploads at once are never held whole.

mod support;

use std::time::Duration;

use futures::StreamExt as _;
use serde_json::Value;
use support::Up;

/// The process's resident memory now and at its peak (VmRSS, VmHWM), in MiB.
fn rss_mib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the process's peak RSS (VmHWM) to its current RSS.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transfers_stream_with_bounded_memory() {
    const BODY_LIMIT: u64 = 64 << 20;
    let up =
        Up::start(|toml| toml.replace("max_body_bytes = 16777216", &format!("max_body_bytes = {BODY_LIMIT}")), |_| {})
            .await;
    let pid = up.child.id();
    let c = up.client();
    let (_, s) = up.create().await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    let files = |path: &str| format!("{}/v1/sessions/{sid}/files/{path}", up.url);

    // A 10 GiB (sparse) directory: 413 before anything is sent, no memory spent on it.
    c.sh(&sid, "mkdir -p /tmp/bomb && truncate -s 10G /tmp/bomb/x && truncate -s 2G /tmp/big").await;
    reset_peak(pid);
    for path in ["/tmp/bomb", "/tmp/big"] {
        let r = up.http.get(files(path)).bearer_auth(&up.token).send().await.unwrap();
        assert_eq!(r.status(), 413, "{path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["code"], "payload_too_large", "{body}");
    }
    // Under the limit (1 GiB by default), 600 MiB streams through, read slowly at first.
    c.sh(&sid, "truncate -s 600M /tmp/ok").await;
    let r = up.http.get(files("/tmp/ok")).bearer_auth(&up.token).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut got = 0u64;
    while let Some(chunk) = body.next().await {
        got += chunk.unwrap().len() as u64;
        if got < (8 << 20) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(got, 600 << 20);
    let (_, peak) = rss_mib(pid);
    eprintln!("peak RSS refusing 10 GiB and streaming 600 MiB: {peak} MiB");
    assert!(peak < 150, "sandpool up peaked at {peak} MiB while refusing 10 GiB and streaming 600 MiB");

    // 20 uploads of 64 MiB at once: 1.25 GiB in, never held whole anywhere.
    reset_peak(pid);
    let uploads = (0..20).map(|i| {
        let req = up
            .http
            .put(files(&format!("up/{i}.bin")))
            .bearer_auth(&up.token)
            .body(vec![b'a' + i as u8; BODY_LIMIT as usize]);
        async move { req.send().await.map(|r| r.status().as_u16()) }
    });
    let statuses: Vec<_> = futures::future::join_all(uploads).await.into_iter().map(Result::unwrap).collect();
    assert!(statuses.iter().all(|&s| s == 204), "{statuses:?}");
    let (_, peak) = rss_mib(pid);
    eprintln!("peak RSS during 20 concurrent 64 MiB uploads: {peak} MiB");
    let sizes = c.sh(&sid, "wc -c up/*.bin | tail -1").await;
    assert_eq!(sizes["stdout"].as_str().unwrap().split_whitespace().next(), Some(&*(20 * BODY_LIMIT).to_string()));
    // The test's own 20 bodies are in this process, not in sandpool's.
    assert!(peak < 250, "sandpool up peaked at {peak} MiB during 20 concurrent 64 MiB uploads");
    // One byte over the limit: 413, the file untouched.
    let over = up.http.put(files("up/0.bin")).bearer_auth(&up.token).body(vec![0u8; BODY_LIMIT as usize + 1]);
    assert_eq!(over.send().await.unwrap().status(), 413);
    assert_eq!(c.sh(&sid, "head -c 1 up/0.bin").await["stdout"], "a");

    // An upload whose client breaks off after 4 MiB: the target is untouched and the upload's
    // temp file goes (nothing half-written is left in the sandbox).
    let chunks = (0..4)
        .map(|_| Ok::<_, std::io::Error>(vec![b'z'; 1 << 20]))
        .chain(std::iter::once(Err(std::io::Error::other("the client went away"))));
    let broken = reqwest::Body::wrap_stream(futures::stream::iter(chunks));
    let cut = up.http.put(files("up/0.bin")).bearer_auth(&up.token).body(broken).send().await;
    assert!(cut.is_err(), "the body broke off: {cut:?}");
    let clean = tests::eventually(Duration::from_secs(10), || async {
        let left = c.sh(&sid, "ls -A up | grep -c sandpool-upload || true").await;
        (left["stdout"] == "0\n").then_some(())
    });
    assert!(clean.await.is_some(), "a broken upload left its temp file");
    assert_eq!(c.sh(&sid, "head -c 1 up/0.bin; wc -c < up/0.bin").await["stdout"], format!("a{BODY_LIMIT}\n"));
}
