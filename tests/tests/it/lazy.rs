//! Sessions on lazy images (issue 32): a template made from an image converted to the lazy
//! form runs through Docker on the `sandpool-lazy` runtime, over the node's `sandpool-lazyd`
//! mount, fetching only what its commands read.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lazy_image::lazyd::{self, MountInfo, Request, Response};
use reqwest::Method;
use serde_json::json;
use tests::corpus::registry;
use tests::{Stack, StackOpts, eventually, rand_hex};

/// The bytes of the image's big file: large beside what a first command reads.
pub(crate) const DATA_BYTES: usize = 48 << 20;
/// The lazy sandbox's disk bound (its writes; the image's bytes are not its).
const DISK_MB: u64 = 32;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds this tree's `sandpool-lazyd` and `sandpool-lazy-runtime` (the pool-manager starts the
/// daemon from beside the test binary's directory) and installs the runtime where dockerd's
/// `sandpool-lazy` entry points (`scripts/lib.sh`: `ensure_runtimes`, `install_lazy_runtime`).
pub(crate) fn install_lazy_binaries() {
    let _lock = lazy_lock();
    install_unlocked();
}

/// [`install_lazy_binaries`] for a caller that holds [`lazy_lock`].
fn install_unlocked() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).current_dir(repo_root()).args(["build", "-q", "-p", "lazy-image", "--bins"]));
    let exe = std::env::current_exe().expect("this test's path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("<target>/<profile>/deps/..");
    let runtime = profile_dir.join("sandpool-lazy-runtime");
    let script =
        format!("source scripts/lib.sh && ensure_runtimes >/dev/null && install_lazy_runtime {}", runtime.display());
    run(Command::new("bash").current_dir(repo_root()).args(["-c", &script]));
}

/// A source image (busybox + random bytes at /data.bin) pushed to a registry, and its lazy
/// form; the stub image and the node's mount of it go on drop.
pub(crate) struct LazyFixture {
    /// The lazy image as a tenant names it (tag).
    pub(crate) lazy: String,
    /// ... and pinned by digest, as its template records it.
    pub(crate) pinned: String,
    pub(crate) data_sha256: String,
    blob_size: u64,
    /// The `sandpool-lazyd` that mounts it.
    socket: PathBuf,
}

impl LazyFixture {
    /// An image whose /data.bin holds `data_bytes` random bytes in the local registry, mounted
    /// by the daemon at `socket`.
    async fn with_data(data_bytes: usize, socket: &Path) -> LazyFixture {
        LazyFixture::build_in(&registry(), data_bytes, socket).await
    }

    /// The same in the registry at `host`.
    pub(crate) async fn build_in(host: &str, data_bytes: usize, socket: &Path) -> LazyFixture {
        let prefix = format!("sptest-lazy-{}", rand_hex(10));
        let src = format!("{host}/{prefix}/img:src");
        let lazy = format!("{host}/{prefix}/img:lazy");
        let dir = std::env::temp_dir().join(&prefix);
        let (data_sha256, converted) = build_and_convert(&src, &lazy, data_bytes, &dir).await;
        LazyFixture {
            lazy,
            pinned: converted.destination.to_string(),
            data_sha256,
            blob_size: converted.config.rootfs.size,
            socket: socket.to_path_buf(),
        }
    }

    /// The node's mount of the image and its counters.
    pub(crate) async fn mount_info(&self) -> MountInfo {
        let (mounts, _, _) = lazyd_stats(&self.socket).await;
        mounts.into_iter().find(|m| m.image == self.pinned).expect("the image is mounted")
    }
}

/// The node's `sandpool-lazyd`: its mounts, the chunk cache's bytes and bound.
async fn lazyd_stats(socket: &Path) -> (Vec<MountInfo>, u64, u64) {
    let answer = lazyd::call(socket, &Request::Stats).await.expect("ask sandpool-lazyd");
    let Response::Stats { mounts, cache_used_bytes, cache_limit_bytes } = answer else {
        panic!("stats answered {answer:?}")
    };
    (mounts, cache_used_bytes, cache_limit_bytes)
}

impl Drop for LazyFixture {
    fn drop(&mut self) {
        // Its stub: `sandpool-lazy:<hex>`, with a suffix for a daemon of a test's own.
        let hex = self.pinned.rsplit_once("@sha256:").map(|(_, h)| h.to_string()).unwrap_or_default();
        let tags = Command::new("docker").args(["images", "--format", "{{.Tag}}", "sandpool-lazy"]).output();
        let tags = tags.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        for tag in tags.lines().filter(|t| !hex.is_empty() && t.starts_with(&hex)) {
            let _ = Command::new("docker").args(["rmi", &format!("sandpool-lazy:{tag}")]).output();
        }
        // The mount and its chunks are the node's (a cache, shared by sandboxes of the image);
        // this image was this test's alone. A blocking client: drops cannot await.
        use std::io::{BufRead as _, Write as _};
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(&self.socket) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
            let req = serde_json::to_string(&Request::Evict { image: self.pinned.clone() }).unwrap_or_default();
            let _ = writeln!(s, "{req}");
            let _ = std::io::BufReader::new(s).read_line(&mut String::new());
        }
    }
}

