"""The ``initlab`` command line and its demo."""

from initlab.cli.main import main

__all__ = ["main"]
