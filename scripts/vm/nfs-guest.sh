#!/bin/bash
# Second stage of `cargo xtask vm-nfs` in the guest (chrooted into the host's root, as the
# kernel matrix's guest.sh; /run and /tmp are the guest's tmpfs, /mnt the run's directory).
# vm.env (written by xtask): REPO, BIN (the unit test binary), TESTS (the test names).
# nfs-check.sh sets up the kernel's NFS server and two mounts and runs the tests; its output
# and exit status are left in nfs.log and nfs.rc.
set -u
O=/mnt
. $O/vm.env
export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
uname -r > $O/uname
ip link set lo up
bash "$REPO/scripts/vm/nfs-check.sh" "$BIN" $TESTS > $O/nfs.log 2>&1
echo $? > $O/nfs.rc
dmesg > $O/dmesg.txt 2>&1
echo ok > $O/done
