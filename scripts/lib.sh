# shellcheck shell=bash
# Shared shell functions for scripts/up, scripts/test, scripts/down and images/*/build.sh.
# Source it; do not run it. Every function is idempotent and quick when the machine is
# already set up: it only installs, starts or builds what is missing.
#
# Knobs (environment):
#   SANDPOOL_REDIS_PORT     redis port on 127.0.0.1 (default 6379)
#   SANDPOOL_CLUSTER_PORTS  ports of the local 3-master Redis Cluster (default "7001 7002 7003")
#   SANDPOOL_REGISTRY_PORT  the local OCI registry's port on 127.0.0.1 (default 5000)
#   SANDPOOL_DOCKERD_ARGS   extra dockerd arguments when we have to start dockerd ourselves
#   SANDPOOL_DOCKERD_WAIT   seconds to wait for dockerd to answer (default 60)
#   SANDPOOL_DATA_ROOT      Docker's data root when we start dockerd ourselves: a loop-mounted
#                           filesystem that bounds each container's disk (templates' disk_mb),
#                           its image file beside it (default /var/lib/sandpool/docker[.img])
#   SANDPOOL_DATA_ROOT_FS   auto (default: XFS with project quotas if the kernel has them, else
#                           btrfs with quotas), xfs, btrfs, or off (dockerd's own data root)
#   SANDPOOL_DATA_ROOT_SIZE size of the sparse image when first made (default 64G, or 80% of the
#                           free disk there if that is less)
#   SANDPOOL_DOCKER_SWITCH=1  if dockerd runs on a data root that cannot bound disks, stop it
#                           (every container on it stops) and start it on the bounded root
#   FORCE=1                 rebuild images even if they exist

# The repository root, whatever the caller's cwd.
SANDPOOL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SANDPOOL_ROOT

SANDPOOL_BUSYBOX_IMAGE="${SANDPOOL_BUSYBOX_IMAGE:-sandpool/busybox:latest}"
SANDPOOL_BASH_IMAGE="${SANDPOOL_BASH_IMAGE:-sandpool/bash:latest}"
SANDPOOL_DEBIAN_IMAGE="${SANDPOOL_DEBIAN_IMAGE:-sandpool/debian:bookworm}"
SANDPOOL_REDIS_PORT="${SANDPOOL_REDIS_PORT:-6379}"
SANDPOOL_DOCKERD_WAIT="${SANDPOOL_DOCKERD_WAIT:-60}"
SANDPOOL_DOCKERD_LOG="${SANDPOOL_DOCKERD_LOG:-/var/log/sandpool-dockerd.log}"
SANDPOOL_DOCKERD_PIDFILE="${SANDPOOL_DOCKERD_PIDFILE:-/var/run/sandpool-dockerd.pid}"
SANDPOOL_REDIS_LOG="${SANDPOOL_REDIS_LOG:-/var/log/sandpool-redis.log}"
SANDPOOL_REDIS_PIDFILE="${SANDPOOL_REDIS_PIDFILE:-/var/run/sandpool-redis.pid}"
SANDPOOL_REDIS_DIR="${SANDPOOL_REDIS_DIR:-/var/lib/sandpool-redis}"
SANDPOOL_CLUSTER_PORTS="${SANDPOOL_CLUSTER_PORTS:-7001 7002 7003}"
SANDPOOL_CLUSTER_DIR="${SANDPOOL_CLUSTER_DIR:-/var/lib/sandpool-redis-cluster}"
# The ledger's URL for that cluster: its seeds, comma-separated (`redis.url`).
# shellcheck disable=SC2086 # one seed per port: the split is meant
SANDPOOL_CLUSTER_URL="$(printf 'redis://127.0.0.1:%s,' $SANDPOOL_CLUSTER_PORTS)"
SANDPOOL_CLUSTER_URL="${SANDPOOL_CLUSTER_URL%,}"
export SANDPOOL_CLUSTER_URL
SANDPOOL_REGISTRY_PORT="${SANDPOOL_REGISTRY_PORT:-5000}"
SANDPOOL_REGISTRY="127.0.0.1:$SANDPOOL_REGISTRY_PORT" # host:port, the prefix of its image names
SANDPOOL_REGISTRY_DIR="${SANDPOOL_REGISTRY_DIR:-/var/lib/sandpool-registry}"
SANDPOOL_REGISTRY_CONFIG="${SANDPOOL_REGISTRY_CONFIG:-$SANDPOOL_REGISTRY_DIR/config.yml}"
SANDPOOL_REGISTRY_LOG="${SANDPOOL_REGISTRY_LOG:-/var/log/sandpool-registry.log}"
SANDPOOL_REGISTRY_PIDFILE="${SANDPOOL_REGISTRY_PIDFILE:-/var/run/sandpool-registry.pid}"
SANDPOOL_DATA_ROOT="${SANDPOOL_DATA_ROOT:-/var/lib/sandpool/docker}"
SANDPOOL_DATA_ROOT_FS="${SANDPOOL_DATA_ROOT_FS:-auto}"

# What every command needs. debootstrap (+ keyring) is added by the Debian image build only.
SANDPOOL_BASE_PACKAGES=(
    docker.io iptables procps redis-server redis-tools busybox-static
    ca-certificates curl python3 gcc libc6-dev
)

