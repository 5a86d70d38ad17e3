"""LSUV wall time: initlab's ``lsuv_`` (2 forward passes) against the PyPI ``lsuv`` package.

Not a test. Run::

    python -m venv --system-site-packages /tmp/bench-venv
    /tmp/bench-venv/bin/pip install lsuv==0.3.0   # depends on torch only; no torchvision
    /tmp/bench-venv/bin/python benchmarks/bench_lsuv.py            # both models, batch 128

Baseline: ``lsuv.lsuv_with_singlebatch`` (Mishkin's package, v0.3.0): the paper's loop literally,
one full forward to measure each layer and one more per correction, with its defaults
(``needed_std=1``, ``std_tol=0.1`` on the *standard deviation*, ``max_attempts=10``, orthonormal
pre-init, eval mode). initlab: ``lsuv_(model, x, target=1, tol=0.1)`` (tolerance on the
variance). Same model (same initial weights), same batch, CPU. Without the package installed
the script says so and times initlab alone.

Each method's final per-layer output variance is re-measured here with plain forward hooks on
every Conv/Linear layer (float64), on the same batch, and summarized as min / median / max over
layers. Timings: :func:`_timing.interleaved_min` (the two methods alternate, best of
``--repeats``). The machine load (``os.getloadavg``) is printed before and after: on a shared
machine absolute times drift, the ratio much less. ``--threads 1`` (default) pins one intra-op
thread for both methods: on 2 busy cores, OpenMP regions stall (a 576 x 64 QR took 200 ms with 2
threads vs 0.2 ms with 1), which adds noise unrelated to the algorithms.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_min
from initlab.methods.lsuv import lsuv_
from initlab.zoo import create_model

try:
    import lsuv as pypi_lsuv  # type: ignore[import-not-found]
except ImportError as err:  # pragma: no cover - depends on the environment
    pypi_lsuv = None
    PYPI_ERROR = f"{type(err).__name__}: {err}"
else:
    PYPI_ERROR = ""

MODELS: dict[str, Callable[[], nn.Module]] = {
    "plain_cnn56": lambda: create_model("plain_cnn", depth=56),
    "resnet56": lambda: create_model("resnet56"),
}


def layer_variances(model: nn.Module, x: torch.Tensor) -> list[float]:
    """Output variance of every Conv/Linear layer in one eval-mode forward (float64)."""
    out: list[float] = []

    def hook(module: nn.Module, args: object, y: torch.Tensor) -> None:
        out.append(float(y.detach().double().var(unbiased=False)))

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return out


def count_forwards(model: nn.Module) -> tuple[list[int], object]:
    calls = [0]

    def pre(module: nn.Module, args: object) -> None:
        calls[0] += 1

    return calls, model.register_forward_pre_hook(pre)


def summary(vs: list[float], tol: float) -> dict[str, object]:
    return {
        "min": min(vs),
        "median": statistics.median(vs),
        "max": max(vs),
        "in_tol": f"{sum(abs(v - 1.0) < tol for v in vs)}/{len(vs)}",
    }


def bench_model(name: str, x: torch.Tensor, tol: float, repeats: int) -> None:
    """Time both methods on fresh copies of one model; print a row for each."""
    torch.manual_seed(0)
    base = MODELS[name]()
    results: dict[str, tuple[nn.Module, int]] = {}

    def run_initlab() -> None:
        model = copy.deepcopy(base)
        report = lsuv_(model, x, target=1.0, tol=tol, generator=0)
        results["initlab"] = (model, report.forward_passes)

    def run_pypi() -> None:
        model = copy.deepcopy(base)
        calls, handle = count_forwards(model)
        pypi_lsuv.lsuv_with_singlebatch(model, x, verbose=False)
        handle.remove()
        results["pypi lsuv 0.3"] = (model, calls[0])

    fns: dict[str, Callable[[], None]] = {"initlab": run_initlab}
    if pypi_lsuv is not None:
        fns["pypi lsuv 0.3"] = run_pypi
    start = time.perf_counter()
    best = interleaved_min(fns, repeats=repeats, warmup=0)
    elapsed = time.perf_counter() - start
    for method in fns:
        model, forwards = results[method]
        s = summary(layer_variances(model, x), tol)
        ratio = best[method] / best["initlab"]
        print(
            f"{name:<12} {method:<14} {best[method]:>8.2f} {forwards:>5} {ratio:>6.1f}x  "
            f"{s['min']:>8.4f} {s['median']:>8.4f} {s['max']:>8.4f}  {s['in_tol']:>11}",
            flush=True,
        )
    print(f"  ({elapsed:.0f} s for {name})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="0: leave torch's default")
    parser.add_argument("--tol", type=float, default=0.1)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"{os.cpu_count()} CPU(s), load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}"
    )
    if pypi_lsuv is None:
        print(f"PyPI lsuv could not be imported ({PYPI_ERROR}); timing initlab alone")
    else:
        print(f"baseline: PyPI lsuv from {Path(pypi_lsuv.__file__).parent}")
    header = (
        f"{'model':<12} {'method':<14} {'wall_s':>8} {'fwd':>5} {'ratio':>7}  "
        f"{'var min':>8} {'median':>8} {'max':>8}  {'|var-1|<tol':>11}"
    )
    print(header)
    print("-" * len(header))
    x = torch.randn(args.batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for name in args.models.split(","):
        bench_model(name, x, args.tol, args.repeats)
    load1 = os.getloadavg()
    print(f"load average at the end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    print(
        "ratio = wall time / initlab's (higher: slower than initlab); fwd = full forward passes; "
        "var = per-layer output variance re-measured after init"
    )


if __name__ == "__main__":
    main()
