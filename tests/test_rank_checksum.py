"""The exact checksum the DDP rank check compares (``_checksum``) takes a tensor of every dtype a
buffer or parameter can have: complex128 (a rotary ``freqs_cis`` kept in double precision) raised
``KeyError: 16``, which stopped every distributed entry point. Checked against the formula
computed here in pure Python from the tensor's bytes."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from initlab._core.distributed import _checksum

#: Every dtype torch names, but the quantized ones (they cannot be viewed from bytes; their own
#: test below).
_DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    - {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4},
    key=str,
)


def _expected(raw: bytes, size: int, numel: int) -> list[int]:
    """``[numel, Σ (l + 7 h), Σ l h]`` over 32-bit words ``w = 2^16 h + l``: an element of 4 or
    more bytes as its 4-byte words, a 1- or 2-byte one as a signed integer modulo 2^32."""
    width = 4 if size >= 4 else size
    words = [
        int.from_bytes(raw[i : i + width], sys.byteorder, signed=size < 4) % 2**32
        for i in range(0, len(raw), width)
    ]
    return [
        numel,
        sum((w & 0xFFFF) + 7 * (w >> 16) for w in words),
        sum((w & 0xFFFF) * (w >> 16) for w in words),
    ]


def _bytes(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    high = 2 if dtype == torch.bool else 256
    return torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)


def test_every_dtype_is_listed() -> None:
    names = {str(d) for d in _DTYPES}
    assert {"torch.complex128", "torch.complex64", "torch.bool", "torch.float8_e4m3fn"} <= names
    assert {"torch.int64", "torch.uint8", "torch.bfloat16", "torch.float64"} <= names


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_checksum_of_every_dtype_is_the_sum_over_its_words(dtype: torch.dtype) -> None:
    raw = _bytes(dtype, 12, 0)
    size = dtype.itemsize
    t = raw.view(dtype)
    expected = _expected(bytes(raw.tolist()), size, 12)
    assert _checksum(t) == expected
    # order-independent, and a non-contiguous (transposed) tensor reads the same elements
    assert _checksum(t.reshape(3, 4).t()) == expected
    assert _checksum(t[0]) == _expected(bytes(raw[:size].tolist()), size, 1)  # 0-dim
    changed = raw.clone()
    changed[0] ^= 1  # the lowest bit of the first element (still 0 or 1 for bool)
    assert _checksum(changed.view(dtype)) != expected


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_checksum_of_a_conjugate_view_reads_its_values(dtype: torch.dtype) -> None:
    """``conj()`` is lazy (a flag on the same memory): the checksum is that of the conjugate's
    values, not of the memory under the flag."""
    gen = torch.Generator().manual_seed(1)
    z = torch.complex(torch.randn(5, generator=gen), torch.randn(5, generator=gen)).to(dtype)
    lazy = z.conj()
    assert lazy.is_conj()
    materialized = lazy.resolve_conj()
    raw = bytes(materialized.view(torch.uint8).tolist())
    assert _checksum(lazy) == _expected(raw, z.element_size(), 5)
    assert _checksum(lazy) != _checksum(z)


def test_checksum_of_quantized_and_sparse_tensors() -> None:
    """A quantized tensor by the values it represents, a sparse one by its dense values."""
    x = torch.tensor([0.5, -1.0, 0.25, 2.0])
    with warnings.catch_warnings():  # quantized tensors are deprecated in recent torch
        warnings.filterwarnings("ignore", ".*quantized tensor creation", UserWarning)
        q = torch.quantize_per_tensor(x, 0.25, 0, torch.qint8)
        other = torch.quantize_per_tensor(x * 2, 0.25, 0, torch.qint8)
    exact = torch.tensor([0.5, -1.0, 0.25, 2.0], dtype=torch.float32)  # multiples of 0.25
    raw = bytes(exact.view(torch.uint8).tolist())
    assert _checksum(q) == _expected(raw, 4, 4)
    assert _checksum(other) != _checksum(q)
    sparse = exact.to_sparse()
    assert _checksum(sparse) == _expected(raw, 4, 4)
