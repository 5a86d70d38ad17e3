"""Moment-probe overhead: forward + backward with the probe vs without.

Models: a ResNet-style CNN (CIFAR shapes), a small transformer encoder (math attention) and, with
``transformers`` installed, a GPT-2-like decoder (Hugging Face GPT-2: Conv1D projections, SDPA).
Each step is ``loss = loss_fn(model, batch); loss.backward()``; the candidates run alternately
(best of ``--repeats``). Goal: probe / plain ≤ 1.5 (default probe: per-example dW included).
Two ways to use the probe are timed: ``probe`` opens a probe, runs one step, closes it and reads
``rows()`` (the worst case: the probe's fixed cost -- hooking every module, reducing every weight,
pooling and reading the results -- borne by one step), and ``probe_k`` keeps one probe open over
``--steps`` steps (as ``measure_moments`` over a loader does) and reads ``rows()`` once, per step.
Run: ``python benchmarks/bench_probe_overhead.py`` (on a loaded machine add ``--cpu-time``: this
process's CPU time, which other processes disturb much less than wall time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import initlab
from _timing import interleaved_min


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.short = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.short(x))


def resnet_cnn(width: int = 16, blocks: int = 3) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
    ]
    c = width
    for stage in range(3):
        for b in range(blocks):
            c_out = width * 2**stage
            layers.append(BasicBlock(c, c_out, 2 if (b == 0 and stage > 0) else 1))
            c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)]
    return nn.Sequential(*layers)


def transformer(dim: int = 128, depth: int = 4, vocab: int = 1000) -> nn.Module:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(tokens)))

    return Encoder()


def gpt2_decoder(dim: int = 128, depth: int = 4, vocab: int = 1000) -> nn.Module | None:
    """A GPT-2-like decoder: Hugging Face ``GPT2LMHeadModel`` (Conv1D projections, tied head),
    built from a config (no download); ``None`` without ``transformers``."""
    try:
        import transformers
    except ImportError:
        return None
    cfg = transformers.GPT2Config(
        n_layer=depth, n_embd=dim, n_head=4, vocab_size=vocab, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--steps", type=int, default=8, help="steps of the probe kept open (probe_k)"
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time by process CPU time (CPU only)"
    )
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    cases = {
        "resnet-cnn (CIFAR 32x32, batch 64)": (
            resnet_cnn().to(device),
            (
                torch.randn(64, 3, 32, 32, generator=g).to(device),
                torch.randint(0, 10, (64,), generator=g).to(device),
            ),
        ),
        "transformer encoder (batch 16 x 64 tokens)": (
            transformer().to(device),
            (
                torch.randint(0, 1000, (16, 64), generator=g).to(device),
                torch.randint(0, 1000, (16, 64), generator=g).to(device),
            ),
        ),
    }
    decoder = gpt2_decoder()
    if decoder is not None:
        cases["gpt2-like decoder (HF GPT-2, batch 16 x 64 tokens)"] = (
            decoder.to(device),
            (
                torch.randint(0, 1000, (16, 64), generator=g).to(device),
                torch.randint(0, 1000, (16, 64), generator=g).to(device),
            ),
        )

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        out = getattr(out, "logits", out)  # a Hugging Face ModelOutput
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    rows = []
    k = args.steps
    for name, (model, batch) in cases.items():
        initlab.init_model(model, "geometric", generator=0)

        def plain(model: nn.Module = model, batch: tuple = batch) -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()

        def probed(
            per_example: bool, steps: int = 1, model: nn.Module = model, batch: tuple = batch
        ) -> None:
            with initlab.MomentProbe(model, per_example=per_example) as probe:
                for _ in range(steps):
                    model.zero_grad(set_to_none=True)
                    loss_fn(model, batch).backward()
            probe.rows()

        times = interleaved_min(
            {
                "plain": plain,
                "probe": lambda: probed(True),
                "probe_k": lambda: probed(True, k),
                "probe_no_example": lambda: probed(False),
            },
            repeats=args.repeats,
            clock=time.process_time if args.cpu_time else time.perf_counter,
        )
        rows.append(
            {
                "model": name,
                "plain_s": times["plain"],
                "probe_s": times["probe"],
                "ratio": times["probe"] / times["plain"],
                f"ratio_{k}_steps": times["probe_k"] / k / times["plain"],
                "goal": "<= 1.5",
                "ratio_no_example": times["probe_no_example"] / times["plain"],
            }
        )
    print(
        initlab.Rows(
            rows,
            title=(
                f"moment probe overhead ({args.device}, {torch.get_num_threads()} threads, "
                f"best of {args.repeats}{', CPU time' if args.cpu_time else ''})"
            ),
        )
    )


if __name__ == "__main__":
    main()
