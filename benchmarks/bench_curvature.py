"""Benchmark: Hessian-vector product modes and the block heat map (prints tables; not a test).

Two questions, on the CPU (or the GPU if there is one):

1. **HVP mode.** Time per product ``H v`` for

   * ``rev_rev reused``: reverse-over-reverse with the first-order graph built once and reused
     (what :class:`initlab.measure.curvature.CurvatureOperator` does; the build is amortized over
     products and reported separately as ``build``), and told the probe's support (one block),
     so each product back-propagates through that block's gradient graph only,
   * ``rev_rev one-shot``: :func:`initlab.hessian_vector_product` (forward, backward
     with ``create_graph``, second backward, for every product),
   * ``fwd_rev``: ``torch.func.jvp`` over ``torch.func.grad`` (forward + backward with tangents
     for every product),
   * ``fwd_rev vmap(L)`` and ``rev_rev batched(L)``: ``L`` products in one vmapped call (the L
     block probes of one heat-map probe), per product.

   Times are the best of interleaved repeats (``_timing.interleaved_min``). Peak memory is the
   resident-set high-water mark in a **fresh subprocess per candidate** (:func:`child`: warm-up
   call, reset of ``VmHWM`` through ``/proc/self/clear_refs``, 3 calls, ``VmHWM - VmRSS before``;
   ``resource.getrusage(...).ru_maxrss`` where ``/proc`` is missing). ``tracemalloc`` does not see
   torch's CPU allocations; on a GPU ``torch.cuda.max_memory_allocated`` is reported as well.

2. **Heat map.** One probe of the full ``L × L`` block map with ``L`` products (a probe on block
   ``k`` gives column ``k`` of every block; :func:`initlab.measure.curvature.block_curvature` with
   ``full_matrix=True``) against a naive loop that takes one double backward per block pair
   (``L²`` products, each ``∇_θl (∇_θk f · r_k)``).

Run: ``python benchmarks/bench_curvature.py [--quick] [--threads N]`` (default 1 thread: on a
shared, loaded machine one thread per process gives the most repeatable numbers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_min
from initlab.init.model import init_model
from initlab.measure.curvature import (
    CurvatureOperator,
    _prepare_forward_ad,
    block_curvature,
    hessian_vector_product,
)
from initlab.zoo import create_model

CANDIDATES = ("rev_rev reused", "rev_rev one-shot", "fwd_rev", "fwd_rev vmap(L)",
              "rev_rev batched(L)")  # fmt: skip


def interleaved_min_cpu(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """:func:`_timing.interleaved_min` on the process's CPU time."""
    return interleaved_min(fns, repeats, clock=time.process_time)


def setup(name: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "lenet":
        model = create_model("strided_lenet")
        x = torch.randn(batch, 3, 32, 32)
    elif name == "lenet_zeropad":
        model = create_model("strided_lenet", circular=False)
        x = torch.randn(batch, 3, 32, 32)
    else:
        model = create_model("paper_mlp", n_in=64)
        x = torch.randn(batch, 64)
    init_model(model, "geometric", generator=0, measure=False)
    return model, x, torch.randint(0, 10, (batch,))


def candidate_fns(
    name: str, batch: int, *, cold: bool = False
) -> tuple[dict[str, Callable[[], object]], int, dict]:
    """Callables that each compute the L block products of one probe; and L.

    ``cold``: ``rev_rev reused`` builds its operator (the first-order graph) inside the call, so
    a memory measurement includes the graph it keeps.
    """
    _prepare_forward_ad()
    model, x, t = setup(name, batch)
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    n_blocks = len(names)
    gen = torch.Generator().manual_seed(0)
    vs = [
        {m: (torch.randn(p.shape, generator=gen) if m == n else torch.zeros_like(p))
         for m, p in params.items()}
        for n in names
    ]  # fmt: skip

    def f(p: dict) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), t)

    op = CurvatureOperator(model, (x, t), "cross_entropy")
    build = {}

    def reused() -> object:
        o = CurvatureOperator(model, (x, t), "cross_entropy") if cold else op
        return [o.product([v[n] for n in names], [k]) for k, v in enumerate(vs)]

    def one_shot() -> object:
        return [hessian_vector_product(f, params, v) for v in vs]

    grad_f = torch.func.grad(f)

    def fwd_rev() -> object:
        return [torch.func.jvp(grad_f, (params,), (v,))[1] for v in vs]

    stacked = {n: torch.stack([v[n] for v in vs]) for n in names}

    def fwd_rev_vmap() -> object:
        return torch.func.vmap(lambda v: torch.func.jvp(grad_f, (params,), (v,))[1])(stacked)

    def rev_rev_batched() -> object:
        leaves = [p.detach().requires_grad_(True) for p in params.values()]
        g = torch.autograd.grad(f(dict(zip(names, leaves, strict=True))), leaves,
                                create_graph=True)  # fmt: skip
        return torch.autograd.grad(g, leaves, [stacked[n] for n in names], is_grads_batched=True)

    if not cold:
        start = time.perf_counter()
        op.engine  # noqa: B018 - build the graph once
        build["rev_rev reused"] = time.perf_counter() - start
    fns = {
        "rev_rev reused": reused,
        "rev_rev one-shot": one_shot,
        "fwd_rev": fwd_rev,
        "fwd_rev vmap(L)": fwd_rev_vmap,
        "rev_rev batched(L)": rev_rev_batched,
    }
    return fns, n_blocks, build


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: resident now, ``VmHWM``: peak)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def child(name: str, batch: int, which: str) -> None:
    """Run one candidate in this (fresh) process and print its peak memory as JSON.

    One warm-up call (one-time costs: forward-AD decompositions, allocator growth), then the
    resident-set high-water mark is reset (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0),
    the current RSS recorded, the candidate run 3 times, and ``VmHWM - RSS before`` reported.
    The parent sets ``MALLOC_MMAP_THRESHOLD_`` so that freed large tensors go back to the OS and
    the baseline is not inflated by memory glibc keeps. On a GPU: ``max_memory_allocated``.
    """
    fns, _, _ = candidate_fns(name, batch, cold=True)
    cuda = torch.cuda.is_available()
    fns[which]()
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        before = _status("VmRSS")
        for _ in range(3):
            fns[which]()
        peak = _status("VmHWM")
        method = "VmHWM after reset"
    except OSError:  # no /proc: fall back to the never-reset high-water mark
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(3):
            fns[which]()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss"
    result = {"delta_mib": (peak - before) / 1024, "method": method}
    if cuda:
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result))