# Root's PATH from a non-login shell may miss the sbin dirs (dockerd lives in /usr/sbin) and
# cargo (rustup installs into ~/.cargo/bin).
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" ;; esac
if ! command -v cargo >/dev/null 2>&1 && [[ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo" ]]; then
    PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi
export PATH

log() { printf '\033[1;34m[sandpool %s]\033[0m %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
warn() { printf '\033[1;33m[sandpool %s] WARNING:\033[0m %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
    printf '\033[1;31m[sandpool %s] ERROR:\033[0m %s\n' "$(date +%H:%M:%S)" "$*" >&2
    exit 1
}

need_root() {
    [[ "$(id -u)" -eq 0 ]] || die "$1 needs root (run this script as root, e.g. with sudo)"
}

pkg_installed() {
    [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

# ensure_packages [pkg...]: install (apt, no recommends) whichever of the packages is missing.
# Without arguments: the base set. apt-get update runs at most once per shell, and only when
# something is missing.
_SANDPOOL_APT_UPDATED=0
ensure_packages() {
    local pkgs=("$@") missing=() p
    ((${#pkgs[@]})) || pkgs=("${SANDPOOL_BASE_PACKAGES[@]}")
    # dockerd refuses to start containers on an AppArmor kernel without apparmor_parser.
    if [[ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" == Y ]]; then
        pkgs+=(apparmor)
    fi
    for p in "${pkgs[@]}"; do
        pkg_installed "$p" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0

    need_root "installing ${missing[*]}"
    command -v apt-get >/dev/null || die "apt-get not found: this script expects Debian 12 (bookworm)"
    log "installing packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Without systemd, keep the packages' init scripts from starting docker/redis with their
    # stock settings: we start them ourselves, our way. Only while we install.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -d /run/systemd/system && ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added_policy=1
    fi
    local rc=0
    if ((_SANDPOOL_APT_UPDATED == 0)); then
        apt-get update -qq || rc=$?
        _SANDPOOL_APT_UPDATED=1
    fi
    if ((rc == 0)); then
        apt-get install -y -qq --no-install-recommends "${missing[@]}" || rc=$?
    fi
    ((added_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (exit $rc) while installing: ${missing[*]}"
}

# ensure_lazy_images: what lazy images need (the lazy-image crate, issue 32): erofs-utils
# (mkfs.erofs, for `sandpool images convert`), fuse3 (fusermount3 and /dev/fuse: a lazy
# image's blob is served as a FUSE file) and a kernel that mounts EROFS from a file
# (CONFIG_EROFS_FS_BACKED_BY_FILE, Linux 6.12+). Debian's stargz-snapshotter was weighed and
# not chosen: it ships ctr-remote but no snapshotter daemon (docs/notes/lazy-images.md).
SANDPOOL_LAZY_PACKAGES=(erofs-utils fuse3)
ensure_lazy_images() {
    ensure_packages "${SANDPOOL_LAZY_PACKAGES[@]}"
    [[ -e /dev/fuse ]] || modprobe fuse 2>/dev/null || warn "no /dev/fuse: lazy images cannot be mounted here"
    grep -qw erofs /proc/filesystems || modprobe erofs 2>/dev/null \
        || warn "this kernel has no EROFS: lazy images cannot be mounted here"
}

# install_lazy_runtime BIN: a build's sandpool-lazy-runtime (lazy-image's binary, the OCI
# runtime of lazy images' sandboxes) at the path ensure_runtimes registers with dockerd,
# replaced atomically (a running shim may be calling the old one). Idempotent.
SANDPOOL_LAZY_RUNTIME=/usr/local/libexec/sandpool/sandpool-lazy-runtime
install_lazy_runtime() {
    _install_binary "$1" "$SANDPOOL_LAZY_RUNTIME" "sandpool-lazy-runtime (cargo build -p lazy-image --bins)"
}

# _install_binary BIN TO WHAT: BIN copied to TO unless it is there already, replaced in one
# rename (a daemon that runs TO never finds it half-written); WHAT names it in the error.
_install_binary() {
    local bin="$1" to="$2" what="$3"
    [[ -x "$bin" ]] || die "no $what at $bin"
    need_root "installing $to"
    cmp -s "$bin" "$to" && return 0
    mkdir -p "$(dirname "$to")"
    install -m 0755 "$bin" "$to.new"
    mv -f "$to.new" "$to"
}

# ---------- containerd shims shared by sandboxes ----------
#
# Docker starts one containerd shim per container, and an idle shim costs ~0.35 ms of CPU a
# second and 11 threads (most of a 2-core node at 2,000 idle sandboxes). The pool-manager names
# a shim group per sandbox (`[docker] shim_group`) and sandpool-shim, installed here as
# containerd-shim-runc-v2 in a directory that dockerds started by this file put first on their
# PATH, hands it to containerd's runc shim (pool-manager/shim/src/main.rs). Containers the
# pool-manager did not group, and dockerds started elsewhere, get a shim each as before.
SANDPOOL_SHIM_DIR="${SANDPOOL_SHIM_DIR:-/usr/local/lib/sandpool/shim}"

# install_shim BIN: a build's sandpool-shim as $SANDPOOL_SHIM_DIR/containerd-shim-runc-v2.
install_shim() {
    _install_binary "$1" "$SANDPOOL_SHIM_DIR/containerd-shim-runc-v2" "sandpool-shim (cargo build -p sandpool-shim)"
}

# ensure_shim_groups [debug|release]: build sandpool-shim (a small crate of its own) and install
# it; warn when the running dockerd does not have $SANDPOOL_SHIM_DIR on its PATH. Call it before
# ensure_dockerd: containerd looks up containerd-shim-runc-v2 at its first container start and
# keeps that path for its life (so a shim installed later is not used until dockerd restarts,
# and removing it once used breaks every container start until then).
ensure_shim_groups() {
    local profile="${1:-debug}" flags=() pid
    [[ "$profile" == release ]] && flags=(--release)
    cargo build -q "${flags[@]}" -p sandpool-shim || die "cargo build -p sandpool-shim failed"
    install_shim "${CARGO_TARGET_DIR:-$SANDPOOL_ROOT/target}/$profile/sandpool-shim"
    pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
    if _pid_alive "$pid" && ! tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -q "^PATH=$SANDPOOL_SHIM_DIR:"; then
        warn "dockerd (pid $pid) was started without $SANDPOOL_SHIM_DIR first on its PATH: every sandbox gets a containerd shim of its own (restart it through scripts/lib.sh to share them)"
    fi
    return 0
}

# ensure_prometheus: Debian's prometheus package (Prometheus 2.x: `prometheus` and `promtool`),
# for scripts/observe and the dashboards' check in scripts/test (tests/tests/it/observe.rs).
# Installed only, never started here: scripts/observe and the test start their own, on
# loopback. The package's init script is kept from starting its service like the others'
# (policy-rc.d in ensure_packages; without systemd nothing starts it either).
SANDPOOL_OBSERVE_PACKAGES=(prometheus)

# ensure_node_tuning: the kernel limits a sandbox node needs, set now and kept across reboots
# (/etc/sysctl.d/90-sandpool.conf). Each idle sandbox costs ~14 threads (its containerd shim
# ~12, the agent 2), so Linux's default kernel.pid_max of 32,768 runs a 24 GiB node out of
# process ids at ~2,350 sandboxes, far below what its memory holds; each also holds open files
# and inotify watches (containerd, dockerd). Values are only ever raised, never lowered.
ensure_node_tuning() {
    need_root "tuning kernel limits for sandboxes"
    local conf=/etc/sysctl.d/90-sandpool.conf key want have changed=0
    local -a settings=(
        "kernel.pid_max=4194304"
        "kernel.threads-max=4194304"
        "fs.file-max=4194304"
        "fs.inotify.max_user_instances=8192"
        "fs.inotify.max_user_watches=1048576"
        "vm.max_map_count=1048576"
    )
    mkdir -p /etc/sysctl.d
    local text="# sandpool: kernel limits of a sandbox node (scripts/lib.sh ensure_node_tuning)"$'\n'
    for kv in "${settings[@]}"; do
        key="${kv%%=*}" want="${kv#*=}"
        have="$(sysctl -n "$key" 2>/dev/null || echo 0)"
        (( have > want )) && want="$have"
        text+="$key = $want"$'\n'
        if (( have < want )); then
            sysctl -qw "$key=$want" >/dev/null || warn "could not set $key=$want"
            changed=1
        fi
    done
    if [[ ! -f "$conf" ]] || [[ "$(cat "$conf")"$'\n' != "$text" ]]; then
        printf '%s' "$text" > "$conf"
    fi
    (( changed )) && log "kernel limits raised for sandboxes ($conf)"
    return 0
}

# crun refuses a hybrid cgroup layout whose cgroup2 hierarchy holds controllers ("cgroups in
# hybrid mode not supported, drop all controllers from cgroupv2"). On such a machine (v1
# controllers plus a unified mount holding, say, hugetlb), give each controller the v2 side
# holds but does not use (empty subtree_control) a v1 hierarchy of its own, as its peers have.
# runc and runsc are indifferent; idempotent.
ensure_cgroup_layout_for_crun() {
    local unified=/sys/fs/cgroup/unified
    [[ -r "$unified/cgroup.controllers" ]] || return 0
    local controllers
    controllers="$(cat "$unified/cgroup.controllers")"
    [[ -n "$controllers" ]] || return 0
    if [[ -n "$(cat "$unified/cgroup.subtree_control" 2>/dev/null)" ]]; then
        warn "cgroup2 controllers in use ($controllers): crun will not run on this hybrid layout"
        return 0
    fi
    local c
    for c in $controllers; do
        mkdir -p "/sys/fs/cgroup/$c"
        mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" \
            || warn "could not mount the $c cgroup controller as v1: crun will not run here"
        log "cgroup controller $c moved off the unified hierarchy (for crun)"
    done
}

# ensure_runtimes: the OCI runtimes templates may name besides runc, installed (Debian's runsc,
# gVisor, and crun) and registered (with sandpool-lazy, lazy images' runtime: install_lazy_runtime) with dockerd in /etc/docker/daemon.json (merged into what
# is there). A running dockerd reloads its runtimes on SIGHUP: no container stops. runsc runs
# with --platform=ptrace (no KVM needed) and --network=none (its own netstack is unused:
# gVisor templates have network = "none").
ensure_runtimes() {
    ensure_packages runsc crun
    need_root "registering OCI runtimes with dockerd"
    ensure_cgroup_layout_for_crun
    mkdir -p /etc/docker
    local changed
    changed="$(python3 - /etc/docker/daemon.json <<'PY'
import json, os, sys
path = sys.argv[1]
conf = json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
want = {
    "runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--platform=ptrace"]},
    "crun": {"path": "/usr/bin/crun"},
    # Lazy images' sandboxes (pool-manager/src/lazy.rs): an overlay on the node's lazy mount,
    # then runc, crun or runsc (the same flags as above). The binary is a build's;
    # install_lazy_runtime puts it at this path.
    "sandpool-lazy": {"path": "/usr/local/libexec/sandpool/sandpool-lazy-runtime"},
    "sandpool-lazy-crun": {"path": "/usr/local/libexec/sandpool/sandpool-lazy-runtime",
                           "runtimeArgs": ["--sandpool-oci=/usr/bin/crun"]},
    "sandpool-lazy-runsc": {"path": "/usr/local/libexec/sandpool/sandpool-lazy-runtime",
                            "runtimeArgs": ["--sandpool-oci=/usr/bin/runsc", "--network=none", "--platform=ptrace"]},
}
runtimes = conf.setdefault("runtimes", {})
changed = any(runtimes.get(k) != v for k, v in want.items())
runtimes.update(want)
if changed:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
print("yes" if changed else "no")
PY
)" || die "could not update /etc/docker/daemon.json"
    if [[ "$changed" == yes ]] && docker_ok; then
        local pid=""
        [[ -r "$SANDPOOL_DOCKERD_PIDFILE" ]] && pid="$(cat "$SANDPOOL_DOCKERD_PIDFILE" 2>/dev/null || true)"
        _pid_alive "$pid" || pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
        _pid_alive "$pid" || die "dockerd runs but its pid is unknown: reload it (SIGHUP) to register runsc and crun"
        kill -HUP "$pid"
        log "registered runsc, crun and the lazy runtimes with dockerd (pid $pid reloaded)"
    fi
    local i
    for i in $(seq 1 20); do
        grep -qw runsc <<<"$(docker info -f '{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>/dev/null)" && return 0
        sleep 0.5
    done
    die "dockerd does not list the runsc runtime (see /etc/docker/daemon.json)"
}

ensure_prometheus() {
    ensure_packages "${SANDPOOL_OBSERVE_PACKAGES[@]}"
    local b
    for b in prometheus promtool; do
        command -v "$b" >/dev/null || die "$b not found after installing package prometheus"
    done
}

docker_ok() { timeout 10 docker info >/dev/null 2>&1; }

# dockerd needs cgroups. Hosts without an init system sometimes have none mounted.
_ensure_cgroups() {
    if [[ -e /sys/fs/cgroup/cgroup.controllers ]] || [[ -d /sys/fs/cgroup/memory ]] ||
        [[ -d /sys/fs/cgroup/unified ]]; then
        return 0
    fi
    warn "no cgroup hierarchy mounted at /sys/fs/cgroup; trying to mount cgroup2"
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || warn "could not mount cgroup2; dockerd may fail"
}

_pid_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

# Start dockerd with the given extra arguments and wait (bounded) until it answers.
# Returns 0 when up, 1 if the daemon exited early, 2 if it is still not answering at the end.
_start_dockerd() {
    local args=("$@") pid waited=0
    log "starting dockerd ${args[*]} (log: $SANDPOOL_DOCKERD_LOG)"
    mkdir -p "$(dirname "$SANDPOOL_DOCKERD_LOG")"
    echo "=== $(date -Is) dockerd ${args[*]}" >>"$SANDPOOL_DOCKERD_LOG"
    # setsid: not in our process group, so Ctrl-C on this script leaves the daemon alone.
    # Each sandbox holds ~7 descriptors open in dockerd (~4 in containerd): at its limit every
    # create fails with "too many open files". Raise it where this machine allows (it needs
    # CAP_SYS_RESOURCE above the current hard limit); the node's budget counts what it is.
    ( ulimit -n 1048576 2>/dev/null || warn "dockerd keeps an open-files limit of $(ulimit -n): about $(( $(ulimit -n) / 8 )) sandboxes"
      exec env PATH="$SANDPOOL_SHIM_DIR:$PATH" setsid dockerd "${args[@]}" </dev/null >>"$SANDPOOL_DOCKERD_LOG" 2>&1 ) &
    pid=$!
    echo "$pid" >"$SANDPOOL_DOCKERD_PIDFILE"
    while ((waited < SANDPOOL_DOCKERD_WAIT)); do
        docker_ok && { log "dockerd is up (pid $pid, ${waited}s)"; return 0; }
        _pid_alive "$pid" || { rm -f "$SANDPOOL_DOCKERD_PIDFILE"; return 1; }
        sleep 1
        waited=$((waited + 1))
    done
    return 2
}

# ---------- a data root that bounds each container's disk ----------
#
# Docker bounds a container's writable layer (`--storage-opt size=`, which the pool-manager
# passes from templates' disk_mb) only on overlay2 over XFS mounted with project quotas
# (pquota) or on the btrfs driver with quotas. Neither is what a stock machine has, so when we
# start dockerd ourselves we give it a data root that can: a sparse image file, formatted and
# loop-mounted at $SANDPOOL_DATA_ROOT. XFS first (overlay2, Docker's default driver, shares the
# page cache of image files between sandboxes); kernels built without XFS quotas refuse the
# pquota mount, and then btrfs, with simple quotas (Linux >= 6.7) so a bound counts only the
# sandbox's own writes and removal stays cheap. Idempotent: a mounted root is reused, an
# existing image is mounted again (after a reboot), never reformatted.

# The dockerd arguments for the bounded data root, set by _prepare_data_root (empty: none).
_SANDPOOL_ROOT_ARGS=()

# _docker_root_bounds: "bounded <how>" or "unbounded <why>" for the dockerd that answers.
_docker_root_bounds() {
    local info driver root fstype opts
    info="$(timeout 10 docker info -f '{{.Driver}}|{{.DockerRootDir}}' 2>/dev/null)" || {
        echo "unbounded an engine that did not answer docker info"
        return
    }
    driver="${info%%|*}" root="${info#*|}"
    fstype="$(findmnt -no FSTYPE --target "$root" 2>/dev/null | head -n1)"
    opts="$(findmnt -no OPTIONS --target "$root" 2>/dev/null | head -n1)"
    case "$driver/$fstype" in
    btrfs/btrfs) echo "bounded btrfs (data root $root)" ;;
    overlay2/xfs)
        if [[ ",$opts," == *,prjquota,* || ",$opts," == *,pquota,* ]]; then
            echo "bounded overlay2 on XFS with project quotas (data root $root)"
        else
            echo "unbounded overlay2 on XFS without the pquota mount option (data root $root)"
        fi
        ;;
    *) echo "unbounded $driver on ${fstype:-an unknown filesystem} (data root $root)" ;;
    esac
}

# _btrfs_simple_quotas DIR: turn on btrfs simple quotas (squota, Linux >= 6.7) on the mounted
# btrfs at DIR, unless quotas are on already. Debian 12's btrfs-progs (6.2) cannot, so this
# is the ioctl itself: BTRFS_IOC_QUOTA_CTL with BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA (4).
_btrfs_simple_quotas() {
    local dir="$1" uuid
    uuid="$(findmnt -no UUID --target "$dir" | head -n1)"
    [[ -n "$uuid" && -d "/sys/fs/btrfs/$uuid/qgroups" ]] && return 0
    python3 - "$dir" <<'PY'
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.ioctl(fd, 0xC0109428, struct.pack("QQ", 4, 0))  # _IOWR(0x94, 40, {u64 cmd, status})
PY
}

# _mount_data_root IMAGE FSTYPE: loop-mount IMAGE at $SANDPOOL_DATA_ROOT the way FSTYPE needs.
_mount_data_root() {
    local img="$1" fs="$2"
    mkdir -p "$SANDPOOL_DATA_ROOT"
    case "$fs" in
    xfs) mount -o loop,pquota "$img" "$SANDPOOL_DATA_ROOT" 2>/dev/null ;;
    btrfs) mount -o loop,noatime "$img" "$SANDPOOL_DATA_ROOT" 2>/dev/null ;;
    *) return 1 ;;
    esac
}

# _make_data_root FSTYPE: a new sparse image formatted with FSTYPE, mounted. Fails (and leaves
# no image) when the kernel cannot mount it with quotas.
_make_data_root() {
    local fs="$1" img="$SANDPOOL_DATA_ROOT.img" size="${SANDPOOL_DATA_ROOT_SIZE:-}" free
    mkdir -p "$(dirname "$img")"
    if [[ -z "$size" ]]; then
        free="$(df --output=avail -B1 "$(dirname "$img")" | tail -n1)"
        size=$((64 << 30))
        ((free * 8 / 10 < size)) && size=$((free * 8 / 10))
        if ((size < 4 << 30)); then
            warn "only $((free >> 30)) GiB free under $(dirname "$img"): no bounded data root made"
            return 1
        fi
    fi
    case "$fs" in
    xfs) ensure_packages xfsprogs ;;
    btrfs) ensure_packages btrfs-progs ;;
    esac
    truncate -s "$size" "$img"
    local ok=0
    case "$fs" in
    xfs) mkfs.xfs -q "$img" && _mount_data_root "$img" xfs && ok=1 ;;
    btrfs)
        if mkfs.btrfs -q "$img" >/dev/null && _mount_data_root "$img" btrfs; then
            ok=1
            _btrfs_simple_quotas "$SANDPOOL_DATA_ROOT" || warn "btrfs simple quotas need Linux >= 6.7; Docker" \
                "turns on full quotas instead: a sandbox's bound then also counts its image's bytes, and" \
                "removing containers of large images is slower"
        fi
        ;;
    esac
    if ((ok == 0)); then
        rm -f "$img"
        return 1
    fi
    log "made a $fs data root for Docker at $SANDPOOL_DATA_ROOT ($(numfmt --to=iec "$(stat -c %s "$img")") sparse image $img)"
}

