//! Convert, mount lazily, read: the first piece of issue 32 end to end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lazy_image::{ChunkCache, ConvertOptions, FetchPolicy, LazyBlob, LazyRootfs, Reference, Registry};

use crate::support::{MountGuard, Pushed, TempDir, docker, prefix, registry, sha256_hex};

const DEBIAN: &str = "sandpool/debian:bookworm";

/// The digests Docker's own copy of the image gives for `files` (sha256sum in a throwaway
/// container, no network).
fn docker_sha256(files: &[&str]) -> Vec<String> {
    let mut args = vec!["run", "--rm", "--network", "none", "--label", "sandpool.test=lazy-image", "--entrypoint"];
    args.extend(["sha256sum", DEBIAN]);
    args.extend(files);
    docker(&args).lines().map(|l| l.split_whitespace().next().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_converts_mounts_lazily_and_reads_match_docker() {
    let prefix = prefix();
    let src = Pushed::new(DEBIAN, format!("{}/{prefix}/debian:src", registry()));
    let src_ref = Reference::parse(&src.name).unwrap();
    let dst_ref = Reference::parse(&format!("{}/{prefix}/debian:lazy", registry())).unwrap();
    let scratch = TempDir::new("convert");

    let options = ConvertOptions { work_dir: scratch.sub("work"), ..ConvertOptions::default() };
    let converted = lazy_image::convert(&src_ref, &dst_ref, &options).await.expect("convert");
    let rootfs = &converted.config.rootfs;
    println!(
        "converted: blob {} bytes in {} chunks (source layers {} bytes); unpack {:?}, mkfs {:?}, push {:?}",
        rootfs.size,
        rootfs.chunks.len(),
        converted.config.source.layers_size,
        converted.timings.unpack,
        converted.timings.mkfs,
        converted.timings.push
    );
    // Both forms are pinned: the source by the manifest converted, the result by its own.
    let src_digest =
        Registry::for_reference(&src_ref).unwrap().manifest(&src_ref.repository, "src").await.unwrap().digest;
    assert_eq!(converted.source.digest.as_deref(), Some(src_digest.as_str()));
    assert_eq!(converted.config.source.digest, src_digest);
    let dst_digest = converted.destination.digest.clone().expect("destination pinned");
    let image = lazy_image::mount::LazyImage::resolve(&dst_ref).await.unwrap();
    assert_eq!(image.reference.digest.as_deref(), Some(dst_digest.as_str()), "the tag names what was pushed");
    assert!(
        converted.config.image_config.get("Env").is_some(),
        "the source's run config travels with the lazy image: {}",
        converted.config.image_config
    );

    // Mount it by digest on a "node" whose cache holds none of it.
    let node = TempDir::new("node");
    let cache = Arc::new(ChunkCache::open(node.sub("chunks"), 64 << 20).unwrap());
    let target = node.sub("rootfs");
    let mounted =
        LazyRootfs::mount(&converted.destination, cache.clone(), FetchPolicy::default(), &node.sub("state"), &target)
            .await
            .expect("mount the lazy image");

    let os_release = tokio::fs::read(target.join("etc/os-release")).await.unwrap();
    assert!(String::from_utf8_lossy(&os_release).contains("bookworm"));
    let first_read = mounted.stats().bytes_fetched();
    println!("first file read: {first_read} bytes fetched of a {}-byte blob", rootfs.size);
    assert!(first_read > 0, "a cold read fetches");
    assert!(
        first_read * 10 <= rootfs.size,
        "one small file fetches a small part of the image: {first_read} of {} bytes",
        rootfs.size
    );

    // Byte-for-byte what Docker's copy of the image holds.
    let files = ["/etc/os-release", "/usr/bin/bash", "/usr/lib/x86_64-linux-gnu/libc.so.6"];
    let expected = docker_sha256(&files);
    for (file, want) in files.iter().zip(&expected) {
        let got = sha256_hex(&tokio::fs::read(target.join(&file[1..])).await.unwrap());
        assert_eq!(&got, want, "{file}");
    }
    let meta = tokio::fs::symlink_metadata(target.join("usr/bin/bash")).await.unwrap();
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o755), "ownership and modes survive the conversion");
    let after_files = mounted.stats().bytes_fetched();
    println!("after {} files: {after_files} bytes fetched", files.len());
    assert!(after_files < rootfs.size / 2, "still a part of the image: {after_files} of {}", rootfs.size);
    assert!(cache.used_bytes() <= cache.limit_bytes());

    // Writes go to an overlay upper; the lazy lower stays as it was.
    let upper = node.sub("upper");
    let merged = node.sub("merged");
    let debian_version = tokio::fs::read(target.join("etc/debian_version")).await.unwrap();
    {
        let _overlay = MountGuard::overlay(&target, &upper, &node.sub("work"), &merged);
        tokio::fs::write(merged.join("etc/debian_version"), b"changed\n").await.unwrap();
        tokio::fs::write(merged.join("root/new-file"), b"new\n").await.unwrap();
        assert_eq!(tokio::fs::read(merged.join("etc/debian_version")).await.unwrap(), b"changed\n");
        assert_eq!(tokio::fs::read(upper.join("etc/debian_version")).await.unwrap(), b"changed\n");
        assert_eq!(tokio::fs::read(upper.join("root/new-file")).await.unwrap(), b"new\n");
    }
    assert_eq!(tokio::fs::read(target.join("etc/debian_version")).await.unwrap(), debian_version);
    assert!(!target.join("root/new-file").exists());
    tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().expect("unmount");

    // A reader moving forward chunk by chunk gets the next chunks fetched ahead of it.
    let fresh = Arc::new(ChunkCache::open(node.sub("chunks-read-ahead"), 64 << 20).unwrap());
    let registry = Registry::for_reference(&converted.destination).unwrap();
    let blob = Arc::new(
        LazyBlob::new(registry, dst_ref.repository.clone(), rootfs.clone(), fresh.clone(), FetchPolicy::default())
            .unwrap(),
    );
    let chunk = rootfs.chunk_size;
    let reader = blob.clone();
    tokio::task::spawn_blocking(move || {
        reader.read_at(0, 4096).unwrap();
        reader.read_at(chunk, 4096).unwrap();
    })
    .await
    .unwrap();
    let key = |index| lazy_image::cache::ChunkKey { blob_hex: rootfs.digest[7..].to_string(), index };
    let began = std::time::Instant::now();
    while !(2..=5).all(|i| fresh.contains(&key(i))) {
        assert!(began.elapsed() < std::time::Duration::from_secs(20), "chunks 2-5 were not read ahead");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(!fresh.contains(&key(6)), "read-ahead stops 4 chunks ahead");
    assert_eq!(blob.stats().chunks_fetched(), 6);

    // A second mount on the same node reads from the chunk cache: nothing fetched.
    let again =
        LazyRootfs::mount(&converted.destination, cache.clone(), FetchPolicy::default(), &node.sub("state2"), &target)
            .await
            .unwrap();
    let bash = tokio::fs::read(target.join("usr/bin/bash")).await.unwrap();
    assert_eq!(sha256_hex(&bash), expected[1]);
    assert_eq!(again.stats().bytes_fetched(), 0, "every chunk read came from the node's cache");
    assert!(again.stats().cache_hits() > 0);
    tokio::task::spawn_blocking(move || again.unmount()).await.unwrap().expect("unmount");
}

/// A node records what a first session reads (its profile); another node whose cache is empty
/// fetches that profile ahead, and the same reads then fetch nothing on demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_profile_prefetched_on_an_empty_cache_serves_the_first_reads() {
    let prefix = prefix();
    let src = Pushed::new(DEBIAN, format!("{}/{prefix}/debian:src", registry()));
    let dst_ref = Reference::parse(&format!("{}/{prefix}/debian:lazy", registry())).unwrap();
    let scratch = TempDir::new("profile");
    let options = ConvertOptions { work_dir: scratch.sub("work"), ..ConvertOptions::default() };
    let converted =
        lazy_image::convert(&Reference::parse(&src.name).unwrap(), &dst_ref, &options).await.expect("convert");
    let files = ["usr/bin/bash", "usr/lib/x86_64-linux-gnu/libc.so.6", "etc/os-release"];

    // The first node: its first reads are recorded.
    let first = TempDir::new("profile-node1");
    let cache = Arc::new(ChunkCache::open(first.sub("chunks"), 256 << 20).unwrap());
    let target = first.sub("rootfs");
    let mounted =
        LazyRootfs::mount(&converted.destination, cache, FetchPolicy::default(), &first.sub("state"), &target)
            .await
            .unwrap();
    let mut expected = Vec::new();
    for f in files {
        expected.push(sha256_hex(&tokio::fs::read(target.join(f)).await.unwrap()));
    }
    // The kernel's read-ahead behind those reads may still be on its way to the blob when the
    // reads return: wait until the profile stops growing (as a node's upload, at the window's
    // end, would), or the second node's same read-ahead finds chunks the profile lacks.
    let profile = settled_profile(mounted.blob()).await;
    assert!(!profile.complete, "the window is still open");
    let needed = mounted.stats().bytes_fetched();
    assert!(!profile.chunks.is_empty() && profile.chunks.len() as u64 <= mounted.stats().chunks_fetched());
    tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().expect("unmount");

    // Another node, nothing cached: a prefetch of the profile, then the same reads.
    let second = TempDir::new("profile-node2");
    let cache = Arc::new(ChunkCache::open(second.sub("chunks"), 256 << 20).unwrap());
    let target = second.sub("rootfs");
    let mounted =
        LazyRootfs::mount(&converted.destination, cache, FetchPolicy::default(), &second.sub("state"), &target)
            .await
            .unwrap();
    let blob = mounted.blob().clone();
    let chunks = profile.chunks.clone();
    let began = std::time::Instant::now();
    let fetched = tokio::task::spawn_blocking(move || blob.prefetch(&chunks)).await.unwrap();
    let prefetch_took = began.elapsed();
    assert!(fetched > 0, "the profile's chunks were not cached yet");
    let before = mounted.stats().bytes_fetched();
    for (f, want) in files.iter().zip(&expected) {
        assert_eq!(&sha256_hex(&tokio::fs::read(target.join(f)).await.unwrap()), want, "{f}");
    }
    let on_demand = mounted.stats().bytes_fetched() - before;
    println!(
        "profile: {} chunks; first node fetched {needed} bytes on demand; prefetch {fetched} chunks in \
         {prefetch_took:?}, then {on_demand} bytes on demand",
        profile.chunks.len()
    );
    assert_eq!(on_demand, 0, "every chunk the first reads need was prefetched");
    assert!(mounted.stats().cache_hits() > 0);
    tokio::task::spawn_blocking(move || mounted.unmount()).await.unwrap().expect("unmount");
}

