//! BENCHMARKS.md "Lazy images", through the API: on the issue's 1 GB image (`scripts/lazy-bench`
//! pushes `:src` and converts it to `:lazy`), `POST /v1/templates` + `POST /v1/sessions` + a
//! first command reading 1 KB of the 1 GB file, with nothing of the image on the node; the plain
//! image (a whole pull) and the lazy one alternating, a fresh test stack each run. Then exec
//! round trips of `true` on a lazy sandbox and a plain one of the same image, alternating.
//!
//! ```text
//! scripts/lazy-bench --runs 0   # once: push and convert the image
//! SANDPOOL_TEST_REDIS=redis://127.0.0.1:6379 cargo run -p tests --example lazy_api_bench -- [RUNS] [EXECS]
//! ```
//! Cold for the lazy image: unmounted from the node's `sandpool-lazyd` and its chunk files
//! removed from the chunk cache; for the plain image: `docker rmi`.

use std::path::Path;
use std::time::{Duration, Instant};

use lazy_image::lazyd::{self, Request, Response};
use reqwest::Method;
use serde_json::json;
use tests::{Client, Stack, StackOpts};

const SRC: &str = "127.0.0.1:5000/sptest-lazy-bench/big:src";
const LAZY: &str = "127.0.0.1:5000/sptest-lazy-bench/big:lazy";
const FIRST: &str = "head -c 1024 /data.bin | wc -c";

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("RUNS EXECS")).collect();
    let runs = args.first().copied().unwrap_or(3);
    let execs = args.get(1).copied().unwrap_or(300);
    let load = || {
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split(' ').take(3).collect::<Vec<_>>().join(" ")
    };
    for run in 1..=runs {
        let (secs, _) = first_command(&format!("plain{run}"), SRC, || {
            let _ = std::process::Command::new("docker").args(["rmi", "-f", SRC]).output();
            forget_plain();
        })
        .await;
        println!("run {run} plain: template + session + first command {secs:.3} s (load {})", load());
        let (secs, pinned) = first_command(&format!("lazy{run}"), LAZY, forget_lazy).await;
        let info = stats(&pinned).await;
        println!(
            "run {run} lazy: template + session + first command {secs:.3} s, fetched {} MiB of a {} MiB blob \
             ({:.2} %; source layers {} MiB) (load {})",
            info.bytes_fetched >> 20,
            info.blob_size >> 20,
            100.0 * info.bytes_fetched as f64 / info.blob_size as f64,
            info.source_size >> 20,
            load()
        );
    }
    if execs > 0 {
        exec_latency(execs).await;
    }
}

/// Times template + session + first command of `image` on a new stack, after `make_cold`.
/// Returns the seconds and the template's pinned image.
async fn first_command(name: &str, image: &str, make_cold: impl FnOnce()) -> (f64, String) {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("bench");
    make_cold();
    let began = Instant::now();
    let t = c.call(Method::POST, "/v1/templates", Some(json!({"name": name, "image": image}))).await;
    assert_eq!(t.status, 201, "{:?}", t.body);
    let s = open(&c, &format!("bench/{name}")).await;
    let out = c.sh(&s, FIRST).await;
    let secs = began.elapsed().as_secs_f64();
    assert_eq!(out["stdout"].as_str().map(str::trim), Some("1024"), "{out:?}");
    c.delete(&s).await;
    stack.shutdown().await;
    (secs, t.body["image"].as_str().expect("a pinned image").to_string())
}

async fn open(c: &Client, template: &str) -> String {
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": template, "max_wait_s": 300}))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    a.body["session_id"].as_str().expect("a session id").to_string()
}

/// The plain image's pinned name is removed too (`docker rmi` of the tag keeps a digest-named
/// image only while it has another name).
fn forget_plain() {
    let out = std::process::Command::new("docker")
        .args([
            "images",
            "--digests",
            "--format",
            "{{.Repository}}@{{.Digest}}",
            "127.0.0.1:5000/sptest-lazy-bench/big",
        ])
        .output()
        .expect("docker images");
    for image in String::from_utf8_lossy(&out.stdout).lines() {
        let _ = std::process::Command::new("docker").args(["rmi", "-f", image]).output();
    }
}

/// Unmounts the lazy image from the node and removes its chunks and stub image.
fn forget_lazy() {
    let rt = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        rt.block_on(async {
            let socket = Path::new(lazyd::DEFAULT_SOCKET);
            if let Ok(Response::Stats { mounts, .. }) = lazyd::call(socket, &Request::Stats).await {
                for m in mounts.iter().filter(|m| m.image.contains("sptest-lazy-bench/big@")) {
                    let r = lazyd::call(socket, &Request::Unmount { image: m.image.clone() }).await;
                    assert!(matches!(r, Ok(Response::Unmounted { .. })), "unmount {}: {r:?}", m.image);
                    let hex = m.image.rsplit_once("@sha256:").map(|(_, h)| h).unwrap_or_default();
                    let _ =
                        std::process::Command::new("docker").args(["rmi", &format!("sandpool-lazy:{hex}")]).output();
                }
            }
        })
    });
    // The blob's chunk files (`<blob hex>-<index>`): every chunk of this image comes from the
    // registry again. (The running cache's byte count still includes them: a bench-only cut.)
    let chunks = Path::new(lazyd::DEFAULT_STATE_DIR).join("chunks");
    let blob = blob_hex();
    for entry in std::fs::read_dir(&chunks).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&blob) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The lazy image's EROFS blob digest (hex), from its manifest.
fn blob_hex() -> String {
    let out = std::process::Command::new("curl")
        .args(["-sf", "-H", "Accept: application/vnd.oci.image.manifest.v1+json"])
        .arg("http://127.0.0.1:5000/v2/sptest-lazy-bench/big/manifests/lazy")
        .output()
        .expect("curl the lazy manifest");
    let manifest: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the lazy manifest");
    manifest["layers"][0]["digest"].as_str().expect("a layer digest").trim_start_matches("sha256:").to_string()
}

async fn stats(pinned: &str) -> lazyd::MountInfo {
    let Ok(Response::Stats { mounts, .. }) = lazyd::call(Path::new(lazyd::DEFAULT_SOCKET), &Request::Stats).await
    else {
        panic!("sandpool-lazyd answers no stats");
    };
    mounts.into_iter().find(|m| m.image == pinned).expect("the image is mounted")
}

/// Exec round trips of `true` on one lazy and one plain sandbox of the same image, alternating.
async fn exec_latency(n: usize) {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("bench");
    let mut sessions = Vec::new();
    for (name, image) in [("plain", SRC), ("lazy", LAZY)] {
        let t = c.call(Method::POST, "/v1/templates", Some(json!({"name": name, "image": image}))).await;
        assert_eq!(t.status, 201, "{:?}", t.body);
        sessions.push((name, open(&c, &format!("bench/{name}")).await, Vec::with_capacity(n)));
    }
    for _ in 0..n {
        for (_, sid, times) in sessions.iter_mut() {
            let began = Instant::now();
            let a = c.exec(sid, json!({"cmd": ["true"]})).await;
            times.push(began.elapsed());
            assert_eq!(a.status, 200, "{:?}", a.body);
        }
    }
    for (name, sid, mut times) in sessions {
        times.sort();
        let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!("exec true on {name}: p50 {:.2} ms, p99 {:.2} ms over {n}", ms(at(0.5)), ms(at(0.99)));
        c.delete(&sid).await;
    }
    stack.shutdown().await;
    forget_lazy();
}
