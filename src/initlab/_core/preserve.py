"""Moved: :func:`initlab._core.state.preserved_state` (this name stays until the imports move)."""

from initlab._core.state import preserved_state

__all__ = ["preserved_state"]