def memory(name: str, batch: int, which: str) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, str(batch), which],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["delta_mib"]


def naive_heatmap(model: nn.Module, batch: tuple, gen: torch.Generator) -> torch.Tensor:
    """One probe of the L×L map with one double backward per block pair (L² products)."""
    names = [n for n, _ in model.named_parameters()]
    leaves = [p.detach().requires_grad_(True) for p in model.parameters()]
    out = torch.func.functional_call(model, dict(zip(names, leaves, strict=True)), (batch[0],))
    g = torch.autograd.grad(F.cross_entropy(out, batch[1]), leaves, create_graph=True)
    n_blocks = len(leaves)
    res = torch.zeros(n_blocks, n_blocks, dtype=torch.float64)
    for k in range(n_blocks):
        n = leaves[k].numel()  # the same draws as block_curvature's Rademacher probes
        r = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64).mul(2).sub(1)
        r = r.to(leaves[k]).view_as(leaves[k])
        for l_ in range(n_blocks):
            (h,) = torch.autograd.grad(g[k], leaves[l_], r, retain_graph=True)
            res[l_, k] = float(h.double().square().sum()) / min(leaves[l_].numel(), r.numel())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    repeats = 2 if args.quick else 7
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")  # fmt: skip
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())

    configs = [("mlp", 1024), ("lenet", 256), ("lenet_zeropad", 256)]
    if args.quick:
        configs = [("mlp", 128), ("lenet", 32)]
    print("\n## HVP modes, ms per product: wall (best of interleaved repeats) / CPU time (best),"
          " peak RSS delta\n")  # fmt: skip
    print(f"{'model':14} {'B':>5} {'L':>3}  " + "  ".join(f"{c:>24}" for c in CANDIDATES)
          + f"  {'build (ms)':>10}")  # fmt: skip
    for name, batch in configs:
        fns, n_blocks, build = candidate_fns(name, batch)
        times = interleaved_min(fns, repeats=repeats)
        cpu = interleaved_min_cpu(fns, repeats=repeats)
        mems = {c: memory(name, batch, c) for c in CANDIDATES}
        cells = [
            f"{1e3 * times[c] / n_blocks:6.2f}/{1e3 * cpu[c] / n_blocks:6.2f} {mems[c]:6.1f}M"
            for c in CANDIDATES
        ]
        print(f"{name:14} {batch:>5} {n_blocks:>3}  " + "  ".join(f"{c:>24}" for c in cells)
              + f"  {1e3 * build['rev_rev reused']:>10.1f}")  # fmt: skip

    print("\n## Block heat map, one probe: L products (ours) vs L² double backwards (naive)\n")
    print(f"{'model':14} {'B':>5} {'L':>3} {'ours (s)':>9} {'naive (s)':>10} {'speed-up':>9}"
          f" {'ours CPU':>9} {'naive CPU':>10} {'speed-up':>9}")  # fmt: skip
    for name, batch in configs:
        model, x, t = setup(name, batch)
        n_blocks = len(list(model.parameters()))

        def ours(model: nn.Module = model, x: torch.Tensor = x, t: torch.Tensor = t) -> object:
            return block_curvature(model, (x, t), "cross_entropy", probes=1, generator=0,
                                   full_matrix=True)  # fmt: skip

        def naive(model: nn.Module = model, x: torch.Tensor = x, t: torch.Tensor = t) -> object:
            return naive_heatmap(model, (x, t), torch.Generator().manual_seed(0))

        best = interleaved_min({"ours": ours, "naive": naive}, repeats=repeats)
        cpu = interleaved_min_cpu({"ours": ours, "naive": naive}, repeats=repeats)
        a, b = ours().matrix(), naive()
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6 * float(b.abs().max())), (a, b)
        print(f"{name:14} {batch:>5} {n_blocks:>3} {best['ours']:9.3f} {best['naive']:10.3f} "
              f"{best['naive'] / best['ours']:8.1f}x {cpu['ours']:9.3f} {cpu['naive']:10.3f} "
              f"{cpu['naive'] / cpu['ours']:8.1f}x")  # fmt: skip
    print("\n(the two heat maps use the same Rademacher probes and agree to float32 rounding)")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
