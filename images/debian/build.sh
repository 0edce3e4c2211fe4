#!/usr/bin/env bash
# Builds sandpool/debian:bookworm: a debootstrapped Debian 12 (minbase + python3 +
# ca-certificates) imported as a single-layer image, for realistic episodes.
# Takes a few minutes (needs deb.debian.org). Skipped when the image exists, unless FORCE=1.
#
#   images/debian/build.sh            # build if missing
#   FORCE=1 images/debian/build.sh    # rebuild
#   DEBIAN_MIRROR=http://my.mirror/debian images/debian/build.sh
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../scripts/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/lib.sh"

IMAGE="$SANDPOOL_DEBIAN_IMAGE"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
INCLUDE="${DEBIAN_INCLUDE:-python3,ca-certificates}"

ensure_packages docker.io ca-certificates
ensure_dockerd
if image_exists "$IMAGE" && [[ "${FORCE:-0}" != 1 ]]; then
    log "image $IMAGE exists (FORCE=1 to rebuild)"
    exit 0
fi
need_root "debootstrap"
ensure_packages debootstrap debian-archive-keyring gpgv

start=$SECONDS
work="$(mktemp -d /var/tmp/sandpool-debian.XXXXXX)"
rootfs="$work/rootfs"
cleanup() {
    # debootstrap mounts proc/sys inside the target; never rm -rf through a live mount.
    local m
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$work/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r)
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

log "debootstrap $SUITE ($MIRROR, minbase + $INCLUDE) into $rootfs (log: $work/debootstrap.log)"
if ! debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" "$MIRROR" \
    >"$work/debootstrap.log" 2>&1; then
    tail -n 40 "$work/debootstrap.log" >&2
    [[ -f "$rootfs/debootstrap/debootstrap.log" ]] && tail -n 40 "$rootfs/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
fi
log "debootstrap done in $((SECONDS - start))s; cleaning"

# Slim it down: package lists and caches, logs, docs/man pages (copyright files kept).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/archives/partial/* \
    "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/lintian \
    "$rootfs"/tmp/* "$rootfs"/var/tmp/* "$rootfs"/debootstrap
find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
find "$rootfs/var/log" -type f -delete
# Docker bind-mounts these per container; don't ship the build host's.
for f in etc/hostname etc/hosts etc/resolv.conf; do
    rm -f "${rootfs:?}/$f"
    : >"$rootfs/$f"
done
rm -f "$rootfs/etc/machine-id" "$rootfs/var/lib/dbus/machine-id"
# Keep apt usable (with a network) inside the image: the full set of bookworm sources.
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
SOURCES
# The image is for containers: no services may start inside it on package install.
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 755 "$rootfs/usr/sbin/policy-rc.d"
install -d -m 0777 "$rootfs/work"
# The unprivileged user tenant code runs as (templates' default `user = "1000"`), named so
# `whoami` and `~` work; its home is the workdir, as the agent sets HOME.
echo 'sandbox:x:1000:1000:sandbox:/work:/bin/bash' >>"$rootfs/etc/passwd"
echo 'sandbox:x:1000:' >>"$rootfs/etc/group"
echo 'sandbox:!:19000::::::' >>"$rootfs/etc/shadow"
chmod 1777 "$rootfs/tmp" "$rootfs/var/tmp"

log "importing into $IMAGE ($(du -sh --one-file-system "$rootfs" | cut -f1) on disk)"
old_id="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
tar --numeric-owner --xattrs -C "$rootfs" -c . |
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV DEBIAN_FRONTEND=noninteractive' \
        --change 'LABEL sandpool.image=debian-bookworm' \
        --change 'WORKDIR /work' \
        --change 'CMD ["/bin/bash"]' \
        --message "sandpool: debootstrap $SUITE minbase + $INCLUDE" \
        - "$IMAGE" >/dev/null
if [[ -n "$old_id" && "$old_id" != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]]; then
    docker rmi "$old_id" >/dev/null 2>&1 || true
fi
log "built $IMAGE in $((SECONDS - start))s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
