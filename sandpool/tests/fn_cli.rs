//! `sandpool fn` against `sandpool up`: a function's life from the command line (deploy,
//! invoke, map, async, ls, get, rm), errors as messages and a failing status; and the README's
//! Functions example (curl, then the same from the command line) run as written.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Up, sandpool, text};

fn ndjson(b: &[u8]) -> Vec<Value> {
    text(b).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_from_the_command_line() {
    let up = Up::start(|t| t, |_| {}).await;
    up.create().await; // warm
    let run = |args: &[&str], stdin: Option<&[u8]>| sandpool(&up, args, stdin);

    let out = run(
        &["fn", "deploy", "echo", "--template", "bb", "--mode", "exec", "--env", "X=1", "--timeout-ms", "20000"]
            .into_iter()
            .chain(["--max-concurrency", "2", "--env-idle-s", "120", "--", "sh", "-c", "cat"])
            .collect::<Vec<_>>(),
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let f: Value = serde_json::from_slice(&out.stdout).expect("the function as JSON");
    assert_eq!(
        (&f["name"], &f["mode"], &f["handler"], &f["env"], &f["version"]),
        (&json!("echo"), &json!("exec"), &json!(["sh", "-c", "cat"]), &json!({"X": "1"}), &json!(1)),
        "{f}"
    );
    assert_eq!((&f["timeout_ms"], &f["max_concurrency"], &f["env_idle_s"]), (&json!(20000), &json!(2), &json!(120)));

    // The result is stdout, byte for byte; the payload an argument or stdin.
    let payload = r#"{"a": [1, 2], "b": "x y"}"#;
    let out = run(&["fn", "invoke", "echo", payload], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), payload);
    let out = run(&["fn", "invoke", "echo", "-"], Some(b"-1\n"));
    assert_eq!((out.status.code(), text(&out.stdout)), (Some(0), "-1\n".into()), "{}", text(&out.stderr));
    let out = run(&["fn", "invoke", "echo", "-7"], None);
    assert_eq!(text(&out.stdout), "-7", "a payload may start with '-'");

    // A batch: NDJSON out, one line per payload in input order; a JSON array or NDJSON in,
    // from stdin or a file.
    let out = run(&["fn", "map", "echo", "-"], Some(b"[1,2,3]"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines = ndjson(&out.stdout);
    assert_eq!(lines.len(), 3, "{}", text(&out.stdout));
    for (i, line) in lines.iter().enumerate() {
        assert_eq!((&line["index"], &line["status"], &line["result"]), (&json!(i), &json!(200), &json!(i + 1)));
    }
    let batch = up.config_path().parent().unwrap().join("batch.ndjson");
    std::fs::write(&batch, "{\"k\":\"a\"}\n{\"k\":\"b\"}\n").unwrap();
    let out = run(&["fn", "map", "echo", batch.to_str().unwrap()], None);
    let results: Vec<Value> = ndjson(&out.stdout).into_iter().map(|l| l["result"].clone()).collect();
    assert_eq!(results, [json!({"k": "a"}), json!({"k": "b"})]);

    // Asynchronously: the id, then its state and result.
    let out = run(&["fn", "invoke", "echo", "--async", r#""later""#], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    assert_eq!(id.len(), 32, "an invocation id: {id:?}");
    let done = tests::eventually(Duration::from_secs(20), || async {
        let out = sandpool(&up, &["fn", "result", &id], None);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        (v["state"] == "done").then_some(v)
    })
    .await
    .expect("the asynchronous invocation finishes");
    assert_eq!((&done["status"], &done["result"]), (&json!(200), &json!("later")), "{done}");

    // A function error: its report on stderr, nothing on stdout, exit status 1.
    let out = run(
        &["fn", "deploy", "fails", "--template", "bb", "--mode", "exec", "--", "sh", "-c", "echo oops >&2; exit 3"],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(&["fn", "invoke", "fails", "1"], None);
    assert_eq!((out.status.code(), text(&out.stdout)), (Some(1), String::new()));
    let report: Value = serde_json::from_str(text(&out.stderr).trim()).expect("the error body on stderr");
    assert_eq!((&report["type"], &report["exit_code"]), (&json!("ExitStatus"), &json!(3)), "{report}");
    assert!(report["log"].as_str().unwrap().contains("oops"));

    let out = run(&["fn", "ls"], None);
    let listed: Value = serde_json::from_slice(&out.stdout).expect("a list as JSON");
    let mut names: Vec<&str> =
        listed["functions"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["echo", "fails"]);
    let out = run(&["fn", "get", "echo"], None);
    let got: Value = serde_json::from_slice(&out.stdout).expect("the function as JSON");
    assert!(got["environments"]["total"].as_u64().is_some_and(|n| n >= 1), "{got}");

    assert!(run(&["fn", "rm", "echo"], None).status.success());
    let out = run(&["fn", "ls"], None);
    assert!(!text(&out.stdout).contains("\"echo\""), "{}", text(&out.stdout));
    // Errors: the API's code and message, and a failing status.
    for (args, want) in [
        (&["fn", "invoke", "echo", "1"][..], r#"not_found (404): no function "echo""#),
        (&["fn", "map", "echo", "-"][..], r#"not_found (404): no function "echo""#),
        (&["fn", "rm", "echo"][..], "not_found (404)"),
        (&["fn", "get", "nope"][..], "not_found (404)"),
        (&["fn", "deploy", "x", "--template", "no-such-template", "--mode", "exec", "--", "true"][..], "(400)"),
        (&["fn", "deploy", "Bad", "--template", "bb", "--mode", "exec", "--", "true"][..], "bad_request (400): name"),
    ] {
        let out = run(args, Some(b"[1]"));
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(text(&out.stderr).contains(want), "{args:?}: {}", text(&out.stderr));
    }
}

/// The first fenced block of `lang` after the text `after`.
fn block(readme: &str, after: &str, lang: &str) -> String {
    let rest = &readme[readme.find(after).unwrap_or_else(|| panic!("README has {after:?}"))..];
    let start = rest.find(&format!("```{lang}\n")).expect("a code block") + lang.len() + 4;
    let len = rest[start..].find("```").expect("the block ends");
    rest[start..start + len].to_string()
}

/// A working directory with `target/release/sandpool`, as after `scripts/up`.
fn checkout(up: &Up) -> PathBuf {
    let dir = up.config_path().parent().unwrap().join("checkout");
    std::fs::create_dir_all(dir.join("target/release")).unwrap();
    let wrapper = dir.join("target/release/sandpool");
    std::fs::write(&wrapper, format!("#!/bin/sh\nexec '{}' \"$@\"\n", env!("CARGO_BIN_EXE_sandpool"))).unwrap();
    let mut perms = std::fs::metadata(&wrapper).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&wrapper, perms).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_functions_example_runs_as_written() {
    // The default config's Debian template (python3), sized for a test machine.
    let debian = "\n[templates.debian]\nimage = \"sandpool/debian:bookworm\"\nexec = \"agent\"\nworkdir = \"/work\"\n\
                  cpus = 0.5\nmemory_mb = 256\npids = 1024\nwarm = 2\nidle_timeout = \"10m\"\nmax_lifetime = \"1h\"\n";
    let up = Up::start(|toml| toml + debian, |_| {}).await;
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let section = &readme[readme.find("## Functions").expect("README has ## Functions")..];
    // `$API` and `auth` as the curl episode sets them.
    let script = format!(
        "API=$SANDPOOL_URL\nauth=(-H \"authorization: Bearer $SANDPOOL_TOKEN\")\n{}\necho '-- the command line --'\n{}",
        block(section, "A worked example", "sh"),
        block(section, "The same from the command line", "sh"),
    );
    let dir = checkout(&up);
    let mut bash = Command::new("bash");
    bash.arg("-euo").arg("pipefail").arg("-c").arg(&script).current_dir(&dir);
    let (out, t) = up.run(bash).await;
    assert!(out.status.success(), "the README's functions example failed:\n{t}");
    println!("{t}");
    for want in [
        r#""version":1"#,
        "x-sandpool-start: cold",
        r#"{"passed":1,"reward":1.0}"#,
        "x-sandpool-function-error: handled",
        r#"{"type":"KeyError","message":"'tests'""#,
        "100 0.773",
        r#""version": 2"#,
        "exit 1",
        r#""index":99"#,
        r#""state": "#,
        r#""name": "reward""#,
    ] {
        assert!(t.contains(want), "no {want:?} in:\n{t}");
    }
    let rewards = ndjson(&std::fs::read(dir.join("rewards.ndjson")).unwrap());
    assert_eq!(rewards.len(), 100);
    for (i, r) in rewards.iter().enumerate() {
        let want =
            if i % 3 == 0 { json!({"passed": 1, "reward": 1.0 / 3.0}) } else { json!({"passed": 3, "reward": 1.0}) };
        assert_eq!((&r["index"], &r["status"], &r["result"]), (&json!(i), &json!(200), &want), "{r}");
    }
    // Removed at the end.
    let out = sandpool(&up, &["fn", "get", "reward"], None);
    assert!(text(&out.stderr).contains("not_found (404)"), "{}", text(&out.stderr));
}
