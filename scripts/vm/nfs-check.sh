#!/bin/bash
# nfs-check.sh TEST_BINARY TEST_NAME...
# In a guest of `cargo xtask vm-nfs` (scripts/vm/nfs-guest.sh; any guest booted as the VM
# harness boots them, with the nfsd and nfsv4 modules loaded), as root: the kernel's own
# NFS server exporting a tmpfs, two `nosharecache` NFSv4.2 mounts of that one export (two
# superblocks: two dentry, attribute and directory caches, as two machines have), then the
# job directory's NFS tests (`agent::jobdir::tests::nfs_*`, ignored on the host) of the unit
# test binary, exactly the names given, with the two mounts' job directories in
# NANTRACE_NFS_JOB_DIRS and the server's own view of the export in NANTRACE_NFS_SERVER_DIR.
#
# No nfs-utils: the host has none (its package's services would start on a host kernel
# without nfsd), and the guest runs the host's root. The server is set up through
# /proc/fs/nfsd (versions, lease and grace times, port, threads; the 10-s grace period is
# waited out) and the export through the kernel's export caches (/proc/net/rpc/*/channel:
# the client's address to a domain, the export, the root filehandle's fsid 0 to its path),
# which is what exportfs and rpc.mountd would write, with no expiry within the run; mounts
# by util-linux `mount -i` with the address given, as mount.nfs would pass it. NFSv4 only:
# no rpcbind, lockd or mountd. Every step that fails ends the script with its reason (rc 3): an
# NFS that cannot be set up is a failure, never a skip.
set -u
BIN=$1; shift
E=/run/ntnfs
say() { echo "nfs-check: $*"; }
die() { say "SETUP FAILED: $*"; dmesg | grep -iE 'nfs|rpc|svc' | tail -20; exit 3; }
step() { "$@" 2>&1 || die "$*"; }
t0=$(cut -d' ' -f1 /proc/uptime)
mkdir -p $E/export $E/a $E/b
step mount -t tmpfs -o mode=0755,size=64m ntnfs-export $E/export
step mkdir -m 0755 $E/export/jobs
grep -q nfsd /proc/filesystems || die "no nfsd filesystem (module nfsd not loaded)"
grep -q 'nfs4$' /proc/filesystems || die "no nfs4 filesystem (module nfsv4 not loaded)"
mountpoint -q /proc/fs/nfsd || step mount -t nfsd nfsd /proc/fs/nfsd
ip link set lo up
# Before the server exists: only NFSv4 (no lockd, no rpcbind), the shortest lease and grace.
echo "-2 -3 +4 +4.1 +4.2" > /proc/fs/nfsd/versions || die "writing /proc/fs/nfsd/versions"
echo 10 > /proc/fs/nfsd/nfsv4leasetime || die "writing nfsv4leasetime"
echo 10 > /proc/fs/nfsd/nfsv4gracetime || die "writing nfsv4gracetime"
# The export: 127.0.0.1 is domain ntnfs; ntnfs may mount the tmpfs read-write, root not
# squashed (the agents are root on the job directory), no subtree check, fsid 0 (a tmpfs has
# no device to name it; fsid 0 is also NFSv4's root). Flags: NFSEXP_NOSUBTREECHECK 0x400 |
# NFSEXP_FSID 0x2000; anonymous uid and gid 65534.
FOREVER=2147483647
echo "nfsd 127.0.0.1 $FOREVER ntnfs" > /proc/net/rpc/auth.unix.ip/channel || die "auth.unix.ip"
echo "ntnfs $E/export $FOREVER $((0x400 | 0x2000)) 65534 65534 0" > /proc/net/rpc/nfsd.export/channel || die "nfsd.export"
printf 'ntnfs 1 \\x00000000 %s %s\n' $FOREVER $E/export > /proc/net/rpc/nfsd.fh/channel || die "nfsd.fh"
echo "tcp 2049" > /proc/fs/nfsd/portlist || die "portlist (tcp 2049)"
echo 4 > /proc/fs/nfsd/threads || die "threads"
say "server: versions $(cat /proc/fs/nfsd/versions), $(cat /proc/fs/nfsd/threads) threads, ports $(tr '\n' ' ' < /proc/fs/nfsd/portlist)"
for m in a b; do
  # The defaults otherwise (hard, lookupcache=all, the attribute cache's 3-60 s): as a site
  # mounts its shared filesystem.
  step timeout 60 mount -i -t nfs4 -o vers=4.2,proto=tcp,port=2049,addr=127.0.0.1,clientaddr=127.0.0.1,nosharecache 127.0.0.1:/ $E/$m
done
grep " $E/[ab] " /proc/mounts | sed 's/^/nfs-check: mount: /'
# The two mounts must be two superblocks of one export: what one writes, the other reads.
dev_a=$(stat -c %d $E/a) dev_b=$(stat -c %d $E/b)
[ "$dev_a" != "$dev_b" ] || die "the two mounts share one superblock (device $dev_a): nosharecache did not take"
# The first OPEN waits out the server's grace period (10 s, the least nfsd takes; 6.1's
# v4_end_grace answers EBUSY here): the client retries until it ends.
timeout 60 sh -c "echo probe > $E/a/jobs/.probe" || die "writing through mount a"
[ "$(cat $E/b/jobs/.probe 2>&1)" = probe ] || die "mount b does not read what mount a wrote"
[ "$(cat $E/export/jobs/.probe 2>&1)" = probe ] || die "the export does not hold what mount a wrote"
[ "$(stat -c %u $E/export/jobs/.probe)" = 0 ] || die "root is squashed on the export"
rm -f $E/a/jobs/.probe
t1=$(cut -d' ' -f1 /proc/uptime)
say "set up in $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s (devices $dev_a, $dev_b)"
NANTRACE_NFS_JOB_DIRS=$E/a/jobs:$E/b/jobs NANTRACE_NFS_SERVER_DIR=$E/export/jobs \
  timeout -k 10 240 "$BIN" --ignored --exact --test-threads=1 --nocapture "$@"
rc=$?
t2=$(cut -d' ' -f1 /proc/uptime)
say "tests exited $rc after $(awk "BEGIN{printf \"%.1f\", $t2 - $t1}") s"
umount $E/a $E/b 2>/dev/null
echo 0 > /proc/fs/nfsd/threads
exit $rc
