#!/bin/sh
# The guest's /init (busybox) for `cargo xtask vm-test`: load the modules the tests need, mount
# the host's root read-only over 9p and the run's output directory writable, then run the
# second stage (guest.sh, from the output directory) chrooted into the host's root, so the
# guest runs the very binaries and tools the host built and uses. Powers off at the end.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
UP=$(cut -d' ' -f1 /proc/uptime)
echo "NTVM: init at $UP s, kernel $(uname -r)"
while read -r m; do
  [ -n "$m" ] && { insmod "/mod/$m" 2>/tmp/insmod.err || echo "NTVM: insmod $m: $(cat /tmp/insmod.err)"; }
done < /modules.order
H=/host
mkdir -p $H
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot $H || { echo "NTVM: FAILED to mount the host's root"; poweroff -f; }
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 out $H/mnt || { echo "NTVM: FAILED to mount the output directory"; poweroff -f; }
echo "$UP" > $H/mnt/boot_to_init_s
# A checkout under a directory the guest covers with a tmpfs below (CI may clone into /tmp):
# a second view of the host's root is kept (a bind, before the tmpfs covers it), and the
# checkout is bound back in place from there, read-only as the rest.
REPO=$(sed -n 's/^REPO=//p' $H/mnt/vm.env)
case $REPO in
  /tmp/*|/run/*|/root/*|/var/tmp/*|/var/lib/*) mkdir -p /hostro && mount --bind $H /hostro || echo "NTVM: FAILED to keep a view of $REPO" ;;
esac
mount -t proc proc $H/proc
mount -t sysfs sysfs $H/sys
mount -t devtmpfs devtmpfs $H/dev
mkdir -p $H/dev/pts $H/dev/shm 2>/dev/null
mount -t devpts devpts $H/dev/pts
mount -t tmpfs tmpfs $H/dev/shm
mount -t tmpfs tmpfs $H/tmp
mount -t tmpfs tmpfs $H/run
mount -t tmpfs tmpfs $H/root
mount -t tmpfs tmpfs $H/var/tmp
mount -t tmpfs tmpfs $H/var/lib 2>/dev/null
if [ -d /hostro ]; then
  mkdir -p $H$REPO && mount --bind /hostro$REPO $H$REPO || echo "NTVM: FAILED to bind the checkout $REPO"
fi
mount -t tracefs tracefs $H/sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs $H/sys/kernel/debug 2>/dev/null
mount -t bpf bpf $H/sys/fs/bpf 2>/dev/null
mount -t cgroup2 cgroup2 $H/sys/fs/cgroup 2>/dev/null
hostname ntvm
chroot $H /bin/bash /mnt/guest.sh
echo "NTVM: guest.sh exited $?"
sync
umount $H/mnt 2>/dev/null
poweroff -f