/// The lazy template the contract tests run on (exec, files, shells, WebSocket, PTY, fork):
/// tenant `t`'s template made from [`shared_image`], over the `lazybase` settings of
/// [`base_toml`].
pub(crate) const TEMPLATE: &str = "t/lazy";

/// The contract tests' lazy image, a version of it per fixture: busybox plus a few MiB,
/// converted once per machine and kept in the local registry as the busybox image is kept in
/// Docker, because every test process of a run shares it (nextest runs each test in a process of
/// its own; converting costs ~10 s on a loaded machine). Its node mount and stub image stay too,
/// the node's caches of it.
const SHARED_REPOSITORY: &str = "sptest-lazy-shared/contract";
const SHARED_TAG: &str = "v1";

/// `[templates.lazybase]` (the settings of the busybox test templates, `disk_mb` bounded) as
/// the base of templates made from images.
pub(crate) fn base_toml() -> String {
    format!(
        r#"
[templates.lazybase]
image = "{}"
exec = "agent"
workdir = "/work"
cpus = 0.5
memory_mb = 128
pids = 1024
disk_mb = {DISK_MB}
idle_timeout = "10m"
max_lifetime = "1h"
[images]
base = "lazybase"
[docker]
disk_bounds = "required"
"#,
        tests::BUSYBOX_IMAGE
    )
}

/// The shared lazy image (by tag): converted unless the registry has it, under a lock file so
/// that concurrent test processes convert it once; the lazy binaries installed on the way.
pub(crate) async fn shared_image() -> String {
    let lazy = format!("{}/{SHARED_REPOSITORY}:{SHARED_TAG}", registry());
    tokio::task::block_in_place(|| {
        let _lock = lazy_lock();
        let began = std::time::Instant::now();
        install_unlocked();
        tokio::runtime::Handle::current().block_on(async {
            if !is_lazy_in_registry(&lazy).await {
                let installed = began.elapsed();
                let src = format!("{}/{SHARED_REPOSITORY}:{SHARED_TAG}-src", registry());
                build_and_convert(&src, &lazy, 4 << 20, &std::env::temp_dir().join("sandpool-test-lazy-shared")).await;
                eprintln!(
                    "the shared lazy image {lazy}: binaries in {installed:?}, built and converted in {:?}",
                    began.elapsed() - installed
                );
            }
        });
    });
    lazy
}

/// A lock across this machine's test processes (held until dropped) around what they share:
/// installing the lazy runtime (two installs at once race on its temporary file) and building
/// the shared image.
fn lazy_lock() -> std::fs::File {
    let lock = std::fs::File::create(std::env::temp_dir().join("sandpool-test-lazy-shared.lock"))
        .expect("the lazy tests' lock file");
    lock.lock().expect("lock the lazy tests' lock file");
    lock
}

/// `image`'s manifest as its (loopback) registry serves it, if it has one.
async fn manifest_in_registry(image: &str) -> Option<lazy_image::registry::FetchedManifest> {
    let reference = lazy_image::Reference::parse(image).expect("a reference");
    let registry = lazy_image::Registry::for_reference(&reference).expect("a loopback registry");
    registry.manifest(&reference.repository, reference.manifest_reference()).await.ok()
}

async fn is_lazy_in_registry(image: &str) -> bool {
    let Some(fetched) = manifest_in_registry(image).await else { return false };
    serde_json::from_slice::<lazy_image::manifest::ImageManifest>(&fetched.bytes)
        .is_ok_and(|m| m.config.media_type == lazy_image::manifest::LAZY_CONFIG_MEDIA_TYPE)
}

/// Builds `src` (busybox + `data_bytes` of random bytes at /data.bin), pushes it, and converts
/// it to `lazy` (in `dir`, removed after). The digest of /data.bin, and what was converted.
async fn build_and_convert(src: &str, lazy: &str, data_bytes: usize, dir: &Path) -> (String, lazy_image::Converted) {
    std::fs::create_dir_all(dir).expect("a build directory");
    let data: Vec<u8> = (0..data_bytes).map(|_| rand::random::<u8>()).collect();
    let data_sha256 = lazy_image::registry::sha256_digest(&data).trim_start_matches("sha256:").to_string();
    std::fs::write(dir.join("data.bin"), &data).expect("write data.bin");
    std::fs::write(dir.join("Dockerfile"), format!("FROM {}\nCOPY data.bin /data.bin\n", tests::BUSYBOX_IMAGE))
        .expect("write the Dockerfile");
    run(Command::new("docker").args(["build", "-q", "-t", src]).arg(dir));
    run(Command::new("docker").args(["push", "-q", src]));
    run(Command::new("docker").args(["rmi", src]));
    let options = lazy_image::ConvertOptions { work_dir: dir.to_path_buf(), ..Default::default() };
    let converted = lazy_image::convert(
        &lazy_image::Reference::parse(src).unwrap(),
        &lazy_image::Reference::parse(lazy).unwrap(),
        &options,
    )
    .await
    .expect("convert the image to its lazy form");
    let _ = std::fs::remove_dir_all(dir);
    (data_sha256, converted)
}