/// The blob's profile once it has not grown for 300 ms (at most 10 s).
async fn settled_profile(blob: &LazyBlob) -> lazy_image::blob::ProfileSnapshot {
    let until = Instant::now() + Duration::from_secs(10);
    let mut last = blob.profile();
    let mut still_since = Instant::now();
    while Instant::now() < until && still_since.elapsed() < Duration::from_millis(300) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = blob.profile();
        if now.chunks.len() != last.chunks.len() {
            still_since = Instant::now();
        }
        last = now;
    }
    last
}

#[tokio::test]
async fn a_plain_image_is_refused_with_how_to_convert_it() {
    let prefix = prefix();
    let src = Pushed::new("sandpool/busybox:latest", format!("{}/{prefix}/busybox:plain", registry()));
    let node = TempDir::new("plain");
    let cache = Arc::new(ChunkCache::open(node.sub("chunks"), 1 << 20).unwrap());
    let err = LazyRootfs::mount(
        &Reference::parse(&src.name).unwrap(),
        cache,
        FetchPolicy::default(),
        &node.sub("state"),
        &node.sub("rootfs"),
    )
    .await
    .err()
    .expect("a plain image is not mounted lazily");
    assert!(format!("{err:#}").contains("sandpool images convert"), "{err:#}");
}

