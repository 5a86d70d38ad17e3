"""Data-free init of a ≥ 1B-parameter model: ``init_model`` vs calling ``torch.nn.init`` per tensor.

The model (large Linear layers) is built on the meta device and materialized with ``to_empty``,
then initialized repeatedly, alternating the candidates (best of ``--repeats``):

* ``torch.nn.init``: what a user writes by hand — ``normal_(w, 0, std)`` per weight with the
  geometric std computed per tensor, ``zeros_`` per bias (and ``kaiming_normal_`` for fan-in);
* ``init_model(measure=False)``: the library, same scheme, same generator;
* ``init_model(measure=True)``: plus the report's achieved std per tensor (its overhead).

Goal: ``init_model`` / ``torch.nn.init`` ≤ 1.1.  Run: ``python benchmarks/bench_init_large.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import initlab
from _timing import interleaved_min


def build(width: int, depth: int, device: str) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    return model.to_empty(device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model = build(args.width, args.depth, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    gen_device = torch.device(args.device)

    def gen() -> torch.Generator:
        return torch.Generator(device=gen_device).manual_seed(0)

    def torch_geometric() -> None:
        g = gen()
        with torch.no_grad():
            for layer in model:
                fan_in, fan_out = layer.in_features, layer.out_features
                std = math.sqrt(2.0 / math.sqrt(fan_in * fan_out))
                nn.init.normal_(layer.weight, 0.0, std, generator=g)
                nn.init.zeros_(layer.bias)

    def torch_kaiming() -> None:
        g = gen()
        for layer in model:
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu", generator=g)
            nn.init.zeros_(layer.bias)

    rows = []
    for scheme, baseline in (("geometric", torch_geometric), ("fan_in", torch_kaiming)):
        times = interleaved_min(
            {
                "torch": baseline,
                "initlab": lambda s=scheme: initlab.init_model(
                    model, s, generator=gen(), measure=False
                ),
                "initlab+report": lambda s=scheme: initlab.init_model(model, s, generator=gen()),
            },
            repeats=args.repeats,
        )
        rows.append(
            {
                "scheme": scheme,
                "params": n_params,
                "torch_s": times["torch"],
                "initlab_s": times["initlab"],
                "ratio": times["initlab"] / times["torch"],
                "goal": "<= 1.1",
                "with_report_s": times["initlab+report"],
                "report_overhead": times["initlab+report"] / times["initlab"] - 1.0,
            }
        )
    print(
        initlab.Rows(
            rows,
            title=(
                f"init of {n_params / 1e9:.2f}B parameters ({args.depth} x Linear({args.width}, "
                f"{args.width}), {args.device}, {torch.get_num_threads()} threads, "
                f"best of {args.repeats})"
            ),
        )
    )


if __name__ == "__main__":
    main()
