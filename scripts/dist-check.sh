#!/bin/bash
# Check a `cargo xtask dist` tarball (run as root; `cargo xtask dist --check-old-glibc` calls it):
#   0. unpack it; install.sh into a scratch DESTDIR, twice (modes; an existing agent.toml kept);
#      `systemd-analyze verify` on the installed unit where systemd-analyze exists;
#   1. its bin/nantrace on an old-glibc userland: a Debian bullseye (glibc 2.31, like Ubuntu 20.04) minbase
#      chroot made by debootstrap, cached under target/dist-test/bullseye: `nantrace --version`,
#      `nantrace doctor`, `nantrace snapshot` (no NVIDIA driver there: a clean "NVML unavailable");
#   2. on this host: `nantrace doctor` and `nantrace watch --json --duration 3` (the embedded
#      eBPF object loads, its probes attach, an event comes through);
#   3. the same watch, and `snapshot --pid` of another user's process, with only the unit's
#      CapabilityBoundingSet and no_new_privs (setpriv).
#
#   scripts/dist-check.sh target/dist/nantrace-VERSION-x86_64-linux-gnu.tar.gz
#
# /proc, /sys and /dev are mounted into the chroot for the duration only; a trap unmounts them
# on every exit path (success, failure, Ctrl-C), and the script fails if any mount is left.
#
# Environment:
#   NANTRACE_DIST_CHROOT   chroot dir (default <repo>/target/dist-test/bullseye)
#   NANTRACE_DEBIAN_MIRROR Debian mirror (default: the one apt uses here, else deb.debian.org)
#   NANTRACE_DIST_SUITE    default bullseye
set -euo pipefail

TARBALL=${1:?usage: $0 TARBALL}
TARBALL=$(realpath "$TARBALL")
REPO=$(cd "$(dirname "$0")/.." && pwd)
SUITE=${NANTRACE_DIST_SUITE:-bullseye}
ROOTFS=${NANTRACE_DIST_CHROOT:-$REPO/target/dist-test/$SUITE}
LOGS=$REPO/target/dist-test/logs
FAILED=0

say() { echo "dist-check: $*" >&2; }
fail() { say "FAIL: $*"; FAILED=1; }

# Run one command, keep its output in $LOGS/NAME.{out,err}, print it, fail on a crash.
# SHOW=bytes limits what is printed (default 3000).
check() {
    local name=$1; shift
    local rc=0
    echo "---- $name: $*" >&2
    "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err" || rc=$?
    head -c "${SHOW:-3000}" "$LOGS/$name.out" >&2; head -c 2000 "$LOGS/$name.err" >&2
    [ "$(stat -c %s "$LOGS/$name.out")" -le "${SHOW:-3000}" ] || echo "[... $(stat -c %s "$LOGS/$name.out") bytes: $LOGS/$name.out]" >&2
    echo "---- $name: exit $rc" >&2
    if grep -q "panicked at\|RUST_BACKTRACE\|Segmentation fault\|GLIBC_[0-9.]* not found" "$LOGS/$name.out" "$LOGS/$name.err"; then
        fail "$name crashed"
    elif [ "$rc" != 0 ]; then
        fail "$name exited $rc"
    fi
}

[ "$(id -u)" = 0 ] || { say "must run as root (debootstrap, chroot, mounts, eBPF)"; exit 2; }
[ -f "$TARBALL" ] || { say "$TARBALL does not exist"; exit 2; }

# Mount points under a directory, deepest first (from /proc/self/mounts; octal escapes decoded).
mounts_under() {
    local dir
    dir=$(realpath -m "$1")
    awk '{ print $2 }' /proc/self/mounts | while read -r m; do
        m=$(printf '%b' "$m")
        case "$m" in "$dir" | "$dir"/*) echo "$m" ;; esac
    done | awk '{ print length, $0 }' | sort -rn | cut -d' ' -f2-
}

unmount_all() {
    local dir=$1 m
    for m in $(mounts_under "$dir"); do
        umount "$m" 2>/dev/null || umount -l "$m" || say "could not unmount $m"
    done
    if [ -n "$(mounts_under "$dir")" ]; then
        say "mounts left under $dir:"; mounts_under "$dir" >&2
        return 1
    fi
}

cleanup() {
    local rc=$?
    if [ -d "$ROOTFS" ] && ! unmount_all "$ROOTFS"; then
        rc=1
    fi
    [ -d "$ROOTFS.partial" ] && { unmount_all "$ROOTFS.partial" || rc=1; }
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mirror() {
    if [ -n "${NANTRACE_DEBIAN_MIRROR:-}" ]; then echo "$NANTRACE_DEBIAN_MIRROR"; return; fi
    # deb822 "URIs:" lines and one-line "deb URI suite ..." entries; the main archive, not -security.
    local m
    m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -nE 's/^URIs:[[:space:]]*//p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' \
        | tr ' ' '\n' | grep -E '^https?://[^ ]*/debian/?$' | head -1 || true)
    echo "${m:-http://deb.debian.org/debian}"
}