# _prepare_data_root: mount (or make) the bounded data root and set _SANDPOOL_ROOT_ARGS, or
# leave them empty with a warning saying why disk bounds will be off.
_prepare_data_root() {
    _SANDPOOL_ROOT_ARGS=()
    local want="$SANDPOOL_DATA_ROOT_FS" img="$SANDPOOL_DATA_ROOT.img" fs="" opts
    case "$want" in
    off) return 0 ;;
    auto | xfs | btrfs) ;;
    *) die "SANDPOOL_DATA_ROOT_FS='$want' is not one of auto, xfs, btrfs, off" ;;
    esac
    # Where dockerd's data root or driver is set already, dockerd refuses ours on top.
    if grep -qsE '"(data-root|graph|storage-driver)"' /etc/docker/daemon.json ||
        [[ " ${SANDPOOL_DOCKERD_ARGS:-} " =~ \ (--data-root|-g|--graph|--storage-driver|-s)[\ =] ]]; then
        warn "dockerd's data root or storage driver is set (/etc/docker/daemon.json or SANDPOOL_DOCKERD_ARGS):" \
            "not preparing a bounded data root; sandboxes' disk bounds depend on that setting"
        return 0
    fi
    if findmnt -no FSTYPE --mountpoint "$SANDPOOL_DATA_ROOT" >/dev/null 2>&1; then
        fs="$(findmnt -no FSTYPE --mountpoint "$SANDPOOL_DATA_ROOT")"
        opts="$(findmnt -no OPTIONS --mountpoint "$SANDPOOL_DATA_ROOT")"
        if [[ "$fs" == xfs && ",$opts," != *,prjquota,* && ",$opts," != *,pquota,* ]]; then
            warn "$SANDPOOL_DATA_ROOT is XFS mounted without pquota: sandboxes' disks will not be bounded"
        fi
    elif [[ -f "$img" ]]; then
        fs="$(blkid -o value -s TYPE "$img" 2>/dev/null || true)"
        _mount_data_root "$img" "$fs" || {
            warn "could not mount $img ($fs) at $SANDPOOL_DATA_ROOT: disk bounds are off (remove the image to start over)"
            return 0
        }
        log "mounted Docker's data root $SANDPOOL_DATA_ROOT ($fs, $img)"
    else
        need_root "preparing Docker's data root"
        local try
        for try in xfs btrfs; do
            [[ "$want" == auto || "$want" == "$try" ]] || continue
            if _make_data_root "$try"; then
                fs="$try"
                break
            fi
            [[ "$try" == xfs ]] && log "this kernel cannot mount XFS with project quotas (CONFIG_XFS_QUOTA)"
        done
        if [[ -z "$fs" ]]; then
            warn "no filesystem that bounds disks could be made ($want): disk bounds are off"
            return 0
        fi
    fi
    [[ "$fs" == btrfs ]] && { _btrfs_simple_quotas "$SANDPOOL_DATA_ROOT" || true; }
    case "$fs" in
    xfs) _SANDPOOL_ROOT_ARGS=(--data-root "$SANDPOOL_DATA_ROOT" --storage-driver overlay2) ;;
    btrfs) _SANDPOOL_ROOT_ARGS=(--data-root "$SANDPOOL_DATA_ROOT" --storage-driver btrfs) ;;
    *) warn "$SANDPOOL_DATA_ROOT is $fs: disk bounds are off" ;;
    esac
}

