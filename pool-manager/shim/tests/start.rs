//! `start` as containerd runs it: in the bundle directory, `containerd-shim-runc-v2` found on
//! `PATH`, and all it prints, stdout and stderr alike, taken as the shim's address.

use std::path::Path;
use std::process::Command;

/// A bundle with `spec` as its config.json, a fake real shim that prints an address, and a log
/// file; runs `sandpool-shim ... start` there and returns (combined output, config.json, log).
fn start(name: &str, spec: &str) -> (String, String, String) {
    let dir = std::env::temp_dir().join(format!("sandpool-shim-test-{name}-{}", std::process::id()));
    let (bundle, bin) = (dir.join("bundle"), dir.join("bin"));
    std::fs::create_dir_all(&bundle).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bundle.join("config.json"), spec).unwrap();
    let real = bin.join("containerd-shim-runc-v2");
    std::fs::write(&real, "#!/bin/sh\necho unix:///run/containerd/s/test\n").unwrap();
    std::fs::set_permissions(&real, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let log = dir.join("shim.log");
    let out = Command::new(env!("CARGO_BIN_EXE_sandpool-shim"))
        .args(["-namespace", "moby", "-id", "c1", "-address", "/run/containerd/containerd.sock", "start"])
        .current_dir(&bundle)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("SANDPOOL_SHIM_LOG", &log)
        .output()
        .unwrap();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let combined = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let got = (combined, read(&bundle.join("config.json")), read(&log));
    std::fs::remove_dir_all(&dir).unwrap();
    got
}

#[test]
fn start_prints_the_real_shims_address_alone_whatever_the_spec() {
    let address = "unix:///run/containerd/s/test\n";
    // Grouped: the annotation is written, nothing is said.
    let (out, spec, log) = start("grouped", r#"{"process":{"env":["SANDPOOL_SHIM_GROUP=g1"]}}"#);
    assert_eq!(out, address);
    assert!(spec.contains(r#""io.containerd.runc.v2.group":"g1""#), "{spec}");
    assert_eq!(log, "");
    // A bad name or a spec it cannot parse: left alone, told in the log only.
    for (name, bad) in
        [("badname", r#"{"process":{"env":["SANDPOOL_SHIM_GROUP=a/b"]}}"#), ("broken", r#"{"SANDPOOL_SHIM_GROUP=x"#)]
    {
        let (out, spec, log) = start(name, bad);
        assert_eq!(out, address, "{name}: containerd would take anything more as the address");
        assert_eq!(spec, bad, "{name}");
        assert!(log.contains("left") && log.contains("ungrouped"), "{name}: {log:?}");
    }
}