/// A stack whose tenant `t` has [`TEMPLATE`] (a cold create on it: templates from images keep
/// no warm pool), with `opts` plus the lazy base and a wait long enough for a cold lazy create
/// on a loaded machine.
pub(crate) async fn stack(opts: StackOpts) -> Stack {
    let image = shared_image().await;
    let extra_toml = format!("{}\n{}", opts.extra_toml, base_toml());
    let stack = Stack::start(StackOpts { extra_toml, default_wait: "60s", ..opts }).await;
    let (_, name) = TEMPLATE.split_once('/').expect("<tenant>/<name>");
    let body = json!({"name": name, "image": image, "env": {"SANDPOOL_TEMPLATE": TEMPLATE}});
    template_from(&stack.client("t"), body).await;
    stack
}

/// What a session of [`TEMPLATE`] is beyond the contract every template keeps: Docker runs it
/// from the stub image on the lazy runtime, with no network, its writes bounded by `disk_mb`.
pub(crate) async fn assert_lazy_sandbox(c: &tests::Client, sid: &str) {
    let got = c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await;
    let inspect = tests::container_inspect(got.body["sandbox_id"].as_str().expect("a sandbox id"));
    assert_eq!(inspect["HostConfig"]["Runtime"], "sandpool-lazy", "{inspect}");
    assert!(inspect["Config"]["Image"].as_str().is_some_and(|i| i.starts_with("sandpool-lazy:")), "{inspect}");
    let net = c.sh(sid, "ls /sys/class/net").await;
    assert_eq!(net["stdout"], "lo\n", "network = \"none\" holds: {net:?}");
    let past = c.sh(sid, &format!("dd if=/dev/zero of=/work/big bs=1M count={} && sync", DISK_MB * 2)).await;
    let err = past["stderr"].as_str().unwrap_or_default();
    assert!(
        past["exit_code"] != 0 && (err.contains("No space left on device") || err.contains("Disk quota exceeded")),
        "a write past disk_mb = {DISK_MB} was not stopped: {past:?}"
    );
    assert_eq!(c.sh(sid, "rm /work/big && echo ok").await["stdout"], "ok\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_session_reads_writes_pauses_snapshots_and_outlives_a_pool_manager_restart() {
    install_lazy_binaries();
    // Declared before the stack: dropped after it, once its containers are gone.
    let own = OwnLazyd::new();
    let image = LazyFixture::with_data(DATA_BYTES, &own.socket).await;
    // Templates from images start from `lazybase`: a disk bound on the sandbox's writes.
    let extra_toml = format!(
        r#"
[templates.lazybase]
image = "{}"
exec = "agent"
workdir = "/work"
memory_mb = 128
disk_mb = {DISK_MB}
[images]
base = "lazybase"
{}
[docker]
disk_bounds = "required"
"#,
        tests::BUSYBOX_IMAGE,
        own.toml()
    );
    let mut stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    // The fork's snapshot image: removed however the test ends (after the stack's containers).
    struct SnapshotImages(String);
    impl Drop for SnapshotImages {
        fn drop(&mut self) {
            let filter = format!("label=sandpool.prefix={}", self.0);
            let out = Command::new("docker").args(["images", "-q", "--filter", &filter]).output();
            for id in out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default().lines() {
                let _ = Command::new("docker").args(["rmi", "-f", id]).output();
            }
        }
    }
    let _snapshots = SnapshotImages(stack.ledger_prefix().to_string());
    let c = stack.client("acme");

    let t = template_from(&c, json!({"name": "lazy", "image": image.lazy})).await;
    assert_eq!(t["image"], image.pinned.as_str(), "pinned to the lazy manifest");
    let opened = open(&c, "acme/lazy").await;
    let sid = opened["session_id"].as_str().expect("a session id").to_string();
    assert_eq!(stack.node.images.pulls_started.load(std::sync::atomic::Ordering::Relaxed), 0, "mounted, not pulled");

    // Docker runs it: the stub image, the lazy runtime, no network.
    let inspect = tests::container_inspect(opened["sandbox_id"].as_str().expect("a sandbox id"));
    assert_eq!(inspect["HostConfig"]["Runtime"], "sandpool-lazy", "{inspect}");
    assert!(inspect["Config"]["Image"].as_str().is_some_and(|i| i.starts_with("sandpool-lazy:")), "{inspect}");
    let container_id = inspect["Id"].as_str().expect("a container id").to_string();

    // The first command reads 1 KB of the big file: a few chunks come from the registry.
    let first = c.sh(&sid, "head -c 1024 /data.bin | wc -c").await;
    assert_eq!(first["stdout"].as_str().map(str::trim), Some("1024"), "{first:?}");
    let fetched = image.mount_info().await.bytes_fetched;
    assert!(fetched > 0 && fetched < image.blob_size / 4, "fetched {fetched} of a {}-byte blob", image.blob_size);

    // Writes land in the sandbox's own layer; the image is the same.
    let w = c.sh(&sid, "echo written > /work/note && cat /work/note").await;
    assert_eq!(w["stdout"], "written\n", "{w:?}");
    let lower = image.mount_info().await.lower;
    assert!(lower.join("bin").exists() && !lower.join("work/note").exists(), "the node's mount is unchanged");
    assert_eq!(c.put_file(&sid, "work/put.txt", b"through the files API".to_vec()).await, 204);
    assert_eq!(c.get_file(&sid, "work/put.txt").await, (200, b"through the files API".to_vec()));
    // The disk bound holds on the overlay's writes (its upper is in the container's own layer).
    let past = c.sh(&sid, &format!("dd if=/dev/zero of=/work/big bs=1M count={} && sync", DISK_MB * 2)).await;
    let err = past["stderr"].as_str().unwrap_or_default();
    assert!(
        past["exit_code"] != 0 && (err.contains("No space left on device") || err.contains("Disk quota exceeded")),
        "a write past disk_mb = {DISK_MB} was not stopped: {past:?}"
    );
    assert_eq!(c.sh(&sid, "rm /work/big && echo ok").await["stdout"], "ok\n");
    let net = c.sh(&sid, "ls /sys/class/net").await;
    assert_eq!(net["stdout"], "lo\n", "network = \"none\" holds: {net:?}");

    // The node's daemon keeps the mount while a sandbox's overlay stands on it.
    let refused = lazyd::call(&own.socket, &Request::Unmount { image: image.pinned.clone() }).await;
    assert!(
        matches!(&refused, Ok(Response::Error { message }) if message.contains("mounted overlays")),
        "an unmount under a running sandbox: {refused:?}"
    );

    // Pause (the runtime passes it to runc: the freezer) and a transparent resume.
    let sandbox = opened["sandbox_id"].as_str().expect("a sandbox id");
    let paused = c.call(Method::POST, &format!("/v1/sessions/{sid}/pause"), None).await;
    assert_eq!((paused.status, paused.body["paused"].as_bool()), (200, Some(true)), "{:?}", paused.body);
    assert_eq!(tests::container_state(sandbox), "paused");
    assert_eq!(c.sh(&sid, "cat /work/note").await["stdout"], "written\n");
    assert_eq!(tests::container_state(sandbox), "running");

    // A snapshot of the lazy sandbox stays lazy: its image is the stub plus the writes, and a
    // container of it runs on the lazy runtime (chosen by the image's label: no stub is
    // recorded for a snapshot) over the same mount. Here through a Docker client that never
    // prepared the image (the API's fork: `snapshot::a_lazy_session_forks_into_lazy_sessions`).
    let node = stack.node.clone();
    // A Docker client of the node's own (the node's runtime is its business): it knows no stub,
    // so the snapshot's runtime comes from the image's label alone.
    let dock = pool_manager::docker::Dock::connect(&stack.config.docker.socket, &stack.config.redis.prefix, &node.id)
        .await
        .expect("connect to docker")
        .with_lazyd(pool_manager::Lazyd::of(&stack.config.images));
    let snapshot = dock.commit(&container_id, &rand_hex(16), "{}").await.expect("commit the lazy sandbox");
    let template = node.template("acme/lazy").expect("the lazy template on the node");
    let kid_template = config::Template { image: snapshot, ..(*template).clone() };
    let kid_sandbox = format!("{}.{}", node.id, rand_hex(16));
    let kid = dock.create(&kid_sandbox, &kid_template, None).await.expect("create from the snapshot");
    dock.start(&kid).await.expect("start the snapshot's container");
    let kid_inspect = tests::container_inspect(&kid_sandbox);
    assert_eq!(kid_inspect["HostConfig"]["Runtime"], "sandpool-lazy", "{kid_inspect}");
    let out =
        run(Command::new("docker").args(["exec", &kid, "sh", "-c", "cat /work/note; head -c 1024 /data.bin | wc -c"]));
    assert_eq!(out, "written\n1024\n");
    dock.remove(&kid).await.expect("remove the snapshot's container");

    // Ending a session removes its container, and the runtime unmounts its overlay.
    let other = open(&c, "acme/lazy").await;
    let other_sandbox = other["sandbox_id"].as_str().expect("a sandbox id").to_string();
    let other_id = tests::container_inspect(&other_sandbox)["Id"].as_str().expect("a container id").to_string();
    assert_eq!(c.delete(other["session_id"].as_str().expect("a session id")).await, 204);
    eventually(Duration::from_secs(120), || async { tests::container_inspect(&other_sandbox).is_null().then_some(()) })
        .await
        .expect("the ended session's container is removed");
    let overlay = Path::new(lazy_image::oci::ROOTS_DIR).join(&other_id);
    assert!(!overlay.exists(), "{} outlived its container", overlay.display());

    // The pool-manager restarts; the sandbox (and the daemon's mount under it) stays.
    stack.restart_pool_manager().await;
    let after = eventually(Duration::from_secs(30), || async {
        let a = c.exec(&sid, json!({"cmd": "cat /work/note; sha256sum /data.bin"})).await;
        (a.status == 200).then_some(a.body)
    })
    .await
    .expect("the session answers after the restart");
    assert_eq!(after["stdout"], format!("written\n{}  /data.bin\n", image.data_sha256), "{after:?}");

    // Deleted after the restart, the readopted sandbox goes too (the old pool-manager's pop of
    // the doomed list once took its id as it stopped: RELIABILITY.md).
    assert_eq!(c.delete(&sid).await, 204);
    eventually(Duration::from_secs(60), || async { tests::container_inspect(sandbox).is_null().then_some(()) })
        .await
        .expect("the readopted session's container is removed after its delete");
    let overlay = Path::new(lazy_image::oci::ROOTS_DIR).join(&container_id);
    assert!(!overlay.exists(), "{} outlived its container", overlay.display());
    stack.shutdown().await;
}

/// A `sandpool-lazyd` of the test's own (the stack's node starts it, at the socket and state
/// directory `toml` names): what the test sets (the cache's bound) and empties (its cache)
/// is no other test's. Stopped, its chunks removed, on drop (after the stack and fixtures).
struct OwnLazyd {
    socket: PathBuf,
    state_dir: PathBuf,
}

impl OwnLazyd {
    fn new() -> OwnLazyd {
        let id = rand_hex(8);
        OwnLazyd {
            socket: PathBuf::from(format!("/run/sandpool/lazyd-test-{id}.sock")),
            state_dir: PathBuf::from(format!("/var/lib/sandpool/lazy-test-{id}")),
        }
    }

    /// The `[images]` lines that point a node at it.
    fn toml(&self) -> String {
        format!("lazyd_socket = {:?}\nlazy_state_dir = {:?}\n", self.socket, self.state_dir)
    }
}

impl Drop for OwnLazyd {
    fn drop(&mut self) {
        // The one process whose command line names this socket: started for this test.
        let socket = self.socket.display().to_string();
        let pids: Vec<i32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                args.first().is_some_and(|a| a.ends_with(b"sandpool-lazyd")) && args.contains(&socket.as_bytes())
            })
            .collect();
        for pid in pids {
            let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
            let began = std::time::Instant::now();
            while Path::new(&format!("/proc/{pid}")).exists() && began.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = std::fs::remove_dir_all(self.state_dir.join("chunks"));
        for file in ["lazyd.lock", "lazyd.log"] {
            let _ = std::fs::remove_file(self.state_dir.join(file));
        }
        // What is left are its mounts' directories, empty once it stopped (never recursive:
        // a mount still there is not ours to descend into).
        for entry in std::fs::read_dir(&self.state_dir).into_iter().flatten().flatten() {
            for sub in ["root", "blob", ""] {
                let _ = std::fs::remove_dir(entry.path().join(sub));
            }
        }
        let _ = std::fs::remove_dir(&self.state_dir);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The base template of templates made from images in the lazy tests below: busybox with the
/// agent, no disk bound (what they check is the node's image disk, not a sandbox's).
fn lazy_base(images_toml: &str) -> String {
    format!(
        r#"
[templates.lazybase]
image = "{}"
exec = "agent"
workdir = "/work"
memory_mb = 128
[images]
base = "lazybase"
{images_toml}
"#,
        tests::BUSYBOX_IMAGE
    )
}

/// Opens a session of `template` (waiting up to a minute for its sandbox).
/// `POST /v1/templates` with `body` (a name, an image, maybe a base); answers the template.
async fn template_from(c: &tests::Client, body: serde_json::Value) -> serde_json::Value {
    let t = c.call(Method::POST, "/v1/templates", Some(body)).await;
    assert_eq!(t.status, 201, "{:?}", t.body);
    t.body
}

async fn open(c: &tests::Client, template: &str) -> serde_json::Value {
    let opened = c.call(Method::POST, "/v1/sessions", Some(json!({"template": template, "max_wait_s": 60}))).await;
    assert_eq!(opened.status, 201, "{:?}", opened.body);
    opened.body
}

/// Two lazy images read whole on a node whose image disk budget is smaller than either: the
/// chunk cache stays within it (what the pulled images leave: here all of it), and what was
/// evicted is fetched again, right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chunk_cache_stays_within_the_image_disk_budget() {
    const BUDGET_MB: u64 = 24;
    install_lazy_binaries();
    let own = OwnLazyd::new();
    let a = LazyFixture::with_data(32 << 20, &own.socket).await;
    let b = LazyFixture::with_data(32 << 20, &own.socket).await;
    let extra_toml = lazy_base(&format!("disk_budget_mb = {BUDGET_MB}\n{}", own.toml()));
    let stack = Stack::start(StackOpts { warm: 0, metrics: true, extra_toml, ..Default::default() }).await;
    let c = stack.client("acme");
    let mut sessions = Vec::new();
    for (name, image) in [("lazy-a", &a), ("lazy-b", &b)] {
        template_from(&c, json!({"name": name, "image": image.lazy})).await;
        sessions.push(open(&c, &format!("acme/{name}")).await["session_id"].as_str().expect("an id").to_string());
    }
    // The node bounds the daemon's cache at its next eviction pass (every 5 s).
    let limit = eventually(Duration::from_secs(30), || async {
        let (_, _, limit) = lazyd_stats(&own.socket).await;
        (limit <= BUDGET_MB << 20).then_some(limit)
    })
    .await
    .expect("the node bounds the chunk cache by its image disk budget");
    for (sid, image) in sessions.iter().zip([&a, &b]) {
        let sum = c.exec(sid, json!({"cmd": "sha256sum /data.bin", "timeout_ms": 120_000})).await;
        assert_eq!(sum.body["stdout"], format!("{}  /data.bin\n", image.data_sha256), "{:?}", sum.body);
        let (_, used, _) = lazyd_stats(&own.socket).await;
        assert!(used <= limit, "the chunk cache holds {used} bytes, over its bound {limit}");
    }
    // Both whole files came through a cache smaller than either: chunks were evicted and read
    // again, and each image's fetched bytes are at least its file.
    for image in [&a, &b] {
        let info = image.mount_info().await;
        assert!(info.bytes_fetched >= 32 << 20, "{info:?}");
    }
    // The node's metrics say the same.
    let metrics_url = stack.metrics_url.clone().expect("metrics");
    let page = eventually(Duration::from_secs(20), || async {
        let page = reqwest::get(&metrics_url).await.ok()?.text().await.ok()?;
        page.contains(&format!("image=\"{}", a.pinned.rsplit_once("@sha256:")?.0)).then_some(page)
    })
    .await
    .expect("the node exports the lazy images' series");
    let value = |prefix: &str| -> f64 {
        let line = page.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} in\n{page}"));
        line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a value")
    };
    assert!(value("sandpool_lazy_cache_bytes{") <= (BUDGET_MB << 20) as f64);
    assert!(value("sandpool_lazy_cache_limit_bytes{") <= (BUDGET_MB << 20) as f64);
    assert!(value("sandpool_image_disk_bytes{") <= (BUDGET_MB << 20) as f64);
    assert!(value("sandpool_lazy_fetch_duration_seconds_count{") > 0.0);
    for sid in &sessions {
        assert_eq!(c.delete(sid).await, 204);
    }
    stack.shutdown().await;
}

