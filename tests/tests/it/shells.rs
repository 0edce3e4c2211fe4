//! Persistent shells on real Docker: state that carries over, independent shells, end
//! detection that output cannot fool, stdin, timeouts and interrupts that keep the shell,
//! background jobs, `exit`, pause and resume, and the limits.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Client, Stack, StackOpts};

use crate::FILL;

struct Sh {
    c: Client,
    sid: String,
}

impl Sh {
    async fn open(&self, body: Value) -> tests::Answer {
        self.c.call(Method::POST, &format!("/v1/sessions/{}/shells", self.sid), Some(body)).await
    }

    async fn run_with(&self, shell: &str, body: Value) -> tests::Answer {
        self.c.call(Method::POST, &format!("/v1/sessions/{}/shells/{shell}/run", self.sid), Some(body)).await
    }

    /// Runs `cmd`, asserting the call succeeded; the result.
    async fn run(&self, shell: &str, cmd: &str) -> Value {
        let a = self.run_with(shell, json!({ "cmd": cmd })).await;
        assert_eq!(a.status, 200, "run {cmd:?}: {:?}", a.body);
        a.body
    }
}

async fn session(stack: &Stack) -> Sh {
    stack.wait_idle("bb", 1, FILL).await;
    session_of(stack, "bb").await
}

