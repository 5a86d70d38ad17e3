"""``initlab demo``: which initialization keeps Defazio & Bottou's MLP well-conditioned?

On scikit-learn's bundled digits set (1,797 images of 8×8 pixels, 10 classes), with the paper's
MLP (64 → 384 → 64 → 10, ReLU):

1. moments (:func:`run_demo`): initialize with each scheme, push one batch through with a
   cross-entropy loss under the moment probe, and tabulate per layer and scheme the forward and
   backward second moments, the gains and the weight-to-gradient ratio ν = E[dW²]/E[W²] of
   per-example gradients (balanced ν across layers: a well-conditioned network, Prop. 4/5);
2. diagnosis (:func:`initlab.cli.diagnose.diagnose_demo`): the per-layer report of each scheme
   (γ, ν, verdicts), one HTML file per scheme and the schemes' γ/ν side by side;
3. training (:func:`demo_study`): a small study, schemes × seeds × learning rates, trained
   together by the vectorized trainer, aggregated as the paper's Table 2, with plots.
"""

from __future__ import annotations

import shlex
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.rows import Rows
from initlab.init.model import init_model
from initlab.measure.probe import measure_moments
from initlab.zoo.paper_mlp import PaperMLP

__all__ = [
    "DEMO_SCHEMES",
    "TRAINED_SCHEMES",
    "DemoResult",
    "demo_study",
    "demo_study_name",
    "demo_training",
    "load_digits_tensors",
    "no_empty_folders",
    "run_demo",
    "training_schemes",
]

DEMO_SCHEMES = ("fan_in", "fan_out", "arithmetic", "geometric", "operator_norm", "orthogonal")
#: The schemes of Defazio & Bottou's Table 2: the demo's training step trains those of --schemes.
TRAINED_SCHEMES = ("fan_in", "fan_out", "arithmetic", "geometric")

#: Columns of the demo's per-layer table.
DEMO_COLUMNS = (
    "scheme",
    "layer",
    "shape",
    "E_x2",
    "E_y2",
    "E_dy2",
    "E_dx2",
    "gain_fwd",
    "gain_bwd",
    "E_W2",
    "E_dW2_example",
    "nu",
)

#: What the columns of the demo's per-layer table are (printed under it).
DEMO_LEGEND = (
    "E_x2, E_y2, E_dy2, E_dx2: second moments E[v^2] of each layer's input x, output y and their "
    "gradients; gain_fwd = var(y)/var(x) (centered: not E_y2/E_x2 when x has a mean, as after a "
    "ReLU); gain_bwd = E_dx2/E_dy2; nu = E_dW2_example/E_W2 (per-example weight gradients)"
)


@dataclass
class DemoResult:
    """Per-layer rows (schema :data:`DEMO_COLUMNS`) and a per-scheme summary."""

    layers: Rows
    summary: Rows

    def __str__(self) -> str:
        return f"{self.layers}\n{DEMO_LEGEND}\n\n{self.summary}"


def load_digits_tensors(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits, features standardized to zero mean and unit variance."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "initlab demo uses scikit-learn's bundled digits data set; install it with "
            "`pip install 'initlab[demo]'`"
        ) from err
    data = load_digits()
    x = torch.as_tensor(data.data, dtype=torch.float64)
    std = x.std(dim=0)
    x = (x - x.mean(dim=0)) / torch.where(std > 0, std, torch.ones_like(std))
    return x.to(dtype), torch.as_tensor(data.target, dtype=torch.long)


def _cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def run_demo(
    schemes: Sequence[str] = DEMO_SCHEMES,
    *,
    seed: int = 0,
    batch_size: int = 1024,
) -> DemoResult:
    """Initialize the paper MLP with each scheme and measure one batch of digits.

    Args:
        schemes: scheme names to compare.
        seed: seeds both the init (a ``torch.Generator``) and the batch choice.
        batch_size: examples in the measured batch (at most 1,797).
    """
    x, y = load_digits_tensors()
    if not 2 <= batch_size <= len(x):
        raise ValueError(f"batch_size must be in [2, {len(x)}], got {batch_size}")
    pick = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:batch_size]
    batch = (x[pick], y[pick])
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for scheme in schemes:
        model = PaperMLP(x.shape[1], 10)
        init_model(model, scheme, generator=seed)
        probe = measure_moments(model, [batch], _cross_entropy)
        layer_rows = probe.table().to_rows()
        params = {(r["layer"], r["param"]): r for r in probe.param_table().to_rows()}
        nus = []
        for r in layer_rows:
            w = params[(r["layer"], "weight")]
            nu = w["E_dW2_example"] / w["E_W2"]
            nus.append(nu)
            rows.append(
                {
                    "scheme": scheme,
                    "layer": r["layer"],
                    "shape": w["shape"],
                    "E_x2": r["E_x2"],
                    "E_y2": r["E_y2"],
                    "E_dy2": r["E_dy2"],
                    "E_dx2": r["E_dx2"],
                    "gain_fwd": r["gain_fwd"],
                    "gain_bwd": r["gain_bwd"],
                    "E_W2": w["E_W2"],
                    "E_dW2_example": w["E_dW2_example"],
                    "nu": nu,
                }
            )
        summary.append(
            {
                "scheme": scheme,
                "nu_max/min": max(nus) / min(nus),
                "logit_E_y2": layer_rows[-1]["E_y2"],
                "loss": float(_cross_entropy(model, batch).detach()),
            }
        )
    return DemoResult(
        Rows(
            rows,
            DEMO_COLUMNS,
            title=f"Paper MLP on digits (batch {batch_size}, seed {seed}): per layer and scheme",
        ),
        Rows(
            summary,
            title="Balance of the weight-to-gradient ratio nu across layers "
            "(1.0 = perfectly balanced)",
        ),
    )


