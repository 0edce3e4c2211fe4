//! File requests against a real agent process.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use agent_proto::{EntryKind, Kind, Listing, ReadSpec, WriteSpec, codes};

use crate::support::{Agent, noise, scratch, sh};

fn read_spec(path: &std::path::Path) -> ReadSpec {
    ReadSpec { path: path.to_str().unwrap().into(), ..ReadSpec::default() }
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
    assert_eq!(err.code, codes::TOO_LARGE);
    assert!(err.message.ends_with("big (1000 bytes) is over the limit of 999 bytes"), "{}", err.message);
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

#[test]
fn a_flow_controlled_read_sends_within_its_credit_and_can_be_cancelled() {
    let mut agent = Agent::start();
    let dir = scratch("read-flow");
    let big = dir.join("big");
    std::fs::write(&big, noise(1 << 20, 7)).unwrap();
    let id = agent.id();
    let chunk = agent_proto::MAX_CHUNK as u32;
    agent.send(Kind::ReadFile, id, &ReadSpec { credit: 2 * chunk, ..read_spec(&big) }.encode());
    let data_bytes = |frames: &[agent_proto::Frame]| {
        frames.iter().filter(|f| f.kind == Kind::Data).map(|f| f.payload.len()).sum::<usize>()
    };
    agent.wait_frames(id, "two chunks", |f| data_bytes(f) == 2 * chunk as usize);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(data_bytes(&agent.frames_now(id)), 2 * chunk as usize, "sent past its credit");
    agent.credit(id, chunk);
    agent.wait_frames(id, "a third chunk", |f| data_bytes(f) == 3 * chunk as usize);
    // Cancelled: an error, and nothing more.
    agent.signal(id, 9);
    let frames = agent.finish(id);
    assert_eq!(frames.last().unwrap().kind, Kind::Error, "{frames:?}");

    // Credit enough: the whole file, exactly.
    let id = agent.id();
    agent.send(Kind::ReadFile, id, &ReadSpec { credit: 1 << 30, ..read_spec(&big) }.encode());
    let frames = agent.finish(id);
    let got: Vec<u8> = frames.iter().filter(|f| f.kind == Kind::Data).flat_map(|f| f.payload.clone()).collect();
    assert_eq!(got, noise(1 << 20, 7));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_directory_over_the_limit_sends_nothing() {
    let mut agent = Agent::start();
    let dir = scratch("read-too-large");
    std::fs::create_dir_all(dir.join("d")).unwrap();
    // 10 GiB apparent, no disk used.
    std::fs::File::create(dir.join("d/sparse")).unwrap().set_len(10 << 30).unwrap();
    let id = agent.id();
    agent.send(Kind::ReadFile, id, &ReadSpec { max_bytes: 1 << 30, ..read_spec(&dir.join("d")) }.encode());
    let frames = agent.finish(id);
    assert_eq!(frames.len(), 1, "no data before the refusal: {frames:?}");
    let err = agent_proto::ErrorInfo::decode(&frames[0].payload).unwrap();
    assert_eq!(err.code, codes::TOO_LARGE, "{err:?}");
    let _ = std::fs::remove_dir_all(dir);
}
