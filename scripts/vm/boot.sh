#!/bin/bash
# boot.sh KERNEL_DIR OUT_DIR TIMEOUT_S
# Boot one kernel of the VM matrix (fetch-kernel.sh's directory) in QEMU with a busybox
# initramfs (init.sh + the kernel's modules), the host's root shared read-only over 9p and
# OUT_DIR (holding guest.sh and vm.env) writable. The serial console goes to OUT_DIR/serial.log.
# TCG by default (-accel tcg,thread=single -cpu max; single: docs/kernel-matrix.md): on this kind of machine /dev/kvm is a software-nested
# KVM under which a guest kernel crawls. NANTRACE_VM_ACCEL=kvm uses KVM.
# The VM cluster (`cargo xtask vm-cluster`) adds a NIC and a shared directory: NANTRACE_VM_NIC
# ("tap-name,mac") puts the guest on that tap (run inside the cluster's network namespace),
# NANTRACE_VM_SHARED a directory every node mounts writable (9p tag `shared`).
set -euo pipefail
K=$1 OUT=$2 TIMEOUT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
R=$(mktemp -d "${TMPDIR:-/tmp}/ntvm-root.XXXXXX")
trap 'rm -rf "$R"' EXIT
mkdir -p "$R"/{bin,sbin,dev,proc,sys,tmp,mod}
cp /bin/busybox "$R/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$R/bin/$a" ] || ln -s busybox "$R/bin/$a"; done
cp "$HERE/init.sh" "$R/init"; chmod +x "$R/init"
cp "$K/modules.order" "$R/modules.order"
[ -d "$K/mod" ] && cp "$K"/mod/*.ko "$R/mod/" 2>/dev/null || true
(cd "$R" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > "$OUT/initramfs.cpio"
case ${NANTRACE_VM_ACCEL:-tcg} in
  kvm) ACCEL=(-enable-kvm -cpu host,-arch-capabilities) ;;
  *) ACCEL=(-accel "tcg,thread=${NANTRACE_VM_TCG_THREAD:-single}" -cpu max) ;;
esac
EXTRA=(-nic none)
if [ -n "${NANTRACE_VM_NIC:-}" ]; then
  EXTRA=(-netdev "tap,id=n0,ifname=${NANTRACE_VM_NIC%%,*},script=no,downscript=no" -device "virtio-net-pci,netdev=n0,mac=${NANTRACE_VM_NIC#*,}")
fi
[ -n "${NANTRACE_VM_SHARED:-}" ] && EXTRA+=(-virtfs "local,path=$NANTRACE_VM_SHARED,mount_tag=shared,security_model=none,multidevs=remap")
rc=0
timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 "${ACCEL[@]}" -smp "${NANTRACE_VM_SMP:-2}" -m "${NANTRACE_VM_MEM:-2048}" \
  "${EXTRA[@]}" -nographic -no-reboot -kernel "$K/vmlinuz" -initrd "$OUT/initramfs.cpio" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$OUT",mount_tag=out,security_model=none,multidevs=remap \
  -append "console=ttyS0 panic=-1 rdinit=/init quiet" </dev/null > "$OUT/serial.log" 2>&1 || rc=$?
rm -f "$OUT/initramfs.cpio"
exit $rc
