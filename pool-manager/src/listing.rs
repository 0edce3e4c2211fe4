//! Directory listings as the API answers them: from an agent's `Listing`, or from a tar of
//! the directory where no agent can list (a docker-exec template, an agent before protocol
//! version 4).

use std::time::{Duration, UNIX_EPOCH};

use agent_proto::{DirEntry, EntryKind, LIST_MAX, Listing};
use wire::EntryType;

/// The API's listing of directory `path`.
pub(crate) fn to_wire(path: String, l: Listing) -> wire::DirListing {
    let entries = l
        .entries
        .into_iter()
        .map(|e| {
            let kind = match e.kind {
                EntryKind::File => EntryType::File,
                EntryKind::Dir => EntryType::Dir,
                EntryKind::Symlink => EntryType::Symlink,
                EntryKind::Other => EntryType::Other,
            };
            let at = UNIX_EPOCH + Duration::from_secs(e.mtime.max(0) as u64);
            let modified_at = humantime::format_rfc3339_seconds(at).to_string();
            wire::DirEntry { name: e.name, kind, size: e.size, mode: e.mode, modified_at }
        })
        .collect();
    wire::DirListing { path, entries, total: l.total }
}

/// The top-level entries of a directory's tar. `prefixed`: Docker's archive, whose entries
/// sit under the directory's own name (its first entry); the agent's are relative to it.
/// A tar of a single regular file (Docker's answer for a file) is "not a directory".
pub(crate) fn from_tar(tar: &[u8], prefixed: bool) -> Result<Listing, String> {
    let mut ar = tar::Archive::new(tar);
    let mut entries = Vec::new();
    let mut root_seen = !prefixed;
    for e in ar.entries().map_err(|_| "not a directory".to_string())? {
        let e = e.map_err(|_| "not a directory".to_string())?;
        let h = e.header();
        let path = e.path().map_err(|e| e.to_string())?.to_string_lossy().trim_end_matches('/').to_string();
        let mut parts = path.split('/').filter(|p| !p.is_empty() && *p != ".");
        if prefixed {
            parts.next(); // the directory's own name
        }
        let (Some(name), None) = (parts.next(), parts.next()) else {
            if !root_seen && !h.entry_type().is_dir() {
                return Err("not a directory".into());
            }
            root_seen = true;
            continue;
        };
        let kind = match h.entry_type() {
            t if t.is_file() => EntryKind::File,
            t if t.is_dir() => EntryKind::Dir,
            t if t.is_symlink() => EntryKind::Symlink,
            _ => EntryKind::Other,
        };
        let size = if kind == EntryKind::Symlink {
            h.link_name_bytes().map_or(0, |l| l.len() as u64)
        } else {
            h.size().unwrap_or(0)
        };
        let (mode, mtime) = (h.mode().unwrap_or(0) & 0o7777, h.mtime().unwrap_or(0) as i64);
        // Its contents are never read: the archive skips them.
        entries.push(DirEntry { name: name.to_string(), kind, size, mode, mtime });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let total = entries.len() as u64;
    entries.truncate(LIST_MAX);
    Ok(Listing { total, entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o640);
            h.set_mtime(1_700_000_000);
            b.append_data(&mut h, path, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn a_tar_lists_its_top_level_only() {
        use tar::EntryType::{Directory, Regular};
        let agent = tar_of(&[("b.txt", Regular, b"hello"), ("a/", Directory, b""), ("a/deep", Regular, b"x")]);
        let l = from_tar(&agent, false).unwrap();
        let names: Vec<_> = l.entries.iter().map(|e| (e.name.as_str(), e.kind, e.size)).collect();
        assert_eq!(names, [("a", EntryKind::Dir, 0), ("b.txt", EntryKind::File, 5)]);
        assert_eq!((l.total, l.entries[1].mode, l.entries[1].mtime), (2, 0o640, 1_700_000_000));

        let docker = tar_of(&[("tmp/", Directory, b""), ("tmp/x", Regular, b"1"), ("tmp/d/", Directory, b"")]);
        let names: Vec<_> = from_tar(&docker, true).unwrap().entries.into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["d", "x"]);
        let file = tar_of(&[("x", Regular, b"1")]);
        assert_eq!(from_tar(&file, true).unwrap_err(), "not a directory");
        let wire = to_wire("/tmp".into(), from_tar(&docker, true).unwrap());
        assert_eq!(wire.entries[1].modified_at, "2023-11-14T22:13:20Z");
    }
}
