//! Snapshot and fork: a session's filesystem becomes a private template; forks diverge.

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

use crate::FILL;

pub(crate) fn images(prefix: &str) -> Vec<String> {
    let out = std::process::Command::new("docker")
        .args(["images", "--format", "{{.Repository}}:{{.Tag}}", &format!("sandpool-snap/{prefix}")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect()
}

/// Snapshot images are not containers: removes a stack's however its test ends.
pub(crate) struct Images(pub(crate) String);

impl Drop for Images {
    fn drop(&mut self) {
        for i in images(&self.0) {
            let _ = std::process::Command::new("docker").args(["rmi", "-f", &i]).output();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_into_four_with_independent_state_and_clean_up_the_snapshot() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let _images = Images(stack.ledger_prefix().to_string());
    stack.wait_idle("bb", 1, FILL).await;
    let c = stack.client("t");
    let parent = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    c.sh(&parent, "mkdir -p /work/repo && echo base > /work/repo/file").await;

    let a = c.call(Method::POST, &format!("/v1/sessions/{parent}/fork"), Some(json!({"count": 4}))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let template = a.body["template"].as_str().unwrap().to_string();
    let kids: Vec<String> =
        a.body["sessions"].as_array().unwrap().iter().map(|s| s["session_id"].as_str().unwrap().to_string()).collect();
    assert_eq!(kids.len(), 4);
    // Each starts from the parent's filesystem, then diverges on its own.
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(c.sh(k, "cat /work/repo/file").await["stdout"], "base\n");
        c.sh(k, &format!("echo {i} >> /work/repo/file")).await;
    }
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(c.sh(k, "cat /work/repo/file").await["stdout"], format!("base\n{i}\n"));
    }
    assert_eq!(c.sh(&parent, "cat /work/repo/file").await["stdout"], "base\n");

    // The template is the tenant's alone.
    let other = stack.client("u").call(Method::POST, "/v1/sessions", Some(json!({"template": template}))).await;
    assert_eq!((other.status, other.body["code"].as_str()), (400, Some("unknown_template")));
    let again = c.call(Method::POST, "/v1/sessions", Some(json!({"template": template}))).await;
    assert_eq!(again.status, 201, "{:?}", again.body);

    // Deleting the template removes its image once no sandbox uses it.
    assert_eq!(images(stack.ledger_prefix()).len(), 1);
    assert_eq!(c.call(Method::DELETE, &format!("/v1/templates/{template}"), None).await.status, 204);
    let gone = c.call(Method::POST, "/v1/sessions", Some(json!({"template": template}))).await;
    assert_eq!(gone.status, 400);
    for k in kids.iter().chain([again.body["session_id"].as_str().unwrap().to_string()].iter()) {
        assert_eq!(c.delete(k).await, 204);
    }
    // Generous: the image goes once the sessions' containers are destroyed, which a loaded
    // machine (the whole suite in parallel) can take a while to get to.
    let pruned = tests::eventually(std::time::Duration::from_secs(90), || async {
        images(stack.ledger_prefix()).is_empty().then_some(())
    })
    .await;
    assert!(pruned.is_some(), "snapshot image left behind: {:?}", images(stack.ledger_prefix()));
    stack.shutdown().await;
}

/// A fork of a session of a template made from an image (here a lazy one) through the API: its
/// snapshot's base is that template (it answered `unknown_template` when only configured
/// templates could be bases), and the copies of a lazy sandbox are lazy (the snapshot image
/// keeps the stub's label, so they run on the lazy runtime over the node's mount).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_session_forks_into_lazy_sessions() {
    let stack = crate::lazy::stack(StackOpts { warm: 0, ..Default::default() }).await;
    let _images = Images(stack.ledger_prefix().to_string());
    let c = stack.client("t");
    let parent = c.create(crate::lazy::TEMPLATE).await["session_id"].as_str().unwrap().to_string();
    c.sh(&parent, "echo base > /work/file").await;

    let a = c.call(Method::POST, &format!("/v1/sessions/{parent}/fork"), Some(json!({"count": 2}))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let template = a.body["template"].as_str().unwrap().to_string();
    let kids: Vec<(String, String)> = a.body["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["session_id"].as_str().unwrap().to_string(), s["sandbox_id"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(kids.len(), 2);
    for (i, (k, sandbox)) in kids.iter().enumerate() {
        let inspect = tests::container_inspect(sandbox);
        assert_eq!(inspect["HostConfig"]["Runtime"], "sandpool-lazy", "{inspect}");
        // The parent's write, the image's bytes (read through the lazy mount), its template's env.
        let r = c.sh(k, "cat /work/file; head -c 1024 /data.bin | wc -c; echo $SANDPOOL_TEMPLATE").await;
        assert_eq!(r["stdout"], format!("base\n1024\n{}\n", crate::lazy::TEMPLATE), "{r}");
        c.sh(k, &format!("echo {i} >> /work/file")).await;
    }
    for (i, (k, _)) in kids.iter().enumerate() {
        assert_eq!(c.sh(k, "cat /work/file").await["stdout"], format!("base\n{i}\n"));
    }
    assert_eq!(c.sh(&parent, "cat /work/file").await["stdout"], "base\n");

    // A snapshot of a copy derives from the same template made from the image, and opens.
    let snap = c.call(Method::POST, &format!("/v1/sessions/{}/snapshot", kids[0].0), None).await;
    assert_eq!(snap.status, 201, "{:?}", snap.body);
    assert_eq!(snap.body["base_template"], crate::lazy::TEMPLATE, "{:?}", snap.body);
    let again = c.create(snap.body["template"].as_str().unwrap()).await;
    let sid = again["session_id"].as_str().unwrap();
    assert_eq!(c.sh(sid, "cat /work/file").await["stdout"], "base\n0\n");

    // The snapshots are the tenant's alone.
    let other = stack.client("u").call(Method::POST, "/v1/sessions", Some(json!({"template": template}))).await;
    assert_eq!((other.status, other.body["code"].as_str()), (400, Some("unknown_template")), "{:?}", other.body);
    stack.shutdown().await;
}
