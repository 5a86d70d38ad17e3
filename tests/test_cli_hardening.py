"""The command line's edges: ``python -m initlab``, a closed stdout, arguments checked before any
work (and before any file is created), the library's Python wording said with the flags, options
that a run does not use, readable summaries and help."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from initlab.cli import main
from initlab.cli._checks import translate
from initlab.cli.bench import format_summary

_MODELS = """
import torch
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

def data_ok():
    return [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(4)]

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.scale

def scaled():
    return Scaled()

def tanh():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

def empty():
    return nn.Sequential(nn.ReLU())

def bn():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

def lazy():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LazyLinear(3))

class _Once(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)

class Once(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(_Once.apply(self.a(x)))

def once():
    torch.manual_seed(0)
    return Once()

def data_large():
    gen = torch.Generator().manual_seed(0)
    return [(30 * torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen))
            for _ in range(4)]
"""

_SPEC = """
name: tiny
datasets: [sklearn:iris]
model: paper_mlp
model_cfg: {widths: [8], input_norm: true}
schemes: [fan_in, geometric]
seeds: 1
lrs: [0.1]
epochs: 1
batch_size: 64
"""


@pytest.fixture
def cli_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mods.py").write_text(textwrap.dedent(_MODELS))
    (tmp_path / "bad.py").write_text("this is not python\n")
    (tmp_path / "syn.py").write_text("def f(:\n  pass\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('import fails')\n")
    (tmp_path / "exits.py").write_text("import sys; sys.exit(3)\n")
    (tmp_path / "dir.py").mkdir()
    (tmp_path / "afolder").mkdir()
    (tmp_path / "afile").write_text("text\n")
    (tmp_path / "spec.yaml").write_text(textwrap.dedent(_SPEC))
    (tmp_path / "badyaml.yaml").write_text("name: [unclosed\n")
    (tmp_path / "twice.yaml").write_text(textwrap.dedent(_SPEC) + "epochs: 9\n")
    (tmp_path / "pow2.yaml").write_text(
        textwrap.dedent(_SPEC).replace("lrs: [0.1]", "lrs: {pow2: [2000, 1999]}")
    )
    rooted = textwrap.dedent(_SPEC).replace("sklearn:iris", "libsvm:iris")
    (tmp_path / "rooted.yaml").write_text(rooted + "data_root: nodir\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "variants.yaml").write_text(textwrap.dedent(_SPEC) + "variants: {epochs: [1, 2]}\n")
    (tmp_path / "evil.yaml").write_text(textwrap.dedent(_SPEC).replace("tiny", '"../evil"'))
    (tmp_path / "zero.sqlite").write_bytes(b"")
    (tmp_path / "damaged.sqlite").write_bytes(b"SQLite format 3\x00" + b"garbage" * 700)
    (tmp_path / "dangling.pt").symlink_to("nowhere/x.pt")
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "linkdir").symlink_to("missingdir")
    torch.save((torch.randn(50, 4), torch.randint(0, 3, (40,))), tmp_path / "uneven.pt")
    torch.save((torch.randn(100, 4), torch.randint(0, 3, (100,))), tmp_path / "rows.pt")
    torch.save((torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))),
               tmp_path / "f64.pt")  # fmt: skip
    torch.save((torch.randint(0, 255, (20, 4), dtype=torch.uint8), torch.randint(0, 3, (20,))),
               tmp_path / "u8.pt")  # fmt: skip
    monkeypatch.setenv("INITLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = int(stop.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


_INIT = ["init", "--model", "mods.py:mlp", "--out", "out.pt"]
_RUN = ["bench", "run", "spec.yaml", "--store", "st/s.sqlite"]

# argv -> (exit code, text of the one-line error, paths that must not exist afterwards)
_ERRORS: dict[str, tuple[list[str], int, str, tuple[str, ...]]] = {
    # 3: --device and the numbers checked before the store is created
    "--device nosuch": ([*_RUN, "--device", "nosuch"], 2, "--device 'nosuch' is not a device",
                        ("st",)),
    "--stale-after -1": ([*_RUN, "--stale-after", "-1"], 2,
                         "argument --stale-after: must be a finite number > 0", ("st",)),
    "--heartbeat 0": ([*_RUN, "--heartbeat", "0"], 2, "argument --heartbeat: must be", ("st",)),
    "--stale-after below --heartbeat": (
        [*_RUN, "--stale-after", "1", "--heartbeat", "5"], 2,
        "--stale-after (1 s) must be longer than --heartbeat (5 s)", ("st",)),
    "--workers 0": ([*_RUN, "--workers", "0"], 2, "argument --workers: must be a positive",
                    ("st",)),
    "--chunk-size 0": ([*_RUN, "--chunk-size", "0"], 2, "argument --chunk-size", ("st",)),
    # 5: output paths checked before the work
    "--out in /proc": (["init", "--model", "mods.py:mlp", "--out", "/proc/c.pt"], 2,
                       "/proc/c.pt (--out: cannot write this file", ()),
    "--out a folder": (["init", "--model", "mods.py:mlp", "--out", "afolder"], 2,
                       "--out afolder is a folder; give a file path", ()),
    "--out empty": (["init", "--model", "mods.py:mlp", "--out", ""], 2, "--out is empty", ()),
    "--out under a file": (["init", "--model", "mods.py:mlp", "--out", "afile/w.pt"], 2,
                           "--out afile/w.pt: afile is a file, and a folder is needed", ()),
    "--report under a file, nothing saved": ([*_INIT, "--report", "afile/r.json"], 2,
                                             "--report afile/r.json: afile is a file",
                                             ("out.pt",)),
    "diagnose --out an existing file": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--out", "afile"], 2,
        "--out afile: afile is a file, and a folder is needed there", ()),
    "doctor --out in /proc": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--out", "/proc/doc"], 2,
        "No such file or directory: /proc/doc (--out: cannot create the folder", ()),
    "demo --out an existing file": (["demo", "--out", "afile"], 2,
                                    "--out afile: afile is a file", ()),
    # 8: the library's wording said with the flags
    "doctor --fix nosuch": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--fix", "nosuch"], 2,
        "(or --fix alone for the recommended ones)", ()),
    "gradinit --steps beyond the batches of --data": (
        [*_INIT, "--method", "gradinit", "--data", "mods.py:data_ok", "--steps", "6"], 2,
        "--steps 6 needs 7 batches (each step reads batch t and t+1), but --data mods.py:data_ok "
        "gave only 4 (--max-batches is 8); give --data with more batches or lower --steps to 3",
        ("out.pt",)),
    "--policy error": (["init", "--model", "mods.py:scaled", "--out", "o.pt", "--policy",
                        "error"], 2, "pass --policy warn or --policy skip", ("o.pt",)),
    "a named data set under a missing --data-dir": (
        [*_INIT, "--method", "lsuv", "--data", "libsvm:letter", "--data-dir", "nodir"], 2,
        "pass --data-dir (or set the INITLAB_DATA_DIR", ("out.pt",)),
    "a LIBSVM set that scikit-learn bundles, not under --data-dir": (
        [*_INIT, "--method", "lsuv", "--data", "wine", "--data-dir", "nodir"], 2,
        "with the folder holding libsvm/, mnist/, cifar-10-batches-py/ or cifar10-jpeg/. Or use "
        "sklearn:wine, the copy bundled with scikit-learn (no download); its features are as the "
        "UCI source stores them, not scaled to [-1, 1] like the LIBSVM copy's, and it has no test "
        "split.\n", ("out.pt",)),
    "--n-boot 0": (["bench", "report", "x.sqlite", "--n-boot", "0"], 2,
                   "argument --n-boot: must be a positive integer", ()),
    "--level 1.5": (["bench", "report", "x.sqlite", "--level", "1.5"], 2,
                    "argument --level: must be in (0, 1)", ()),
    "bench report --seed -1": (["bench", "report", "x.sqlite", "--seed", "-1"], 2,
                               "argument --seed: must be an integer >= 0", ()),
    # 9: bad values of options this run would not use
    "init --data nosuch.pt without --method": (
        [*_INIT, "--data", "nosuch.pt"], 2, "--data file nosuch.pt does not exist", ("out.pt",)),
    "init --loss garbage": ([*_INIT, "--loss", "garbage"], 2, "unknown --loss 'garbage'; valid",
                            ("out.pt",)),
    # 10: raw errors
    "--model of a file that does not run (NameError)": (
        ["init", "--model", "bad.py:f", "--out", "o.pt"], 2,
        "--model bad.py: executing the file failed: NameError", ()),
    "--model of a file with a SyntaxError": (
        ["init", "--model", "syn.py:f", "--out", "o.pt"], 2,
        "--model syn.py: executing the file failed: SyntaxError", ()),
    "--model of a file that raises": (
        ["init", "--model", "raises.py:f", "--out", "o.pt"], 2,
        "--model raises.py: executing the file failed: RuntimeError: import fails", ()),
    "--model of a file that exits": (
        ["init", "--model", "exits.py:f", "--out", "o.pt"], 2,
        "--model exits.py: executing the file failed: SystemExit", ()),
    "--model of a folder": (["init", "--model", "dir.py:f", "--out", "o.pt"], 2,
                            "--model dir.py is a folder, not a Python file", ()),
    "--bias foo": ([*_INIT, "--bias", "foo"], 2, "--bias 'foo': give 'zeros', 'keep'",
                   ("out.pt",)),
    "--seed too big": ([*_INIT, "--seed", "999999999999999999999"], 2,
                       "argument --seed: must fit in 64 bits", ("out.pt",)),
    "--how parametrize": ([*_INIT, "--method", "precondition", "--how", "parametrize"], 2,
                          "--how parametrize registers torch parametrizations", ("out.pt",)),
    "a spec that is not YAML": (["bench", "run", "badyaml.yaml", "--store", "st/s.sqlite"], 2,
                                "study spec badyaml.yaml is not valid YAML", ("st",)),
    "a spec with a key given twice": (
        ["bench", "run", "twice.yaml", "--store", "st/s.sqlite"], 2,
        "study spec twice.yaml is not valid YAML: found the key 'epochs' twice (remove one)",
        ("st",)),
    "a spec's pow2 exponent beyond a float": (
        ["bench", "run", "pow2.yaml", "--store", "st/s.sqlite"], 2,
        "initlab bench run: error: study spec pow2.yaml: lrs: pow2 exponent 2000: 2**2000 "
        "overflows a float, and a learning rate must be positive and finite; use exponents from "
        "-1074 to 1023\n", ("st",)),
    "a spec's data_root without the data": (
        ["bench", "run", "rooted.yaml", "--store", "st/s.sqlite"], 2,
        "(data root nodir, from the spec's data_root)", ("st",)),
    "a spec's variants: {key: [values]}": (
        ["bench", "run", "variants.yaml", "--store", "st/s.sqlite"], 2,
        "study spec variants.yaml: variants must be {name: {key: value, ...}} (each variant's "
        "name: the keys it changes), got epochs: [1, 2]; epochs is a protocol key, not a "
        "variant's name: write `epochs: [1, 2]` at the top level of the spec", ("st",)),
    "a binary spec": (["bench", "run", "binary.yaml", "--store", "st/s.sqlite"], 2,
                      "study spec binary.yaml is not a text (YAML) file", ("st",)),
    "a missing spec": (["bench", "run", "nosuch.yaml"], 2, "study spec nosuch.yaml does not exist",
                       ("results",)),
    "--store a text file": (["bench", "run", "spec.yaml", "--store", "afile"], 2,
                            "--store afile is not a SQLite store", ()),
    "--store a folder": (["bench", "run", "spec.yaml", "--store", "afolder"], 2,
                         "--store afolder is a folder", ()),
    "--store in /proc": (["bench", "run", "spec.yaml", "--store", "/proc/x"], 2,
                         "/proc/x (--store: cannot write this file", ()),
    "bench report of a missing store": (["bench", "report", "nosuch.sqlite"], 2,
                                        "STORE nosuch.sqlite does not exist", ("nosuch-report",)),
    "--window 0": (["bench", "report", "x.sqlite", "--window", "0"], 2,
                   "argument --window: must be a positive integer, got '0'", ()),
    "--window -3": (["bench", "report", "x.sqlite", "--window", "-3"], 2,
                    "argument --window: must be a positive integer", ()),
    # round 2, 4: an output that is an input or the other output
    "--out and --report the same file": (
        [*_INIT, "--report", "out.pt"], 2,
        "--report out.pt is the same file as --out out.pt, which --report would overwrite",
        ("out.pt",)),
    "--out the --model file": (["init", "--model", "mods.py:mlp", "--out", "mods.py"], 2,
                               "--out mods.py is the same file as --model mods.py", ()),
    # round 2, 5: links, devices and stdout as --out, checked before the work
    "--out a dangling link": (["init", "--model", "mods.py:mlp", "--out", "dangling.pt"], 2,
                              "--out dangling.pt is a symbolic link to", ("nowhere",)),
    "--out a loop of links": (["init", "--model", "mods.py:mlp", "--out", "loop1"], 2,
                              "--out loop1 is a symbolic link that leads back to itself", ()),
    "--out under a link to a missing folder": (
        ["init", "--model", "mods.py:mlp", "--out", "linkdir/o.pt"], 2,
        "--out linkdir/o.pt: linkdir is a symbolic link to missingdir", ("missingdir",)),
    "--out a device": (["init", "--model", "mods.py:mlp", "--out", "/dev/full"], 2,
                       "--out /dev/full is not a regular file", ()),
    "--out -": (["init", "--model", "mods.py:mlp", "--out", "-"], 2,
                "--out -: the output cannot go to stdout", ("-",)),
    "--report a loop of links, nothing saved": (
        [*_INIT, "--report", "loop1"], 2, "--report loop1 is a symbolic link that leads back",
        ("out.pt",)),
    "--store a dangling link": (["bench", "run", "spec.yaml", "--store", "dangling.pt"], 2,
                                "--store dangling.pt is a symbolic link to", ("nowhere",)),
    "--store under a link to a missing folder": (
        ["bench", "run", "spec.yaml", "--store", "linkdir/s.sqlite"], 2,
        "--store linkdir/s.sqlite: linkdir is a symbolic link to missingdir", ("missingdir",)),
    # round 2, 6: every argument checked before a folder is made
    "--bias abc under a new folder": (
        ["init", "--model", "mods.py:mlp", "--out", "newd/sub/o.pt", "--bias", "abc"], 2,
        "--bias 'abc'", ("newd",)),
    "diagnose --loss nosuch, no --out folder": (
        ["diagnose", "--model", "mods.py:mlp", "--loss", "nosuch", "--out", "dl1"], 2,
        "unknown --loss 'nosuch'", ("dl1",)),
    "diagnose --init nosuch, no --out folder": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--init", "nosuch", "--out",
         "dl2"], 2, "--init 'nosuch': unknown scheme 'nosuch'; valid names: fan_in", ("dl2",)),
    "doctor --fix init,bogus, no --out folder": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--fix", "init,bogus", "--out",
         "dbog"], 2, "--fix init,bogus: unknown fix 'bogus'; valid: init, lsuv", ("dbog",)),
    "doctor --fix twice, no --out folder": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--fix", "init,lsuv_,lsuv",
         "--out", "dtw"], 2, "--fix init,lsuv_,lsuv: fix 'lsuv' given twice ('lsuv_' and 'lsuv' "
        "are both 'lsuv')", ("dtw",)),
    "demo --schemes twice": (["demo", "--schemes", "fan_in,fan_in", "--out", "dm"], 2,
                             "--schemes fan_in,fan_in: fan_in given twice", ("dm",)),
    "demo --schemes nosuch": (["demo", "--schemes", "nosuch", "--out", "dm"], 2,
                              "--schemes 'nosuch': unknown scheme 'nosuch'", ("dm",)),
    "a model that fails to load, no --out folder": (
        ["diagnose", "--model", "bad.py:f", "--data", "random:4", "--out", "dl3"], 2,
        "--model bad.py: executing the file failed", ("dl3",)),
    # round 2, 7: the library's wording said with the flags
    "precondition --how rescale on a model it cannot rescale": (
        ["init", "--model", "mods.py:tanh", "--method", "precondition", "--how", "rescale",
         "--data", "random:4", "--loss", "random_quadratic", "--out", "o.pt"], 2,
        "--how rescale changed the network function", ("o.pt",)),
    "a catalogue prefix with an unknown set": (
        [*_INIT, "--method", "lsuv", "--data", "libsvm:nosuch"], 2,
        "unknown data set --data 'libsvm:nosuch'; known libsvm sets: libsvm:dna", ("out.pt",)),
    "gradinit --max-batches 1": (
        [*_INIT, "--method", "gradinit", "--data", "random:4", "--loss", "random_quadratic",
         "--max-batches", "1"], 2, "--max-batches 1: gradinit needs at least 2 batches",
        ("out.pt",)),
    "x and y of different lengths in a .pt": (
        [*_INIT, "--method", "lsuv", "--data", "uneven.pt"], 2,
        "--data uneven.pt: the tensors of its batch have different numbers of rows (50, 40)",
        ("out.pt",)),
    "--data random with no known shape": (
        [*_INIT, "--method", "lsuv", "--data", "random"], 2,
        "--data random needs the model's input shape, which is unknown: give --data "
        "random:SHAPE (e.g. random:3x32x32), --input-shape SHAPE,", ("out.pt",)),
    "diagnose of a model without parameters": (
        ["diagnose", "--model", "mods.py:empty", "--data", "random:4"], 2,
        "the --model has no parameters, so there is nothing to measure", ()),
    # eleventh session: the command line has no --gamma
    "gradinit through a @once_differentiable backward": (
        ["init", "--model", "mods.py:once", "--out", "out.pt", "--method", "gradinit", "--data",
         "mods.py:data_large"], 1,
        "(e.g. a custom autograd.Function without @once_differentiable), or use --method lsuv "
        "or --method scale_output, which need no derivative (the command line runs gradinit "
        "with gamma 1, so it takes a constraint step wherever the gradient norm exceeds 1)\n",
        ("out.pt",)),
    "init --method precondition of a model without parameters": (
        ["init", "--model", "mods.py:empty", "--out", "out.pt", "--method", "precondition",
         "--data", "random:4", "--loss", "random_quadratic"], 2,
        "precondition_: the --model has no parameters, so there is nothing to precondition",
        ("out.pt",)),
    # round 2, 8: empty values and options that contradict each other
    "--store ''": (["bench", "run", "spec.yaml", "--store", ""], 2, "--store is empty",
                   ("results",)),
    "data --data-dir ''": (["data", "--data-dir", ""], 2, "--data-dir is empty", ()),
    "diagnose --data-dir ''": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--data-dir", ""], 2,
        "--data-dir is empty", ()),
    "--no-extend-grid with --extend-rounds": (
        [*_RUN, "--no-extend-grid", "--extend-rounds", "2"], 2,
        "--no-extend-grid and --extend-rounds 2 contradict each other", ("st",)),
    "bench report of a text file": (["bench", "report", "afile"], 2,
                                    "STORE afile is not a SQLite store (it is another kind of "
                                    "file); give the store `initlab bench run` wrote\n",
                                    ("afile-report",)),
    "--store a damaged SQLite file": (
        ["bench", "run", "spec.yaml", "--store", "damaged.sqlite"], 2,
        "initlab bench run: error: --store damaged.sqlite is a damaged SQLite file, which SQLite "
        "cannot read (file is not a database); initlab changes nothing in it: give another "
        "--store path (a new file is made there)\n", ("damaged.sqlite-wal",)),
    "bench report of a damaged SQLite file": (
        ["bench", "report", "damaged.sqlite"], 2,
        "initlab bench report: error: STORE damaged.sqlite is a damaged SQLite file, which SQLite "
        "cannot read (file is not a database); give the store `initlab bench run` wrote\n",
        ("damaged-report",)),
    "bench report of an empty file": (["bench", "report", "zero.sqlite"], 2,
                                      "STORE zero.sqlite is empty (0 bytes), not a store",
                                      ("zero-report",)),
    # round 2, 9: a study name that is a path
    "a study name with '..'": (["bench", "run", "evil.yaml"], 2, "'../evil'",
                               ("results", "../evil.sqlite")),
    "diagnose, a shape error suggests what diagnose has": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:5"], 2,
        "A factory's input size may be set with --model-kwargs", ()),
    # round 3, 3: a model that cannot run on the data is bad input
    "init --method lsuv, data of another width": (
        [*_INIT, "--method", "lsuv", "--data", "random:5"], 2,
        "(the model could not run on the data: do --data, --input-shape and the model's input "
        "agree?)", ("out.pt",)),
    "diagnose of float64 data": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "f64.pt"], 2,
        "is torch.float64 and the model's parameters are torch.float32 (mat1 and mat2 must have "
        "the same dtype, but got Double and Float). initlab does not convert data: convert the "
        "data before saving it (x.to(torch.float32), x.float()), or have the factory build the "
        "model in torch.float64\n", ()),
    "init --method lsuv on uint8 data": (
        [*_INIT, "--method", "lsuv", "--data", "u8.pt"], 2,
        "is torch.uint8 and the model's parameters are torch.float32 (mat1 and mat2 must have the "
        "same dtype, but got Byte and Float): integer data reached a layer that computes in "
        "floating point. initlab does not convert data: convert the data before saving it "
        "(x.to(torch.float32), x.float()), scaled as the model expects (image bytes: / 255)",
        ("out.pt",)),
    # round 3, 4: too few batches for --steps, with --max-batches large enough
    "metainit --steps beyond the data, --max-batches large enough": (
        [*_INIT, "--method", "metainit", "--steps", "20", "--max-batches", "40", "--data",
         "rows.pt"], 2,
        "--method metainit --steps 20 needs 20 batches (one per step), but --data rows.pt gave "
        "only 2 (--max-batches is 40); lower --batch-size (now 64), give more data or lower "
        "--steps to 2", ("out.pt",)),
    "gradinit --steps beyond --max-batches": (
        [*_INIT, "--method", "gradinit", "--steps", "20", "--max-batches", "10", "--data",
         "rows.pt", "--batch-size", "10"], 2,
        "gave only 10 (--max-batches is 10); pass --max-batches 21 or more or lower --steps to 9",
        ("out.pt",)),
    "gradinit on one batch, no --steps": (
        [*_INIT, "--method", "gradinit", "--data", "rows.pt", "--batch-size", "128"], 2,
        "--method gradinit needs 2 batches (each step reads batch t and t+1), but --data rows.pt "
        "gave only 1 (--max-batches is 8); lower --batch-size (now 128) or give more data",
        ("out.pt",)),
    # round 3, 5, 7, 8, 9: empty lists, shapes, biases, scheme aliases
    "doctor --fix ''": (["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--fix", ""],
                        2, "--fix '' names no fix; give e.g. --fix init,lsuv", ()),
    "doctor --fix ,": (["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--fix", ","],
                       2, "--fix ',' names no fix", ()),
    "demo --schemes ''": (["demo", "--schemes", "", "--out", "dm"], 2,
                          "--schemes '' names no scheme", ("dm",)),
    "demo --schemes, an alias and its scheme": (
        ["demo", "--schemes", "kaiming,fan_in", "--out", "dm"], 2,
        "--schemes kaiming,fan_in: fan_in given twice (kaiming and fan_in are both fan_in)",
        ("dm",)),
    "--data random:abc": ([*_INIT, "--method", "lsuv", "--data", "random:abc"], 2,
                          "--data random:abc: 'abc' is not a shape (positive sizes joined by x); "
                          "write e.g. --data random:3x32x32", ("out.pt",)),
    # a truncated shape ran on the shape its empty sizes were dropped from: 3x32x read (3, 32)
    "--data random:3x": ([*_INIT, "--method", "lsuv", "--data", "random:3x"], 2,
                         "--data random:3x: '3x' is not a shape (positive sizes joined by x; it "
                         "has an empty size); write e.g. --data random:3x32x32", ("out.pt",)),
    "--data random:x4": ([*_INIT, "--method", "lsuv", "--data", "random:x4"], 2,
                         "--data random:x4: 'x4' is not a shape", ("out.pt",)),
    "--input-shape 4x": ([*_INIT, "--method", "lsuv", "--input-shape", "4x"], 2,
                         "--input-shape 4x: '4x' is not a shape (positive sizes joined by x; it "
                         "has an empty size); write e.g. --input-shape 3x32x32", ("out.pt",)),
    "--input-shape 2xx2": ([*_INIT, "--method", "lsuv", "--input-shape", "2xx2"], 2,
                           "--input-shape 2xx2: '2xx2' is not a shape", ("out.pt",)),
    "--input-shape 1_0": ([*_INIT, "--method", "lsuv", "--input-shape", "1_0"], 2,
                          "--input-shape 1_0: '1_0' is not a shape (positive sizes joined by x; "
                          "the size '1_0' has an underscore)", ("out.pt",)),
    # what the refusal of a size int() reads says what is wrong with it (was: only 'positive
    # sizes joined by x', which '+3' seems to be)
    "--input-shape +3": ([*_INIT, "--method", "lsuv", "--input-shape", "+3"], 2,
                         "--input-shape +3: '+3' is not a shape (positive sizes joined by x; the "
                         "size '+3' has a sign); write e.g. --input-shape 3x32x32", ("out.pt",)),
    "--data random:4x0": ([*_INIT, "--method", "lsuv", "--data", "random:4x0"], 2,
                          "--data random:4x0: '4x0' is not a shape (positive sizes joined by x; a "
                          "size is 0)", ("out.pt",)),
    "--data random:3 2": ([*_INIT, "--method", "lsuv", "--data", "random:3 2"], 2,
                          "--data random:3 2: '3 2' is not a shape (positive sizes joined by x; "
                          "the size '3 2' has a space inside)", ("out.pt",)),
    "--bias nan": ([*_INIT, "--bias", "nan"], 2,
                   "--bias 'nan': give 'zeros', 'keep' (the factory's biases) or a finite number",
                   ("out.pt",)),
    "--bias=-inf": ([*_INIT, "--bias=-inf"], 2, "--bias '-inf': give", ("out.pt",)),
    # the flags, not the Python API, in the advice
    "a batch of one example into a batch norm": (
        ["diagnose", "--model", "mods.py:bn", "--data", "rows.pt", "--batch-size", "1",
         "--max-batches", "1"], 2,
        "to normalize: use --batch-size 2 or more, one that leaves no last batch of a single "
        "example (or lower --max-batches); data that is already batched must leave out its "
        "batches of one example (Expected more than 1 value", ()),
    "a lazy layer, init without data": (
        ["init", "--model", "mods.py:lazy", "--out", "o.pt"], 2,
        "init_model: 2.weight, 2.bias of the model are uninitialized (a lazy module, e.g. "
        "nn.LazyLinear, before its first forward pass); make the --model factory run one "
        "forward pass on a dummy batch before it returns the model", ("o.pt",)),
    "a lazy layer, diagnose": (
        ["diagnose", "--model", "mods.py:lazy", "--data", "random:4"], 2,
        "diagnose: 2.weight, 2.bias of the model are uninitialized (a lazy module, e.g. "
        "nn.LazyLinear, before its first forward pass); make the --model factory run one "
        "forward pass on a dummy batch before it returns the model", ()),
    # round 3, 6: Python code in a message stays Python
    "--how parametrize names the Python call": (
        [*_INIT, "--method", "precondition", "--how", "parametrize"], 2,
        "or call `initlab.precondition_(model, data, loss_fn, how='parametrize')` in Python",
        ("out.pt",)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_ERRORS))
def test_bad_input_is_one_line_naming_the_flag_and_creates_nothing(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    argv, code, text, absent = _ERRORS[name]
    got, _, err = _run(argv, capsys)
    assert got == code, err
    assert text in err
    assert "Traceback" not in err
    assert "--input-shape" not in err or argv[0] == "init"
    for path in absent:
        assert not (cli_dir / path).exists(), path
    assert not list(cli_dir.glob(".initlab-write-test-*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_before_the_store(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run([*_RUN, "--device", "cuda"], capsys)
    assert code == 2
    assert "--device cuda: CUDA is not available here" in err
    assert not (cli_dir / "st").exists()


def test_python_dash_m_initlab_is_the_initlab_command(tmp_path: Path) -> None:
    runs = [
        subprocess.run([*cmd, "schemes"], capture_output=True, text=True, check=False)
        for cmd in ([sys.executable, "-m", "initlab"], [sys.executable, "-m", "initlab.cli"])
    ]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    bad = subprocess.run(
        [sys.executable, "-m", "initlab", "init", "--model", "no_colon", "--out",
         str(tmp_path / "x.pt")], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("initlab init: error: --model must look like")


class _ClosedPipe:
    """A stdout whose reader went away."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("extra", [[], ["--method", "lsuv", "--data", "random:4"]])