# _check_disk_bounds [started]: say whether the running dockerd bounds disks; move it to a
# bounded root when asked (SANDPOOL_DOCKER_SWITCH=1), unless we have just started it.
_check_disk_bounds() {
    local state
    state="$(_docker_root_bounds)"
    if [[ "$state" == bounded* ]]; then
        log "sandbox disk bounds: on, ${state#bounded }"
        return 0
    fi
    if [[ "${1:-}" == started ]]; then
        warn "sandbox disk bounds are OFF: dockerd runs ${state#unbounded }; templates' disk_mb is not enforced"
        return 0
    fi
    if [[ "${SANDPOOL_DOCKER_SWITCH:-0}" == 1 ]]; then
        switch_dockerd_root
        return 0
    fi
    warn "sandbox disk bounds are OFF: dockerd runs ${state#unbounded }, which cannot bound a container's" \
        "disk, so templates' disk_mb is not enforced (a sandbox can fill Docker's disk). To switch, run" \
        "SANDPOOL_DOCKER_SWITCH=1 scripts/up (it stops dockerd and every container on it, and restarts" \
        "it on a bounded data root at $SANDPOOL_DATA_ROOT; images are rebuilt there)."
}

# switch_dockerd_root: stop the dockerd our pid file names (or /var/run/docker.pid's, when
# DOCKER_HOST is unset) and start it again on the bounded data root. Every container on it
# stops; the old data root is left as it is.
switch_dockerd_root() {
    need_root "moving dockerd to a bounded data root"
    local pid="" n waited=0
    [[ -r "$SANDPOOL_DOCKERD_PIDFILE" ]] && pid="$(cat "$SANDPOOL_DOCKERD_PIDFILE" 2>/dev/null || true)"
    if ! _pid_alive "$pid" && [[ -z "${DOCKER_HOST:-}" && -r /var/run/docker.pid ]]; then
        pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
    fi
    _pid_alive "$pid" || die "cannot find the running dockerd's pid ($SANDPOOL_DOCKERD_PIDFILE): stop it yourself, then rerun"
    if [[ -d /run/systemd/system ]] && systemctl is-active --quiet docker 2>/dev/null; then
        die "dockerd is a systemd service: stop it (systemctl stop docker docker.socket), then rerun this" \
            "(or set data-root and storage-driver in /etc/docker/daemon.json to a filesystem with quotas)"
    fi
    n="$(docker ps -q 2>/dev/null | wc -l)"
    log "stopping dockerd (pid $pid) to move it to a bounded data root; its $n running container(s) stop"
    kill "$pid"
    while _pid_alive "$pid" && ((waited < 120)); do
        sleep 1
        waited=$((waited + 1))
    done
    _pid_alive "$pid" && die "dockerd (pid $pid) did not stop within 120s"
    rm -f "$SANDPOOL_DOCKERD_PIDFILE"
    _launch_dockerd
    local state
    state="$(_docker_root_bounds)"
    [[ "$state" == bounded* ]] || die "dockerd restarted but still runs ${state#unbounded }"
    log "sandbox disk bounds: on, ${state#bounded }"
}

# ensure_dockerd: make `docker info` work, starting dockerd in the background if needed (on a
# bounded data root, see above). A dockerd that already runs is used as it is, with a warning
# when it cannot bound disks (SANDPOOL_DOCKER_SWITCH=1: moved to a bounded root).
ensure_dockerd() {
    docker_ok && { _check_disk_bounds; return 0; }
    command -v docker >/dev/null || die "docker CLI not found (package docker.io)"
    # A daemon may be running but still starting (or be one we started before): wait for it.
    local pid=""
    [[ -r /var/run/docker.pid ]] && pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
    if _pid_alive "$pid" && [[ -z "${DOCKER_HOST:-}" ]]; then
        log "dockerd (pid $pid) is running but not answering yet; waiting up to ${SANDPOOL_DOCKERD_WAIT}s"
        local waited=0
        while ((waited < SANDPOOL_DOCKERD_WAIT)); do
            docker_ok && { _check_disk_bounds; return 0; }
            _pid_alive "$pid" || break
            sleep 1
            waited=$((waited + 1))
        done
        docker_ok && { _check_disk_bounds; return 0; }
        if _pid_alive "$pid"; then
            die "dockerd (pid $pid) is running but does not answer 'docker info' after ${SANDPOOL_DOCKERD_WAIT}s"
        fi
    fi
    _launch_dockerd
    _check_disk_bounds started
}

# _launch_dockerd: start our dockerd (bounded data root when possible), retrying without
# iptables where the kernel has none.
_launch_dockerd() {
    need_root "starting dockerd"
    command -v dockerd >/dev/null || die "dockerd not found (package docker.io)"
    _ensure_cgroups
    _prepare_data_root
    local extra=("${_SANDPOOL_ROOT_ARGS[@]}")
    # shellcheck disable=SC2206 # word splitting of the user's extra flags is intended
    [[ -n "${SANDPOOL_DOCKERD_ARGS:-}" ]] && extra+=(${SANDPOOL_DOCKERD_ARGS})
    local rc=0
    _start_dockerd "${extra[@]}" || rc=$?
    ((rc == 0)) && return 0
    # Kernels/containers without working iptables (nf_tables or legacy) make dockerd exit at
    # startup. Sandboxes run with networking disabled by default, so retry without iptables.
    if ((rc == 1)) && grep -qiE 'iptables|nf_tables|xtables' <<<"$(tail -n 40 "$SANDPOOL_DOCKERD_LOG")"; then
        warn "dockerd failed on iptables; retrying with --iptables=false --ip6tables=false (no NAT for bridge networks)"
        rc=0
        _start_dockerd "${extra[@]}" --iptables=false --ip6tables=false || rc=$?
        ((rc == 0)) && return 0
    fi
    tail -n 30 "$SANDPOOL_DOCKERD_LOG" >&2 || true
    if ((rc == 1)); then
        die "dockerd exited during startup; see $SANDPOOL_DOCKERD_LOG (last lines above)"
    fi
    die "dockerd did not answer 'docker info' within ${SANDPOOL_DOCKERD_WAIT}s; see $SANDPOOL_DOCKERD_LOG"
}

