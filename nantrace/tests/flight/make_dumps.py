#!/usr/bin/env python3
"""Make the Flight Recorder dumps nantrace's tests read (nantrace/tests/flight/<scenario>/).

Real dumps written by torch itself: three gloo ranks on loopback (no GPU), torch's Flight
Recorder on (TORCH_FR_BUFFER_SIZE), each rank dumping with
torch._C._distributed_c10d._dump_fr_trace_file(rank, backend="gloo") to
TORCH_FR_DUMP_TEMP_FILE + rank, as torch's watchdog does at its timeout. A rank stuck outside
any collective dumps from a thread of its own after the others' timeout (as torch's
heartbeat monitor dumps on the dump signal of another rank). Next to each dump, <dump>.json:
what Python's own pickle.load reads of it (tuples as lists), which the Rust decoder's tests
compare with.

Made with torch 2.15.0+cu132 (CPU), Python 3:

    /tmp/tv/bin/python nantrace/tests/flight/make_dumps.py [scenario...]

Scenarios:
  stopped   rank 1 stops before collective 6 (all_reduce); ranks 0, 2 time out in it
  mismatch  rank 2 all_reduces 512 float64 at collective 4 where ranks 0, 1 reduce 1024
            float32; gloo aborts rank 1 (terminate: "Received data size doesn't match
            expected size"), which writes no dump
  two_pgs   the default group and a group of ranks 0, 1; rank 1 stops before the group's
            collective 3 (broadcast), stack traces included
  p2p       rank 0 sends to rank 1 each step, rank 1 stops before its 4th recv (gloo's
            Flight Recorder records no send/recv entry: its pg_status counts them)
"""
import datetime
import json
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 3
TIMEOUT_S = 3.0


def jsonable(v):
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    return v


def rank_main(scenario, rank, init, out, stacks):
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(out, "fr_")
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_file

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    sub = dist.new_group([0, 1]) if scenario == "two_pgs" else None
    dumped = threading.Lock()

    def dump():
        if dumped.acquire(blocking=False):
            _dump_fr_trace_file(rank, includeStackTraces=stacks, backend="gloo")

    def late_dump():
        # The rank that stopped dumps on its own, after the others timed out.
        time.sleep(TIMEOUT_S * 2 + 2)
        dump()
        os._exit(3)

    threading.Thread(target=late_dump, daemon=True).start()
    x = torch.ones(1024)
    try:
        for step in range(12):
            if scenario == "stopped" and rank == 1 and step == 5:
                time.sleep(60)
            if scenario == "mismatch":
                t = torch.ones(512, dtype=torch.float64) if (rank == 2 and step == 3) else x
                dist.all_reduce(t)
            elif scenario == "two_pgs":
                dist.all_reduce(x)
                if rank in (0, 1):
                    if rank == 1 and step == 2:
                        time.sleep(60)
                    dist.broadcast(x, src=0, group=sub)
            elif scenario == "p2p":
                dist.all_reduce(x)
                if rank == 0:
                    dist.send(x, dst=1)
                elif rank == 1:
                    if step == 3:
                        time.sleep(60)
                    dist.recv(x, src=0)
            else:
                dist.all_reduce(x)
            time.sleep(0.05)
        # Nobody stopped in this scenario's steps: wait for the dump thread.
        time.sleep(60)
    except Exception as e:  # the timeout (gloo: "Timed out waiting ...ms for recv")
        print(f"[rank{rank}]: {type(e).__name__}: {e}", flush=True)
        dump()
        os._exit(1)


def run(scenario):
    out = os.path.join(HERE, scenario)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    init = f"file://{out}/.rendezvous"
    stacks = scenario == "two_pgs"
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=rank_main, args=(scenario, r, init, out, stacks)) for r in range(WORLD)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(90)
        if p.is_alive():
            p.kill()
    if os.path.exists(f"{out}/.rendezvous"):
        os.remove(f"{out}/.rendezvous")
    for r in range(WORLD):
        path = os.path.join(out, f"fr_{r}")
        if os.path.exists(path):
            with open(path, "rb") as f:
                d = pickle.load(f)
            with open(path + ".json", "w") as f:
                json.dump(jsonable(d), f, indent=1, sort_keys=True)
                f.write("\n")
    import torch
    with open(os.path.join(out, "README"), "w") as f:
        f.write(f"made by make_dumps.py {scenario} with torch {torch.__version__}\n")
    print(scenario, sorted(os.listdir(out)))


if __name__ == "__main__":
    for s in sys.argv[1:] or ["stopped", "mismatch", "two_pgs", "p2p"]:
        run(s)
