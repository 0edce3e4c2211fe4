#!/usr/bin/env python3
"""Build a corpus of distinct small images in the local registry (scripts/corpus runs this).

Each image is the busybox image's layers plus one layer of its own holding /task/id (the
image's name and a newline) and /task/blob (K KiB of bytes drawn from SHAKE-256 of the seed
and the image's index), so every rerun with the same options makes the same bytes, hence the
same digests. Nothing is built by Docker: the busybox layers are taken once from `docker save`
(gzip-compressed and cached under --cache, keyed by the image's id), and images are pushed
straight over the registry's HTTP API v2: cross-repository mounts for the shared layers,
monolithic uploads (POST, then PUT with the digest) for the rest, a Docker schema2 manifest
last. An image whose tag already names the same manifest is skipped.

Standard library only.
"""

import argparse
import hashlib
import http.client
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import zlib
from concurrent.futures import ThreadPoolExecutor

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def die(msg):
    print(f"corpus: error: {msg}", file=sys.stderr)
    sys.exit(1)


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def gzip_bytes(data):
    """gzip with a fixed header (no name, mtime 0, OS "unknown"): the same bytes on every
    Python (since 3.11, gzip.compress(mtime=0) takes its OS byte from the zlib build)."""
    comp = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = comp.compress(data) + comp.flush()
    header = b"\x1f\x8b\x08\x00" + b"\x00\x00\x00\x00" + b"\x00\xff"
    trailer = struct.pack("<II", zlib.crc32(data) & 0xFFFFFFFF, len(data) & 0xFFFFFFFF)
    return header + body + trailer


# ---------- the base image: busybox's layers and config, from `docker save`, cached ----------


def load_base(image, cache_root):
    """(config dict, [layer dict: digest, size, diff_id, path]) for IMAGE, from the cache or,
    the first time for this image id, from `docker save` (layers gzip-compressed)."""
    try:
        image_id = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Id}}", image],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        err = (getattr(e, "stderr", "") or str(e)).strip()
        die(f"cannot inspect the base image {image} (scripts/lib.sh build_images makes it): {err}")
    cache = os.path.join(cache_root, image_id.split(":", 1)[-1])
    meta_path = os.path.join(cache, "base.json")
    if not os.path.exists(meta_path):
        save_base(image, image_id, cache)
    with open(meta_path) as f:
        meta = json.load(f)
    with open(os.path.join(cache, "config.json"), "rb") as f:
        config = json.loads(f.read())
    layers = [dict(layer, path=os.path.join(cache, layer["digest"].split(":", 1)[1] + ".gz"))
              for layer in meta["layers"]]
    return config, layers


