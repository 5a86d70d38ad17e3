"""Run a function on 2 CPU ranks with the gloo backend (for the DDP-awareness tests).

``run_ranks(fn, world_size=2, *args)`` spawns ``world_size`` processes, initializes a gloo process
group on a free loopback port, calls ``fn(rank, world_size, *args)`` in each, and returns
each rank's return value (it must be picklable), in rank order. ``fn`` must be importable
(a module-level function of a test module). Collectives time out after ``TIMEOUT`` (a rank left
waiting for a peer that stopped fails the test instead of hanging it). A rank that has written its
result but does not exit within ``TEARDOWN_S`` is killed: torch 2.4's gloo can deadlock in
``destroy_process_group`` (the main thread holding the GIL while it waits for a gloo thread that
waits for the GIL), which left the test suite waiting forever. A rank without a result by
``DEADLINE_S`` fails the test. ``timeout_s`` shortens both for a test whose ranks must not wait
long (a collective left waiting then fails the test within about that time).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)
TEARDOWN_S = 30.0
DEADLINE_S = 900.0


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
    timeout: datetime.timedelta = TIMEOUT,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"{rank}.part").write_bytes(pickle.dumps(result))
        os.replace(Path(out_dir, f"{rank}.part"), Path(out_dir, f"{rank}.pkl"))  # whole or absent
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their results in order.
    ``timeout_s``: the collectives' timeout, and (plus a minute to start) the deadline."""
    timeout = TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    limit = DEADLINE_S if timeout_s is None else timeout_s + 60.0
    with tempfile.TemporaryDirectory() as out_dir:
        results = [Path(out_dir, f"{r}.pkl") for r in range(world_size)]
        ctx = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), out_dir, fn, args, timeout),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline, teardown = time.monotonic() + limit, None
        while not ctx.join(timeout=1.0):  # a rank that raised re-raises here
            if teardown is None and all(p.exists() for p in results):
                teardown = time.monotonic() + TEARDOWN_S
            now = time.monotonic()
            if (teardown is not None and now > teardown) or now > deadline:
                for process in ctx.processes:
                    process.kill()
                    process.join(5.0)
                if teardown is None:
                    raise TimeoutError(f"a rank gave no result in {limit:.0f} s")
                break
        return [pickle.loads(p.read_bytes()) for p in results]