# 0. The tarball and install.sh.
mkdir -p "$LOGS"
UNPACK=$REPO/target/dist-test/unpack
rm -rf --one-file-system "$UNPACK"
mkdir -p "$UNPACK"
tar -xzf "$TARBALL" -C "$UNPACK"
TOP=$(find "$UNPACK" -mindepth 1 -maxdepth 1 -type d)
BIN=$TOP/bin/nantrace
[ -x "$BIN" ] || { say "the tarball has no executable bin/nantrace"; exit 1; }
echo "==== tarball $(basename "$TARBALL")" >&2
(cd "$UNPACK" && find . -type f -printf '%m %10s %p\n' | sort -k3) >&2

DEST=$UNPACK/destdir
check install-1 env DESTDIR="$DEST" "$TOP/install.sh"
mode() { stat -c %a "$1" 2>/dev/null || echo missing; }
[ "$(mode "$DEST/usr/local/bin/nantrace")" = 755 ] || fail "install.sh: /usr/local/bin/nantrace is $(mode "$DEST/usr/local/bin/nantrace"), not 755"
[ "$(mode "$DEST/etc/systemd/system/nantrace-agent.service")" = 644 ] || fail "install.sh: the unit is not 644"
if [ -f "$TOP/etc/nantrace/agent.toml" ]; then
    [ "$(mode "$DEST/etc/nantrace/agent.toml")" = 600 ] || fail "install.sh: agent.toml is not 600"
fi
grep -q "systemctl daemon-reload && systemctl enable --now nantrace-agent" "$LOGS/install-1.out" || fail "install.sh does not say how to enable the agent"
# A second run must keep an agent.toml the admin wrote.
mkdir -p "$DEST/etc/nantrace" && echo "# the admin's own" >"$DEST/etc/nantrace/agent.toml"
check install-2 env DESTDIR="$DEST" "$TOP/install.sh"
grep -q "the admin's own" "$DEST/etc/nantrace/agent.toml" || fail "install.sh overwrote an existing agent.toml"
if command -v systemd-analyze >/dev/null; then
    # verify wants ExecStart's binary at its real path: check a copy of the unit pointing at the DESTDIR one.
    sed "s|ExecStart=/usr/local/bin/nantrace|ExecStart=$DEST/usr/local/bin/nantrace|" \
        "$DEST/etc/systemd/system/nantrace-agent.service" >"$UNPACK/nantrace-agent.service"
    check unit-verify systemd-analyze verify "$UNPACK/nantrace-agent.service"
    systemd-analyze security --offline=true "$UNPACK/nantrace-agent.service" >"$LOGS/unit-security.out" 2>&1 || true
    say "systemd-analyze security: $(grep -o 'Overall exposure level.*' "$LOGS/unit-security.out" || echo '(no score)')"
fi

# 1. The chroot, made once. debootstrap into .partial, renamed when complete, so an interrupted
#    run is redone rather than used.
if [ ! -f "$ROOTFS/.nantrace-debootstrap-ok" ]; then
    command -v debootstrap >/dev/null || apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends debootstrap >&2
    if [ -e "$ROOTFS.partial" ]; then
        unmount_all "$ROOTFS.partial"
        rm -rf --one-file-system "$ROOTFS.partial"
    fi
    [ -e "$ROOTFS" ] && { unmount_all "$ROOTFS"; rm -rf --one-file-system "$ROOTFS"; }
    MIRROR=$(mirror)
    say "debootstrap --variant=minbase $SUITE from $MIRROR into $ROOTFS (once; cached)"
    t0=$(date +%s)
    mkdir -p "$(dirname "$ROOTFS")"
    if ! debootstrap --variant=minbase "$SUITE" "$ROOTFS.partial" "$MIRROR" >"$LOGS/debootstrap.log" 2>&1; then
        tail -20 "$LOGS/debootstrap.log" >&2
        say "debootstrap failed (log: $LOGS/debootstrap.log)"
        exit 1
    fi
    unmount_all "$ROOTFS.partial"   # debootstrap may leave its own /proc mount behind
    mv "$ROOTFS.partial" "$ROOTFS"
    touch "$ROOTFS/.nantrace-debootstrap-ok"
    say "debootstrap took $(( $(date +%s) - t0 )) s"
