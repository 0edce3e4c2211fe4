//! File requests against a real agent process.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use agent_proto::{EntryKind, Kind, Listing, ReadSpec, WriteSpec, codes};

use crate::support::{Agent, noise, scratch, sh};

fn read_spec(path: &std::path::Path) -> ReadSpec {
    ReadSpec { fence: 0, path: path.to_str().unwrap().into(), max_bytes: 0, list: false }
}

fn write_spec(path: &std::path::Path, mode: u32) -> WriteSpec {
    WriteSpec { fence: 0, path: path.to_str().unwrap().into(), mode }
}

#[test]
fn write_into_new_dirs_then_read_back_exactly() {
    let mut agent = Agent::start();
    let dir = scratch("write-read");
    let target = dir.join("a/b/c/data.bin");
    let data = noise(300_000, 1);
    assert_eq!(agent.write(&write_spec(&target, 0o600), &data).unwrap(), data.len() as u64);
    assert_eq!(std::fs::read(&target).unwrap(), data);
    assert_eq!(std::fs::metadata(&target).unwrap().permissions().mode() & 0o7777, 0o600);
    assert_eq!(agent.read(&read_spec(&target)).unwrap(), data);

    // Overwrite atomically with a shorter file and another mode; no temp files left behind.
    assert_eq!(agent.write(&write_spec(&target, 0o755), b"short").unwrap(), 5);
    assert_eq!(agent.read(&read_spec(&target)).unwrap(), b"short");
    assert_eq!(std::fs::metadata(&target).unwrap().permissions().mode() & 0o7777, 0o755);
    let names: Vec<_> = std::fs::read_dir(target.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["data.bin"]);

    // Empty file.
    let empty = dir.join("empty");
    assert_eq!(agent.write(&write_spec(&empty, 0o644), b"").unwrap(), 0);
    assert_eq!(agent.read(&read_spec(&empty)).unwrap(), b"");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_directory_lists_its_entries_by_name_without_following_links() {
    let mut agent = Agent::start();
    let dir = scratch("list");
    std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
    std::fs::write(dir.join("b.txt"), b"hello").unwrap();
    std::fs::set_permissions(dir.join("b.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink("/nowhere", dir.join("a-link")).unwrap();
    let list = |agent: &mut Agent, p: &std::path::Path| agent.read(&ReadSpec { list: true, ..read_spec(p) });
    let l = Listing::decode(&list(&mut agent, &dir).unwrap()).unwrap();
    let seen: Vec<_> = l.entries.iter().map(|e| (e.name.as_str(), e.kind)).collect();
    assert_eq!(seen, [("a-link", EntryKind::Symlink), ("b.txt", EntryKind::File), ("sub", EntryKind::Dir)]);
    assert_eq!((l.total, l.entries[1].size, l.entries[1].mode), (3, 5, 0o640));
    assert!(l.entries[1].mtime > 1_600_000_000);

    assert_eq!(list(&mut agent, &dir.join("b.txt")).unwrap_err().code, codes::BAD_REQUEST, "a file is no directory");
    assert_eq!(list(&mut agent, &dir.join("nope")).unwrap_err().code, codes::NOT_FOUND);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn read_errors() {
    let mut agent = Agent::start();
    let dir = scratch("read-errors");
    let missing = agent.read(&read_spec(&dir.join("nope"))).unwrap_err();
    assert_eq!(missing.code, codes::NOT_FOUND);

    let big = dir.join("big");
    std::fs::write(&big, vec![7u8; 1000]).unwrap();
    let err = agent.read(&ReadSpec { max_bytes: 999, ..read_spec(&big) }).unwrap_err();
    assert_eq!(err.code, codes::IO);
    assert_eq!(err.message, "file too large (1000 bytes, limit 999)");
    assert_eq!(agent.read(&ReadSpec { max_bytes: 1000, ..read_spec(&big) }).unwrap().len(), 1000);

    let relative = agent.read(&ReadSpec { path: "etc/hostname".into(), ..ReadSpec::default() }).unwrap_err();
    assert_eq!(relative.code, codes::BAD_REQUEST);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn write_errors() {
    let mut agent = Agent::start();
    let dir = scratch("write-errors");
    let err = agent.write(&write_spec(&dir, 0o644), b"data").unwrap_err();
    assert_eq!(err.code, codes::IS_DIRECTORY);

    let file = dir.join("file");
    std::fs::write(&file, "x").unwrap();
    let err = agent.write(&write_spec(&file.join("below"), 0o644), b"data").unwrap_err();
    assert_eq!(err.code, codes::IO, "{err:?}");
    // Still serving.
    agent.ping();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn directory_reads_as_a_tar_the_host_can_list() {
    let mut agent = Agent::start();
    let dir = scratch("tar-src");
    std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
    std::fs::write(dir.join("top.txt"), "top").unwrap();
    std::fs::write(dir.join("sub/deeper/blob"), noise(200_000, 3)).unwrap();
    std::os::unix::fs::symlink("top.txt", dir.join("link")).unwrap();
    let tar = agent.read(&read_spec(&dir)).unwrap();

    let out_dir = scratch("tar-out");
    let archive = out_dir.join("x.tar");
    std::fs::write(&archive, &tar).unwrap();
    let listed = Command::new("tar").arg("-tf").arg(&archive).output().unwrap();
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let mut names: Vec<String> = String::from_utf8(listed.stdout).unwrap().lines().map(String::from).collect();
    names.sort();
    assert_eq!(names, ["link", "sub/", "sub/deeper/", "sub/deeper/blob", "top.txt"]);

    let extracted = out_dir.join("x");
    std::fs::create_dir(&extracted).unwrap();
    let status = Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&extracted).status().unwrap();
    assert!(status.success());
    assert_eq!(std::fs::read(extracted.join("sub/deeper/blob")).unwrap(), noise(200_000, 3));
    assert_eq!(std::fs::read_link(extracted.join("link")).unwrap().to_str(), Some("top.txt"));
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(out_dir);
}

#[test]
fn concurrent_uploads_interleave_with_execs() {
    let mut agent = Agent::start();
    let dir = scratch("concurrent");
    let exec = agent.start_exec(&sh("sleep 0.2; echo ok"));
    let payloads: Vec<Vec<u8>> = (0..4).map(|i| noise(150_000 + i * 1000, i as u64 + 10)).collect();
    let ids: Vec<u32> = (0..4).map(|_| agent.id()).collect();
    // Open all four uploads, then interleave their chunks.
    for (i, id) in ids.iter().enumerate() {
        agent.send(Kind::WriteFile, *id, &write_spec(&dir.join(format!("f{i}")), 0o644).encode());
    }
    for round in 0..3 {
        for (id, data) in ids.iter().zip(&payloads) {
            let chunk = &data[round * 50_000..((round + 1) * 50_000).min(data.len())];
            agent.send(Kind::Data, *id, chunk);
        }
    }
    for (id, data) in ids.iter().zip(&payloads) {
        agent.send(Kind::Data, *id, &data[150_000..]);
        agent.send(Kind::End, *id, &[]);
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(agent.write_result(*id).unwrap(), payloads[i].len() as u64);
        assert_eq!(std::fs::read(dir.join(format!("f{i}"))).unwrap(), payloads[i]);
    }
    assert_eq!(agent.exec_result(exec).stdout_str(), "ok\n");
    let _ = std::fs::remove_dir_all(dir);
}
