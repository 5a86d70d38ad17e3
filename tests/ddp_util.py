"""Run a function on 2 CPU ranks with the gloo backend (for the DDP-awareness tests).

``run_ranks(fn, world_size=2, *args)`` spawns ``world_size`` processes, initializes a gloo process
group on a free loopback port, calls ``fn(rank, world_size, *args)`` in each, and returns
each rank's return value (it must be picklable), in rank order. ``fn`` must be importable
(a module-level function of a test module). Collectives time out after ``TIMEOUT`` (a rank left
waiting for a peer that stopped fails the test instead of hanging it).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their results in order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
