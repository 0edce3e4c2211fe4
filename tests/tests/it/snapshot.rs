//! Snapshot and fork: a session's filesystem becomes a private template; forks diverge.

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

use crate::FILL;

fn images(prefix: &str) -> Vec<String> {
    let out = std::process::Command::new("docker")
        .args(["images", "--format", "{{.Repository}}:{{.Tag}}", &format!("sandpool-snap/{prefix}")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_into_four_with_independent_state_and_clean_up_the_snapshot() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    // Snapshot images are not containers: remove them however the test ends.
    struct Images(String);
    impl Drop for Images {
        fn drop(&mut self) {
            for i in images(&self.0) {
                let _ = std::process::Command::new("docker").args(["rmi", "-f", &i]).output();
            }
        }
    }
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