# ---------- a second dockerd, for fault tests ----------
#
# A fault test runs one node on a dockerd of its own, so that "the host's Docker dies" can be
# tested by killing it while every other node and test keeps the first. Same docker.io
# package, nothing shared with the first: its own data root ($SANDPOOL_DOCKER2_DIR/docker),
# exec root, socket, pid file, log, trust key and config file (the runtimes of
# /etc/docker/daemon.json and nothing else: a data-root or hosts key there would clash with
# the flags), and its own containerd: dockerd starts one under its exec root unless a system
# containerd listens on /run/containerd/containerd.sock, which both daemons would then share,
# kept apart by the containerd namespaces given below. Its default bridge is a device of its
# own ($SANDPOOL_DOCKER2_BRIDGE, made here), not docker0 and not `--bridge none`: a dockerd
# started with `--bridge none` deletes any link named docker0 (moby's
# removeDefaultBridgeInterface), which is the first daemon's, and that one's builds and
# bridge containers then fail. No iptables or masquerading rules: its sandboxes run with
# network "none" (a node on it should have no bridge or egress templates). Its containers'
# cgroups sit under `sandpool-docker2`.
#
# Its data root is a plain directory (overlay2 on the host's filesystem), so it cannot bound
# disks: a node on it must keep `docker.disk_bounds = "best_effort"` (the default; "required"
# refuses to start) and set `docker.socket = "/run/sandpool-docker2.sock"`. Its engine id is
# its own (see _dockerd2_config), so the node id derived from it differs from the first's.
#
#   ensure_dockerd2 [image...]  start it unless it answers, then copy each image (default the
#                               busybox image) from the first dockerd where missing or stale
#   stop_dockerd2               SIGTERM and wait (it stops its containers first)
#   kill_dockerd2               SIGKILL: the fault (a test may as well `kill -9` the pid in
#                               $SANDPOOL_DOCKERD2_PIDFILE itself)
#   docker2 ARGS...             the docker CLI against it
#
# After SIGKILL its containerd is gone too (its parent-death signal), while the shims and the
# containers run on, unreachable. ensure_dockerd2 then starts both again, and dockerd stops
# the containers it finds running (SIGTERM, SIGKILL after 10 s: a PID 1 that ignores SIGTERM
# exits 137; `--rm` ones are removed; the rest can be started again), so it answers only after
# ~11 s. SANDPOOL_DOCKERD2_ARGS adds dockerd arguments: with `--live-restore` the containers
# keep running through the restart (same process) and it answers within a second.
DOCKER2_SOCKET="${DOCKER2_SOCKET:-/run/sandpool-docker2.sock}"
SANDPOOL_DOCKER2_DIR="${SANDPOOL_DOCKER2_DIR:-/var/lib/sandpool-docker2}"
SANDPOOL_DOCKER2_EXEC_ROOT="${SANDPOOL_DOCKER2_EXEC_ROOT:-/run/sandpool-docker2}"
SANDPOOL_DOCKERD2_PIDFILE="${SANDPOOL_DOCKERD2_PIDFILE:-/run/sandpool-docker2.pid}"
SANDPOOL_DOCKERD2_LOG="${SANDPOOL_DOCKERD2_LOG:-/var/log/sandpool-dockerd2.log}"
SANDPOOL_DOCKER2_BRIDGE="${SANDPOOL_DOCKER2_BRIDGE:-sandpool-d2}"
SANDPOOL_DOCKER2_BRIDGE_CIDR="${SANDPOOL_DOCKER2_BRIDGE_CIDR:-172.31.254.1/24}"
export DOCKER2_SOCKET SANDPOOL_DOCKERD2_PIDFILE

docker2() { docker -H "unix://$DOCKER2_SOCKET" "$@"; }
docker2_ok() { timeout 10 docker -H "unix://$DOCKER2_SOCKET" info >/dev/null 2>&1; }
# _pid_running PID: alive and not a zombie (a killed daemon whose parent has not reaped it).
_pid_running() {
    local s
    s="$(ps -o stat= -p "${1:-0}" 2>/dev/null)"
    [[ -n "$s" && "$s" != Z* ]]
}

# _dockerd2_pid: the pid in the second dockerd's pid file, if that process is a dockerd.
_dockerd2_pid() {
    local pid=""
    [[ -r "$SANDPOOL_DOCKERD2_PIDFILE" ]] && pid="$(cat "$SANDPOOL_DOCKERD2_PIDFILE" 2>/dev/null || true)"
    if [[ -n "$pid" ]] && _pid_running "$pid" && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == dockerd ]]; then
        echo "$pid"
    fi
}

# _dockerd2_config: write its daemon.json (the first's runtimes, and a trust key of its own);
# prints changed or same. Docker's engine id (a node's derived id hashes it) comes from the
# trust key, /etc/docker/key.json, before Docker 23 and from the data root since: before 23 the
# second daemon needs a key of its own (a config key only, not a flag), or both report one id.
_dockerd2_config() {
    local version key=""
    version="$(dockerd --version 2>/dev/null | sed -nE 's/^Docker version ([0-9]+)\..*/\1/p')"
    [[ -n "$version" ]] && ((version < 23)) && key="$SANDPOOL_DOCKER2_DIR/key.json"
    python3 - /etc/docker/daemon.json "$SANDPOOL_DOCKER2_DIR/daemon.json" "$key" <<'PY'
import json, os, sys
src, dst, key = sys.argv[1], sys.argv[2], sys.argv[3]
conf = json.load(open(src)) if os.path.exists(src) and os.path.getsize(src) else {}
want = {"runtimes": conf["runtimes"]} if conf.get("runtimes") else {}
if key:
    want["deprecated-key-path"] = key
have = json.load(open(dst)) if os.path.exists(dst) and os.path.getsize(dst) else None
if have != want:
    with open(dst + ".tmp", "w") as f:
        json.dump(want, f, indent=2)
        f.write("\n")
    os.replace(dst + ".tmp", dst)
print("same" if have == want else "changed")
PY
}

# _dockerd2_bridge: the second dockerd's bridge device, with its address, up.
_dockerd2_bridge() {
    local dev="$SANDPOOL_DOCKER2_BRIDGE"
    ip link show "$dev" >/dev/null 2>&1 || ip link add "$dev" type bridge ||
        die "could not create bridge $dev for the second dockerd"
    # Not `ip … | grep -q`: grep leaves at the first match, ip dies of SIGPIPE writing the next
    # line, and under pipefail the check fails although the address is there.
    grep -q "inet ${SANDPOOL_DOCKER2_BRIDGE_CIDR%/*}/" <<<"$(ip -o addr show dev "$dev")" ||
        ip addr add "$SANDPOOL_DOCKER2_BRIDGE_CIDR" dev "$dev" ||
        die "could not give bridge $dev the address $SANDPOOL_DOCKER2_BRIDGE_CIDR"
    ip link set "$dev" up || die "could not bring bridge $dev up"
}

