"""Every example in a docstring (``>>>``) runs and prints what it says: the examples a user reads
in ``help()`` are tested like the code (they were never run by the suite)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import initlab


def _examples(name: str) -> list[doctest.DocTest]:
    """The docstrings of module ``name`` (its own objects) that hold examples."""
    module = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(module, name) if t.examples]


def _modules_with_examples() -> list[str]:
    names = (i.name for i in pkgutil.walk_packages(initlab.__path__, "initlab."))
    return [n for n in names if not n.endswith("__main__") and _examples(n)]


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    assert len(MODULES) >= 20  # the finder reads the package (a broken walk would find none)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in _examples(name):
        runner.run(test, out=lambda text: None)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted > 0
    assert failed == 0, f"{failed} of {attempted} examples of {name} failed (run its doctests)"
