//! The house rules: what ARCHITECTURE.md claims about the code's shape, checked where a grep
//! can check it. These read the workspace's sources; they need neither Redis nor Docker.
//!
//! Each rule names itself in ARCHITECTURE.md's table of invariants. A failure says which file
//! broke which rule; the fix is in the code or, when the rule itself has changed, in both
//! ARCHITECTURE.md and here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the tests crate lives in the workspace").to_path_buf()
}

/// The workspace's crates: (directory, package name).
fn crates() -> Vec<(String, String)> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let members = section(&manifest, "[workspace]");
    let start = members.find("members").expect("workspace members");
    let list = &members[start..members[start..].find(']').map(|e| start + e).unwrap()];
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(|dir| {
            let toml = std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
            let name = section(&toml, "[package]")
                .lines()
                .find_map(|l| l.strip_prefix("name = \""))
                .and_then(|n| n.strip_suffix('"'))
                .expect("a package name")
                .to_string();
            (dir.to_string(), name)
        })
        .collect()
}

/// The text of one `[section]` of a TOML file, up to the next section header.
fn section(toml: &str, header: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in toml.lines() {
        if line.starts_with('[') {
            inside = line.trim() == header;
            continue;
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The names a crate lists under `[dependencies]` (not dev- or build-dependencies).
fn dependencies(dir: &str) -> BTreeSet<String> {
    let toml = std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
    section(&toml, "[dependencies]")
        .lines()
        .filter_map(|l| l.split(['.', '=', ' ']).next())
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .map(str::to_string)
        .collect()
}

/// Every `.rs` file under `<crate>/src`, with its path relative to the workspace.
fn sources(dir: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root().join(dir).join("src")];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// A file's code without its unit tests (everything from `#[cfg(test)]` on) and without
/// comment lines, so a rule about code is not tripped by a test or a sentence.
fn code(text: &str) -> String {
    let end = text.find("#[cfg(test)]").unwrap_or(text.len());
    text[..end].lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The crates that run in production (not the harness, the benchmarks or the agent, which
/// lives inside sandboxes and has rules of its own).
const SERVICES: &[&str] = &[
    "wire",
    "agent-proto",
    "config",
    "http-util",
    "telemetry",
    "ledger",
    "autoscaler",
    "gateway",
    "pool-manager",
    "lazy-image",
    "sandpool",
];

/// Every source file of the services: (crate, path, text).
fn service_sources() -> Vec<(String, String, String)> {
    crates()
        .into_iter()
        .filter(|(_, name)| SERVICES.contains(&name.as_str()))
        .flat_map(|(dir, name)| sources(&dir).into_iter().map(move |(path, text)| (name.clone(), path, text)))
        .collect()
}

#[test]
fn crates_depend_downwards_only() {
    // A crate may use only crates of a lower layer: the graph in ARCHITECTURE.md.
    let layer: BTreeMap<&str, u8> = [
        ("wire", 0),
        ("agent-proto", 0),
        ("telemetry", 0),
        ("lazy-image", 0),
        ("config", 1),
        ("http-util", 1),
        ("ledger", 1),
        ("agent", 1),
        ("sandpool-shim", 1),
        ("autoscaler", 2),
        ("gateway", 3),
        ("pool-manager", 3),
        ("sandpool", 4),
        ("tests", 4),
        ("loadtest", 5),
    ]
    .into();
    let mut wrong = Vec::new();
    for (dir, name) in crates() {
        let own = *layer.get(name.as_str()).unwrap_or_else(|| panic!("crate {name} has no layer here: give it one"));
        for dep in dependencies(&dir) {
            if let Some(&theirs) = layer.get(dep.as_str())
                && theirs >= own
            {
                wrong.push(format!("{name} (layer {own}) uses {dep} (layer {theirs})"));
            }
        }
    }
    assert!(wrong.is_empty(), "dependencies that point up or sideways:\n{}", wrong.join("\n"));
}

#[test]
fn only_the_ledger_speaks_redis() {
    let mut wrong = Vec::new();
    for (dir, name) in crates() {
        if name == "ledger" || !SERVICES.contains(&name.as_str()) {
            continue;
        }
        for dep in dependencies(&dir) {
            if dep.contains("redis") {
                wrong.push(format!("{name} depends on {dep}"));
            }
        }
    }
    // Scripts live in ledger/src/lua, and `Ledger::run` (script.rs) is the one way to call one.
    for (dir, _) in crates() {
        for (path, text) in sources(&dir) {
            let code = code(&text);
            if path != "ledger/src/script.rs" && (code.contains(".invoke_async(") || code.contains("Script::new(")) {
                wrong.push(format!("{path} runs a script itself (use `Ledger::run`)"));
            }
        }
    }
    let mut lua = Vec::new();
    let mut stack = vec![root()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() && !name.starts_with('.') && name != "target" {
                stack.push(p);
            } else if name.ends_with(".lua") {
                lua.push(p.strip_prefix(root()).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    wrong.extend(
        lua.iter().filter(|p| !p.starts_with("ledger/src/lua/")).map(|p| format!("a script outside the ledger: {p}")),
    );
    assert!(!lua.is_empty(), "found no Lua script at all: is the walk broken?");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn deadlines_come_from_redis_time() {
    // The ledger never reads the process's wall clock: deadlines are Redis `TIME`, so nodes
    // and gateways with skewed clocks agree on every expiry.
    let wrong: Vec<String> = sources("ledger")
        .into_iter()
        .filter(|(_, text)| {
            let code = code(text);
            code.contains("SystemTime") || code.contains("chrono::")
        })
        .map(|(p, _)| p)
        .collect();
    assert!(wrong.is_empty(), "the ledger reads the process's clock in: {wrong:?}");
}

/// Where the Docker API may be called from: the pool-manager's runtime room.
fn is_docker_room(path: &str) -> bool {
    path == "pool-manager/src/docker.rs"
        || path.starts_with("pool-manager/src/docker/")
        || path.starts_with("pool-manager/src/runtime/docker")
}

#[test]
fn only_the_runtime_calls_docker() {
    let mut wrong = Vec::new();
    for (dir, name) in crates() {
        if !SERVICES.contains(&name.as_str()) {
            continue;
        }
        if name != "pool-manager" && dependencies(&dir).contains("bollard") {
            wrong.push(format!("{name} depends on bollard"));
        }
        for (path, text) in sources(&dir) {
            if !is_docker_room(&path) && code(&text).contains("bollard::") {
                wrong.push(format!("{path} uses bollard"));
            }
        }
    }
    assert!(wrong.is_empty(), "Docker is called outside the runtime:\n{}", wrong.join("\n"));
}

#[test]
fn no_default_hasher() {
    let wrong: Vec<String> = service_sources()
        .into_iter()
        .filter(|(_, _, text)| code(text).contains("DefaultHasher"))
        .map(|(_, p, _)| p)
        .collect();
    assert!(wrong.is_empty(), "std's DefaultHasher (use wire::stable_hash) in: {wrong:?}");
}

#[test]
fn no_detached_tasks() {
    // Every task a service spawns is on a tracker that shutdown waits for. Any other spawn
    // says on the line above (or up to three above) either who waits for it (`// joined: ...`,
    // its handle is awaited or joined) or why it may outlive shutdown (`// detached: ...`).
    let mut wrong = Vec::new();
    for (name, path, text) in service_sources() {
        if name == "sandpool" {
            continue;
        }
        let end = text.find("#[cfg(test)]").unwrap_or(text.len());
        let lines: Vec<&str> = text[..end].lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let l = line.trim_start();
            if l.starts_with("//") {
                continue;
            }
            let spawns = ["tokio::spawn(", "tokio::task::spawn(", "thread::spawn("].iter().any(|s| l.contains(s));
            let said = lines[..i].iter().rev().take(3).any(|p| {
                let p = p.trim_start();
                p.starts_with("// detached:") || p.starts_with("// joined:")
            });
            if spawns && !said {
                wrong.push(format!("{path}:{}: {}", i + 1, l));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "tasks spawned off any tracker (or say `// joined: who waits` or `// detached: why`):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn files_stay_small() {
    let mut wrong = Vec::new();
    for (dir, _) in crates() {
        for (path, text) in sources(&dir) {
            let lines = text.lines().count();
            let first = text.lines().next().unwrap_or("");
            let says_why = first.starts_with("//") && first.to_lowercase().contains("one file");
            if lines > 600 && !says_why {
                wrong.push(format!("{path}: {lines} lines"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "files over 600 lines whose first line does not say why they are one file:\n{}",
        wrong.join("\n")
    );
}

/// A crate's modules (one per file) and, for each, the modules of the same crate it names.
fn module_graph(dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = format!("{dir}/src/");
    let mut texts = BTreeMap::new();
    for (path, text) in sources(dir) {
        let rel = path.strip_prefix(&src).unwrap().trim_end_matches(".rs");
        if rel.starts_with("bin/") || rel == "lib" || rel == "main" {
            continue;
        }
        let module = rel.trim_end_matches("/mod").replace('/', "::");
        texts.insert(module, code(&text));
    }
    let modules: BTreeSet<String> = texts.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (module, text) in &texts {
        let mut uses = BTreeSet::new();
        for path in paths_after(text, "crate::") {
            if let Some(target) = longest_module(&modules, &path) {
                uses.insert(target);
            }
        }
        if let Some((parent, _)) = module.rsplit_once("::") {
            for path in paths_after(text, "super::") {
                if let Some(target) = longest_module(&modules, &format!("{parent}::{path}")) {
                    uses.insert(target);
                }
            }
        }
        // A module and its own children or parent are one room, not a circle.
        uses.retain(|t| {
            t != module && !t.starts_with(&format!("{module}::")) && !module.starts_with(&format!("{t}::"))
        });
        graph.insert(module.clone(), uses);
    }
    graph
}

/// The module paths written after `prefix`, with `prefix{a, b::c}` expanded one level.
fn paths_after(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        // `super::` inside `crate::x::super::` does not occur; a `crate::` inside an
        // identifier (`my_crate::`) is not ours.
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            out.extend(group[..end].split(',').map(|p| ident_path(p.trim())));
        } else {
            out.push(ident_path(rest));
        }
    }
    out
}

fn ident_path(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
        .collect::<String>()
        .trim_end_matches(':')
        .to_string()
}

fn longest_module(modules: &BTreeSet<String>, path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split("::").collect();
    (1..=parts.len()).rev().map(|k| parts[..k].join("::")).find(|m| modules.contains(m))
}

/// Circles a crate may keep, each with its reason: a type and its `impl` split on purpose.
const ALLOWED_CIRCLES: &[(&str, &[&str], &str)] = &[];

#[test]
fn no_circles_between_files() {
    let mut found = Vec::new();
    for (dir, name) in crates() {
        let graph = module_graph(&dir);
        for component in strongly_connected(&graph) {
            let allowed = ALLOWED_CIRCLES
                .iter()
                .any(|(c, members, _)| *c == name && members.iter().copied().eq(component.iter().map(String::as_str)));
            if !allowed {
                let edges: Vec<String> = component
                    .iter()
                    .map(|m| {
                        format!("  {m} -> {:?}", graph[m].iter().filter(|t| component.contains(t)).collect::<Vec<_>>())
                    })
                    .collect();
                found.push(format!("{name}: {component:?}\n{}", edges.join("\n")));
            }
        }
    }
    assert!(found.is_empty(), "circles between files of one crate:\n{}", found.join("\n"));
}

/// Tarjan's strongly connected components with more than one member, each sorted.
fn strongly_connected(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.graph[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out
}

#[test]
fn the_circle_finder_finds_a_circle() {
    // The check above passes on a tree with no circles; this shows it would see one.
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), ["b".to_string()].into()),
        ("b".to_string(), ["c".to_string()].into()),
        ("c".to_string(), ["a".to_string()].into()),
        ("d".to_string(), ["a".to_string()].into()),
    ]
    .into();
    assert_eq!(strongly_connected(&graph), vec![vec!["a".to_string(), "b".to_string(), "c".to_string()]]);
    let uses =
        paths_after("use crate::{node::lock, docker::Dock};\nlet x = crate::plan::plan(); my_crate::x", "crate::");
    assert_eq!(uses, ["node::lock", "docker::Dock", "plan::plan"]);
}

#[test]
fn the_autoscaler_writes_only_targets() {
    // It reads the ledger and writes the pools' targets; every other call it makes is a read.
    const READS: &[&str] = &["arrivals", "image_templates", "node_images", "node_seen", "nodes", "now_ms", "stats"];
    let mut wrong = BTreeSet::new();
    for (path, text) in sources("autoscaler") {
        for call in paths_after(&code(&text), "ledger.") {
            let call = call.split("::").next().unwrap_or("").to_string();
            if call != "set_targets" && !READS.contains(&call.as_str()) {
                wrong.insert(format!("{path}: ledger.{call}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the autoscaler calls ledger functions that are not reads (add a read to READS): {wrong:?}"
    );
}

#[test]
fn one_timeout_rule() {
    // Exec, shell and invoke `timeout_ms` are bounded by `wire::timeouts` alone; gateway and
    // node call it rather than restate the bound.
    let wrong: Vec<String> = service_sources()
        .into_iter()
        .filter(|(_, path, text)| {
            let code = code(text);
            path != "wire/src/timeouts.rs"
                && (code.contains("timeout_ms: must") || code.contains("MAX_EXEC_TIMEOUT.as_"))
        })
        .map(|(_, p, _)| p)
        .collect();
    assert!(wrong.is_empty(), "a timeout bound restated outside wire::timeouts: {wrong:?}");
}
