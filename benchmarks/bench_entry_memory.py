"""Peak memory of the measuring and fixing entry points vs a plain forward + backward.

Each candidate runs in its own Python process (none can reuse memory another freed): the model
and two batches are built, ``ru_maxrss`` is read, the candidate runs, and the growth of the peak
resident set is reported, in MiB and as a multiple of the parameters' bytes and of the plain
step's growth:

* ``plain``: forward + cross-entropy + backward on one batch (the baseline);
* ``measure_moments``, ``diagnose`` (``spectra=False``), ``doctor`` (no fixes), ``doctor_fix``
  (``fix=True``), ``lsuv``, ``gradinit`` (4 steps).

What it shows: the blocks that keep the model as it was (:mod:`initlab._core.state`) share the
copy of an enclosing block while a tensor keeps its bits (before, ``doctor``'s nested
measurements each held a copy of the weights), and ``diagnose``'s per-entry gradient statistics
are stored in the parameter's precision and computed in float64 chunks. Measured on a loaded
2-core CPU (2026-11-27, ``--width 4096``: 129 MiB of float32 weights), growth as a multiple of
the parameter bytes, at 36f98b0 (its ``src`` on ``PYTHONPATH``) / after:

=================  ======  =====
``plain``          1.17    1.13
``measure_moments``  2.21  2.26
``diagnose``       11.41   4.72
``doctor``         3.32    2.33
``doctor_fix``     4.23    2.35
``lsuv``           3.68    4.16
``gradinit``       7.64    7.70
=================  ======  =====

(``lsuv``'s figure is its orthogonal pre-init's QR workspace, which the allocator places
differently from run to run: 3.7-4.2 in either tree.)

Run: ``python benchmarks/bench_entry_memory.py [--width 4096]``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import torch
from torch import nn

CANDIDATES = ("plain", "measure_moments", "diagnose", "doctor", "doctor_fix", "lsuv", "gradinit")


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
    )  # fmt: skip


def _child(name: str, width: int) -> None:
    import initlab

    model = _model(width)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))] * 2
    loss = nn.CrossEntropyLoss()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run = {
        "plain": lambda: loss(model(data[0][0]), data[0][1]).backward(),
        "measure_moments": lambda: initlab.measure_moments(model, data, loss),
        "diagnose": lambda: initlab.diagnose(model, data, loss, spectra=False),
        "doctor": lambda: initlab.doctor(model, data, loss, generator=0),
        "doctor_fix": lambda: initlab.doctor(model, data, loss, fix=True, generator=0),
        "lsuv": lambda: initlab.lsuv_(model, data, generator=0),
        "gradinit": lambda: initlab.gradinit_(model, data * 3, loss, steps=4),
    }[name]
    run()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    print(grown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.width)
        return
    params = sum(p.numel() * p.element_size() for p in _model(args.width).parameters())
    grown = {}
    for name in CANDIDATES:
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, "--width", str(args.width)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        grown[name] = int(out.stdout.strip().splitlines()[-1])
    print(f"parameters: {params / 2**20:.0f} MiB (width {args.width})")
    print(f"{'entry point':<16} {'peak growth MiB':>16} {'x params':>9} {'x plain':>8}")
    for name, b in grown.items():
        print(f"{name:<16} {b / 2**20:>16.0f} {b / params:>9.2f} {b / grown['plain']:>8.2f}")


if __name__ == "__main__":
    main()
