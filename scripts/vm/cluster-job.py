#!/usr/bin/env python3
"""The VM cluster's distributed job (`cargo xtask vm-cluster`): one rank per node, started by
srun, exchanging values over TCP like a tiny all-reduce. Rank 0 listens on MASTER_ADDR:PORT;
every step each other rank sends its value and waits for the mean; rank 0 prints the loss.
NAN_AT: the step at which rank 0's loss is NaN (then it exits 1, as a training loop that
stops on a non-finite loss). A peer silent for STEP_TIMEOUT seconds: a TIMEOUT line, exit 3.
STEP_FILE: rank 0 writes the current step there (the host times its faults on it)."""
import math
import os
import socket
import struct
import sys
import time

rank = int(os.environ["SLURM_PROCID"])
world = int(os.environ.get("SLURM_NTASKS", "3"))
master = os.environ["MASTER_ADDR"]
port = int(os.environ.get("MASTER_PORT", "29500"))
steps = int(os.environ.get("STEPS", "60"))
pause = float(os.environ.get("STEP_PAUSE", "0.3"))
nan_at = int(os.environ.get("NAN_AT", "0"))
timeout = float(os.environ.get("STEP_TIMEOUT", "10"))
step_file = os.environ.get("STEP_FILE", "")
host = socket.gethostname()


def say(line):
    print(line, flush=True)


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise ConnectionError("peer closed the connection")
        b += c
    return b


if rank == 0:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(world)
    srv.settimeout(60)
    peers = [srv.accept()[0] for _ in range(world - 1)]
    for p in peers:
        p.settimeout(timeout)
    say(f"rank 0/{world} on {host}, {world - 1} peers connected")
    for step in range(1, steps + 1):
        try:
            vals = [struct.unpack("!d", recv_exact(p, 8))[0] for p in peers]
        except (socket.timeout, ConnectionError, OSError) as e:
            say(f"step {step} | TIMEOUT waiting for a peer: {e!r}")
            sys.exit(3)
        mean = (sum(vals) + 1.0) / world
        for p in peers:
            p.sendall(struct.pack("!d", mean))
        loss = 2.0 / (1 + step * 0.1) * mean
        if step_file:
            with open(step_file + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(step_file + ".tmp", step_file)
        if nan_at and step >= nan_at:
            say(f"step {step} | loss {math.nan} | lr 3e-4")
            sys.exit(1)
        say(f"step {step} | loss {loss:.4f} | lr 3e-4")
        time.sleep(pause)
    say("done")
else:
    s = None
    for _ in range(300):
        try:
            s = socket.create_connection((master, port), timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    if s is None:
        say(f"rank {rank}: cannot connect to {master}:{port}")
        sys.exit(2)
    s.settimeout(timeout)
    say(f"rank {rank}/{world} on {host} connected to {master}:{port}")
    for step in range(1, steps + 1):
        try:
            s.sendall(struct.pack("!d", 1.0))
            struct.unpack("!d", recv_exact(s, 8))
        except socket.timeout as e:
            say(f"rank {rank} step {step} | TIMEOUT waiting for rank 0: {e!r}")
            sys.exit(3)
        except (ConnectionError, OSError) as e:
            say(f"rank {rank} step {step} | connection to rank 0 lost: {e!r}")
            sys.exit(1)
