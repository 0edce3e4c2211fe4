//! `sandpool images convert` as a user runs it: bad input exits 2 with a message naming the
//! problem; a real conversion (busybox, local registry) prints the lazy image pinned by digest,
//! and that image resolves as a lazy image pinning its source.

use std::process::{Command, Output};

fn sandpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sandpool")).args(args).output().expect("run sandpool")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_input_exits_2_naming_the_problem() {
    let out = sandpool(&["images", "convert", "debian:bookworm", "127.0.0.1:5000/x/y:lazy"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("expected host[:port]/repository"), "{}", stderr(&out));

    let out = sandpool(&["images", "convert", "127.0.0.1:5000/x/y:src", "127.0.0.1:5000/x/y@sha256:12"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("sha256:<64 hex digits>"), "{}", stderr(&out));

    let out = sandpool(&["images", "convert", "--chunk-size", "1000", "127.0.0.1:5000/x/y:a", "127.0.0.1:5000/x/y:b"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--chunk-size 1000"), "{}", stderr(&out));

    let out = sandpool(&["images", "convert", "--compressor", "zstd", "127.0.0.1:5000/x/y:a", "127.0.0.1:5000/x/y:b"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));

    let out = sandpool(&["images", "convert", "registry.example.com/x/y:a", "127.0.0.1:5000/x/y:b"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("only loopback registries"), "{}", stderr(&out));
}

/// Removes the test's local tag, pass or fail.
struct LocalTag(String);

impl Drop for LocalTag {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", &self.0]).output();
    }
}

#[tokio::test]
async fn converts_busybox_and_prints_the_pinned_lazy_image() {
    let port = std::env::var("SANDPOOL_REGISTRY_PORT").unwrap_or_else(|_| "5000".into());
    let prefix = format!("sptest-lazy-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let src = format!("127.0.0.1:{port}/{prefix}/busybox:src");
    let dst = format!("127.0.0.1:{port}/{prefix}/busybox:lazy");
    let docker = |args: &[&str]| {
        let out = Command::new("docker").args(args).output().expect("run docker");
        assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    docker(&["tag", tests::BUSYBOX_IMAGE, &src]);
    let _tag = LocalTag(src.clone());
    docker(&["push", "-q", &src]);

    let out = sandpool(&["images", "convert", "--json", &src, &dst]);
    assert!(out.status.success(), "{}", stderr(&out));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let destination = result["destination"].as_str().unwrap();
    assert!(destination.starts_with(&format!("127.0.0.1:{port}/{prefix}/busybox@sha256:")), "{result}");
    assert!(result["blob_bytes"].as_u64().unwrap() > 0, "{result}");

    let image = lazy_image::mount::LazyImage::resolve(&lazy_image::Reference::parse(destination).unwrap())
        .await
        .expect("the result is a lazy image");
    assert_eq!(image.reference.to_string(), destination);
    assert_eq!(
        result["source"].as_str().unwrap(),
        format!("127.0.0.1:{port}/{prefix}/busybox@{}", image.config.source.digest)
    );
}