/// A node records what a lazy image's first session read and shares it through the ledger; a
/// node that never saw the image, its chunks gone from the cache, prefetches the profile, and
/// a session's start and first command then fetch (almost) nothing on demand.
/// A lazy image's filesystem is parsed by the node's kernel, so a node mounts lazy images only
/// from registries it trusts with that (`images.lazy_registries`; by default its loopback ones,
/// which every other lazy test uses): from any other, a tenant's template is refused when it
/// is made, an operator's template's sessions are refused with the reason, and nothing is
/// mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_mounts_lazy_images_only_from_registries_it_trusts() {
    install_lazy_binaries();
    let own = OwnLazyd::new();
    let image = shared_image().await;
    let digest = manifest_in_registry(&image).await.expect("its manifest").digest;
    let pinned = format!("{}@{digest}", image.rsplit_once(':').expect("a tag").0);
    let elsewhere = format!("lazy_registries = [\"registry.example:5000\"]\n{}", own.toml());
    let operators = format!("[templates.oplazy]\nimage = \"{pinned}\"\nexec = \"agent\"\nworkdir = \"/work\"\n");
    let extra_toml = format!("{operators}{}", lazy_base(&elsewhere));
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    let c = stack.client("acme");
    let names_the_setting = |body: &serde_json::Value| {
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.contains("lazy image") && message.contains("images.lazy_registries"), "{body}");
    };
    let made = c.call(Method::POST, "/v1/templates", Some(json!({"name": "lazy", "image": image}))).await;
    assert_eq!(made.status, 400, "{:?}", made.body);
    names_the_setting(&made.body);
    let t0 = std::time::Instant::now();
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "oplazy", "max_wait_s": 30}))).await;
    assert_eq!(a.status, 502, "{:?}", a.body);
    assert!(t0.elapsed() < Duration::from_secs(10), "told at once, not at max_wait_s: {:?}", t0.elapsed());
    names_the_setting(&a.body);
    let mounts = match lazyd::call(&own.socket, &Request::Stats).await {
        Ok(Response::Stats { mounts, .. }) => mounts,
        _ => vec![],
    };
    assert!(mounts.is_empty(), "mounted: {mounts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_fetches_what_a_first_session_read() {
    install_lazy_binaries();
    let own = OwnLazyd::new();
    let image = LazyFixture::with_data(DATA_BYTES, &own.socket).await;
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: lazy_base(&own.toml()), ..Default::default() }).await;
    let c = stack.client("acme");
    template_from(&c, json!({"name": "lazy", "image": image.lazy})).await;
    const FIRST: &str = "head -c 1024 /data.bin | wc -c; tail -c 4096 /data.bin | wc -c; ls /bin | wc -l";

    // The first session, on a cold node: what it reads is fetched, and recorded.
    // (The node starts its daemon when it first mounts the image: maybe not yet.)
    let before = match lazyd::call(&own.socket, &Request::Stats).await {
        Ok(Response::Stats { mounts, .. }) => {
            mounts.iter().find(|m| m.image == image.pinned).map_or(0, |m| m.bytes_fetched)
        }
        _ => 0,
    };
    let began = std::time::Instant::now();
    let first = open(&c, "acme/lazy").await;
    let sid = first["session_id"].as_str().expect("an id").to_string();
    let out = c.sh(&sid, FIRST).await;
    assert_eq!(out["exit_code"], 0, "{out:?}");
    let cold_took = began.elapsed();
    let cold = image.mount_info().await.bytes_fetched - before;
    let ledger = ledger::Ledger::connect(&tests::redis_url(), stack.ledger_prefix()).await.expect("the ledger");
    let digest = image.pinned.rsplit_once('@').expect("pinned").1.to_string();
    let profile = eventually(Duration::from_secs(30), || async {
        ledger.lazy_profile(&digest).await.ok().flatten().filter(|p| !p.is_empty())
    })
    .await
    .expect("the node publishes the image's profile");
    assert_eq!(c.delete(&sid).await, 204);
    let sandbox = first["sandbox_id"].as_str().expect("a sandbox").to_string();
    eventually(Duration::from_secs(120), || async { tests::container_inspect(&sandbox).is_null().then_some(()) })
        .await
        .expect("the ended session's container is removed");

    // The node's cache loses the image (unmounted, its chunks dropped) ...
    let evicted = lazyd::call(&own.socket, &Request::Evict { image: image.pinned.clone() }).await.unwrap();
    assert!(matches!(evicted, Response::Evicted { was_mounted: true, .. }), "{evicted:?}");
    // ... and a node that never saw the image prefetches it.
    let second = stack.add_node().await;
    let prefetch = json!({"templates": ["acme/lazy"], "nodes": [second.node.id]});
    let present = eventually(Duration::from_secs(60), || async {
        let a = c.call(Method::POST, "/v1/images:prefetch", Some(prefetch.clone())).await;
        assert_eq!(a.status, 202, "{:?}", a.body);
        (a.body["pulls"][0]["state"] == "present").then_some(())
    });
    present.await.expect("the second node prefetches the lazy image");
    assert!(image.mount_info().await.bytes_fetched > 0, "the prefetch fetched the profile's chunks");

    // A session's start and first command now read from the cache.
    let prefetched = image.mount_info().await.bytes_fetched;
    let began = std::time::Instant::now();
    let again = open(&c, "acme/lazy").await;
    let sid = again["session_id"].as_str().expect("an id").to_string();
    let out = c.sh(&sid, FIRST).await;
    assert_eq!(out["exit_code"], 0, "{out:?}");
    let warm_took = began.elapsed();
    let on_demand = image.mount_info().await.bytes_fetched - prefetched;
    println!(
        "profile: {} chunks; cold first session fetched {cold} bytes (session + first command {cold_took:?}); \
         prefetch {prefetched} bytes; after it, on demand {on_demand} bytes ({warm_took:?}, on {})",
        profile.len(),
        again["node"]
    );
    assert_eq!(on_demand, 0, "after the prefetch the start and first command fetched {on_demand} bytes (cold: {cold})");
    assert_eq!(c.delete(&sid).await, 204);
    drop(second);
    stack.shutdown().await;
}