async fn session_of(stack: &Stack, template: &str) -> Sh {
    let c = stack.client("t");
    let sid = c.create(template).await["session_id"].as_str().unwrap().to_string();
    Sh { c, sid }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_state_carries_over_and_shells_are_independent() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    shell_state_contract(session(&stack).await).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_state_carries_over_on_a_lazy_image() {
    let stack = crate::lazy::stack(StackOpts { warm: 0, ..Default::default() }).await;
    shell_state_contract(session_of(&stack, crate::lazy::TEMPLATE).await).await;
    stack.shutdown().await;
}

/// A persistent shell's state, a second shell's independence, and a shell across a pause.
async fn shell_state_contract(sh: Sh) {
    let a = sh.open(json!({"name": "main"})).await;
    assert_eq!(
        (a.status, a.body["name"].as_str(), a.body["cwd"].as_str()),
        (201, Some("main"), Some("/work")),
        "{:?}",
        a.body
    );
    let r =
        sh.run("main", "cd /tmp && export FOO=bar && LOCAL=1 && f() { echo \"f:$1\"; } && alias hi='echo hello'").await;
    assert_eq!((r["exit_code"].as_i64(), r["cwd"].as_str(), r["output"].as_str()), (Some(0), Some("/tmp"), Some("")));
    let r = sh.run("main", "pwd; echo $FOO $LOCAL; f x; hi").await;
    assert_eq!(r["output"], "/tmp\nbar 1\nf:x\nhello\n");
    sh.run("main", "echo 'export SOURCED=yes' > /tmp/env.sh").await;
    sh.run("main", ". /tmp/env.sh").await;
    assert_eq!(sh.run("main", "echo $SOURCED; false").await["output"], "yes\n");
    assert_eq!(sh.run("main", "false").await["exit_code"], 1);
    assert_eq!(sh.run("main", "echo err >&2; echo out").await["output"], "err\nout\n", "both streams, in order");
    // A second shell has its own state.
    let a = sh.open(json!({"env": {"GREETING": "hi"}})).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let other = a.body["name"].as_str().unwrap().to_string();
    assert_eq!(sh.run(&other, "echo ${FOO:-unset} $GREETING; pwd").await["output"], "unset hi\n/work\n");
    let list = sh.c.call(Method::GET, &format!("/v1/sessions/{}/shells", sh.sid), None).await;
    let names: Vec<&str> =
        list.body["shells"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 2, "{:?}", list.body);
    // A shell survives a pause and resume of its session.
    assert_eq!(sh.c.call(Method::POST, &format!("/v1/sessions/{}/pause", sh.sid), None).await.status, 200);
    assert_eq!(sh.run("main", "echo $FOO; pwd").await["output"], "bar\n/tmp\n", "a run resumes the session");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_end_exactly_whatever_they_print_or_read() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let sh = session(&stack).await;
    assert_eq!(sh.open(json!({"name": "s"})).await.status, 201);
    // Output that looks like the end markers, and no final newline.
    let r = sh.run("s", "echo SPOUT_0123 SPCTL_0123 0 /; printf 'no newline'").await;
    assert_eq!(
        (r["output"].as_str(), r["exit_code"].as_i64()),
        (Some("SPOUT_0123 SPCTL_0123 0 /\nno newline"), Some(0))
    );
    // Standard input: end of input unless given.
    assert_eq!(sh.run("s", "cat; echo done").await["output"], "done\n");
    let r = sh.run_with("s", json!({"cmd": "read x; echo got:$x; cat", "stdin": "first\nsecond"})).await;
    assert_eq!(r.body["output"], "got:first\nsecond", "{:?}", r.body);
    // A syntax error is an exit status; the shell lives on.
    let r = sh.run("s", "if then").await;
    assert_ne!(r["exit_code"], 0);
    assert_eq!(sh.run("s", "echo alive").await["output"], "alive\n");
    // Large output is kept up to the cap; the run still ends.
    let r = sh
        .run("s", "i=0; while [ $i -lt 2000 ]; do echo 0123456789012345678901234567890123456789; i=$((i+1)); done")
        .await;
    assert_eq!(r["output"].as_str().unwrap().len(), 2000 * 41);
    // A background job lives on between runs.
    sh.run("s", "(sleep 1; echo bg-done > /tmp/bg) &").await;
    assert_eq!(sh.run("s", "sleep 1.5; cat /tmp/bg").await["output"], "bg-done\n");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_interrupts_stop_the_command_and_keep_the_shell() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let sh = session(&stack).await;
    assert_eq!(sh.open(json!({"name": "s"})).await.status, 201);
    sh.run("s", "cd /tmp; export KEEP=1").await;
    let t0 = Instant::now();
    let r = sh.run_with("s", json!({"cmd": "echo before; sleep 30; echo never", "timeout_ms": 500})).await;
    assert_eq!((r.status, r.body["timed_out"].as_bool()), (200, Some(true)), "{:?}", r.body);
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    assert!(r.body["output"].as_str().unwrap().starts_with("before\n"), "{:?}", r.body);
    assert_eq!(sh.run("s", "pwd; echo $KEEP").await["output"], "/tmp\n1\n");
    // A command that ignores SIGINT is killed at the second step.
    let t0 = Instant::now();
    let r = sh.run_with("s", json!({"cmd": "sh -c 'trap \"\" INT; sleep 30'", "timeout_ms": 300})).await;
    assert_eq!((r.status, r.body["timed_out"].as_bool()), (200, Some(true)), "{:?}", r.body);
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert_eq!(sh.run("s", "echo $KEEP").await["output"], "1\n");
    // Interrupt on demand; meanwhile the shell is busy.
    let (c, sid) = (sh.c.clone(), sh.sid.clone());
    let running = tokio::spawn(async move {
        c.call(Method::POST, &format!("/v1/sessions/{sid}/shells/s/run"), Some(json!({"cmd": "sleep 30"}))).await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let busy = sh.run_with("s", json!({"cmd": "true"})).await;
    assert_eq!((busy.status, busy.body["code"].as_str()), (409, Some("conflict")), "{:?}", busy.body);
    let i = sh.c.call(Method::POST, &format!("/v1/sessions/{}/shells/s/interrupt", sh.sid), None).await;
    assert_eq!(i.status, 204, "{:?}", i.body);
    let r = running.await.unwrap();
    assert_eq!(
        (r.status, r.body["exit_code"].as_i64(), r.body["timed_out"].as_bool()),
        (200, Some(130), Some(false)),
        "{:?}",
        r.body
    );
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_ends_a_shell_and_the_limits_hold() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let sh = session(&stack).await;
    assert_eq!(sh.open(json!({"name": "s"})).await.status, 201);
    let r = sh.run("s", "echo bye; exit 3").await;
    assert_eq!((r["exit_code"].as_i64(), r["output"].as_str()), (Some(3), Some("bye\n")));
    let gone = sh.run_with("s", json!({"cmd": "true"})).await;
    assert_eq!((gone.status, gone.body["code"].as_str()), (409, Some("shell_gone")), "{:?}", gone.body);
    let path = |rest: &str| format!("/v1/sessions/{}/shells{rest}", sh.sid);
    assert_eq!(sh.c.call(Method::DELETE, &path("/s"), None).await.status, 204);
    assert_eq!(sh.c.call(Method::DELETE, &path("/s"), None).await.status, 404);
    assert_eq!(sh.run_with("nope", json!({"cmd": "true"})).await.status, 404);
    for (body, status) in [
        (json!({"name": "bad name"}), 400),
        (json!({"shell": "zsh"}), 400),
        (json!({"shell": "bash"}), 400),
        (json!({"nmae": "x"}), 400),
    ] {
        let a = sh.open(body.clone()).await;
        assert_eq!(a.status, status, "{body}: {:?}", a.body);
    }
    for i in 0..wire::shells::MAX_SHELLS {
        assert_eq!(sh.open(json!({"name": format!("s{i}")})).await.status, 201);
    }
    let a = sh.open(json!({"name": "one-more"})).await;
    assert_eq!((a.status, a.body["code"].as_str()), (409, Some("conflict")), "{:?}", a.body);
    let a = sh.open(json!({"name": "s0"})).await;
    assert_eq!(a.status, 409, "a duplicate name: {:?}", a.body);
    // Shells are the session owner's alone.
    let other = stack.client("u").call(Method::GET, &path(""), None).await;
    assert_eq!(other.status, 404);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shell_runs_on_the_session_socket_with_output_as_it_comes() {
    use crate::ws::{connect, recv, send};
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let sh = session(&stack).await;
    assert_eq!(sh.open(json!({"name": "s"})).await.status, 201);
    let mut ws = connect(&stack.url, &sh.sid, &sh.c.token).await;
    let cmd = "cd /tmp; for i in 1 2 3; do echo line$i; sleep 0.3; done";
    send(&mut ws, json!({"type": "shell_run", "id": "r1", "shell": "s", "cmd": cmd})).await;
    let (mut chunks, mut output) = (0, String::new());
    let exit = loop {
        let m = recv(&mut ws).await;
        match m["type"].as_str().unwrap() {
            "started" => {}
            "stdout" => {
                chunks += 1;
                output.push_str(m["data"].as_str().unwrap());
            }
            "shell_exit" => break m,
            other => panic!("unexpected {other}: {m}"),
        }
    };
    assert_eq!(output, "line1\nline2\nline3\n");
    assert!(chunks >= 2, "output came as it was printed ({chunks} messages)");
    assert_eq!((exit["exit_code"].as_i64(), exit["cwd"].as_str()), (Some(0), Some("/tmp")), "{exit}");
    // The same shell over HTTP.
    assert_eq!(sh.run("s", "pwd").await["output"], "/tmp\n");
    // Interrupt from the socket.
    send(&mut ws, json!({"type": "shell_run", "id": "r2", "shell": "s", "cmd": "sleep 30"})).await;
    assert_eq!(recv(&mut ws).await["type"], "started");
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(&mut ws, json!({"type": "shell_interrupt", "shell": "s"})).await;
    let m = recv(&mut ws).await;
    assert_eq!(
        (m["type"].as_str(), m["id"].as_str(), m["exit_code"].as_i64()),
        (Some("shell_exit"), Some("r2"), Some(130)),
        "{m}"
    );
    send(&mut ws, json!({"type": "shell_run", "id": "r3", "shell": "nope", "cmd": "true"})).await;
    let m = recv(&mut ws).await;
    assert_eq!((m["type"].as_str(), m["code"].as_str()), (Some("error"), Some("not_found")), "{m}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bash_shell_keeps_bash_state_like_an_activated_virtualenv() {
    let extra = "[templates.bash]\nimage = \"sandpool/bash:latest\"\nexec = \"agent\"\nworkdir = \"/work\"\nwarm = 1\n";
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: extra.into(), ..Default::default() }).await;
    stack.wait_idle("bash", 1, FILL).await;
    let c = stack.client("t");
    let sid = c.create("bash").await["session_id"].as_str().unwrap().to_string();
    let sh = Sh { c, sid };
    let a = sh.open(json!({"name": "b", "shell": "bash"})).await;
    assert_eq!((a.status, a.body["shell"].as_str()), (201, Some("bash")), "{:?}", a.body);
    // What `source .venv/bin/activate` does: PATH, a variable, a function to undo it.
    sh.run("b", "mkdir -p /work/venv/bin && printf '#!/bin/sh\\necho venv-tool\\n' > /work/venv/bin/tool && chmod +x /work/venv/bin/tool").await;
    sh.run("b", "printf 'export VIRTUAL_ENV=/work/venv\\nexport PATH=$VIRTUAL_ENV/bin:$PATH\\ndeactivate() { export PATH=${PATH#*:}; unset VIRTUAL_ENV; }\\n' > /work/venv/bin/activate").await;
    sh.run("b", "source /work/venv/bin/activate").await;
    assert_eq!(sh.run("b", "tool; echo $VIRTUAL_ENV").await["output"], "venv-tool\n/work/venv\n");
    // Bash's own state: arrays, aliases, shell options.
    sh.run("b", "arr=(a b c); alias ll='echo listed'; shopt -s nullglob").await;
    assert_eq!(
        sh.run("b", "echo ${arr[1]} ${#arr[@]}; ll; shopt -q nullglob && echo on").await["output"],
        "b 3\nlisted\non\n"
    );
    sh.run("b", "deactivate").await;
    assert_eq!(
        sh.run("b", "command -v tool || echo gone; echo ${VIRTUAL_ENV:-unset}").await["output"],
        "gone\nunset\n"
    );
    let r = sh.run_with("b", json!({"cmd": "sleep 20", "timeout_ms": 300})).await;
    assert_eq!((r.status, r.body["timed_out"].as_bool()), (200, Some(true)), "{:?}", r.body);
    assert_eq!(sh.run("b", "echo ${arr[2]}").await["output"], "c\n", "bash survives the interrupt");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_interrupts_its_run_and_the_next_run_sees_none_of_it() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let sh = session(&stack).await;
    assert_eq!(sh.open(json!({"name": "s"})).await.status, 201);
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(400)).build().unwrap();
    let gone = impatient
        .post(format!("{}/v1/sessions/{}/shells/s/run", stack.url, sh.sid))
        .bearer_auth(&sh.c.token)
        .json(&json!({"cmd": "cd /tmp; sleep 5; echo from-abandoned"}))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up");
    let t0 = Instant::now();
    let r = sh.run("s", "echo next; pwd").await;
    assert_eq!(r["output"], "next\n/tmp\n", "nothing of the abandoned run, and its cd stays");
    assert!(t0.elapsed() < Duration::from_secs(4), "the abandoned sleep was interrupted: {:?}", t0.elapsed());
    stack.shutdown().await;
}
