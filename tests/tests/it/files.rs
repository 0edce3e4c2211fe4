//! File operations beyond read and write: exists, remove, rename, make a directory. Each as
//! the sandbox's user, under the file calls' path rules, with a clear error for each refusal.

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Client, Stack, StackOpts};

use crate::FILL;

async fn op(c: &Client, method: Method, sid: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let a = c.call(method, &format!("/v1/sessions/{sid}/{path}"), body).await;
    (a.status, a.body)
}

async fn exists(c: &Client, sid: &str, path: &str) -> Value {
    let (s, body) = op(c, Method::GET, sid, &format!("exists/{path}"), None).await;
    assert_eq!(s, 200, "exists {path}: {body:?}");
    body
}

fn code(answer: &(u16, Value)) -> (u16, &str) {
    (answer.0, answer.1["code"].as_str().unwrap_or("<no code>"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exists_remove_rename_and_make_dir_as_the_sandboxs_user() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    file_operations_contract(&stack, "bb").await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exists_remove_rename_and_make_dir_on_a_lazy_image() {
    let stack = crate::lazy::stack(StackOpts { warm: 0, ..Default::default() }).await;
    file_operations_contract(&stack, crate::lazy::TEMPLATE).await;
    stack.shutdown().await;
}

/// The file operations' contract on a session of `template` (tenant `t`'s).
async fn file_operations_contract(stack: &Stack, template: &str) {
    let c = stack.client("t");
    let sid = c.create(template).await["session_id"].as_str().unwrap().to_string();

    // make_dir: parents too, as the sandbox's user; again is fine (`mkdir -p`).
    assert_eq!(op(&c, Method::POST, &sid, "dirs/a/b/c", None).await.0, 204);
    assert_eq!(op(&c, Method::POST, &sid, "dirs/a/b/c", None).await.0, 204);
    assert_eq!(op(&c, Method::POST, &sid, "dirs//tmp/abs/dir", None).await.0, 204);
    let owners = c.sh(&sid, "stat -c %u:%g:%F a a/b/c /tmp/abs/dir").await;
    assert_eq!(owners["stdout"], "1000:1000:directory\n".repeat(3), "{owners}");

    // exists: what is there, relative or absolute, links not followed (a dangling one counts).
    assert_eq!(c.put_file(&sid, "a/f.txt", b"hello".to_vec()).await, 204);
    c.sh(&sid, "ln -s /nowhere a/dangling && ln -s /etc a/etc-link").await;
    let e = exists(&c, &sid, "a/f.txt").await;
    assert_eq!(e, json!({"path": "/work/a/f.txt", "exists": true, "type": "file"}));
    assert_eq!(exists(&c, &sid, "a/b").await["type"], "dir");
    assert_eq!(exists(&c, &sid, "/tmp/abs").await["type"], "dir");
    assert_eq!(exists(&c, &sid, "a/dangling").await["type"], "symlink");
    assert_eq!(exists(&c, &sid, "a/etc-link").await["type"], "symlink");
    assert_eq!(exists(&c, &sid, "a/missing").await, json!({"path": "/work/a/missing", "exists": false}));
    assert_eq!(exists(&c, &sid, "a/f.txt/under-a-file").await["exists"], false);

    // rename: a file, a directory; never over something; missing source is 404.
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/f.txt", "to": "a/g.txt"}))).await;
    assert_eq!(r.0, 204, "{r:?}");
    assert_eq!(exists(&c, &sid, "a/f.txt").await["exists"], false);
    assert_eq!(c.get_file(&sid, "a/g.txt").await, (200, b"hello".to_vec()));
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/b", "to": "//tmp/moved"}))).await;
    assert_eq!(r.0, 204, "{r:?}");
    assert_eq!(exists(&c, &sid, "/tmp/moved/c").await["type"], "dir");
    assert_eq!(c.put_file(&sid, "a/h.txt", b"other".to_vec()).await, 204);
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/g.txt", "to": "a/h.txt"}))).await;
    assert_eq!(code(&r), (409, "conflict"), "{r:?}");
    assert!(r.1["message"].as_str().unwrap().contains("exists already"), "{r:?}");
    assert_eq!(c.get_file(&sid, "a/h.txt").await, (200, b"other".to_vec()), "the target was left alone");
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/nope", "to": "a/x"}))).await;
    assert_eq!(code(&r), (404, "not_found"), "{r:?}");
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/g.txt", "to": "no/such/dir/x"}))).await;
    assert_eq!(code(&r), (404, "not_found"), "{r:?}");
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/g.txt"}))).await;
    assert_eq!(code(&r), (400, "bad_request"), "{r:?}");
    // Renaming a link moves the link, not what it points at.
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "a/etc-link", "to": "a/e2"}))).await;
    assert_eq!(r.0, 204, "{r:?}");
    assert_eq!(c.sh(&sid, "readlink a/e2; ls -d /etc").await["stdout"], "/etc\n/etc\n");
    // Where the user may not write, the user may not rename either.
    let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": "//etc/passwd", "to": "a/p"}))).await;
    assert_eq!(code(&r), (400, "bad_request"), "{r:?}");

    // make_dir over a file (or under one) is a conflict.
    let r = op(&c, Method::POST, &sid, "dirs/a/h.txt", None).await;
    assert_eq!(code(&r), (409, "conflict"), "{r:?}");
    let r = op(&c, Method::POST, &sid, "dirs/a/h.txt/sub", None).await;
    assert_eq!(code(&r), (409, "conflict"), "{r:?}");
    // A link to a directory is a directory to make_dir (as to `mkdir -p`); a dangling one is not.
    assert_eq!(op(&c, Method::POST, &sid, "dirs/a/e2", None).await.0, 204);
    let r = op(&c, Method::POST, &sid, "dirs/a/dangling", None).await;
    assert_eq!(code(&r), (409, "conflict"), "{r:?}");
    let r = op(&c, Method::POST, &sid, "dirs//etc/not-mine", None).await;
    assert_eq!(code(&r), (400, "bad_request"), "{r:?}");

    // remove: a file; a link (its target stays); an empty directory; a full one only with
    // `recursive`, which removes the links inside, never what they point at.
    assert_eq!(op(&c, Method::DELETE, &sid, "files/a/g.txt", None).await.0, 204);
    assert_eq!(exists(&c, &sid, "a/g.txt").await["exists"], false);
    assert_eq!(op(&c, Method::DELETE, &sid, "files/a/e2", None).await.0, 204);
    assert_eq!(c.sh(&sid, "ls -d /etc").await["stdout"], "/etc\n");
    let r = op(&c, Method::DELETE, &sid, "files/a/missing", None).await;
    assert_eq!(code(&r), (404, "not_found"), "{r:?}");
    assert_eq!(op(&c, Method::POST, &sid, "dirs/empty", None).await.0, 204);
    assert_eq!(op(&c, Method::DELETE, &sid, "files/empty", None).await.0, 204);
    c.sh(&sid, "mkdir -p /tmp/keep && echo kept > /tmp/keep/f && ln -s /tmp/keep a/keep-link").await;
    let r = op(&c, Method::DELETE, &sid, "files/a", None).await;
    assert_eq!(code(&r), (409, "conflict"), "{r:?}");
    assert!(r.1["message"].as_str().unwrap().contains("not empty"), "{r:?}");
    assert_eq!(exists(&c, &sid, "a/h.txt").await["exists"], true);
    let r = op(&c, Method::DELETE, &sid, "files/a?recursive=true", None).await;
    assert_eq!(r.0, 204, "{r:?}");
    assert_eq!(exists(&c, &sid, "a").await["exists"], false);
    assert_eq!(c.sh(&sid, "cat /tmp/keep/f").await["stdout"], "kept\n", "a link's target survived");
    let r = op(&c, Method::DELETE, &sid, "files//etc/passwd", None).await;
    assert_eq!(code(&r), (400, "bad_request"), "{r:?}");
    assert_eq!(c.sh(&sid, "head -c 5 /etc/passwd").await["stdout"], "root:");
    let r = op(&c, Method::DELETE, &sid, "files//", None).await;
    assert_eq!(code(&r), (400, "invalid_path"), "{r:?}");

    // Paths that climb out are refused before any node sees them (encoded: a client resolves
    // a literal `../`).
    for bad in ["..%2F..%2Fetc%2Fpasswd", "x/..%2F..%2Fetc"] {
        for (m, path) in [
            (Method::GET, format!("exists/{bad}")),
            (Method::DELETE, format!("files/{bad}?recursive=true")),
            (Method::POST, format!("dirs/{bad}")),
        ] {
            let r = op(&c, m.clone(), &sid, &path, None).await;
            assert_eq!(code(&r), (400, "invalid_path"), "{m} {path}: {r:?}");
        }
    }
    for (from, to) in [("../../etc/passwd", "x"), ("a", "../../tmp/x"), ("a", "x/\0")] {
        let r = op(&c, Method::POST, &sid, "files:rename", Some(json!({"from": from, "to": to}))).await;
        assert_eq!(code(&r), (400, "invalid_path"), "{from} -> {to}: {r:?}");
    }

    // Another tenant's session is not there at all.
    let mallory = stack.client("mallory");
    assert_eq!(c.put_file(&sid, "mine.txt", b"mine".to_vec()).await, 204);
    for (m, path, body) in [
        (Method::GET, "exists/mine.txt", None),
        (Method::DELETE, "files/mine.txt", None),
        (Method::POST, "dirs/evil", None),
        (Method::POST, "files:rename", Some(json!({"from": "mine.txt", "to": "stolen.txt"}))),
    ] {
        let r = op(&mallory, m.clone(), &sid, path, body).await;
        assert_eq!(code(&r), (404, "not_found"), "{m} {path}: {r:?}");
    }
    assert_eq!(c.get_file(&sid, "mine.txt").await, (200, b"mine".to_vec()));
    assert_eq!(exists(&c, &sid, "evil").await["exists"], false);

    assert_eq!(c.delete(&sid).await, 204);
    let r = op(&c, Method::GET, &sid, "exists/mine.txt", None).await;
    assert_eq!(code(&r), (404, "session_gone"), "{r:?}");
}

/// A docker-exec template has no agent to ask: a clear refusal, not a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_exec_templates_refuse_file_operations_clearly() {
    let stack = Stack::start(StackOpts { warm: 0, warm_docker: 1, ..Default::default() }).await;
    stack.wait_idle("bbd", 1, FILL).await;
    let c = stack.client("alice");
    let sid = c.create("bbd").await["session_id"].as_str().unwrap().to_string();
    let r = op(&c, Method::GET, &sid, "exists/x", None).await;
    assert_eq!(code(&r), (400, "bad_request"), "{r:?}");
    assert!(r.1["message"].as_str().unwrap().contains("exec = \"agent\""), "{r:?}");
    assert_eq!(c.delete(&sid).await, 204);
    stack.shutdown().await;
}