/// A lazy image runs on each isolation class: the wrapper mounts the overlay, then hands over to
/// crun or gVisor's runsc as it does to runc (dockerd's `sandpool-lazy-crun`/`-runsc` entries);
/// and on the node's egress network, under a named policy, like any other sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_image_runs_on_crun_on_gvisor_and_under_named_egress() {
    install_lazy_binaries();
    // Declared before the stack: dropped after it, once its containers are gone.
    let own = OwnLazyd::new();
    let image = LazyFixture::with_data(DATA_BYTES, &own.socket).await;
    let (task, other) =
        (crate::egress::server("127.0.0.2", "task").await, crate::egress::server("127.0.0.3", "other").await);
    let template = |name: &str, image: &str, runtime: &str, more: &str| {
        format!(
            "[templates.{name}]\nimage = \"{image}\"\nruntime = \"{runtime}\"\nexec = \"agent\"\nworkdir = \"/work\"\nmemory_mb = 256\n{more}"
        )
    };
    let extra_toml = format!(
        "{}{}{}[images]\nbase = \"lazycrun\"\nbases = [\"lazycrun\", \"lazygvisor\"]\n{}\
         [egress.hosts]\n\"task.test\" = \"127.0.0.2\"\n\"other.test\" = \"127.0.0.3\"\n\
         [egress.policies.task-service]\nallow = [\"task.test:{task}\"]\n\
         [egress.policies.both]\nallow = [\"task.test:{task}\", \"other.test:{other}\"]\n",
        template("lazycrun", tests::BUSYBOX_IMAGE, "crun", ""),
        template("lazygvisor", tests::BUSYBOX_IMAGE, "runsc", ""),
        // Bases with named egress make no image templates: the operator's template names the
        // lazy image itself.
        template(
            "lazyegress",
            &image.pinned,
            "runc",
            "egress = \"task-service\"\negress_allowed = [\"task-service\", \"both\"]\n"
        ),
        own.toml(),
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    let c = stack.client("acme");
    for (base, runtime) in
        [("lazycrun", "sandpool-lazy-crun"), ("lazygvisor", "sandpool-lazy-runsc"), ("lazyegress", "sandpool-lazy")]
    {
        let template = if base == "lazyegress" {
            base.to_string()
        } else {
            template_from(&c, json!({"name": base, "image": image.lazy, "base": base})).await;
            format!("acme/{base}")
        };
        let opened = open(&c, &template).await;
        let sid = opened["session_id"].as_str().expect("a session id").to_string();
        let sandbox = opened["sandbox_id"].as_str().expect("a sandbox id").to_string();
        let inspect = tests::container_inspect(&sandbox);
        assert_eq!(inspect["HostConfig"]["Runtime"], runtime, "{base}");
        let container_id = inspect["Id"].as_str().expect("a container id").to_string();

        let r = c.sh(&sid, "sha256sum /data.bin && echo written > /work/note && cat /work/note").await;
        assert_eq!(r["stdout"], format!("{}  /data.bin\nwritten\n", image.data_sha256), "{base}: {r:?}");
        if base == "lazygvisor" {
            // gVisor's own kernel answers, not the host's.
            let k = c.sh(&sid, "dmesg | head -n 1").await;
            assert!(k["stdout"].as_str().is_some_and(|s| s.contains("gVisor")), "{base}: {k:?}");
        }
        if base == "lazyegress" {
            let get = |host: &str, port: u16| format!("wget -q -O - http://{host}:{port}/ 2>&1");
            assert_eq!(c.sh(&sid, &get("task.test", task)).await["stdout"], "task", "the policy's host");
            let refused = c.sh(&sid, &get("other.test", other)).await;
            assert!(refused["stdout"].as_str().is_some_and(|s| s.contains("403")), "{refused:?}");
            let path = format!("/v1/sessions/{sid}/egress");
            assert_eq!(c.call(Method::PUT, &path, Some(json!({"policy": "both"}))).await.status, 200);
            assert_eq!(c.sh(&sid, &get("other.test", other)).await["stdout"], "other", "switched to both");
        }

        assert_eq!(c.delete(&sid).await, 204);
        eventually(Duration::from_secs(60), || async { tests::container_inspect(&sandbox).is_null().then_some(()) })
            .await
            .unwrap_or_else(|| panic!("{base}: the ended session's container is removed"));
        let overlay = Path::new(lazy_image::oci::ROOTS_DIR).join(&container_id);
        assert!(!overlay.exists(), "{base}: {} outlived its container", overlay.display());
    }
    stack.shutdown().await;
}

