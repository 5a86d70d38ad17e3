"""Randomness is passed in, never global: the helper that turns a seed into a generator, and
the forked-RNG scopes that make measurement passes (dropout masks) reproducible."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = [
    "Seeds",
    "as_generator",
    "draw_device",
    "global_rng_kept",
    "global_rng_saved",
    "peeked",
    "stage_generator",
]


def as_generator(generator: torch.Generator | int | None) -> torch.Generator | None:
    """``None`` and generators pass through; an int seeds a new CPU ``torch.Generator``.

    Raises:
        TypeError: anything else (a bool, a float, a string).
        ValueError: an int seed outside 64 bits (torch's range).
    """
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        if not -(2**63) <= generator < 2**64:
            raise ValueError(
                f"generator: the seed {generator} does not fit in 64 bits (-2**63 <= seed < 2**64)"
            )
        return torch.Generator().manual_seed(generator)
    raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {generator!r}")


def draw_device(generator: torch.Generator | None) -> torch.device:
    """The device a draw from ``generator`` is made on: the generator's own, else the CPU (torch's
    global CPU generator); never torch's default device (``torch.set_default_device``, a ``with
    torch.device(...)`` block), so that the draws are the same under it."""
    return generator.device if generator is not None else torch.device("cpu")


def peeked(generator: torch.Generator | None) -> torch.Generator | None:
    """A new generator in ``generator``'s state: what is drawn from it leaves ``generator`` where
    it was (a measurement that must not shift the draws of what follows it); ``None`` stays."""
    if generator is None:
        return None
    return torch.Generator(device=generator.device).set_state(generator.get_state())


#: The seed of :func:`stage_generator` without a generator (fixed draws, not the global RNG).
STAGE_SEED = 0


def stage_generator(generator: torch.Generator | None) -> torch.Generator:
    """The generator a measurement's random stages (power iterations, curvature probes, landscape
    directions) draw from: ``generator`` itself, else a new CPU generator seeded
    :data:`STAGE_SEED`, so that ``None`` gives fixed draws and never reads torch's global RNG."""
    return generator if generator is not None else torch.Generator().manual_seed(STAGE_SEED)


def global_rng_saved() -> Callable[[], None]:
    """Torch's global RNG state now (the CPU generator, and every CUDA device's where CUDA is
    initialized), as a function that puts it back (:func:`global_rng_kept`,
    :func:`~initlab._core.state.model_kept`)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def put_back() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    return put_back


@contextlib.contextmanager
def global_rng_kept() -> Iterator[None]:
    """Torch's global RNG (:func:`global_rng_saved`) as it was when the block ends: around
    reading the data, whose ``DataLoader`` iterator draws its base seed (and a shuffling sampler
    its permutation's seed) from it."""
    put_back = global_rng_saved()
    try:
        yield
    finally:
        put_back()


class Seeds:
    """Forked-RNG scopes; each :meth:`scope` call with the same ``key`` replays the same draws.

    Torch's global RNG (CPU and the model's CUDA devices) is restored when a scope ends. Seeds come
    from ``generator`` when given, else from a fixed base, so measurement passes are reproducible
    either way.
    """

    def __init__(self, model: nn.Module, generator: torch.Generator | int | None) -> None:
        generator = as_generator(generator)
        base = (
            0
            if generator is None
            else int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        )
        self.base = base
        self.devices = sorted(
            {t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"}
        )

    @contextlib.contextmanager
    def scope(self, key: int = 0) -> Iterator[None]:
        seed = (self.base + 7919 * key) % 2**62
        with torch.random.fork_rng(devices=self.devices):
            torch.default_generator.manual_seed(seed)
            for d in self.devices:
                torch.cuda.default_generators[d].manual_seed(seed)
            yield