def test_a_closed_stdout_still_writes_the_files(
    cli_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    extra: list[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main([*_INIT, "--report", "r.json", *extra])
    assert code == 0
    assert set(torch.load(cli_dir / "out.pt", weights_only=True)) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }
    assert json.loads((cli_dir / "r.json").read_text())
    assert "Broken pipe" not in capsys.readouterr().err


def test_a_pipe_closed_by_the_reader_in_a_shell(tmp_path: Path) -> None:
    out, report = tmp_path / "bp.pt", tmp_path / "bp.json"
    cmd = (
        f"'{sys.executable}' -m initlab init --model zoo:paper_mlp --out '{out}' "
        f"--report '{report}' | true; echo rc=${{PIPESTATUS[0]}}"
    )
    result = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=False)
    assert "rc=0" in result.stdout, result.stderr
    assert "Broken pipe" not in result.stderr and "Traceback" not in result.stderr
    assert out.stat().st_size > 0 and report.stat().st_size > 0


def test_precondition_how(cli_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["init", "--model", "mods.py:mlp", "--scheme", "geometric", "--seed", "1"]
    data = ["--data", "mods.py:data_ok", "--loss", "cross_entropy"]
    assert main([*base, "--out", "plain.pt"]) == 0
    capsys.readouterr()
    assert main([*base, *data, "--method", "precondition", "--out", "lr.pt"]) == 0
    out = capsys.readouterr().out
    assert "leaves the weights unchanged" in out and "add --report FILE" in out
    assert main([*base, *data, "--method", "precondition", "--how", "lr", "--report", "lr.json",
                 "--out", "lr.pt"]) == 0  # fmt: skip
    assert "lr_scale_sgd and lr_scale_adam, in lr.json (its rows whose table is precondition_)" in (
        capsys.readouterr().out
    )
    rows = json.loads((cli_dir / "lr.json").read_text())
    assert {r["lr_scale_sgd"] for r in rows if r["table"] == "precondition_"} != {1.0}
    assert main([*base, *data, "--method", "precondition", "--how", "rescale",
                 "--out", "rescale.pt"]) == 0  # fmt: skip
    assert "unchanged" not in capsys.readouterr().out
    plain, lr, rescaled = (
        torch.load(cli_dir / f, weights_only=True) for f in ("plain.pt", "lr.pt", "rescale.pt")
    )
    assert all(torch.equal(plain[k], lr[k]) for k in plain)
    assert not torch.equal(plain["0.weight"], rescaled["0.weight"])
    # rescaling keeps the network's function
    sys.path.insert(0, str(cli_dir))
    try:
        import mods  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(cli_dir))
    a, b = mods.mlp(), mods.mlp()
    a.load_state_dict(plain)
    b.load_state_dict(rescaled)
    x = torch.randn(5, 4)
    torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-5)