def demo_study(
    out: str | Path,
    schemes: Sequence[str] = ("fan_in", "fan_out", "arithmetic", "geometric"),
    *,
    seeds: int = 3,
    seed: int = 0,
    lrs: Sequence[float] = (0.5, 0.125, 0.03125, 0.0078125),
    epochs: int = 3,
    progress: bool = True,
) -> Rows:
    """Train the paper MLP on digits for each scheme × seed × learning rate; report as Table 2.

    The study (input LayerNorm, logits' std 0.05 after the first minibatch, SGD with momentum 0.9,
    weight decay 1e-5, batch 64; seeds ``seed`` to ``seed + seeds - 1``) is stored in
    ``out/demo.sqlite`` under a name made of the options (:func:`demo_study_name`: a second call
    with the same options reuses its finished runs, other options make another study in the same
    store) and reported in ``out/study`` (``table2.md``, CSVs and plots), that study only.
    Returns the per-scheme rows: median final training loss at the best learning rate,
    normalized by the worst scheme.
    """
    from initlab.study import StudySpec, report_study, run_study

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    name = demo_study_name(schemes, seed=seed, seeds=seeds, lrs=lrs, epochs=epochs)
    spec = StudySpec(
        name=name,
        datasets=("sklearn:digits",),
        schemes=tuple(schemes),
        seeds=tuple(range(seed, seed + seeds)),
        lrs=tuple(lrs),
        model="paper_mlp",
        model_cfg=(("input_norm", True), ("widths", (384, 64))),
        epochs=epochs,
        batch_size=64,
        optimizer="sgd",
        momentum=0.9,
        weight_decay=1e-5,
        output_std=0.05,
    )
    per_chunk = max(1, len(spec.runs()) // 4)
    run_study(spec, folder / "demo.sqlite", progress=progress, chunk_size=per_chunk)
    return report_study(folder / "demo.sqlite", folder / "study", study=name)


def demo_study_name(
    schemes: Sequence[str],
    *,
    seed: int = 0,
    seeds: int = 3,
    lrs: Sequence[float] = (0.5, 0.125, 0.03125, 0.0078125),
    epochs: int = 3,
) -> str:
    """The demo study's name in its store: ``demo`` and the options that change its runs, e.g.
    ``demo[fan_in,geometric;seeds=1..3]``; learning rates and epochs are added when they are not
    the defaults."""
    tag = f"{','.join(schemes)};seeds={seed}..{seed + seeds - 1}"
    if tuple(lrs) != (0.5, 0.125, 0.03125, 0.0078125) or epochs != 3:
        tag += f";lrs={','.join(f'{lr:g}' for lr in lrs)};epochs={epochs}"
    return f"demo[{tag}]"


def training_schemes(schemes: Sequence[str]) -> list[str]:
    """The schemes the demo's training step trains: those of ``schemes`` in
    :data:`TRAINED_SCHEMES`, or all of ``schemes`` when none is."""
    return [s for s in schemes if s in TRAINED_SCHEMES] or list(schemes)


def demo_training(
    out: Path, schemes: Sequence[str], *, seed: int, note: Callable[[str], None], **options: Any
) -> Rows:
    """``initlab demo``'s training step, :func:`demo_study` (``options``: its ``seeds``, ``lrs``,
    ``epochs``, ``progress``). Without geometric among ``schemes`` there are no paired
    comparisons: ``note`` is told the command that gives them (the report's own warning speaks
    of Python's ``reference=``)."""
    reference = "geometric"
    if reference in schemes:
        return demo_study(out, schemes, seed=seed, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no runs of the reference scheme")
        rows = demo_study(out, schemes, seed=seed, **options)
    naming = {k: v for k, v in options.items() if k in ("seeds", "lrs", "epochs")}
    name = demo_study_name(schemes, seed=seed, **naming)
    store = shlex.quote(str(out / "demo.sqlite"))
    note(
        f"no {reference} among the trained schemes, so the study has no paired comparisons; "
        f"for comparisons against {schemes[0]}, run `initlab bench report {store} --study "
        f"{shlex.quote(name)} --reference {schemes[0]}`"
    )
    return rows


@contextmanager
def no_empty_folders(out: Path) -> Iterator[None]:
    """On an error or an interrupt, remove the folders under ``out`` (and ``out``) that the
    block made and left empty; files already written stay (a finished diagnosis, a store that
    resumes)."""
    before = {p for p in out.rglob("*") if p.is_dir()} if out.is_dir() else set()
    existed = out.is_dir()
    try:
        yield
    except BaseException:
        made = [p for p in out.rglob("*") if p.is_dir() and p not in before] if out.is_dir() else []
        for folder in sorted(made, key=lambda p: len(p.parts), reverse=True):
            _remove_if_empty(folder)
        if not existed:
            _remove_if_empty(out)
        raise


def _remove_if_empty(folder: Path) -> None:
    with suppress(OSError):  # rmdir removes only an empty folder
        folder.rmdir()