ensure_dockerd2() {
    local images=("$@") pid changed launcher start=$SECONDS gone=0
    ((${#images[@]})) || images=("$SANDPOOL_BUSYBOX_IMAGE")
    if ! docker2_ok; then
        need_root "starting the second dockerd"
        command -v dockerd >/dev/null || die "dockerd not found (package docker.io)"
        _ensure_cgroups
        mkdir -p "$SANDPOOL_DOCKER2_DIR/docker" "$SANDPOOL_DOCKER2_EXEC_ROOT" "$(dirname "$SANDPOOL_DOCKERD2_LOG")"
        _dockerd2_config >/dev/null || die "could not write $SANDPOOL_DOCKER2_DIR/daemon.json"
        _dockerd2_bridge
        pid="$(_dockerd2_pid)"
        if [[ -z "$pid" ]]; then
            # A pid file left by a killed daemon names a dead (or reused) pid: dockerd would
            # refuse to start over a live one.
            rm -f "$SANDPOOL_DOCKERD2_PIDFILE"
            # Its containerd dies with it (dockerd gives it SIGKILL as its parent-death
            # signal), but dockerd takes any process its containerd.pid names for a live
            # containerd, zombies too (where PID 1 reaps orphans late), and then times out
            # waiting for it: forget a pid that is no running containerd.
            local cpidfile="$SANDPOOL_DOCKER2_EXEC_ROOT/containerd/containerd.pid" cpid
            cpid="$(cat "$cpidfile" 2>/dev/null || true)"
            if [[ -n "$cpid" ]] && ! { _pid_running "$cpid" &&
                [[ "$(cat "/proc/$cpid/comm" 2>/dev/null)" == containerd ]]; }; then
                rm -f "$cpidfile"
            fi
            local args=(
                --data-root "$SANDPOOL_DOCKER2_DIR/docker" --exec-root "$SANDPOOL_DOCKER2_EXEC_ROOT"
                --pidfile "$SANDPOOL_DOCKERD2_PIDFILE" -H "unix://$DOCKER2_SOCKET"
                --config-file "$SANDPOOL_DOCKER2_DIR/daemon.json"
                --containerd-namespace sandpool-docker2
                --containerd-plugins-namespace sandpool-docker2-plugins
                --bridge "$SANDPOOL_DOCKER2_BRIDGE" --iptables=false --ip6tables=false --ip-masq=false
                --cgroup-parent sandpool-docker2
            )
            # shellcheck disable=SC2206 # word splitting of the user's extra flags is intended
            [[ -n "${SANDPOOL_DOCKERD2_ARGS:-}" ]] && args+=(${SANDPOOL_DOCKERD2_ARGS})
            log "starting a second dockerd on $DOCKER2_SOCKET (log: $SANDPOOL_DOCKERD2_LOG)"
            echo "=== $(date -Is) dockerd ${args[*]}" >>"$SANDPOOL_DOCKERD2_LOG"
            # As in _start_dockerd: a session of its own, and as many open files as allowed.
            ( ulimit -n 1048576 2>/dev/null || true
              exec env PATH="$SANDPOOL_SHIM_DIR:$PATH" setsid dockerd "${args[@]}" </dev/null >>"$SANDPOOL_DOCKERD2_LOG" 2>&1 ) &
            launcher=$!
        else
            log "the second dockerd (pid $pid) is running but not answering yet; waiting"
            launcher="$pid"
        fi
        # setsid forks when the caller leads its process group (an interactive shell), so the
        # launcher may be gone while dockerd runs: failed only when neither lives for 2 s.
        # docker info waits while dockerd restores containers (it listens before that).
        while ((SECONDS - start < SANDPOOL_DOCKERD_WAIT)); do
            docker2_ok && break
            if _pid_running "$launcher" || [[ -n "$(_dockerd2_pid)" ]]; then
                gone=0
            elif ((++gone >= 4)); then
                tail -n 20 "$SANDPOOL_DOCKERD2_LOG" >&2 || true
                die "the second dockerd exited during startup; see $SANDPOOL_DOCKERD2_LOG"
            fi
            sleep 0.5
        done
        docker2_ok || die "the second dockerd does not answer on $DOCKER2_SOCKET after" \
            "${SANDPOOL_DOCKERD_WAIT}s; see $SANDPOOL_DOCKERD2_LOG"
        log "the second dockerd is up (pid $(_dockerd2_pid), $((SECONDS - start))s)"
    else
        changed="$(_dockerd2_config)" || die "could not write $SANDPOOL_DOCKER2_DIR/daemon.json"
        pid="$(_dockerd2_pid)"
        # Runtimes registered since it started: dockerd reloads them on SIGHUP.
        [[ "$changed" == changed && -n "$pid" ]] && kill -HUP "$pid"
    fi
    # The images, from the first dockerd: `docker load` keeps the image id, so the same id on
    # both means up to date.
    local img want have
    for img in "${images[@]}"; do
        want="$(docker image inspect -f '{{.Id}}' "$img" 2>/dev/null)" ||
            die "image $img is not on the first dockerd: build it first (build_images)"
        have="$(docker2 image inspect -f '{{.Id}}' "$img" 2>/dev/null || true)"
        [[ "$have" == "$want" ]] && continue
        log "copying image $img to the second dockerd"
        docker save "$img" | docker2 load -q >/dev/null
        have="$(docker2 image inspect -f '{{.Id}}' "$img" 2>/dev/null || true)"
        [[ "$have" == "$want" ]] || die "could not copy image $img to the second dockerd"
    done
}

# stop_dockerd2: stop the second dockerd (SIGTERM: it stops its containers first, unless it
# runs with --live-restore) and wait for it, at most 60 s.
stop_dockerd2() {
    local pid i
    pid="$(_dockerd2_pid)"
    [[ -n "$pid" ]] || return 0
    need_root "stopping the second dockerd"
    kill "$pid"
    for ((i = 0; i < 120; i++)); do
        _pid_running "$pid" || { log "the second dockerd (pid $pid) stopped"; return 0; }
        sleep 0.5
    done
    die "the second dockerd (pid $pid) did not stop within 60s"
}

# kill_dockerd2: SIGKILL to the second dockerd, and wait until it is gone.
kill_dockerd2() {
    local pid i
    pid="$(_dockerd2_pid)"
    [[ -n "$pid" ]] || die "the second dockerd is not running ($SANDPOOL_DOCKERD2_PIDFILE)"
    need_root "killing the second dockerd"
    kill -9 "$pid"
    for ((i = 0; i < 50; i++)); do
        _pid_running "$pid" || { log "killed the second dockerd (pid $pid)"; return 0; }
        sleep 0.1
    done
    die "the second dockerd (pid $pid) survived SIGKILL for 5s"
}

redis_ok() {
    [[ "$(timeout 5 redis-cli -h 127.0.0.1 -p "$SANDPOOL_REDIS_PORT" ping 2>/dev/null)" == PONG ]]
}

# ensure_redis: a throwaway Redis on 127.0.0.1:$SANDPOOL_REDIS_PORT (no persistence).
ensure_redis() {
    redis_ok && return 0
    command -v redis-server >/dev/null || die "redis-server not found (package redis-server)"
    log "starting redis-server on 127.0.0.1:$SANDPOOL_REDIS_PORT (log: $SANDPOOL_REDIS_LOG)"
    mkdir -p "$(dirname "$SANDPOOL_REDIS_LOG")"
    # AOF persistence, fsync once a second: a Redis restart loses no session (at most the
    # last second's writes); the ledger's nodes rebuild the rest from their sandboxes.
    mkdir -p "$SANDPOOL_REDIS_DIR"
    redis-server --bind 127.0.0.1 --port "$SANDPOOL_REDIS_PORT" --save '' --appendonly yes \
        --appendfsync everysec --dir "$SANDPOOL_REDIS_DIR" --daemonize yes --pidfile "$SANDPOOL_REDIS_PIDFILE" \
        --logfile "$SANDPOOL_REDIS_LOG" ||
        die "redis-server failed to start; see $SANDPOOL_REDIS_LOG"
    local i
    for ((i = 0; i < 50; i++)); do
        redis_ok && { log "redis is up"; return 0; }
        sleep 0.2
    done
    tail -n 20 "$SANDPOOL_REDIS_LOG" >&2 || true
    die "redis-server on 127.0.0.1:$SANDPOOL_REDIS_PORT does not answer PING after 10s"
}

# _cluster_ok: every node of the local cluster answers and reports every slot served.
_cluster_ok() {
    local p info
    for p in $SANDPOOL_CLUSTER_PORTS; do
        info="$(timeout 5 redis-cli -h 127.0.0.1 -p "$p" cluster info 2>/dev/null)" || return 1
        [[ "$info" == *cluster_state:ok* && "$info" == *cluster_slots_ok:16384* ]] || return 1
    done
}

# _cluster_wait SECONDS: wait (bounded) for _cluster_ok.
_cluster_wait() {
    local i
    for ((i = 0; i < $1 * 5; i++)); do
        _cluster_ok && return 0
        sleep 0.2
    done
    return 1
}

# ensure_redis_cluster: a throwaway 3-master Redis Cluster on 127.0.0.1 ports
# $SANDPOOL_CLUSTER_PORTS (no replicas; AOF under $SANDPOOL_CLUSTER_DIR/<port>), for the tests
# that run the ledger on a cluster (scripts/test). Its seeds are $SANDPOOL_CLUSTER_URL. Does
# nothing when the cluster is up and serves every slot; starts the nodes that are down (they
# rejoin from their nodes-<port>.conf); creates the cluster (redis-cli --cluster create) when
# it has never been made or cannot recover, wiping its nodes first (test data only).
ensure_redis_cluster() {
    _cluster_ok && return 0
    command -v redis-server >/dev/null || die "redis-server not found (package redis-server)"
    command -v redis-cli >/dev/null || die "redis-cli not found (package redis-tools)"
    local p dir started=0 remembered=0 seeds=()
    for p in $SANDPOOL_CLUSTER_PORTS; do
        seeds+=("127.0.0.1:$p")
        [[ "$(timeout 5 redis-cli -h 127.0.0.1 -p "$p" ping 2>/dev/null)" == PONG ]] && continue
        dir="$SANDPOOL_CLUSTER_DIR/$p"
        mkdir -p "$dir"
        [[ -s "$dir/nodes-$p.conf" ]] && remembered=1
        log "starting cluster node redis-server on 127.0.0.1:$p (log: $dir/redis.log)"
        redis-server --bind 127.0.0.1 --port "$p" --cluster-enabled yes \
            --cluster-config-file "$dir/nodes-$p.conf" --cluster-node-timeout 5000 \
            --dir "$dir" --appendonly yes --appendfsync everysec --save '' \
            --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" ||
            die "redis-server on port $p failed to start; see $dir/redis.log"
        started=1
    done
    for p in $SANDPOOL_CLUSTER_PORTS; do
        local i
        for ((i = 0; i < 50; i++)); do
            [[ "$(timeout 5 redis-cli -h 127.0.0.1 -p "$p" ping 2>/dev/null)" == PONG ]] && break
            sleep 0.2
        done
        ((i < 50)) || die "cluster node on 127.0.0.1:$p does not answer PING after 10s"
    done
    # Nodes that were restarted rejoin the cluster they remember; running nodes may be
    # finishing a failover. A first start has nothing to wait for.
    if ((remembered || !started)) && _cluster_wait 15; then
        log "redis cluster is up ($SANDPOOL_CLUSTER_URL)"
        return 0
    fi
    log "creating the redis cluster on ${seeds[*]}"
    for p in $SANDPOOL_CLUSTER_PORTS; do
        redis-cli -h 127.0.0.1 -p "$p" flushall >/dev/null 2>&1 || true
        redis-cli -h 127.0.0.1 -p "$p" cluster reset hard >/dev/null ||
            die "could not reset the cluster node on 127.0.0.1:$p"
    done
    redis-cli --cluster create "${seeds[@]}" --cluster-replicas 0 --cluster-yes >/dev/null ||
        die "redis-cli --cluster create ${seeds[*]} failed"
    _cluster_wait 30 || die "the redis cluster on ${seeds[*]} is not cluster_state:ok after 30s"
    log "redis cluster is up ($SANDPOOL_CLUSTER_URL)"
}

registry_ok() { timeout 5 curl -fsS -o /dev/null "http://$SANDPOOL_REGISTRY/v2/" 2>/dev/null; }

# ensure_registry: a local OCI registry (Debian's docker-registry, distribution 2.8) on
# $SANDPOOL_REGISTRY only, storing under $SANDPOOL_REGISTRY_DIR with deletes enabled (so a
# test can remove what it pushed; `docker-registry garbage-collect $SANDPOOL_REGISTRY_CONFIG`
# then frees the blobs). No blob descriptor cache: with one, the registry answers HEAD (200,
# empty GET) for blobs garbage-collect removed, so a push skips them and leaves images that
# cannot be pulled. Our own instance with a config we write, not the package's service
# (policy-rc.d in ensure_packages keeps its init script from starting that one). dockerd
# talks plain HTTP to registries on 127.0.0.0/8 without any daemon configuration.
# prune_test_registry [MINUTES]: forgets what test runs pushed to the local registry
# (repositories named <sptest|sptest-lazy|sdk>-<hex>, each a run's own) more than MINUTES (60)
# ago, then garbage-collects the blobs nothing refers to. Without it every lazy test run left
# ~100 MB there for good. Run it when no test pushes: a blob pushed whose manifest is not yet
# is collected too (scripts/test calls it before its tests).
prune_test_registry() {
    local minutes="${1:-60}" repos="$SANDPOOL_REGISTRY_DIR/docker/registry/v2/repositories" n=0 dir
    [[ -d "$repos" ]] || return 0
    need_root "pruning the local registry"
    while IFS= read -r -d '' dir; do
        rm -rf "$dir"
        n=$((n + 1))
    done < <(find "$repos" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended \
        -regex '.*/(sptest|sptest-lazy|sdk)-[0-9a-f]{8,}' -mmin "+$minutes" -print0)
    ((n)) || return 0
    docker-registry garbage-collect "$SANDPOOL_REGISTRY_CONFIG" >/dev/null 2>&1 \
        || warn "docker-registry garbage-collect failed; the registry keeps the blobs of $n pruned repositories"
    log "pruned $n test repositories from the local registry ($(du -sh "$SANDPOOL_REGISTRY_DIR" | cut -f1) left)"
}

ensure_registry() {
    registry_ok && return 0
    ensure_packages docker-registry
    command -v docker-registry >/dev/null || die "docker-registry not found (package docker-registry)"
    need_root "starting the local registry"
    local pid="" i secret
    [[ -r "$SANDPOOL_REGISTRY_PIDFILE" ]] && pid="$(cat "$SANDPOOL_REGISTRY_PIDFILE" 2>/dev/null || true)"
    if _pid_alive "$pid"; then
        # Ours from an earlier run that stopped answering: replace it.
        warn "the registry (pid $pid) does not answer on $SANDPOOL_REGISTRY; restarting it"
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 25; i++)); do
            _pid_alive "$pid" || break
            sleep 0.2
        done
    fi
    mkdir -p "$SANDPOOL_REGISTRY_DIR" "$(dirname "$SANDPOOL_REGISTRY_CONFIG")" \
        "$(dirname "$SANDPOOL_REGISTRY_LOG")" "$(dirname "$SANDPOOL_REGISTRY_PIDFILE")"
    # The secret signs upload state: a new one per start voids only uploads in flight.
    secret="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
    cat >"$SANDPOOL_REGISTRY_CONFIG" <<EOF
# Written by scripts/lib.sh ensure_registry: the local registry of sandpool's tests.
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $SANDPOOL_REGISTRY_DIR
  delete:
    enabled: true
http:
  addr: $SANDPOOL_REGISTRY
  secret: $secret
EOF
    log "starting docker-registry on $SANDPOOL_REGISTRY (data: $SANDPOOL_REGISTRY_DIR, log: $SANDPOOL_REGISTRY_LOG)"
    echo "=== $(date -Is) docker-registry serve $SANDPOOL_REGISTRY_CONFIG" >>"$SANDPOOL_REGISTRY_LOG"
    # setsid + nohup: a session of its own, so it outlives this script and its terminal. The
    # pid is written from inside (setsid forks when the caller leads its process group).
    rm -f "$SANDPOOL_REGISTRY_PIDFILE"
    # shellcheck disable=SC2016 # $$ and $1 are the inner shell's
    setsid nohup sh -c 'echo $$ >"$1" && exec docker-registry serve "$2"' sh \
        "$SANDPOOL_REGISTRY_PIDFILE" "$SANDPOOL_REGISTRY_CONFIG" \
        </dev/null >>"$SANDPOOL_REGISTRY_LOG" 2>&1 &
    for ((i = 0; i < 50; i++)); do
        [[ -s "$SANDPOOL_REGISTRY_PIDFILE" ]] && pid="$(cat "$SANDPOOL_REGISTRY_PIDFILE")"
        registry_ok && { log "registry is up (pid $pid)"; return 0; }
        ((i > 5)) && ! _pid_alive "$pid" && break
        sleep 0.2
    done
    tail -n 20 "$SANDPOOL_REGISTRY_LOG" >&2 || true
    if ! _pid_alive "$pid"; then
        rm -f "$SANDPOOL_REGISTRY_PIDFILE"
        die "docker-registry exited at startup; see $SANDPOOL_REGISTRY_LOG"
    fi
    die "docker-registry on $SANDPOOL_REGISTRY does not answer /v2/ after 10s; see $SANDPOOL_REGISTRY_LOG"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# build_busybox_image: sandpool/busybox:latest from images/busybox/Dockerfile and Debian's
# static busybox. Rebuilt only when missing, when the Dockerfile or busybox binary changed
# (tracked by a content-hash label), or with FORCE=1. Never pulls anything.
build_busybox_image() {
    local dockerfile="$SANDPOOL_ROOT/images/busybox/Dockerfile" bb
    [[ -f "$dockerfile" ]] || die "missing $dockerfile"
    pkg_installed busybox-static || ensure_packages busybox-static
    bb="$(dpkg-query -L busybox-static | grep -E '/s?bin/busybox$' | head -n1)"
    [[ -x "$bb" ]] || die "static busybox binary not found (package busybox-static)"

    local hash current=""
    hash="$(cat "$dockerfile" "$bb" | sha256sum | cut -c1-16)"
    if image_exists "$SANDPOOL_BUSYBOX_IMAGE"; then
        current="$(docker image inspect -f '{{ index .Config.Labels "sandpool.build-hash" }}' \
            "$SANDPOOL_BUSYBOX_IMAGE" 2>/dev/null || true)"
    fi
    if [[ "$current" == "$hash" && "${FORCE:-0}" != 1 ]]; then
        log "image $SANDPOOL_BUSYBOX_IMAGE is up to date"
        return 0
    fi

    local ctx start old_id
    start=$SECONDS
    old_id="$(docker image inspect -f '{{.Id}}' "$SANDPOOL_BUSYBOX_IMAGE" 2>/dev/null || true)"
    ctx="$(mktemp -d "${TMPDIR:-/tmp}/sandpool-busybox.XXXXXX")"
    cp "$dockerfile" "$ctx/Dockerfile"
    cp "$bb" "$ctx/busybox"
    log "building $SANDPOOL_BUSYBOX_IMAGE from $bb"
    # The classic builder: it needs no buildx plugin and FROM scratch needs nothing pulled.
    local out rc=0
    out="$(DOCKER_BUILDKIT=0 docker build --no-cache --label "sandpool.build-hash=$hash" \
        -t "$SANDPOOL_BUSYBOX_IMAGE" "$ctx" 2>&1)" || rc=$?
    rm -rf "$ctx"
    if ((rc != 0)); then
        printf '%s\n' "$out" >&2
        die "docker build of $SANDPOOL_BUSYBOX_IMAGE failed"
    fi
    # Drop the replaced image (fails harmlessly while containers still use it).
    if [[ -n "$old_id" ]]; then
        docker rmi "$old_id" >/dev/null 2>&1 || true
    fi
    log "built $SANDPOOL_BUSYBOX_IMAGE in $((SECONDS - start))s"
}

# build_bash_image: sandpool/bash:latest, the busybox image plus Debian's static bash
# (images/bash/Dockerfile). Rebuilt when the Dockerfile, bash or the busybox image changed.
build_bash_image() {
    local dockerfile="$SANDPOOL_ROOT/images/bash/Dockerfile" bash hash current="" ctx out rc=0
    pkg_installed bash-static || ensure_packages bash-static
    bash="$(dpkg-query -L bash-static | grep -E '/s?bin/bash-static$' | head -n1)"
    [[ -x "$bash" ]] || die "static bash binary not found (package bash-static)"
    hash="$( (cat "$dockerfile" "$bash"; docker image inspect -f '{{.Id}}' "$SANDPOOL_BUSYBOX_IMAGE") | sha256sum | cut -c1-16)"
    if image_exists "$SANDPOOL_BASH_IMAGE"; then
        current="$(docker image inspect -f '{{ index .Config.Labels "sandpool.build-hash" }}' \
            "$SANDPOOL_BASH_IMAGE" 2>/dev/null || true)"
    fi
    if [[ "$current" == "$hash" && "${FORCE:-0}" != 1 ]]; then
        log "image $SANDPOOL_BASH_IMAGE is up to date"
        return 0
    fi
    ctx="$(mktemp -d "${TMPDIR:-/tmp}/sandpool-bash.XXXXXX")"
    cp "$dockerfile" "$ctx/Dockerfile"
    cp "$bash" "$ctx/bash"
    out="$(DOCKER_BUILDKIT=0 docker build --no-cache --label "sandpool.build-hash=$hash" \
        --build-arg "BASE=$SANDPOOL_BUSYBOX_IMAGE" -t "$SANDPOOL_BASH_IMAGE" "$ctx" 2>&1)" || rc=$?
    rm -rf "$ctx"
    if ((rc != 0)); then
        printf '%s\n' "$out" >&2
        die "docker build of $SANDPOOL_BASH_IMAGE failed"
    fi
    log "built $SANDPOOL_BASH_IMAGE"
}

# ensure_python_sdk: what the Python tests need. The SDK's: a python3 that makes virtual
# environments (`python3 -m venv`, with pip in them: Debian's python3-venv); they install the
# SDK and its dependencies from PyPI into fresh venvs of their own, as a user does
# (sandpool/tests/python_sdk.rs, readme.rs), never relying on PYTHONPATH. The runtime's: pytest.
ensure_python_sdk() {
    command -v python3 >/dev/null 2>&1 || ensure_packages python3
    local probe
    probe="$(mktemp -d "${TMPDIR:-/tmp}/sandpool-venv.XXXXXX")"
    if ! python3 -m venv "$probe/v" >/dev/null 2>&1; then
        ensure_packages python3-venv
        rm -rf "$probe/v"
        python3 -m venv "$probe/v" >/dev/null 2>&1 || { rm -rf "$probe"; die "python3 -m venv fails even with python3-venv"; }
    fi
    rm -rf "$probe"
    # The function runtime's own tests (sandpool/tests/runtime_py.rs) run pytest on the system
    # python3: the runtime is stdlib-only, as it runs inside sandboxes.
    python3 -c 'import pytest' >/dev/null 2>&1 && return 0
    python3 -m pip --version >/dev/null 2>&1 || ensure_packages python3-pip
    log "installing pytest for the function runtime's tests"
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore 'pytest>=7' \
        || python3 -m pip install -q --disable-pip-version-check --break-system-packages 'pytest>=7' \
        || die "pip install of pytest failed"
}

# build_debian_image: sandpool/debian:bookworm with debootstrap (minutes; cached).
build_debian_image() {
    "$SANDPOOL_ROOT/images/debian/build.sh"
}

# The image of sandpool itself (images/sandpool/Dockerfile), for compose, systemd and Kubernetes.
SANDPOOL_IMAGE="${SANDPOOL_IMAGE:-sandpool/sandpool:latest}"

# build_sandpool_image BIN [TAG]: the sandpool image from the binary BIN (stripped: the image
# needs no debug info) and config/sandpool.toml, on the project's Debian base. Rebuilt only
# when the Dockerfile, the binary, the config or the base changed (a content-hash label), or
# with FORCE=1. The only network it uses is Debian's mirror (apt in the Dockerfile).
build_sandpool_image() {
    local bin="$1" tag="${2:-$SANDPOOL_IMAGE}" dockerfile="$SANDPOOL_ROOT/images/sandpool/Dockerfile"
    local config="$SANDPOOL_ROOT/config/sandpool.toml" hash current="" ctx out rc=0 start=$SECONDS base_id old_id
    [[ -x "$bin" ]] || die "build_sandpool_image: no sandpool binary at $bin (cargo build -p sandpool)"
    image_exists "$SANDPOOL_DEBIAN_IMAGE" || build_debian_image
    pkg_installed binutils || ensure_packages binutils
    base_id="$(docker image inspect -f '{{.Id}}' "$SANDPOOL_DEBIAN_IMAGE")"
    hash="$({ cat "$dockerfile" "$bin" "$config"; echo "$base_id"; } | sha256sum | cut -c1-16)"
    if image_exists "$tag"; then
        current="$(docker image inspect -f '{{ index .Config.Labels "sandpool.build-hash" }}' "$tag" 2>/dev/null || true)"
    fi
    if [[ "$current" == "$hash" && "${FORCE:-0}" != 1 ]]; then
        log "image $tag is up to date"
        return 0
    fi
    old_id="$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)"
    ctx="$(mktemp -d "${TMPDIR:-/tmp}/sandpool-image.XXXXXX")"
    cp "$dockerfile" "$ctx/Dockerfile"
    cp "$config" "$ctx/sandpool.toml"
    strip -o "$ctx/sandpool" "$bin"
    log "building $tag from $bin on $SANDPOOL_DEBIAN_IMAGE"
    out="$(DOCKER_BUILDKIT=0 docker build --label "sandpool.build-hash=$hash" \
        --build-arg "BASE=$SANDPOOL_DEBIAN_IMAGE" -t "$tag" "$ctx" 2>&1)" || rc=$?
    rm -rf "$ctx"
    if ((rc != 0)); then
        printf '%s\n' "$out" >&2
        die "docker build of $tag failed"
    fi
    # Drop the replaced image (fails harmlessly while containers still use it).
    if [[ -n "$old_id" ]]; then
        docker rmi "$old_id" >/dev/null 2>&1 || true
    fi
    log "built $tag in $((SECONDS - start))s"
}

# ensure_compose: Debian's docker-compose (v1, Python), for deploy/compose.yml and its test
# (tests/tests/it/deploy.rs). `docker compose` (v2) runs the same file where it is installed.
ensure_compose() {
    command -v docker-compose >/dev/null || ensure_packages docker-compose
}

# build_images [busybox] [bash] [debian]: default busybox only.
build_images() {
    local what=("$@") w
    ((${#what[@]})) || what=(busybox)
    for w in "${what[@]}"; do
        case "$w" in
        busybox) build_busybox_image ;;
        bash) build_busybox_image && build_bash_image ;;
        debian) build_debian_image ;;
        *) die "build_images: unknown image '$w'" ;;
        esac
    done
}

# ensure_rust [build] [fmt] [clippy]: cargo on PATH (edition 2024 needs >= 1.85), plus rustfmt
# and clippy when asked.
ensure_rust() {
    command -v cargo >/dev/null ||
        die "cargo not found: install Rust (rustup, stable >= 1.85) and put ~/.cargo/bin on PATH"
    local c
    for c in "$@"; do
        case "$c" in
        fmt) cargo fmt --version >/dev/null 2>&1 ||
            die "rustfmt missing: rustup component add rustfmt" ;;
        clippy) cargo clippy --version >/dev/null 2>&1 ||
            die "clippy missing: rustup component add clippy" ;;
        esac
    done
}