def save_base(image, image_id, cache):
    """Fill CACHE (written aside, then renamed into place) from `docker save IMAGE`."""
    print(f"corpus: caching the layers of {image} ({image_id[:19]}) in {cache}", file=sys.stderr)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(cache))
    try:
        tar_path = os.path.join(work, "image.tar")
        with open(tar_path, "wb") as out:
            subprocess.run(["docker", "save", image], check=True, stdout=out)
        with tarfile.open(tar_path) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))[0]
            config_raw = tar.extractfile(manifest["Config"]).read()
            if sha256(config_raw) != image_id:
                die(f"docker save gave a config of digest {sha256(config_raw)}, not {image_id}")
            config = json.loads(config_raw)
            diff_ids = config["rootfs"]["diff_ids"]
            if len(diff_ids) != len(manifest["Layers"]):
                die(f"{image}: {len(manifest['Layers'])} layers but {len(diff_ids)} diff_ids")
            layers = []
            for name, diff_id in zip(manifest["Layers"], diff_ids):
                raw = tar.extractfile(name).read()  # follows the links of repeated layers
                if sha256(raw) != diff_id:
                    die(f"{image}: layer {name} is {sha256(raw)}, its config says {diff_id}")
                gz = gzip_bytes(raw)
                digest = sha256(gz)
                with open(os.path.join(work, digest.split(":", 1)[1] + ".gz"), "wb") as f:
                    f.write(gz)
                layers.append({"digest": digest, "size": len(gz), "diff_id": diff_id})
        os.remove(tar_path)
        with open(os.path.join(work, "config.json"), "wb") as f:
            f.write(config_raw)
        with open(os.path.join(work, "base.json"), "w") as f:
            json.dump({"image": image, "id": image_id, "layers": layers}, f, indent=2)
        os.chmod(work, 0o755)  # mkdtemp's 0700
        try:
            os.rename(work, cache)
        except OSError:  # another run cached it meanwhile
            if not os.path.exists(os.path.join(cache, "base.json")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------- one image of the corpus ----------


def task_layer(name, index, seed, layer_kb):
    """The uncompressed tar of the image's own layer: task/, task/id, task/blob."""
    blob = hashlib.shake_256(f"sandpool-corpus:{seed}:{index}".encode()).digest(layer_kb * 1024)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        def add(path, data=None):
            info = tarfile.TarInfo(path)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode, info.size = 0o644, len(data)
                tar.addfile(info, io.BytesIO(data))
        add("task")
        add("task/id", (name + "\n").encode())
        add("task/blob", blob)
    return buf.getvalue()


def image_config(base, diff_id, name):
    """The base image's config (Env, Cmd, WorkingDir, Labels... and platform) with one more
    layer. Fields that describe the base's build container are left out."""
    created = base.get("created", "1970-01-01T00:00:00Z")
    config = {"architecture": base["architecture"], "os": base["os"]}
    for key in ("variant", "os.version", "os.features", "author"):
        if key in base:
            config[key] = base[key]
    config["config"] = base.get("config") or {}
    config["created"] = created
    config["history"] = list(base.get("history", [])) + [{
        "created": created,
        "created_by": f"sandpool corpus: /task/id ({name}) and /task/blob",
    }]
    config["rootfs"] = {"type": "layers", "diff_ids": list(base["rootfs"]["diff_ids"]) + [diff_id]}
    return json.dumps(config, separators=(",", ":")).encode()


class Image:
    """Everything pushed for one image, made locally (so its manifest digest is known before
    asking the registry anything)."""

    def __init__(self, opts, base_config, base_layers, index):
        self.index = index
        self.repo = f"{opts.repo_prefix}/task-{index:04d}"
        self.name = f"{opts.registry}/{self.repo}:latest"
        raw = task_layer(self.name, index, opts.seed, opts.layer_kb)
        self.layer = gzip_bytes(raw)
        self.layer_digest = sha256(self.layer)
        self.config = image_config(base_config, sha256(raw), self.name)
        self.config_digest = sha256(self.config)
        layers = [(layer["size"], layer["digest"]) for layer in base_layers]
        layers.append((len(self.layer), self.layer_digest))
        self.manifest = json.dumps({
            "schemaVersion": 2,
            "mediaType": MANIFEST_V2,
            "config": {"mediaType": CONFIG_V1, "size": len(self.config),
                       "digest": self.config_digest},
            "layers": [{"mediaType": LAYER_GZIP, "size": size, "digest": digest}
                       for size, digest in layers],
        }, indent=3).encode()
        self.digest = sha256(self.manifest)
        self.layer_bytes = sum(size for size, _ in layers)

    def record(self, registry):
        return {
            "image": self.name,
            "digest": self.digest,
            "ref": f"{registry}/{self.repo}@{self.digest}",
            "layer_bytes": self.layer_bytes,  # compressed, all layers: what a pull fetches
            "unique_bytes": len(self.layer),  # compressed, the image's own layer
        }


# ---------- the registry's HTTP API v2 ----------


class RegistryError(Exception):
    pass


class Registry:
    """A client of one registry: a keep-alive connection per thread."""

    def __init__(self, hostport, timeout=60):
        self.hostport = hostport
        self.timeout = timeout
        self.local = threading.local()

    def request(self, method, path, body=None, headers=None, ok=(200,)):
        """(status, headers) of METHOD PATH; RegistryError unless the status is in OK. One
        retry on a fresh connection when a kept-alive one was closed under us."""
        for attempt in (0, 1):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = http.client.HTTPConnection(self.hostport, timeout=self.timeout)
                self.local.conn = conn
            try:
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.HTTPException, ConnectionError) as e:
                conn.close()
                self.local.conn = None
                if attempt:
                    raise RegistryError(f"{method} {path}: {e}") from e
                continue
            if resp.status not in ok:
                text = data[:500].decode(errors="replace")
                raise RegistryError(f"{method} {path}: HTTP {resp.status}: {text}")
            return resp.status, resp.headers
        raise AssertionError("unreachable")

    def manifest_digest(self, repo, tag):
        status, headers = self.request("HEAD", f"/v2/{repo}/manifests/{tag}",
                                       headers={"Accept": MANIFEST_V2}, ok=(200, 404))
        return headers.get("Docker-Content-Digest") if status == 200 else None

    def _upload_path(self, headers):
        location = headers.get("Location") or ""
        url = urllib.parse.urlsplit(location)
        if not url.path:
            raise RegistryError(f"upload started without a Location ({location!r})")
        return url.path + (f"?{url.query}" if url.query else "")

    def put_blob(self, repo, digest, data, mount_from=None):
        """Make DIGEST a blob of REPO: mounted from MOUNT_FROM when it is there (no bytes
        sent; MOUNT_FROM may be REPO itself), else uploaded monolithically (POST, then PUT
        with the digest). Returns the bytes sent."""
        path = f"/v2/{repo}/blobs/uploads/"
        if mount_from:
            path += "?" + urllib.parse.urlencode({"mount": digest, "from": mount_from})
        status, headers = self.request("POST", path, headers={"Content-Length": "0"}, ok=(201, 202))
        if status == 201:  # mounted
            return 0
        upload = self._upload_path(headers)
        sep = "&" if "?" in upload else "?"
        body = data() if callable(data) else data
        self.request("PUT", f"{upload}{sep}digest={urllib.parse.quote(digest)}", body=body,
                     headers={"Content-Type": "application/octet-stream",
                              "Content-Length": str(len(body))}, ok=(201,))
        return len(body)

    def put_manifest(self, repo, tag, manifest):
        _, headers = self.request("PUT", f"/v2/{repo}/manifests/{tag}", body=manifest,
                                  headers={"Content-Type": MANIFEST_V2,
                                           "Content-Length": str(len(manifest))}, ok=(201,))
        return headers.get("Docker-Content-Digest")


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def push(reg, image, base_layers, mount_from, force):
    """Push IMAGE unless its tag already names its manifest. Returns (pushed, bytes sent)."""
    if not force and reg.manifest_digest(image.repo, "latest") == image.digest:
        return False, 0
    sent = 0
    # Each blob is one POST that mounts it (from the first image's repository for the shared
    # layers, from its own for the rest: a blob the repository has already "mounts" too) or,
    # when it is not there, starts the upload the PUT then completes. A HEAD first would cost a
    # request more, and fill the registry's log with a 404 error line per new blob.
    for layer in base_layers:
        sent += reg.put_blob(image.repo, layer["digest"], lambda p=layer["path"]: read_file(p),
                             mount_from=mount_from or image.repo)
    for digest, data in ((image.layer_digest, image.layer), (image.config_digest, image.config)):
        sent += reg.put_blob(image.repo, digest, data, mount_from=image.repo)
    got = reg.put_manifest(image.repo, "latest", image.manifest)
    if got and got != image.digest:
        raise RegistryError(f"{image.name}: the registry stored {got}, we sent {image.digest}")
    return True, sent