else
    say "using the cached $SUITE chroot $ROOTFS"
fi

install -m 0755 "$BIN" "$ROOTFS/usr/local/bin/nantrace"

unmount_all "$ROOTFS"   # what a SIGKILLed run left behind
mount -t proc proc "$ROOTFS/proc"
# rbind brings tracefs/debugfs/cgroup/BTF with /sys; rslave at once, so that unmounting here
# never propagates back to the host's mounts.
mount --rbind /sys "$ROOTFS/sys"
mount --make-rslave "$ROOTFS/sys"
mount --rbind /dev "$ROOTFS/dev"
mount --make-rslave "$ROOTFS/dev"

inchroot() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root TERM=dumb "$@"; }

echo "==== on $SUITE: $(inchroot ldd --version | head -1)" >&2
check chroot-ldd inchroot ldd /usr/local/bin/nantrace
check chroot-version inchroot nantrace --version
check chroot-doctor inchroot nantrace doctor
grep -q "^probes built  yes" "$LOGS/chroot-doctor.out" || fail "chroot doctor: the binary has no probes"
grep -q " attached " "$LOGS/chroot-doctor.out" || fail "chroot doctor: no probe attached"
SHOW=300 check chroot-snapshot inchroot nantrace snapshot
grep -q '"available": false' "$LOGS/chroot-snapshot.out" && grep -q 'NVML unavailable' "$LOGS/chroot-snapshot.out" \
    || fail "chroot snapshot: expected gpu.available=false with an 'NVML unavailable' reason"

unmount_all "$ROOTFS"

echo "==== on this host: $(ldd --version | head -1)" >&2
check host-doctor "$BIN" doctor
grep -q "^probes built  yes" "$LOGS/host-doctor.out" || fail "host doctor: the binary has no probes"
grep -q " attached " "$LOGS/host-doctor.out" || fail "host doctor: no probe attached"
# An exit with a non-zero code during the watch: an event must come through.
(sleep 1; /bin/false) &
SHOW=0 check host-watch timeout 20 "$BIN" watch --json --duration 3
grep '"comm":"false"' "$LOGS/host-watch.out" | head -1 >&2 || true
tail -1 "$LOGS/host-watch.out" | cut -c1-400 >&2
tail -1 "$LOGS/host-watch.out" | grep -q '"probes_attached":\["' || fail "host watch: no probes_attached in the accounting line"
grep -q '"comm":"false"' "$LOGS/host-watch.out" || fail "host watch: the exit of /bin/false was not seen"

# 3. The unit's CapabilityBoundingSet and NoNewPrivileges, applied with setpriv: root's
#    permitted set after execve is the bounding set, as under systemd. Probes load, an event
#    arrives, and another user's process environment is readable (CAP_SYS_PTRACE).
UNIT=$TOP/lib/systemd/system/nantrace-agent.service
CAPS=$(sed -n 's/^CapabilityBoundingSet=//p' "$UNIT" | tr ' ' '\n' | sed -n 's/^CAP_\(.*\)/+\L\1/p' | paste -sd,)
asunit() { setpriv --bounding-set "-all,$CAPS" --inh-caps=-all --no-new-privs -- "$@"; }
echo "==== with the unit's capabilities only: $CAPS, no_new_privs" >&2
(sleep 1; /bin/false) &
SHOW=0 check unit-watch asunit timeout 20 "$BIN" watch --json --duration 3
tail -1 "$LOGS/unit-watch.out" | cut -c1-400 >&2
grep -q '"comm":"false"' "$LOGS/unit-watch.out" || fail "unit caps: watch saw no event"
setpriv --reuid=65534 --regid=65534 --clear-groups env -i NCCL_DEBUG=INFO CUDA_VISIBLE_DEVICES=0 sleep 30 &
JOB=$!
sleep 0.5
SHOW=0 check unit-snapshot asunit "$BIN" snapshot --pid "$JOB"
kill "$JOB" 2>/dev/null || true
grep -m1 -B1 -A1 '"NCCL_DEBUG"' "$LOGS/unit-snapshot.out" >&2 || fail "unit caps: the environment of a process of another user (nobody) was not read"
wait

if [ "$FAILED" != 0 ]; then
    say "FAILED (logs: $LOGS)"
    exit 1
fi
say "OK: install.sh; runs on $SUITE's glibc; probes load on this host, also with the unit's capabilities only (logs: $LOGS)"
