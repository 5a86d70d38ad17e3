"""Cost of ``initlab.diagnose``: the moment-based report against one plain forward + backward.

Models (the same as ``bench_probe_overhead.py``): a ResNet-style CNN (CIFAR shapes, BatchNorm,
in-place ReLU) and a small transformer encoder (math attention). Candidates, run alternately
(best of ``--repeats``, :func:`_timing.interleaved_min`):

* ``plain``: ``loss_fn(model, batch).backward()``;
* ``moments``: ``diagnose(..., gradients=False, spectra=False, lint=False)`` on the same batch:
  gamma, nu (per-example where defined), forward/backward moments, gains, verdicts and the report
  object. Goal: ``moments / plain <= 1.5``;
* ``moments_minibatch``: the same with ``per_example=False`` (nu from the minibatch gradient);
* ``weights_only``: ``moments`` with ``modules="weights"`` (the probe hooks only the layers with a
  weight matrix: no rows for BatchNorm/LayerNorm, all gamma and nu still there);
* ``probe``: :class:`initlab.MomentProbe` alone (per-example as ``moments`` does) plus its
  ``table()``/``param_table()``: what the report costs on top of the probe is
  ``moments - probe``;
* ``default``: ``diagnose`` with its defaults (also gradient spread, spectra with convolution
  operator norms, the linter), for information.

Run: ``python benchmarks/bench_diagnose.py [--repeats 5] [--threads N]``; prints a table and the
machine load (``os.getloadavg``), since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import initlab
from _timing import interleaved_min
from bench_probe_overhead import resnet_cnn, transformer
from initlab.diagnostics import diagnose


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--skip-default", action="store_true", help="skip the full diagnose")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    cases = {
        "resnet-cnn (CIFAR 32x32, batch 64)": (
            resnet_cnn(),
            (torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)),
        ),
        "transformer encoder (batch 16 x 64 tokens)": (
            transformer(),
            (
                torch.randint(0, 1000, (16, 64), generator=g),
                torch.randint(0, 1000, (16, 64), generator=g),
            ),
        ),
    }
    rows = []
    load_before = os.getloadavg()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, (model, batch) in cases.items():
        initlab.init_model(model, "geometric", generator=0)

        def plain(model=model, batch=batch) -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()

        def moments(
            per_example: bool | str, modules: str = "params", model=model, batch=batch
        ) -> None:
            diagnose(model, batch, loss_fn, gradients=False, spectra=False, lint=False,
                     per_example=per_example, modules=modules)  # fmt: skip

        # what diagnose's per_example="auto" picks: off when BatchNorm is in train mode
        auto = not any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
            for m in model.modules()
        )

        def probe_only(model=model, batch=batch, per_example=auto) -> None:
            model.zero_grad(set_to_none=True)
            with initlab.MomentProbe(model, per_example=per_example) as probe:
                loss_fn(model, batch).backward()
            probe.table()
            probe.param_table()
            model.zero_grad(set_to_none=True)

        def full(model=model, batch=batch) -> None:
            diagnose(model, batch, loss_fn)

        candidates = {
            "plain": plain,
            "probe": probe_only,
            "moments": lambda: moments("auto"),
            "moments_minibatch": lambda: moments(False),
            "weights_only": lambda: moments("auto", "weights"),
        }
        with sdpa_kernel(SDPBackend.MATH):
            times = interleaved_min(candidates, repeats=args.repeats)
            full_s = float("nan")
            if not args.skip_default:
                full_s = interleaved_min({"default": full}, repeats=max(1, args.repeats // 2))[
                    "default"
                ]
        rows.append(
            {
                "model": name,
                "plain_s": times["plain"],
                "moments_s": times["moments"],
                "ratio": times["moments"] / times["plain"],
                "goal": "<= 1.5",
                "probe_s": times["probe"],
                "ratio_probe": times["probe"] / times["plain"],
                "minibatch_nu_s": times["moments_minibatch"],
                "ratio_minibatch": times["moments_minibatch"] / times["plain"],
                "weights_only_s": times["weights_only"],
                "ratio_weights_only": times["weights_only"] / times["plain"],
                "default_s": full_s,
                "ratio_default": full_s / times["plain"],
            }
        )
    load_after = os.getloadavg()
    print(
        initlab.Rows(
            rows,
            title=(
                f"diagnose cost (cpu, {torch.get_num_threads()} threads, best of {args.repeats}; "
                f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, "
                f"{os.cpu_count()} cores)"
            ),
        )
    )


if __name__ == "__main__":
    main()