/// The second dockerd `scripts/lib.sh` runs (the chaos run's third node): its data root is
/// overlay2 on ext4, where a container's root is itself an overlayfs.
const OVERLAY2_DOCKER: &str = "unix:///run/sandpool-docker2.sock";

/// A lazy session, and a fork of it, on a node whose Docker stores containers with overlay2: the
/// lazy overlay's upper cannot live on the container's root (an overlayfs) there, so it lives
/// in the container's layer directory (`upperdir`), and a fork sees its parent's writes from
/// Docker's lower layers. Not `#[tokio::test]`: the harness and the node follow `DOCKER_HOST`,
/// set before any thread of a runtime exists.
#[test]
fn a_lazy_session_and_its_fork_run_on_an_overlay2_docker() {
    // SAFETY: no other thread of this process runs yet (nextest runs each test in a process of
    // its own; the runtime is built below), so nothing reads the environment while it changes.
    unsafe { std::env::set_var("DOCKER_HOST", OVERLAY2_DOCKER) };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");
    rt.block_on(async {
        let driver = Command::new("docker").args(["info", "-f", "{{.Driver}}"]).output().expect("docker info");
        assert_eq!(String::from_utf8_lossy(&driver.stdout).trim(), "overlay2", "the second dockerd's storage driver");
        install_lazy_binaries();
        // Declared before the stack: dropped after it, once its containers are gone.
        let own = OwnLazyd::new();
        let image = LazyFixture::with_data(4 << 20, &own.socket).await;
        let extra_toml = format!(
            "[templates.lazybase]\nimage = \"{}\"\nexec = \"agent\"\nworkdir = \"/work\"\nmemory_mb = 128\n\
             [images]\nbase = \"lazybase\"\n{}",
            tests::BUSYBOX_IMAGE,
            own.toml()
        );
        let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
        // The fork's snapshot image, on this Docker, however the test ends.
        let _snapshots = crate::snapshot::Images(stack.ledger_prefix().to_string());
        let c = stack.client("acme");
        template_from(&c, json!({"name": "lazy", "image": image.lazy})).await;
        let opened = open(&c, "acme/lazy").await;
        let sid = opened["session_id"].as_str().expect("a session id").to_string();
        let sandbox = opened["sandbox_id"].as_str().expect("a sandbox id").to_string();
        let inspect = tests::container_inspect(&sandbox);
        assert_eq!(inspect["HostConfig"]["Runtime"], "sandpool-lazy", "{inspect}");
        assert_eq!(inspect["Driver"], "overlay2", "{inspect}");
        let r = c.sh(&sid, "sha256sum /data.bin && echo base > /work/file && cat /work/file").await;
        assert_eq!(r["stdout"], format!("{}  /data.bin\nbase\n", image.data_sha256), "{r:?}");

        let fork = c.call(Method::POST, &format!("/v1/sessions/{sid}/fork"), Some(json!({"count": 1}))).await;
        assert_eq!(fork.status, 201, "{:?}", fork.body);
        let kid = fork.body["sessions"][0]["session_id"].as_str().expect("a forked session").to_string();
        let r =
            c.sh(&kid, "cat /work/file; echo kid >> /work/file; cat /work/file; head -c 1024 /data.bin | wc -c").await;
        assert_eq!(r["stdout"], "base\nbase\nkid\n1024\n", "the fork sees its parent's writes: {r:?}");
        assert_eq!(c.sh(&sid, "cat /work/file").await["stdout"], "base\n", "and the parent not the fork's");
        for s in [&kid, &sid] {
            assert_eq!(c.delete(s).await, 204);
        }
        stack.shutdown().await;
    });
}