fn gone_rootfs() -> lazy_image::manifest::Rootfs {
    lazy_image::manifest::Rootfs {
        format: "erofs".into(),
        digest: format!("sha256:{}", "0".repeat(64)),
        size: 3 << 20,
        chunk_size: 1 << 20,
        chunks: vec!["0".repeat(64); 3],
    }
}

/// The registry gone: a read of an uncached chunk fails with an I/O error within the fetch
/// bound (retries included), and is counted; once the outage is known, the next read fails at
/// once; nothing hangs.
#[tokio::test]
async fn reads_fail_with_an_io_error_when_the_registry_is_unreachable() {
    let node = TempDir::new("gone");
    let cache = Arc::new(ChunkCache::open(node.sub("chunks"), 8 << 20).unwrap());
    // A loopback port with nothing listening: connections are refused at once.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let registry = Registry::new(&format!("127.0.0.1:{port}")).unwrap();
    let policy = FetchPolicy::with_total(Duration::from_secs(2));
    let blob = Arc::new(LazyBlob::new(registry, "gone/image".into(), gone_rootfs(), cache, policy).unwrap());
    let began = Instant::now();
    let reader = blob.clone();
    let err = tokio::task::spawn_blocking(move || reader.read_at(1 << 20, 4096)).await.unwrap().unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::Other, "{err}");
    let took = began.elapsed();
    // Retried (the backoff alone is over a second within a 2 s bound), then given up in time.
    assert!(took >= Duration::from_millis(1000) && took < Duration::from_secs(4), "bounded: {took:?}");
    assert_eq!(blob.stats().fetch_errors(), 1);
    assert_eq!(blob.stats().bytes_fetched(), 0);
    // The outage is known now: one attempt, refused at once.
    let began = Instant::now();
    let reader = blob.clone();
    tokio::task::spawn_blocking(move || reader.read_at(2 << 20, 4096)).await.unwrap().unwrap_err();
    assert!(began.elapsed() < Duration::from_millis(500), "a known outage fails at once: {:?}", began.elapsed());
    assert_eq!(blob.stats().fetch_errors(), 2);
}

/// A registry that accepts connections and never answers (stopped, or a black hole on the
/// way): each attempt is cut at its bound and the whole fetch at the total.
#[tokio::test]
async fn a_registry_that_never_answers_is_given_up_on_within_the_bound() {
    let node = TempDir::new("stalled");
    let cache = Arc::new(ChunkCache::open(node.sub("chunks"), 8 << 20).unwrap());
    // Connections queue in the backlog (the kernel completes the handshake); nobody reads them.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let registry = Registry::new(&format!("127.0.0.1:{port}")).unwrap();
    let policy = FetchPolicy::with_total(Duration::from_secs(3));
    let blob = Arc::new(LazyBlob::new(registry, "stalled/image".into(), gone_rootfs(), cache, policy).unwrap());
    let began = Instant::now();
    let reader = blob.clone();
    let err = tokio::task::spawn_blocking(move || reader.read_at(0, 4096)).await.unwrap().unwrap_err();
    let took = began.elapsed();
    assert!(took >= Duration::from_millis(2500) && took < Duration::from_secs(5), "{took:?}: {err}");
    assert_eq!(blob.stats().fetch_errors(), 1);
    drop(listener);
}
