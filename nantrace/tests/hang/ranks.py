"""Two ranks of a job that hangs (tests/hangs.rs): rank 1 blocks in D state reading a block
device its cgroup throttles; rank 0 waits in collective 42 and prints torch's watchdog lines
(their real wording) when its "timeout" expires, then gives up. No torch: the launcher's
variables and the lines are what nantrace reads."""
import mmap
import os
import subprocess
import sys
import time

dev, cgroup, flag = sys.argv[1:4]
rank = os.environ.get("RANK")
if rank is None:
    kids = [
        subprocess.Popen(
            [sys.executable, __file__, dev, cgroup, flag],
            env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"),
        )
        for r in (0, 1)
    ]
    codes = [k.wait() for k in kids]
    sys.exit(max(codes))
if rank == "1":
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    off = 0
    while not os.path.exists(flag):
        os.preadv(fd, [buf], off)  # 4 KiB at 512 B/s: 8 s in D state each
        off += 4096
    sys.exit(0)
time.sleep(3)
print("[rank0]:[E1202 04:54:03.090 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=3000) ran for 3012 milliseconds before timing out.", flush=True)
print("[rank0]:[E1202 04:54:03.100 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 0] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.", flush=True)
time.sleep(4)
open(flag, "w").close()
sys.exit(1)