def main():
    env = os.environ.get
    default_registry = env("SANDPOOL_REGISTRY") or \
        "127.0.0.1:" + env("SANDPOOL_REGISTRY_PORT", "5000")
    default_base = env("SANDPOOL_BUSYBOX_IMAGE", "sandpool/busybox:latest")
    default_cache = env("SANDPOOL_CORPUS_CACHE", "/var/cache/sandpool-corpus")
    p = argparse.ArgumentParser(
        prog="scripts/corpus",
        description="Push N distinct small images (busybox + /task/id + /task/blob) to a "
                    "registry, named REGISTRY/PREFIX/task-NNNN:latest; images already there "
                    "(same manifest digest) are skipped.")
    p.add_argument("--count", type=int, default=200, help="images to make (default 200)")
    p.add_argument("--layer-kb", type=int, default=64,
                   help="KiB of random bytes in each image's /task/blob (default 64)")
    p.add_argument("--repo-prefix", default="corpus", help="repository prefix (default corpus)")
    p.add_argument("--registry", default=default_registry,
                   help=f"HOST:PORT (default {default_registry})")
    p.add_argument("--out", help="write one JSON line per image here: image, digest (of the "
                                 "manifest), ref (by digest), layer_bytes, unique_bytes")
    p.add_argument("--seed", default="0", help="seed of the blobs' bytes (default 0)")
    p.add_argument("--start", type=int, default=0, help="index of the first image (default 0)")
    p.add_argument("--jobs", type=int, default=4, help="images pushed at once (default 4)")
    p.add_argument("--force", action="store_true",
                   help="push images already there too (blobs the registry has are not resent)")
    p.add_argument("--base-image", default=default_base,
                   help=f"the local image whose layers start every image (default {default_base})")
    p.add_argument("--cache", default=default_cache,
                   help=f"where the base image's gzipped layers are kept (default {default_cache})")
    opts = p.parse_args()
    if opts.count < 0 or opts.start < 0 or opts.start + opts.count > 10000:
        die("--start and --count must name images 0000..9999")
    if opts.layer_kb < 0 or opts.jobs < 1:
        die("--layer-kb must be >= 0 and --jobs >= 1")
    if not opts.repo_prefix or opts.repo_prefix.strip("/") != opts.repo_prefix:
        die("--repo-prefix must be a non-empty path without leading or trailing /")

    start = time.monotonic()
    base_config, base_layers = load_base(opts.base_image, opts.cache)
    images = [Image(opts, base_config, base_layers, i)
              for i in range(opts.start, opts.start + opts.count)]
    reg = Registry(opts.registry)
    pushed = skipped = sent = 0
    if images:
        try:
            reg.request("GET", "/v2/")
            # The first image carries the shared layers (uploaded, unless there already); the
            # others mount them from its repository.
            first = images[0]
            results = [push(reg, first, base_layers, None, opts.force)]
            with ThreadPoolExecutor(max_workers=opts.jobs) as pool:
                results += pool.map(
                    lambda image: push(reg, image, base_layers, first.repo, opts.force),
                    images[1:])
        except (RegistryError, OSError) as e:
            die(f"registry {opts.registry}: {e}")
        pushed = sum(done for done, _ in results)
        skipped = len(results) - pushed
        sent = sum(n for _, n in results)
    if opts.out:
        tmp = opts.out + ".tmp"
        with open(tmp, "w") as f:
            for image in images:
                f.write(json.dumps(image.record(opts.registry)) + "\n")
        os.replace(tmp, opts.out)
    span = f"{images[0].repo}..{images[-1].index:04d}" if images else opts.repo_prefix
    print(f"corpus: {len(images)} images ({opts.registry}/{span}, {opts.layer_kb} KiB each): "
          f"{pushed} pushed, {skipped} skipped, {sent / 1048576:.1f} MiB sent, "
          f"{time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
