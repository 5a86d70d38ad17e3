"""Decode image files with Pillow into one uint8 array; also runnable as a worker process.

This file imports only NumPy and Pillow, never ``initlab``: :mod:`initlab.data.images` runs its
source with ``python -c`` in worker processes. Workers started that way need no
``if __name__ == "__main__"`` guard in the user's script (``multiprocessing``'s spawn start method
does), are not forked from a process that may be running torch's threads, and start in a fraction
of a second because they do not import torch.

Worker usage: ``python -c <this source> <paths.json> <out.npy> <mode>``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import numpy as np


def decode(paths: Sequence[str], mode: str) -> np.ndarray:
    """Decode ``paths`` to a uint8 array ``(n, H, W, C)``; all images must have one size."""
    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError(
            "reading image folders needs Pillow: `pip install pillow` (or `pip install "
            "'initlab[images]'`)"
        ) from err
    out: np.ndarray | None = None
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                pixels = np.asarray(im if im.mode == mode else im.convert(mode))
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: cannot decode image ({err})") from err
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if out is None:
            out = np.empty((len(paths), *pixels.shape), dtype=np.uint8)
        elif pixels.shape != out.shape[1:]:
            raise ValueError(
                f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]} but {paths[0]} is "
                f"{out.shape[2]}x{out.shape[1]}; all images in a folder must have one size"
            )
        out[i] = pixels
    if out is None:
        raise ValueError("no images to decode")
    return out


def _main(argv: Sequence[str]) -> int:
    paths_file, out_file, mode = argv
    with open(paths_file, encoding="utf-8") as f:
        paths = json.load(f)
    try:
        images = decode(paths, mode)
    except (ImportError, ValueError) as err:
        print(err, file=sys.stderr)
        return 1
    np.save(out_file, images)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
