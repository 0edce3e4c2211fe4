//! `sandpool sessions|exec|cp|fs` against `sandpool up`: a session's life from the command line
//! (listings a page at a time, an end by label),
//! the exit code passed through, files in and out, errors as messages and a failing status.

mod support;

use std::process::Command;

use support::{Up, sandpool, text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_from_the_command_line() {
    let up = Up::start(|t| t, |_| {}).await;
    up.create().await; // warm
    let run = |args: Vec<String>, stdin: Option<Vec<u8>>| {
        let up = &up;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        sandpool(up, &args, stdin.as_deref())
    };
    let v = |s: &[&str]| s.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let out = run(v(&["sessions", "create", "bb", "--label", "job=cli", "--idle-timeout", "600"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the session as JSON");
    let sid = session["session_id"].as_str().unwrap().to_string();
    assert_eq!(session["labels"]["job"], "cli");

    // The command's output and exit code are ours.
    let out = run(v(&["exec", &sid, "--env", "X=1", "--", "sh", "-c", "echo out $X; echo err >&2; exit 7"]), None);
    assert_eq!((out.status.code(), text(&out.stdout), text(&out.stderr)), (Some(7), "out 1\n".into(), "err\n".into()));
    let out = run(v(&["exec", &sid, "--timeout", "0.3", "--", "sleep", "5"]), None);
    assert_eq!(out.status.code(), Some(124), "a timeout is 124, like timeout(1)");

    // Files in and out, through a file and through stdin/stdout.
    let local = up.config_path().parent().unwrap().join("in.bin");
    let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    std::fs::write(&local, &data).unwrap();
    let out = run(v(&["cp", local.to_str().unwrap(), &format!("{sid}:data/in.bin")]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(v(&["cp", &format!("{sid}:/work/data/in.bin"), "-"]), None);
    assert_eq!(out.stdout, data);
    let out = run(v(&["cp", "-", &format!("{sid}:/tmp/piped")]), Some(b"piped in".to_vec()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let back = up.config_path().parent().unwrap().join("back.txt");
    let out = run(v(&["cp", &format!("{sid}:/tmp/piped"), back.to_str().unwrap()]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read(&back).unwrap(), b"piped in");

    // exists, mkdir, mv, rm: the file operations; a refusal is its code and a failing status.
    let out = run(v(&["fs", "mkdir", &sid, "made/deep"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(v(&["fs", "mv", &sid, "data/in.bin", "made/deep/moved.bin"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(v(&["fs", "exists", &sid, "made/deep/moved.bin"]), None);
    assert!(out.status.success() && text(&out.stdout).contains("\"type\": \"file\""), "{}", text(&out.stdout));
    let out = run(v(&["fs", "rm", &sid, "made"]), None);
    assert!(text(&out.stderr).contains("conflict (409)") && !out.status.success(), "{}", text(&out.stderr));
    let out = run(v(&["fs", "rm", "-r", &sid, "made"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(v(&["fs", "exists", &sid, "made"]), None);
    assert_eq!(out.status.code(), Some(1), "nothing there: {}", text(&out.stdout));

    let out = run(v(&["sessions", "ls", "--label", "job=cli"]), None);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a list as JSON");
    let listed: Vec<&str> =
        listed["sessions"].as_array().unwrap().iter().map(|s| s["session_id"].as_str().unwrap()).collect();
    assert_eq!(listed, [sid.as_str()]);
    let out = run(v(&["sessions", "get", &sid]), None);
    assert!(out.status.success() && text(&out.stdout).contains(&sid));
    // Pages: one at a time with --limit/--cursor; without --limit every page as one list.
    let out = run(v(&["sessions", "create", "bb", "--label", "job=cli"]), None);
    let second: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the session as JSON");
    let second = second["session_id"].as_str().unwrap().to_string();
    let page = |extra: &[&str]| {
        let out = run(v(&[&["sessions", "ls", "--label", "job=cli"][..], extra].concat()), None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("a page as JSON")
    };
    let first_page = page(&["--limit", "1"]);
    assert_eq!(first_page["sessions"][0]["session_id"], sid.as_str());
    let cursor = first_page["next_cursor"].as_str().expect("a next page").to_string();
    let second_page = page(&["--limit", "1", "--cursor", &cursor]);
    assert_eq!(second_page["sessions"][0]["session_id"], second.as_str());
    assert!(second_page.get("next_cursor").is_none(), "{second_page}");
    assert_eq!(page(&[])["sessions"].as_array().map(Vec::len), Some(2));
    let out = run(v(&["sessions", "ls", "--limit", "1", "--cursor", "nonsense"]), None);
    assert!(text(&out.stderr).contains("bad_request (400): cursor"), "{}", text(&out.stderr));
    let out = run(v(&["sessions", "rm", "--label", "job"]), None);
    assert!(text(&out.stderr).contains("bad_request (400): label"), "{}", text(&out.stderr));
    // Every session with the label ends in one call.
    let out = run(v(&["sessions", "rm", "--label", "job=cli"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ended: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a count as JSON");
    assert_eq!(ended, serde_json::json!({"ended": 2}));
    assert!(!run(v(&["sessions", "rm", &sid]), None).status.success(), "already ended");
    // Errors: the API's code and message, and a failing status.
    let out = run(v(&["exec", &sid, "--", "true"]), None);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("session_gone (404)"), "{}", text(&out.stderr));
    let out = run(v(&["cp", &format!("{sid}:/x"), "/dev/null"]), None);
    assert!(!out.status.success());
    let out = run(v(&["sessions", "create", "no-such-template"]), None);
    assert!(text(&out.stderr).contains("unknown_template (400)"), "{}", text(&out.stderr));
}

/// Drives `sandpool shell` through a pseudo-terminal (Python's `pty`): typing, a resize that
/// the remote terminal sees, and the remote exit code as ours.
const PTY_DRIVER: &str = r#"
import fcntl, os, pty, struct, sys, termios, time
bin, sid = sys.argv[1], sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
    os.execv(bin, [bin, "shell", sid])
buf = b""
def until(token, timeout=20):
    global buf
    end = time.time() + timeout
    while token not in buf:
        if time.time() > end:
            sys.exit(f"no {token!r} in {buf!r}")
        try:
            buf += os.read(fd, 4096)
        except OSError:
            sys.exit(f"ended before {token!r}: {buf!r}")
os.write(fd, b"stty size\r")
until(b"33 111")
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
time.sleep(0.5)
os.write(fd, b"stty size\r")
until(b"40 120")
os.write(fd, b"exit 5\r")
while True:
    try:
        if not os.read(fd, 4096):
            break
    except OSError:
        break
_, status = os.waitpid(pid, 0)
print("EXIT", os.waitstatus_to_exitcode(status))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_from_the_command_line() {
    let up = Up::start(|t| t, |_| {}).await;
    let (_, session) = up.create().await;
    let sid = session["session_id"].as_str().unwrap().to_string();
    let mut python = Command::new("python3");
    python.args(["-c", PTY_DRIVER, env!("CARGO_BIN_EXE_sandpool"), &sid]);
    let (out, t) = up.run(python).await;
    assert!(out.status.success(), "{t}");
    assert!(t.contains("EXIT 5"), "the remote exit code is ours: {t}");
}
