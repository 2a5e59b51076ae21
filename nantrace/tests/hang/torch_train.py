"""One rank of a real PyTorch distributed job (tests/torch_job.rs): gloo on CPU, an
all_reduce per step, a step/loss line after each. One rank is made to stop before collective
STOP_STEP + 1 (torch's seq ids count from 1) until FLAG exists:

  STOP_HOW=sleep        in Python (a rank-only branch: the job's code)
  STOP_HOW=read:DEV     in D state, reading block device DEV with O_DIRECT (the test puts
                        this process in a cgroup that throttles DEV: storage)

The other ranks wait in the all_reduce until gloo's timeout (TIMEOUT_S), print torch's error,
and dump torch's Flight Recorder (TORCH_FR_BUFFER_SIZE set by the test). Gloo does not dump
on its own (NCCL's watchdog does, TORCH_NCCL_DUMP_ON_TIMEOUT): a job on gloo calls torch's dump
itself, as here."""
import datetime
import mmap
import os
import sys
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
stop_rank = int(os.environ.get("STOP_RANK", "-1"))
stop_step = int(os.environ.get("STOP_STEP", "5"))
how = os.environ.get("STOP_HOW", "sleep")
flag = os.environ.get("FLAG", "/nonexistent")
timeout = datetime.timedelta(seconds=float(os.environ.get("TIMEOUT_S", "20")))

dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
print(f"[rank{rank}]: process group up: gloo, world {world}", flush=True)


def load_shard(path):
    """Read the next 'data shard' from a device the rank's cgroup throttles: D state."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    off = 0
    while not os.path.exists(flag):
        os.preadv(fd, [buf], off)  # 4 KiB at 512 B/s: 8 s in D state each
        off += 4096


def wait_for_the_flag():
    """A rank-only branch that outlasts the collective timeout."""
    deadline = time.time() + 300
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.2)


weights = torch.ones(4096)
for step in range(1000):
    if rank == stop_rank and step == stop_step:
        if how.startswith("read:"):
            load_shard(how.split(":", 1)[1])
        else:
            wait_for_the_flag()
    grads = torch.full((4096,), 0.01 * (rank + 1))
    try:
        dist.all_reduce(grads)
    except RuntimeError as e:
        print(f"[rank{rank}]: collective {step + 1} failed: {e}", flush=True)
        torch._C._distributed_c10d._dump_fr_trace_file(rank, backend="gloo")
        print(f"[rank{rank}]: Flight Recorder dumped", flush=True)
        sys.exit(1)
    weights -= grads
    loss = float(weights.mean())
    print(f"[rank{rank}]: step {step} | loss {loss:.4f}", flush=True)
    time.sleep(0.25)