def test_steps_raise_the_default_max_batches(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "init",
        "--model",
        "mods.py:mlp",
        "--method",
        "gradinit",
        "--data",
        "random:4",
        "--loss",
        "random_quadratic",
        "--steps",
        "9",
        "--batch-size",
        "8",
        "--out",
        "g.pt",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert "steps=9" in capsys.readouterr().out.replace(" ", "")


def test_library_warnings_are_one_line_in_the_flags_words(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code, _, err = _run(["init", "--model", "mods.py:scaled", "--out", "o.pt"], capsys)
    assert code == 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("initlab init: warning: init_model left 1 parameter(s)")
    assert "--policy skip" in lines[0] and "UserWarning" not in err


@pytest.mark.parametrize(
    ("library", "cli", "python_words"),
    [
        ("Download it there, or point root= or the INITLAB_DATA_DIR environment variable at the "
         "folder holding libsvm/", "pass --data-dir", "root="),
        ("register one or pass policy='warn' or 'skip'", "--policy warn or --policy skip",
         "policy="),
        ("doctor: unknown fix 'x'; valid: init, lsuv (or True)", "--fix alone", "True"),
        ("the model has no parameters; use modules='leaves' or 'all' to probe it",
         "give a model with parameters", "modules="),
        ("Pass (x, y) batches, forward=lambda model, batch: ... with a loss on the outputs, or a "
         "loss_fn(model, batch) that calls the model itself", "--loss pkg.module:fn", "lambda"),
        ("say which: initlab.Batches([...]) for 3 batches, or a tuple (x, y, ...) for one batch",
         "a list of (x, y) tuples for 3 batches", "initlab.Batches"),
        ("n_boot must be >= 1, got 0", "--n-boot must be >= 1", "n_boot"),
        ("level must be in (0, 1), got 2", "--level must be in (0, 1)", "level must"),
        ("how='rescale' changed the network function; use how='lr' or how='parametrize'",
         "--how rescale changed the network function; use --how lr (", "how="),
        ("got outputs (50, 3) and targets (50, 2). Reshape the targets, or pass a "
         "loss_fn(model, batch) that pairs them", "pass --loss pkg.module:fn, a function",
         "a loss_fn"),
        ("MomentProbe(modules='params') selects no module: the model has no parameters; give a "
         "model with parameters", "the --model has no parameters", "MomentProbe"),
        ("gradinit_ differentiates the loss twice (...). Use twice-differentiable operations in "
         "the model (...), or raise gamma above the gradient norms of the trace so that no "
         "constraint step is taken (the objective steps of exact=False are first-order)",
         "or use --method lsuv or --method scale_output, which need no derivative",
         "raise gamma"),
        ("drop short batches (a DataLoader's last batch: DataLoader(..., drop_last=True)) (x)",
         "use --batch-size 2 or more", "DataLoader"),
        ("Drop empty batches (filter them out, or use a DataLoader with drop_last=True)",
         "(leave them out of the --data file or function)", "DataLoader"),
        ("  not changed (fix=False); the same command with --fix applies the fixes",
         "not changed (no --fix);", "fix=False"),
        ("  initial_loss, no fix here: mild (warn): shrinking the outputs also slows their "
         "learning; doctor(model, data, fix='output_scale') scales them anyway",
         "learning; the same command with --fix output_scale scales them anyway", "fix="),
        ("  gamma_spread, no fix here: reported, not treated; block_curvature(model, data) "
         "measures the curvature", "not treated; initlab diagnose --curvature measures",
         "block_curvature"),
        ("  with report.param_groups(model, lr=...): γ spread 1 over every weight layer (the "
         "model itself is unchanged by precondition_)",
         "with precondition's per-layer learning rates (which `initlab init --method "
         "precondition --how lr --report FILE` writes): γ spread 1", "param_groups"),
        ("a; balanced by precondition_: train with report.param_groups(model, lr=...)",
         "balanced by precondition: train with its per-layer learning rates, which `initlab "
         "init --method precondition --how lr --report FILE` writes", "precondition_"),
        ("x.weight is an uninitialized lazy parameter; run a forward pass (or materialize the "
         "module) before asking for its fans", "make the --model factory run one forward pass",
         "materialize"),
        ("the default forward: a tuple batch is passed to the model as model(batch[0]) (...). "
         "Pass dict batches of its keyword arguments, a loss_fn(model, batch) that calls the "
         "model itself and names the target (e.g. loss_fn=lambda model, batch: "
         "F.cross_entropy(model(batch[0], batch[1]), batch[2]) for (x, z, y) batches), or, "
         "where the function takes one, a forward= that leaves the target at batch[1], where a "
         "loss reads it: forward=lambda model, batch: model(batch[0], *batch[2:]) for (x, y, "
         "z, ...) batches (model(*batch) where no loss reads a target)",
         "Make --data give dict batches of its keyword arguments, or pass --loss pkg.module:fn",
         "forward="),
        ("  note: the output scale is a forward hook on 2 (not in the state_dict); "
         "report.reports['output_scale'].info['handle'].remove() undoes it",
         "the command does not save the model", "info['handle']"),
    ],
)  # fmt: skip
def test_python_wording_is_translated_to_flags(library: str, cli: str, python_words: str) -> None:
    said = translate(library)
    assert cli in said
    assert python_words not in said.replace("--level must", "")


def test_bench_run_prints_a_readable_summary_and_report_checks_its_options(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run([*_RUN, "--quiet", "--debug"], capsys)  # --debug after the command
    assert code == 0, err
    assert "StudySummary(" not in out
    assert "study tiny: 2 runs, 0 already stored, 2 trained now" in out
    store = ["bench", "report", "st/s.sqlite", "--no-plots", "--n-boot", "20"]
    code, _, err = _run([*store, "--reference", "nosuch", "--debug"], capsys)
    assert code == 2
    assert "--reference 'nosuch' is not a scheme of st/s.sqlite; valid: fan_in, geometric" in err
    assert "Traceback" in err  # --debug after `bench report`
    assert not (cli_dir / "st" / "s-report").exists()
    code, out, err = _run([*store, "--reference", "fan_in"], capsys)
    assert code == 0, err


def test_format_summary_lists_extension_and_failures() -> None:
    from initlab.study.runner import StudySummary

    summary = StudySummary("s", Path("x.sqlite"), 8, 2, n_trained=8, n_failed=1, n_chunks=2,
                           n_extended=3, n_extended_new=3, extension_rounds=1,
                           edges_left=["v/d/s (low)"],
                           wall_s=1.5, errors=["Traceback ...\nValueError: boom"])  # fmt: skip
    text = format_summary(summary)
    assert text.splitlines()[0] == (
        "study s: 11 runs (8 of the spec's grid, 3 added by grid extension), 2 already stored, "
        "8 trained now (2 chunk(s)), 0 by other drivers, 1 failed (1.5 s)"
    )
    assert "grid extension: 1 round(s), 3 run(s) beyond the spec's grid, 3 of them new" in text
    again = StudySummary("s", Path("x.sqlite"), 8, 8, n_extended=3, extension_rounds=1)
    assert "3 run(s) beyond the spec's grid, 0 of them new in this call" in format_summary(again)
    assert "v/d/s (low)" in text and "failed chunk: ValueError: boom" in text


def test_bench_run_counts_the_runs_grid_extension_added(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench run --extend-rounds` printed "24 runs, 0 already stored, 40 trained now": the
    runs counted the spec's grid, the trained ones the extension's too. The runs now count both,
    saying how many each; the counts add up to the runs in the store."""
    import sqlite3

    (cli_dir / "two.yaml").write_text(textwrap.dedent(_SPEC).replace("[0.1]", "[0.5, 0.25]"))
    grid = 1 * 2 * 1 * 2  # data sets × schemes × seeds × rates of the spec

    def stored() -> int:
        with contextlib.closing(sqlite3.connect(cli_dir / "st" / "x.sqlite")) as db:
            return int(db.execute("SELECT count(*) FROM runs").fetchone()[0])

    run = ["bench", "run", "two.yaml", "--store", "st/x.sqlite", "--quiet", "--extend-rounds"]
    code, out, err = _run([*run, "1"], capsys)
    assert code == 0, err
    first = stored()
    assert first > grid  # the best rates sat at an edge: the grid was extended
    assert out.splitlines()[0].startswith(
        f"study tiny: {first} runs ({grid} of the spec's grid, {first - grid} added by grid "
        f"extension), 0 already stored, {first} trained now ("
    )
    code, out, err = _run([*run, "2"], capsys)
    assert code == 0, err
    second = stored()
    assert out.splitlines()[0].startswith(
        f"study tiny: {second} runs ({grid} of the spec's grid, {second - grid} added by grid "
        f"extension), {first} already stored, {second - first} trained now ("
    )


def test_bench_run_finished_line_counts_the_runs_grid_extension_added(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runner's "finished:" line said "0 runs trained, 4 skipped" where the summary below it
    said "N runs (4 of the spec's grid, N - 4 added by grid extension), N already stored": the
    extension runs found stored were in neither count. Its counts are the summary's (the store's
    runs before and after each call)."""
    import sqlite3

    (cli_dir / "two.yaml").write_text(textwrap.dedent(_SPEC).replace("[0.1]", "[0.5, 0.25]"))

    def stored() -> int:
        with contextlib.closing(sqlite3.connect(cli_dir / "st" / "x.sqlite")) as db:
            return int(db.execute("SELECT count(*) FROM runs").fetchone()[0])

    run = ["bench", "run", "two.yaml", "--store", "st/x.sqlite", "--extend-rounds"]
    before = 0
    for rounds in ("1", "1", "2"):
        code, out, err = _run([*run, rounds], capsys)
        assert code == 0, err
        after = stored()
        assert after > 4, err  # the best rates sat at an edge: the grid was extended
        finished = [line for line in err.splitlines() if "] finished: " in line]
        assert len(finished) == 1 and finished[0].startswith(
            f"[tiny] finished: {after - before} runs trained, {before} already stored, 0 trained "
            "by another driver, 0 failed, "
        ), err
        assert f"), {before} already stored, {after - before} trained now (" in out, out
        before = after


def test_data_prints_the_root_and_warns_when_it_is_missing(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(["data", "--data-dir", "/nonexistent"], capsys)
    assert code == 0
    assert "data root: /nonexistent (from --data-dir)" in out
    assert (
        "initlab data: warning: the data root /nonexistent (from --data-dir) does not exist; only "
        "the bundled scikit-learn sets are available: put the named sets there (libsvm/, mnist/, "
        "...), or pass --data-dir (or set INITLAB_DATA_DIR) with the folder that holds them"
    ) in err
    code, _, err = _run(["data", "--data-dir", "afile"], capsys)
    assert code == 0
    assert "the data root afile (from --data-dir) is not a folder; only the bundled" in err


def test_data_and_the_help_say_where_the_cache_is(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A named --data is decoded into a cache that no help text named."""
    monkeypatch.setenv("INITLAB_CACHE_DIR", str(cli_dir / "cc"))
    code, out, _ = _run(["data", "--data-dir", "/nonexistent"], capsys)
    assert code == 0 and f"cache: {cli_dir / 'cc'} (from $INITLAB_CACHE_DIR;" in out
    monkeypatch.delenv("INITLAB_CACHE_DIR")
    _, out, _ = _run(["data", "--data-dir", "/nonexistent"], capsys)
    assert f"cache: {Path.home() / '.cache' / 'initlab'} (the default;" in out
    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    assert "$INITLAB_CACHE_DIR, else ~/.cache/initlab" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("given", "warning"),
    [
        (
            "root/libsvm",
            "root/libsvm is one of a data root's folders (libsvm/), not the root: "
            "pass the folder that holds it, root; the named sets under root/libsvm show as not "
            "available",
        ),
        (".", ". holds no named set, but root holds some: pass that folder"),
        ("flat", "flat holds LIBSVM files; the loader reads them from flat/libsvm/"),
    ],
)
def test_data_says_when_the_root_is_a_level_off(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], given: str, warning: str
) -> None:
    (cli_dir / "root" / "libsvm").mkdir(parents=True)
    (cli_dir / "root" / "libsvm" / "iris.scale").write_text("1 1:1\n")
    (cli_dir / "flat").mkdir()
    (cli_dir / "flat" / "iris.scale").write_text("1 1:1\n")
    code, _, err = _run(["data", "--data-dir", given], capsys)
    assert code == 0
    assert f"initlab data: warning: {warning}" in err
    code, _, err = _run(["data", "--data-dir", "root"], capsys)
    assert code == 0 and "warning" not in err


def test_seed_seeds_the_model_construction(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["init", "--model", "mods.py:mlp", "--method", "lsuv", "--data", "random:4"]
    for name, seed in (("a.pt", "3"), ("b.pt", "3"), ("c.pt", "4")):
        assert main([*argv, "--seed", seed, "--out", name]) == 0
    a, b, c = (torch.load(cli_dir / n, weights_only=True) for n in ("a.pt", "b.pt", "c.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["0.weight"], c["0.weight"])
    spreads = []
    for _ in range(2):
        assert main(["doctor", "--model", "zoo:paper_mlp", "--data", "random", "--seed", "5"]) == 0
        spreads.append([ln for ln in capsys.readouterr().out.splitlines() if "γ spread" in ln])
    assert spreads[0] and spreads[0] == spreads[1]


@pytest.mark.parametrize(
    ("argv", "texts"),
    [
        (["init", "--help"], ["(default: 64)", "(default: warn)", "(default: 0)", "model",
                              "(default: 8, or what --steps needs",
                              "lsuv rescales the --scheme's weights and keeps its --bias; without "
                              "--scheme, lsuv first replaces the factory's weights"]),
        (["doctor", "--help"], ["(default: 4;", "seeds the model's construction",
                                "data that is already batched (a list of batches) keeps its own"]),
        (["diagnose", "--help"], ["seeds the model's construction", "random_quadratic | model",
                                  "| file.pt | pkg.module:fn | file.py:fn (default: random",
                                  "| pkg.module:fn | file.py:fn (fn(model, batch) -> scalar)"]),
        (["init", "--help"], ["| file.pt | pkg.module:fn | file.py:fn",
                              "| pkg.module:fn | file.py:fn (fn(model, batch) -> scalar)"]),
        (["doctor", "--help"], ["| file.pt | pkg.module:fn | file.py:fn",
                                "| pkg.module:fn | file.py:fn (fn(model, batch) -> scalar)"]),
        (["demo", "--help"], ["study's seeds (SEED", "step 1's measured batch",
                              "(all of --schemes when it names none of these four)"]),
        (["data", "--help"], ["else ~/initlab-data"]),
        (["bench", "run", "--help"], ["--debug", "cpu, cuda, cuda:N or mps"]),
        (["bench", "report", "--help"], ["--debug", "one of the store's schemes"]),
    ],
)  # fmt: skip
def test_help_shows_defaults_and_what_options_affect(
    capsys: pytest.CaptureFixture[str], argv: list[str], texts: list[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    out = " ".join(capsys.readouterr().out.split())
    for text in texts:
        assert text in out


def test_demo_study_is_keyed_by_its_options(tmp_path: Path) -> None:
    from initlab.cli.demo import demo_study, demo_study_name

    small = {"seeds": 1, "lrs": (0.125,), "epochs": 1, "progress": False}
    first = demo_study(tmp_path, ("fan_in", "geometric"), seed=0, **small)
    assert {r["scheme"] for r in first.to_rows()} == {"fan_in", "geometric"}
    second = demo_study(tmp_path, ("geometric",), seed=1, **small)
    assert {r["scheme"] for r in second.to_rows()} == {"geometric"}
    from initlab.study.store import Store

    with Store(tmp_path / "demo.sqlite") as store:
        names = set(store.studies())
        assert demo_study_name(["geometric"], seed=1, seeds=1, lrs=(0.125,), epochs=1) in names
        seeds = {
            r["seed"]
            for r in store.records(
                demo_study_name(["geometric"], seed=1, seeds=1, lrs=(0.125,), epochs=1)
            )
        }
    assert seeds == {1}
    assert len(names) == 2
    assert demo_study_name(["fan_in"], seed=0) != demo_study_name(["fan_in"], seed=1)


def test_seed_and_batch_size_reach_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--seed", "2", "--batch-size", "64"]) == 0
    assert "seed 2, batch 64" in capsys.readouterr().out
    code, _, err = _run(["demo", "--quick", "--batch-size", "1"], capsys)
    assert code == 2 and "argument --batch-size: must be in [2, 1797]" in err


@contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """``path`` (a file or a folder) cannot be written while in the block: chmod, or, for root
    (whom chmod does not stop), ``chattr +i``; skips the test where neither works."""
    mode = path.stat().st_mode
    path.chmod(mode & ~0o222)
    chattr = False
    try:
        probe = path / ".probe" if path.is_dir() else path
        try:
            with open(probe, "ab"):
                pass
        except OSError:
            pass
        else:
            if path.is_dir():
                probe.unlink()
            chattr = subprocess.run(["chattr", "+i", str(path)], capture_output=True,
                                    check=False).returncode == 0  # fmt: skip
            if not chattr:
                pytest.skip("cannot make a path read-only here (root without chattr)")
        yield
    finally:
        if chattr:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
        path.chmod(mode)


def test_bench_report_without_the_default_reference_and_on_read_only_stores(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (cli_dir / "one.yaml").write_text(textwrap.dedent(_SPEC).replace("fan_in, geometric",
                                                                     "fan_in"))  # fmt: skip
    code, out, err = _run(["bench", "run", "one.yaml", "--store", "my st/s.sqlite", "--quiet"],
                          capsys)  # fmt: skip
    assert code == 0, err
    assert "report: initlab bench report 'my st/s.sqlite'" in out  # a command to paste
    report = ["bench", "report", "my st/s.sqlite", "--no-plots", "--n-boot", "20"]
    # 1: no geometric runs, no --reference: the report without paired comparisons
    code, _, err = _run(report, capsys)
    assert code == 0, err
    assert "warning: no geometric runs in my st/s.sqlite, so no paired comparisons" in err
    assert "reference scheme" not in err  # said once, in the command line's words
    assert (cli_dir / "my st" / "s-report" / "table2.md").is_file()
    code, _, err = _run([*report, "--reference", "geometric"], capsys)
    assert code == 2 and "--reference 'geometric' is not a scheme of my st/s.sqlite" in err
    code, _, err = _run([*report, "--out", ""], capsys)
    assert code == 2 and "--out is empty" in err
    code, _, err = _run([*report, "--out", "afile"], capsys)
    assert code == 2 and "--out afile: afile is a file" in err
    # 2, 3: a store that cannot be written: reported (read-only: nothing written beside it);
    # running into it is refused before anything is made
    for ro in (cli_dir / "my st" / "s.sqlite", cli_dir / "my st"):
        for log in (cli_dir / "my st").glob("s.sqlite-*"):  # no connection is open
            log.unlink()
        before = sorted(p.name for p in (cli_dir / "my st").iterdir())
        with _read_only(ro):
            code, _, err = _run([*report, "--out", f"r-{ro.name}"], capsys)
            assert code == 0, err
            assert (cli_dir / f"r-{ro.name}" / "table2.md").is_file()
            code, _, err = _run(["bench", "run", "one.yaml", "--store", "my st/s.sqlite"], capsys)
            assert code == 2 and "--store my st/s.sqlite: cannot write" in err, err
        # (SQLite's shared-memory files of a read-only WAL reader may appear where it can)
        after = [
            p.name for p in (cli_dir / "my st").iterdir() if not p.name.endswith(("-wal", "-shm"))
        ]
        assert sorted(after) == before
    assert (cli_dir / "zero.sqlite").read_bytes() == b""
    assert _run(["bench", "report", "zero.sqlite"], capsys)[0] == 2
    assert (cli_dir / "zero.sqlite").read_bytes() == b""  # not made a store


@pytest.mark.parametrize(
    ("argv", "warning"),
    [
        (["init", "--model", "mods.py:mlp", "--out", "o.pt", "--batches", "2", "--method", "lsuv",
          "--data", "random:4"],
         "initlab init: warning: --batches is deprecated; use --max-batches"),
        (["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--batches", "2"],
         "initlab doctor: warning: --batches is deprecated"),
        (["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--data-dir", "/nope",
          "--max-batches", "1"],
         "initlab diagnose: warning: --data-dir is only used with a named data set"),
        (["init", "--model", "mods.py:mlp", "--out", "o.pt", "--method", "lsuv", "--data",
          "random:4", "--how", "parametrize"],
         "initlab init: warning: --how is only used with --method precondition"),
        ([*_RUN, "--quiet", "--ray-address", "x:1"],
         "initlab bench run: warning: --ray-address is only used with --backend ray"),
        ([*_INIT, "--data", "random:4"], "initlab init: warning: --data only used with --method"),
        ([*_INIT, "--input-shape", "4", "--steps", "3"],
         "initlab init: warning: --input-shape, --steps only used"),
        ([*_INIT, "--method", "lsuv", "--data", "random:4", "--loss", "mse"],
         "initlab init: warning: --loss is only used with --method gradinit or metainit or "
         "precondition"),
        ([*_INIT, "--method", "lsuv", "--data", "random:4", "--steps", "5"],
         "initlab init: warning: --steps is only used with --method gradinit or metainit"),
        ([*_INIT, "--method", "lsuv", "--data", "mods.py:data_ok", "--input-shape", "4"],
         "initlab init: warning: --input-shape is only used with random data"),
        ([*_INIT, "--method", "lsuv", "--data", "random:4", "--bias", "0.5"],
         "initlab init: warning: --bias is only used with --scheme (the scheme sets the biases); "
         "ignored with --method lsuv alone"),
        (["diagnose", "--model", "mods.py:mlp", "--data", "mods.py:data_ok", "--batch-size", "8",
          "--max-batches", "1"],
         "initlab diagnose: warning: --batch-size is ignored with --data mods.py:data_ok: the "
         "data is already batched (its batches are used as they are, 1 of them here)"),
        (["doctor", "--model", "mods.py:mlp", "--data", "mods.py:data_ok", "--batch-size", "8"],
         "initlab doctor: warning: --batch-size is ignored with --data mods.py:data_ok"),
        (["demo", "--quick", "--out", "dq", "--batch-size", "64"],
         "initlab demo: warning: --out is unused with --quick (step 1 only, which writes "
         "nothing)"),
        ([*_INIT, "--method", "lsuv", "--data", "mods.py:data_ok", "--batch-size", "8"],
         "initlab init: warning: --batch-size is ignored with --data mods.py:data_ok"),
    ],
)  # fmt: skip
def test_deprecated_and_unused_options_are_named(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], warning: str
) -> None:
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    assert warning in err
    assert "error" not in err  # --how parametrize with lsuv: noted, not refused as well


def test_bench_takes_debug_and_names_its_subcommands(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["bench", "--debug", "run", "nosuch.yaml"], capsys)
    assert code == 2 and "Traceback" in err and "study spec nosuch.yaml does not exist" in err
    code, _, err = _run(["bench"], capsys)
    assert code == 2 and "required: {run,report}" in err
    code, _, err = _run([], capsys)
    assert code == 2 and "required: {schemes,init,diagnose,doctor,data,bench,demo}" in err


_COUNTED_LOSS = """
from pathlib import Path
import torch.nn.functional as F

with Path("runs.txt").open("a") as f:
    f.write("ran\\n")

def loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])
"""


def test_a_loss_file_runs_once_per_command(cli_dir: Path, capsys: pytest.CaptureFixture[str]):
    """--loss file.py:fn is resolved when the options are checked and used later: the file is
    executed once (it ran twice), and again once it changes."""
    (cli_dir / "lossfile.py").write_text(_COUNTED_LOSS)
    argv = ["diagnose", "--model", "mods.py:mlp", "--data", "mods.py:data_ok",
            "--loss", "lossfile.py:loss"]  # fmt: skip
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    assert (cli_dir / "runs.txt").read_text() == "ran\n"
    (cli_dir / "lossfile.py").write_text(_COUNTED_LOSS + "\n# changed\n")
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    assert (cli_dir / "runs.txt").read_text() == "ran\nran\n"


def test_batch_size_is_noted_only_where_given_and_unused(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for data in (["--data", "mods.py:data_ok"], ["--data", "rows.pt", "--batch-size", "8"]):
        code, _, err = _run([*_INIT, "--method", "lsuv", *data], capsys)
        assert code == 0, err
        assert "--batch-size" not in err


def test_translate_keeps_code_in_backticks() -> None:
    said = translate("use how='lr', or call `initlab.precondition_(m, d, how='lr')` (how='lr')")
    assert said == "use --how lr, or call `initlab.precondition_(m, d, how='lr')` (--how lr)"


def test_a_bad_input_shape_is_refused_before_any_warning(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run([*_INIT, "--input-shape", "abc"], capsys)
    assert code == 2
    assert err.splitlines() == [
        "initlab init: error: --input-shape abc: 'abc' is not a shape (positive sizes joined by "
        "x); write e.g. --input-shape 3x32x32"
    ]
    assert not (cli_dir / "out.pt").exists()


@pytest.mark.parametrize("spaced", ["random:4 ", "random: 4", "random:\t4\n"])
def test_spaces_around_a_shape_size_are_left_out(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], spaced: str
) -> None:
    """'3, 32, 32' and '3x32x32 ' were refused since every size had to be digits (they ran as
    (3, 32, 32) before): the run on --data random:4 with spaces is the run on random:4."""
    from initlab.cli.inputs import parse_shape

    for text in ("3, 32, 32", "3x32x32 ", " 3 x 32 x32", "3,32,\t32"):
        assert parse_shape(text) == (3, 32, 32), text
    saved = []
    for data in ("random:4", spaced):
        code, _, err = _run([*_INIT, "--method", "lsuv", "--data", data, "--seed", "0"], capsys)
        assert code == 0, err
        saved.append(torch.load(cli_dir / "out.pt", weights_only=True))
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


@pytest.fixture
def badpkg(cli_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package on the import path whose modules fail at import."""
    pkg = cli_dir / "clibadpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "syn.py").write_text("def f(:\n  pass\n")
    (pkg / "raises.py").write_text("raise RuntimeError('import fails')\n")
    (pkg / "exits.py").write_text("import sys; sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(cli_dir))
    yield pkg
    for name in [n for n in sys.modules if n.split(".")[0] == "clibadpkg"]:
        del sys.modules[name]


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["init", "--model", "clibadpkg.syn:f", "--out", "o.pt"],
         "--model clibadpkg.syn:f: importing clibadpkg.syn failed: SyntaxError: "),
        (["diagnose", "--model", "mods.py:mlp", "--data", "clibadpkg.raises:f"],
         "--data clibadpkg.raises:f: importing clibadpkg.raises failed: RuntimeError: import "
         "fails"),
        (["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--loss",
          "clibadpkg.exits:f"],
         "--loss clibadpkg.exits:f: importing clibadpkg.exits failed: SystemExit: it called "
         "sys.exit(3)"),
    ],
)  # fmt: skip
def test_a_module_that_fails_to_import_is_bad_input_naming_the_flag(
    badpkg: Path, capsys: pytest.CaptureFixture[str], argv: list[str], text: str
) -> None:
    code, _, err = _run(argv, capsys)
    assert code == 2, err
    assert f"error: {text}" in err
    assert not (badpkg.parent / "o.pt").exists()


def test_a_module_of_the_current_folder_gets_a_hint(
    cli_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (cli_dir / "clihere.py").write_text(textwrap.dedent(_MODELS))
    (cli_dir / "clihere_pkg").mkdir()
    (cli_dir / "clihere_pkg" / "__init__.py").write_text(textwrap.dedent(_MODELS))
    here = {"", ".", str(cli_dir)}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in here])  # as the script
    code, _, err = _run(["init", "--model", "clihere:mlp", "--out", "o.pt"], capsys)
    assert code == 2
    assert (
        "cannot import 'clihere' for --model: No module named 'clihere'; clihere.py is in this "
        "folder, which is not on the import path: use --model clihere.py:mlp, or PYTHONPATH=."
    ) in err
    code, _, err = _run(["init", "--model", "clihere_pkg:mlp", "--out", "o.pt"], capsys)
    assert code == 2 and "clihere_pkg is a package in this folder" in err
    code, _, err = _run(["init", "--model", "clinowhere:mlp", "--out", "o.pt"], capsys)
    assert code == 2 and err.rstrip().endswith("No module named 'clinowhere'")


def test_lsuv_after_a_scheme_rescales_its_weights_and_keeps_its_biases(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scheme = [*_INIT[:3], "--scheme", "fan_out", "--bias", "0.5"]
    assert main([*scheme, "--out", "scheme.pt"]) == 0
    assert main([*scheme, "--method", "lsuv", "--data", "random:4", "--out", "lsuv.pt"]) == 0
    out = capsys.readouterr().out
    assert "constant(0.5)" in out and "orthogonal" not in out
    plain, scaled = (torch.load(cli_dir / f, weights_only=True) for f in ("scheme.pt", "lsuv.pt"))
    for key in ("0.weight", "2.weight"):
        factor = scaled[key].norm() / plain[key].norm()
        torch.testing.assert_close(scaled[key], plain[key] * factor)
    assert all(torch.all(scaled[k] == 0.5) for k in ("0.bias", "2.bias"))
    # without --scheme: LSUV's orthogonal pre-init, said so
    assert main([*_INIT, "--method", "lsuv", "--data", "random:4"]) == 0
    assert "note: lsuv replaced the factory's weights with an orthogonal pre-init" in (
        capsys.readouterr().out
    )
    assert all(
        torch.all(torch.load(cli_dir / "out.pt", weights_only=True)[k] == 0)
        for k in ("0.bias", "2.bias")
    )


def test_demo_resolves_scheme_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--schemes", "he,geometric", "--batch-size", "64"]) == 0
    summary = capsys.readouterr().out.split("Balance of the weight-to-gradient ratio")[1]
    assert [line.split()[0] for line in summary.splitlines()[3:5]] == ["fan_in", "geometric"]


def test_bench_report_leaves_the_store_folder_as_it_found_it(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run([*_RUN, "--quiet"], capsys)
    assert code == 0, err
    before = sorted(p.name for p in (cli_dir / "st").iterdir())
    assert before == ["s.sqlite"]
    code, _, err = _run(["bench", "report", "st/s.sqlite", "--no-plots", "--n-boot", "20"],
                        capsys)  # fmt: skip
    assert code == 0, err
    assert sorted(p.name for p in (cli_dir / "st").iterdir()) == ["s-report", "s.sqlite"]


def test_bench_run_refuses_another_application_s_database_unchanged(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench run --store app.db` (a typo) added initlab's tables to that database and switched
    it to WAL, exit 0; `bench report app.db` refused it. Both refuse it, naming the flag, and the
    file is left byte for byte as it was."""
    import sqlite3

    conn = sqlite3.connect(cli_dir / "app.db")
    conn.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    conn.commit()
    conn.close()
    before = (cli_dir / "app.db").read_bytes()
    code, _, err = _run(["bench", "run", "spec.yaml", "--store", "app.db"], capsys)
    assert code == 2, err
    assert err == (
        "initlab bench run: error: --store app.db is a SQLite database but not an initlab store "
        "(it holds the tables users, and no store's meta table); initlab changes nothing in it: "
        "give another --store path (a new file is made there)\n"
    )
    code, _, err = _run(["bench", "report", "app.db", "--no-plots"], capsys)
    assert code == 2, err
    assert (
        "STORE app.db is a SQLite database but not an initlab store (it holds the tables users"
        in err
    )
    assert (cli_dir / "app.db").read_bytes() == before
    assert not list(cli_dir.glob("app*-*"))  # no -wal, -shm, nor app-report


def test_a_store_a_driver_is_still_writing_is_a_store(cli_dir: Path) -> None:
    """A new store's tables are in its driver's write-ahead log until the first checkpoint: the
    check of a report's STORE reads them there (it read the file alone, "not an initlab store")."""
    from initlab.cli._checks import check_store, store_schemes
    from initlab.study.store import Store

    with Store(cli_dir / "new.sqlite") as writer:
        writer.register_study("x", {"name": "x"}, [])
        assert check_store("new.sqlite", flag="STORE", must_exist=True) == Path("new.sqlite")
        assert store_schemes(cli_dir / "new.sqlite") == set()
        assert (cli_dir / "new.sqlite-wal").exists()  # the driver's, left to it
    assert not (cli_dir / "new.sqlite-wal").exists()


def test_doctor_summary_names_the_flags(cli_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doctor = ["doctor", "--model", "mods.py:mlp", "--data", "mods.py:data_ok"]
    code, out, err = _run(doctor, capsys)
    assert code == 0, err
    assert "recommended: nothing\n  not changed (no --fix)\n" in out  # no fix to apply: not offered
    assert "fix=False" not in out
    code, out, err = _run([*doctor, "--fix", "precondition"], capsys)
    assert code == 0, err
    assert (
        "with precondition's per-layer learning rates (which `initlab init --method precondition "
        "--how lr --report FILE` writes): γ spread"
    ) in out
    assert "unchanged by precondition)" in out
    assert "param_groups" not in out and "precondition_" not in out


_DEEP = """
import torch
from torch import nn

def deep():
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(8, 3))
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Linear):
                m.weight.normal_(0, 0.05, generator=g)
                m.bias.zero_()
    return net

def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
            for _ in range(2)]
"""

#: The library's Python wording that a doctor run on the command line must not save.
_API_WORDING = (
    "param_groups(",
    "precondition_:",
    "precondition_'s",
    "unchanged by precondition_",
    "(model, data",
    "init_model(model",
    "fix=",
    "how='",
    "block_curvature",
)


def _strings(obj: object) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def test_doctor_out_saves_what_it_prints(cli_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`doctor --out` wrote doctor.md and doctor.json in the API's wording
    (`report.param_groups(model, lr=...)`, `lsuv_(model, data)`) while it printed the flags: the
    saved files now say what stdout says, the summary in doctor.md being stdout's own."""
    (cli_dir / "deep.py").write_text(textwrap.dedent(_DEEP))
    doctor = ["doctor", "--model", "deep.py:deep", "--data", "deep.py:data"]
    for fix, folder in (([], "plain"), (["--fix"], "fixed")):
        code, out, err = _run([*doctor, *fix, "--out", folder], capsys)
        assert code == 0, err
        printed = out.split("\n\nreport written to")[0]
        md = (cli_dir / folder / "doctor.md").read_text(encoding="utf-8")
        assert md.split("```\n")[1] == printed + "\n"
        saved = _strings(json.loads((cli_dir / folder / "doctor.json").read_text()))
        for text in (md, *saved):
            assert not [w for w in _API_WORDING if w in text], text
        checks = json.loads((cli_dir / folder / "doctor.json").read_text())["checks"]["rows"]
        if fix:  # the param groups' check, the note and the γ spread's reason: their flags
            assert "with precondition's per-layer learning rates (which `initlab init" in printed
            assert sum("initlab init --method precondition --how lr" in t for t in saved) >= 3
            assert "initlab init --method precondition" in checks[-1]["why"]
        else:  # the checks' fixes, named by their flags
            fixes = [r["fix"] for r in checks if r["fix"]]
            assert any(f.startswith("--fix lsuv") for f in fixes), fixes
            assert any(f.startswith("--fix precondition (per-layer") for f in fixes), fixes


def _sklearn_sizes(name: str) -> tuple[int, int]:
    """(features, classes) of a scikit-learn set, read from scikit-learn itself."""
    import sklearn.datasets

    bunch = getattr(sklearn.datasets, f"load_{name}")()
    return int(bunch.data.shape[1]), len(set(bunch.target.tolist()))


@pytest.mark.parametrize(
    ("model", "data", "kwargs", "first", "last"),
    [
        ("paper_mlp", "iris", None, "layers.0.weight", "layers.4.weight"),
        ("lecture_mlp", "wine", None, "input.weight", "output.weight"),
        ("paper_mlp", "wine", {"n_classes": 5}, "layers.0.weight", "layers.4.weight"),
        ("paper_mlp", "iris", {"n_in": 4}, "layers.0.weight", "layers.4.weight"),
    ],
)
def test_a_zoo_model_is_sized_from_a_named_data_set(
    cli_dir: Path,
    capsys: pytest.CaptureFixture[str],
    model: str,
    data: str,
    kwargs: dict[str, int] | None,
    first: str,
    last: str,
) -> None:
    """`init/doctor/diagnose --model zoo:paper_mlp --data sklearn:iris` kept the zoo's sizes (64
    inputs, 10 classes): a raw shape error, then "Target 25 is out of bounds" on letter. A zoo
    model takes n_in and n_classes (n_out) from the data set, as in a study; --model-kwargs win."""
    features, classes = _sklearn_sizes(data)
    given = ["--model-kwargs", json.dumps(kwargs)] if kwargs else []
    argv = ["--model", f"zoo:{model}", "--data", f"sklearn:{data}", *given, "--max-batches", "1"]
    code, _, err = _run(["init", *argv, "--method", "lsuv", "--out", "m.pt"], capsys)
    assert code == 0, err
    state = torch.load(cli_dir / "m.pt", weights_only=True)
    assert state[first].shape[1] == features
    assert state[last].shape[0] == (kwargs or {}).get("n_classes", classes)
    for command in (["doctor"], ["diagnose", "--no-plots"]):
        code, _, err = _run([*command, *argv], capsys)
        assert code == 0, err


def test_a_zoo_model_sized_from_a_data_set_says_what_does_not_fit(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An image model on a set of vectors is refused as a study refuses it, and fewer classes
    given than the data set has (its labels would exceed them) is warned of, naming both."""
    code, _, err = _run(["diagnose", "--model", "zoo:resnet20", "--data", "sklearn:iris"], capsys)
    assert code == 2
    assert "model 'resnet20' takes images (in_channels), but data set 'sklearn:iris' gives " in err
    argv = ["init", "--model", "zoo:paper_mlp", "--data", "sklearn:wine", "--method", "lsuv"]
    with warnings.catch_warnings():  # shown as the command line shows them
        warnings.simplefilter("always")
        code, _, err = _run([*argv, "--model-kwargs", '{"n_classes": 2}', "--out", "m.pt"], capsys)
    assert code == 0, err
    assert (
        "warning: --model-kwargs sets n_classes=2, but --data sklearn:wine has 3 classes (labels "
        "up to 2); leave n_classes out to take it from the data set"
    ) in err
    assert torch.load(cli_dir / "m.pt", weights_only=True)["layers.4.weight"].shape == (2, 64)


def test_bench_report_refuses_to_pool_the_studies_of_one_store(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two studies with other epochs in one store: `bench report` without --study pooled them
    (n_seeds doubled, exit 0); it names the studies and asks for --study, writing nothing."""
    (cli_dir / "e2.yaml").write_text(textwrap.dedent(_SPEC).replace("epochs: 1", "epochs: 2")
                                     .replace("tiny", "tiny_e2"))  # fmt: skip
    for spec in ("spec.yaml", "e2.yaml"):
        code, _, err = _run(["bench", "run", spec, "--store", "st/two.sqlite", "--quiet"], capsys)
        assert code == 0, err
    report = ["bench", "report", "st/two.sqlite", "--no-plots", "--n-boot", "20", "--out", "r"]
    code, _, err = _run(report, capsys)
    assert code == 2
    assert "st/two.sqlite holds 2 studies ('tiny', 'tiny_e2')" in err
    assert "pass --study with one of these names" in err and "study=" not in err
    assert not (cli_dir / "r").exists()
    code, _, err = _run([*report, "--study", "tiny_e2"], capsys)
    assert code == 0, err
    assert "study 'tiny_e2'" in (cli_dir / "r" / "table2.md").read_text()
    code, _, err = _run([*report, "--study", "nosuch"], capsys)
    assert code == 2 and "no study 'nosuch' in st/two.sqlite; its studies: 'tiny', 'tiny_e2'" in err


_USER_LOSSES = """
def boom(model, batch):
    raise KeyError("labels")

def one(a):
    return 0

def nested(model, batch):
    return _helper(batch)

def _helper(batch):
    return batch["labels"]

def wrong(model, batch):
    return 0
"""


@pytest.mark.parametrize(
    ("command", "fn", "text"),
    [
        ("init", "boom", "--loss 'my losses.py:boom' raised KeyError: 'labels' (it is called as "
                         "fn(model, batch) on each batch of --data and returns the loss)"),
        ("diagnose", "boom", "--loss 'my losses.py:boom' raised KeyError: 'labels'"),
        ("init", "nested", "--loss 'my losses.py:nested' raised TypeError: "),
        ("diagnose", "one", "--loss 'my losses.py:one' must take two arguments, fn(model, "
                            "batch) (a batch of --data), and return the loss; it takes (a)"),
        ("init", "wrong", "the --loss function 'wrong' returned int, not a tensor"),
    ],
)  # fmt: skip
def test_an_error_in_a_loss_function_names_the_loss(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], command: str, fn: str, text: str
) -> None:
    """Errors of the user's --loss function came out bare (`error: KeyError: 'labels'`); they
    name --loss, the file and the function, as --model's factory errors do."""
    (cli_dir / "my losses.py").write_text(_USER_LOSSES)
    argv = ["--model", "mods.py:mlp", "--data", "mods.py:data_ok", "--loss", f"my losses.py:{fn}"]
    if command == "init":
        argv = ["init", *argv, "--method", "gradinit", "--steps", "1", "--out", "o.pt"]
    else:
        argv = ["diagnose", *argv, "--no-plots", "--out", "dg"]
    code, _, err = _run(argv, capsys)
    assert code == 2, err
    assert f"error: {text}" in err
    assert not (cli_dir / "o.pt").exists()


def test_data_takes_the_options_of_a_study_spec(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--data mnist?pad=2` was refused ("unknown --data") though a study spec takes it: the
    command line reads named data sets with the study's parser (one syntax for both)."""
    from tests.test_data import write_mnist

    write_mnist(cli_dir / "root" / "mnist")  # 6 training images of 28x28
    (cli_dir / "pad.py").write_text(
        "from torch import nn\n\ndef net():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, 10))\n"
    )
    argv = ["diagnose", "--model", "pad.py:net", "--data-dir", "root", "--batch-size", "3",
            "--max-batches", "2", "--no-plots", "--out", "d"]  # fmt: skip
    code, _, err = _run([*argv, "--data", "MNIST?pad=2&train_per_class=1"], capsys)
    assert code == 0, err
    code, _, err = _run([*argv, "--data", "mnist"], capsys)  # 28x28: the model needs 32x32
    assert code == 2 and "could not run on the data" in err
    for data, text in [
        ("mnist?pad=x", "--data 'mnist?pad=x': data option pad='x': must be an integer >= 0"),
        ("mnist?bogus=1", "--data 'mnist?bogus=1': bad option 'bogus=1'; write name?key=value"),
        ("sklearn:iris?pad=2", "--data 'sklearn:iris?pad=2': option(s) pad apply to image sets"),
        ("nosuch?pad=2", "unknown --data 'nosuch?pad=2'; give random"),
    ]:
        code, _, err = _run([*argv, "--data", data, "--out", "d2"], capsys)
        assert code == 2 and f"error: {text}" in err, err
        assert not (cli_dir / "d2").exists()


def test_an_interrupted_bench_run_says_what_is_stored_and_how_to_resume(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `bench run` said only "interrupted": it says how many runs are stored and
    that the same command resumes."""
    import initlab.study.runner as runner
    from initlab.study.trainer import train_runs

    calls = []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return train_runs(*args, **kwargs)

    real = runner.run_study
    monkeypatch.setattr(runner, "run_study", lambda *a, **k: real(*a, **k, train_fn=interrupting))
    code, _, err = _run([*_RUN, "--chunk-size", "1", "--quiet"], capsys)
    assert code == 130
    assert err.strip().splitlines()[-1] == (
        "initlab bench run: interrupted; 1 of the 2 runs of study 'tiny' are stored in "
        "st/s.sqlite; run the same command again to train the rest (stored runs are not trained "
        "again)"
    )
    monkeypatch.setattr(runner, "run_study", real)
    code, out, err = _run([*_RUN, "--quiet"], capsys)
    assert code == 0 and "2 runs, 1 already stored, 1 trained now" in out, err


def test_extend_grid_and_no_extend_grid_together_are_refused(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags in (["--extend-grid", "--no-extend-grid"], ["--no-extend-grid", "--extend-grid"]):
        code, _, err = _run([*_RUN, *flags], capsys)
        assert code == 2
        assert "--extend-grid and --no-extend-grid contradict each other" in err
        assert not (cli_dir / "st").exists()
    code, _, err = _run([*_RUN, "--no-extend-grid", "--quiet"], capsys)
    assert code == 0, err


def test_demo_without_geometric_says_how_to_get_paired_comparisons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's warning said "pass reference= one of lecun, orthogonal", Python wording the
    demo has no flag for; it gives the `bench report` command instead, and that command works."""
    import shlex

    from initlab.cli.demo import demo_training

    notes: list[str] = []
    small = {"seeds": 1, "lrs": (0.125,), "epochs": 1, "progress": False}
    out = tmp_path / "my demo"
    rows = demo_training(out, ["orthogonal", "lecun"], seed=0, note=notes.append, **small)
    assert {r["scheme"] for r in rows.to_rows()} == {"orthogonal", "lecun"}  # no warning raised
    assert len(notes) == 1 and "reference=" not in notes[0]
    assert notes[0].startswith(
        "no geometric among the trained schemes, so the study has no paired comparisons; for "
        "comparisons against orthogonal, run "
    )
    command = notes[0].split("`")[1]
    assert command.startswith("initlab bench report ") and "--reference orthogonal" in command
    code, _, err = _run([*shlex.split(command)[1:], "--no-plots", "--n-boot", "20"], capsys)
    assert code == 0, err
    assert (out / "demo-report" / "paired.csv").read_text().count("lecun") >= 1
    assert demo_training(out, ["geometric"], seed=0, note=notes.append, **small) is not None
    assert len(notes) == 1  # with geometric: nothing to say


def test_an_interrupted_demo_leaves_no_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import initlab.cli.diagnose as diagnose_module

    def interrupted(schemes, *, out, **kwargs):
        Path(out).mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(diagnose_module, "diagnose_demo", interrupted)
    out = tmp_path / "d4"
    code, _, err = _run(["demo", "--schemes", "fan_in", "--batch-size", "64", "--out", str(out)],
                        capsys)  # fmt: skip
    assert code == 130 and "initlab demo: interrupted" in err
    assert not out.exists()  # was: an empty d4/diagnosis/
    (tmp_path / "kept" / "empty").mkdir(parents=True)
    (tmp_path / "kept" / "notes.txt").write_text("mine\n")
    code, _, _ = _run(["demo", "--schemes", "fan_in", "--batch-size", "64", "--out",
                       str(tmp_path / "kept")], capsys)  # fmt: skip
    assert code == 130
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["empty", "notes.txt"]


def test_a_data_file_torch_cannot_load_is_said_in_words(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A text file given as --data x.pt gave "cannot read it (101)", torch's unpickler's bare
    KeyError; the message says what the file is."""
    import argparse

    (cli_dir / "text.pt").write_text("101\n")
    (cli_dir / "empty.pt").write_bytes(b"")
    torch.save({"x": argparse.Namespace(a=1)}, cli_dir / "obj.pt")
    (cli_dir / "cut.pt").write_bytes((cli_dir / "rows.pt").read_bytes()[:200])
    for name, text in [
        ("text.pt", "it is a text file, not a file that torch.save wrote; save a tensor"),
        ("empty.pt", "it is an empty file, not a file that torch.save wrote"),
        ("obj.pt", "it holds an object of type argparse.Namespace, which torch.load("),
        ("cut.pt", "torch.load(weights_only=True) cannot read it; is it damaged or truncated? ("),
    ]:
        code, _, err = _run(["diagnose", "--model", "mods.py:mlp", "--data", name], capsys)
        assert code == 2 and f"error: --data {name}: {text}" in err, err
        assert "(101)" not in err


def test_demo_table_says_gain_fwd_is_centered(capsys: pytest.CaptureFixture[str]) -> None:
    """gain_fwd (var(y)/var(x)) is not E_y2/E_x2 of its row; the table said nothing of it."""
    assert main(["demo", "--quick", "--schemes", "fan_in", "--batch-size", "64"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "gain_fwd = var(y)/var(x) (centered: not E_y2/E_x2 when x has a mean" in out


@pytest.mark.parametrize("method", ["lsuv", "scale_output", "precondition"])
def test_method_pools_the_max_batches_it_was_given(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    """`init --method lsuv --max-batches 4` read one batch (lsuv_'s default) where the other
    methods read the four the flag loads."""
    args = ["init", "--model", "zoo:paper_mlp", "--data", "digits", "--method", method]
    assert main([*args, "--max-batches", "4", "--out", "o.pt"]) == 0
    assert "(4 batches, 256 examples)" in capsys.readouterr().out


def test_diagnose_names_the_report_path_without_a_double_slash(
    cli_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's `--out report/` printed "report written to report//report.html"."""
    args = ["diagnose", "--model", "zoo:paper_mlp", "--data", "digits", "--no-plots"]
    assert main([*args, "--out", "report/"]) == 0
    assert "report written to report/report.html" in capsys.readouterr().out


def test_a_data_function_draws_its_data_under_the_seed(cli_dir: Path) -> None:
    """``--seed`` seeds the data too: a ``file.py:fn`` that draws from torch's global RNG was
    called in whatever state earlier work left it (the same seed gave other data after other
    calls, two seeds the same data in a fresh process)."""
    from initlab.cli.inputs import load_data_spec

    def load(seed: int) -> torch.Tensor:
        batches = load_data_spec("mods.py:data_ok", None, batch_size=16, batches=4, seed=seed)
        return torch.cat([x for x, _ in batches])

    state = torch.random.get_rng_state()
    first = load(1)
    torch.randn(100)  # other work between two calls
    assert torch.equal(load(1), first)
    assert not torch.equal(load(2), first)
    torch.random.set_rng_state(state)
    load(1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG left as it was


def test_init_report_saves_every_table_it_prints(cli_dir: Path) -> None:
    """--report held the method's rows only: the scheme's init table and the trace were lost."""
    args = [*_INIT, "--scheme", "fan_in", "--method", "gradinit", "--data", "random:4"]
    assert main([*args, "--loss", "random_quadratic", "--report", "r.json"]) == 0
    rows = json.loads((cli_dir / "r.json").read_text())
    tables = list(dict.fromkeys(r["table"] for r in rows))
    assert tables == ["init_model(scheme='fan_in')", "gradinit", "gradinit trace"]
    init_rows = [r for r in rows if r["table"].startswith("init_model")]
    assert {f"{r['layer']}.{r['param']}" for r in init_rows} == {"0.weight", "0.bias", "2.weight",
                                                                "2.bias"}  # fmt: skip
    assert all("target_std" in r for r in init_rows)


_LAZY_CLI = (
    "make the --model factory run one forward pass on a dummy batch before it returns the model "
    "(a lazy layer takes its shape from its first input)"
)
_LRS_CLI = "`initlab init --method precondition --how lr --report FILE`"

#: Every rewrite of the CLI's wording table on the library's sentence it is for (as the library
#: words it), and the whole sentence the command line prints: each must read as a sentence.
_WHOLE_SENTENCES = {
    "data root": (
        "letter: not found; looked for /d/libsvm (data root /d, from root=). Download it there, "
        "or point root= or the INITLAB_DATA_DIR environment variable at the folder holding "
        "libsvm/, mnist/, cifar-10-batches-py/ or cifar10-jpeg/.",
        "letter: not found; looked for /d/libsvm (data root /d, from --data-dir). Download it "
        "there, or pass --data-dir (or set the INITLAB_DATA_DIR environment variable) with the "
        "folder holding libsvm/, mnist/, cifar-10-batches-py/ or cifar10-jpeg/.",
    ),
    "dtype, data or model": (
        "initlab does not convert data: convert it (x.to(torch.float32), x.float(), in the "
        "dataset or a collate_fn), or the model (model.to(torch.float64))",
        "initlab does not convert data: convert the data before saving it (x.to(torch.float32), "
        "x.float()), or have the factory build the model in torch.float64",
    ),
    "dtype, integer data": (
        "initlab does not convert data: convert it (x.to(torch.float32), x.float(), in the "
        "dataset or a collate_fn), scaled as the model expects (image bytes: / 255).",
        "initlab does not convert data: convert the data before saving it (x.to(torch.float32), "
        "x.float()), scaled as the model expects (image bytes: / 255).",
    ),
    "no handler": (
        "register one with initlab.register_handler(ModuleType, handler) or pass policy='warn' "
        "or 'skip'",
        "register one with initlab.register_handler(ModuleType, handler) or pass --policy warn "
        "or --policy skip",
    ),
    "output scale hook": (
        "  note: the output scale is a forward hook on 2 (not in the state_dict); "
        "report.reports['output_scale'].info['handle'].remove() undoes it",
        "  note: the output scale is a forward hook on 2 (not in the state_dict); the command "
        "does not save the model (in Python, the report's handle removes it)",
    ),
    "policy skip": (
        "Register a handler with initlab.register_handler(ModuleType, handler), or pass "
        "policy='skip' to silence this.",
        "Register a handler with initlab.register_handler(ModuleType, handler), or pass "
        "--policy skip to silence this.",
    ),
    "unknown fix": (
        "doctor: unknown fix 'x'; valid: init, lsuv, output_scale, precondition (or True)",
        "doctor: unknown fix 'x'; valid: init, lsuv, output_scale, precondition (or --fix alone "
        "for the recommended ones)",
    ),
    "probe no parameters": (
        "MomentProbe(modules='params') selects no module: the model has no parameters; use "
        "modules='leaves' or 'all' to probe it",
        "the --model has no parameters, so there is nothing to measure; give a model with "
        "parameters",
    ),
    "dict keys": (
        "lsuv_: a dict batch is passed to the model as keyword arguments, model(**batch), and "
        "the model does not take the key 'a' of the batch's keys ['a', 'b']: drop it or rename "
        "it to an argument of its forward (err). Or pass (x, y) batches, forward=lambda model, "
        "batch: ... with a loss on the outputs, or a loss_fn(model, batch) that calls the model "
        "itself",
        "lsuv_: a dict batch is passed to the model as keyword arguments, model(**batch), and "
        "the model does not take the key 'a' of the batch's keys ['a', 'b']: drop it or rename "
        "it to an argument of its forward (err). Or pass (x, y) batches, or --loss "
        "pkg.module:fn, a function fn(model, batch) that calls the model itself",
    ),
    "tuple, more inputs": (
        "lsuv_: a tuple batch is passed to the model as model(batch[0]) (the rest of the tuple "
        "is read as targets), and the model's forward takes more inputs (err). Pass dict "
        "batches of its keyword arguments, a loss_fn(model, batch) that calls the model itself "
        "and names the target (e.g. loss_fn=lambda model, batch: F.cross_entropy(model(batch[0], "
        "batch[1]), batch[2]) for (x, z, y) batches), or, where the function takes one, a "
        "forward= that leaves the target at batch[1], where a loss reads it: forward=lambda "
        "model, batch: model(batch[0], *batch[2:]) for (x, y, z, ...) batches (model(*batch) "
        "where no loss reads a target)",
        "lsuv_: a tuple batch is passed to the model as model(batch[0]) (the rest of the tuple "
        "is read as targets), and the model's forward takes more inputs (err). Make --data give "
        "dict batches of its keyword arguments, or pass --loss pkg.module:fn, a function "
        "fn(model, batch) that calls the model itself",
    ),
    "ambiguous list": (
        "data is a list of 3 tensors ((4, 2), (4, 2), (4, 2)), which reads both as 3 batches and "
        "as one batch of 3 tensors; say which: initlab.Batches([...]) for 3 batches, or a tuple "
        "(x, y, ...) for one batch",
        "data is a list of 3 tensors ((4, 2), (4, 2), (4, 2)), which reads both as 3 batches and "
        "as one batch of 3 tensors; say which: save a list of (x, y) tuples for 3 batches, or a "
        "tuple (x, y, ...) for one batch",
    ),
    "data forms": (
        "lsuv_ needs data; accepted forms: one batch: a tensor, a tuple such as (x, y), a dict "
        "of model inputs, a [x, y] list from default collate, or a custom object; many batches: "
        "a DataLoader, any iterable or generator of batches, a list of (x, y) tuples, or "
        "initlab.Batches([...])",
        "lsuv_ needs data; accepted forms: one batch: a tensor, a tuple such as (x, y), a dict "
        "of model inputs, a [x, y] list from default collate, or a custom object; many batches: "
        "a DataLoader, any iterable or generator of batches, or a list of (x, y) tuples (in a "
        "--data .pt file saved with torch.save, or returned by a --data function)",
    ),
    "loss returned": (
        "the loss 'mine' returned int, not a tensor",
        "the --loss function 'mine' returned int, not a tensor",
    ),
    "studies": (
        "a report covers one study, so that runs of different protocols are never pooled as "
        "seeds of one: pass study= with one of these names",
        "a report covers one study, so that runs of different protocols are never pooled as "
        "seeds of one: pass --study with one of these names",
    ),
    "protocols": (
        "store each protocol's runs in its own store, or run them as studies "
        "(initlab.study.run_study)",
        "store each protocol's runs in its own store, or run them as studies (`initlab bench "
        "run SPEC`, one spec per protocol)",
    ),
    "n_boot": (
        "n_boot must be >= 1 (an integer), got 0",
        "--n-boot must be >= 1 (an integer), got 0",
    ),
    "level": (
        "level must be in (0, 1), e.g. 0.95, got 2",
        "--level must be in (0, 1), e.g. 0.95, got 2",
    ),
    "stale_after": ("stale_after must be positive, got 0", "--stale-after must be positive, got 0"),
    "heartbeat": (
        "stale_after (5 s) must be longer than heartbeat_s (10 s), or other drivers take over "
        "this driver's live runs",
        "--stale-after (5 s) must be longer than --heartbeat (10 s), or other drivers take over "
        "this driver's live runs",
    ),
    "how frozen": (
        "how='rescale' would change the frozen tensor(s) ['0.weight'] (requires_grad=False: the "
        "rescaled chain multiplies every later bias); use how='lr' or how='parametrize', or "
        "unfreeze them",
        "--how rescale would change the frozen tensor(s) ['0.weight'] (requires_grad=False: the "
        "rescaled chain multiplies every later bias); use --how lr (the weights unchanged, "
        "per-layer learning-rate scales), or unfreeze them",
    ),
    "loss_fn reads": (
        "the model's output has no tensor at the top; or pass a loss_fn(model, batch) that reads "
        "it",
        "the model's output has no tensor at the top; or pass --loss pkg.module:fn, a function "
        "fn(model, batch) that reads it",
    ),
    "no parameters": (
        "lsuv_: the model has no parameters, so there is nothing to initialize (a loss of "
        "Identity has no gradient); give a model with parameters",
        "lsuv_: the --model has no parameters, so there is nothing to initialize (a loss of "
        "Identity has no gradient); give a model with parameters",
    ),
    "gradinit gamma": (
        "gradinit_ differentiates the loss twice (err). Use twice-differentiable operations in "
        "the model, or raise gamma above the gradient norms of the trace so that no constraint "
        "step is taken (the objective steps of exact=False are first-order)",
        "gradinit_ differentiates the loss twice (err). Use twice-differentiable operations in "
        "the model, or use --method lsuv or --method scale_output, which need no derivative (the "
        "command line runs gradinit with gamma 1, so it takes a constraint step wherever the "
        "gradient norm exceeds 1)",
    ),
    "batch_size": (
        "batch_size must be in [2, 1797], got 1",
        "--batch-size must be in [2, 1797], got 1",
    ),
    "one example": (
        "a batch of one example reached a batch norm layer in training mode, which needs more "
        "than one value per channel to normalize: drop short batches (a DataLoader's last batch: "
        "DataLoader(..., drop_last=True)) (err)",
        "a batch of one example reached a batch norm layer in training mode, which needs more "
        "than one value per channel to normalize: use --batch-size 2 or more, one that leaves no "
        "last batch of a single example (or lower --max-batches); data that is already batched "
        "must leave out its batches of one example (err)",
    ),
    "0 examples": (
        "no statistic is defined on 0 examples. Drop empty batches (filter them out, or use a "
        "DataLoader with drop_last=True)",
        "no statistic is defined on 0 examples. Drop empty batches (leave them out of the --data "
        "file or function)",
    ),
    "doctor refused": (
        "  not changed (fix=False); the fixes (and doctor(model, data, fix=True)) refuse this "
        "model: x",
        "  not changed (no --fix); the fixes (and the same command with --fix) refuse this "
        "model: x",
    ),
    "doctor mild": (
        "  initial_loss, no fix here: mild (warn): shrinking the outputs also slows their "
        "learning; doctor(model, data, fix='output_scale') scales them anyway",
        "  initial_loss, no fix here: mild (warn): shrinking the outputs also slows their "
        "learning; the same command with --fix output_scale scales them anyway",
    ),
    "doctor curvature": (
        "reported, not treated; block_curvature(model, data) measures the curvature",
        "reported, not treated; initlab diagnose --curvature measures the curvature",
    ),
    "balanced": (
        "γ; balanced by precondition_: train with report.param_groups(model, lr=...)",
        f"γ; balanced by precondition: train with its per-layer learning rates, which {_LRS_CLI} "
        "writes",
    ),
    "param groups line": (
        "  with report.param_groups(model, lr=...): γ spread 1 over every weight layer (the "
        "model itself is unchanged by precondition_)",
        f"  with precondition's per-layer learning rates (which {_LRS_CLI} writes): γ spread 1 "
        "over every weight layer (the model itself is unchanged by precondition)",
    ),
    "param groups warning": (
        "report.param_groups(model, lr=...) multiplies each weight layer's learning rate by x0.5",
        f"precondition's per-layer learning rates (which {_LRS_CLI} writes) multiply each weight "
        "layer's learning rate by x0.5",
    ),
    "param groups check": (
        "γ max/min over every weight layer when training with report.param_groups(model, lr=...) "
        "(the learning rates of precondition_'s multipliers; the weights are unchanged)",
        "γ max/min over every weight layer when training with precondition's per-layer learning "
        f"rates (which {_LRS_CLI} writes; the weights are unchanged)",
    ),
    "doctor curvature blocks": (
        "not treated (precondition's per-layer rates made a BERT classifier and a Llama train "
        "worse); block_curvature measures the Hessian blocks themselves",
        "not treated (precondition's per-layer rates made a BERT classifier and a Llama train "
        "worse); initlab diagnose --curvature measures the Hessian blocks themselves",
    ),
    "doctor fix init": (
        "the logits are too large; init_model(model, 'geometric') would not shrink the logits "
        "(std 1 → 0.6309): scale the output instead",
        "the logits are too large; the geometric init (--fix init) would not shrink the logits "
        "(std 1 → 0.6309): scale the output instead",
    ),
    "doctor fix column": (
        "lsuv_(model, data); scale_output_(model, data, target=sqrt(0.2 ln C) / 2, how='hook'); "
        "precondition_(model, data, how='lr') → preconditioned_param_groups",
        "--fix lsuv; --fix output_scale (the logits' std to sqrt(0.2 ln C) / 2); --fix "
        f"precondition (per-layer learning rates, which {_LRS_CLI} writes)",
    ),
    "lazy fans": (
        "torch.nn.LazyLinear.weight is an uninitialized lazy parameter; run a forward pass (or "
        "materialize the module) before asking for its fans",
        f"torch.nn.LazyLinear.weight is an uninitialized lazy parameter; {_LAZY_CLI}",
    ),
    "lazy model": (
        "lsuv_: 0.weight of the model is uninitialized (a lazy module, e.g. nn.LazyLinear, "
        "before its first forward pass); run the model once on a batch (model(x)) so that they "
        "take their shapes, then call lsuv_ again",
        "lsuv_: 0.weight of the model is uninitialized (a lazy module, e.g. nn.LazyLinear, "
        f"before its first forward pass); {_LAZY_CLI}",
    ),
    "lazy torch": (
        "Can't access the shape of an uninitialized parameter or buffer. Call `forward` with a "
        "dummy batch to initialize the parameters before calling torch functions",
        "Can't access the shape of an uninitialized parameter or buffer. Call `forward` with a "
        "dummy batch to initialize the parameters; the --model factory must do that before it "
        "returns the model (a lazy layer takes its shape from its first input)",
    ),
}


@pytest.mark.parametrize("case", list(_WHOLE_SENTENCES))
def test_each_rewrite_leaves_a_whole_sentence(case: str) -> None:
    """The rewrite of DATA_FORMS dropped its "or": "..., a list of (x, y) tuples, (save them
    with torch.save)". Each rewrite is checked on its whole library sentence."""
    library, cli = _WHOLE_SENTENCES[case]
    assert translate(library) == cli


def test_every_rewrite_is_in_the_table_of_whole_sentences() -> None:
    from initlab.cli._checks import _WORDING

    used = set()
    for library, _ in _WHOLE_SENTENCES.values():
        text = library
        for i, (pattern, repl) in enumerate(_WORDING):  # in turn, as translate applies them
            text, n = re.subn(pattern, repl, text)
            used |= {i} if n else set()
    assert [p for i, (p, _) in enumerate(_WORDING) if i not in used] == []


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({"a": 1}, "--data bad.pt: the file holds no tensor: it is a dict ('a': int); save one "
         "batch with torch.save (a tensor, a tuple (x, y) or a dict of model inputs, of tensors) "
         "or a list of batches"),
        ([1, 2], "--data bad.pt: the file holds no tensor: it is a list (int, int); save one"),
        ({}, "--data bad.pt: the file holds no tensor: it is an empty dict; save one"),
        ([(torch.zeros(16, 4), torch.zeros(16, dtype=torch.long)), {"a": 1}],
         "--data bad.pt: batch 1 holds no tensor: it is a dict ('a': int); save one"),
    ],
)  # fmt: skip
def test_a_data_file_without_a_tensor_is_named(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], content: object, said: str
) -> None:
    """A .pt file holding a dict without a tensor: "a batch must hold a tensor; got dict.
    Accepted data: ... a dict of model inputs ... a list of (x, y) tuples, (save them with
    torch.save)": the dict was an accepted form, --data and the file were not named."""
    torch.save(content, cli_dir / "bad.pt")
    code, _, err = _run([*_INIT, "--method", "lsuv", "--data", "bad.pt"], capsys)
    assert code == 2
    assert f"initlab init: error: {said}" in err
    assert "Traceback" not in err and not (cli_dir / "out.pt").exists()


def test_a_batch_without_a_tensor_says_what_it_holds() -> None:
    """The library's message said "got dict" where a dict of model inputs is an accepted form."""
    from initlab import lsuv_

    cases = [
        ({"a": 1}, "got a dict ('a': int), which holds none"),
        ([[1, 2]], "got a list (int, int), which holds none"),
        ([{}], "got an empty dict, which holds none"),
        (
            [{"a": 1, "b": "x", "c": None, "d": 2.0, "e": 3}],
            "got a dict ('a': int, 'b': str, 'c': NoneType, 'd': float, ...), which holds none",
        ),
    ]
    for data, said in cases:
        with pytest.raises(TypeError) as err:
            lsuv_(torch.nn.Linear(2, 2), data)
        assert f"a batch must hold a tensor; {said}. Accepted data: one batch" in str(err.value)


#: A batch that holds no tensor, and how the command line names it.
_NO_TENSOR_BATCHES = {
    "None": (None, "None"),
    "str": ("oops", "str"),
    "int": (3, "int"),
    "float": (2.5, "float"),
    "strings": (["a", "b"], "a list (str, str)"),
    "nones": ((None, None), "a tuple (NoneType, NoneType)"),
    "dict": ({"a": 1}, "a dict ('a': int)"),
}


@pytest.mark.parametrize("command", ["init", "doctor"])
@pytest.mark.parametrize("at", [0, 1, 2])
@pytest.mark.parametrize("kind", list(_NO_TENSOR_BATCHES))
def test_a_data_file_with_a_batch_without_a_tensor_names_it(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], command: str, at: int, kind: str
) -> None:
    """A list of batches holding None, a string or a number was read as ONE batch ([(x, y),
    None]: model((x, y))), which failed with "linear(): argument 'input' ... must be Tensor, not
    tuple"; a dict there was named ("batch 1 holds no tensor")."""
    bad, said = _NO_TENSOR_BATCHES[kind]
    good = (torch.randn(16, 4), torch.randint(0, 3, (16,)))
    content = [good, good]
    content.insert(at, bad)
    torch.save(content, cli_dir / "bad.pt")
    argv = (
        [*_INIT, "--method", "lsuv"] if command == "init" else ["doctor", "--model", "mods.py:mlp"]
    )
    code, _, err = _run([*argv, "--data", "bad.pt"], capsys)
    assert code == 2
    assert (
        f"initlab {command}: error: --data bad.pt: batch {at} holds no tensor: it is {said}; save "
        "one batch with torch.save (a tensor, a tuple (x, y) or a dict of model inputs, of "
        "tensors) or a list of batches"
    ) in err
    assert "Traceback" not in err and not (cli_dir / "out.pt").exists()
