"""The reductions against float64, at sizes where float32 drifts."""

from __future__ import annotations

import pytest
import torch

from initlab._core.reductions import sum_of_products, sum_of_squares, total_sum_of_squares


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 5_000_003])
def test_sum_of_squares_matches_float64(n: int) -> None:
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 1
    exact = float((t.double() ** 2).sum())
    got = sum_of_squares(t)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(exact, rel=1e-6)  # a naive float32 norm: 1e-4 at 5M


def test_sum_of_squares_per_row_and_low_precision() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 70, 50, generator=g)
    exact = (t.double() ** 2).flatten(1).sum(1)
    torch.testing.assert_close(sum_of_squares(t, per_row=True), exact, rtol=1e-6, atol=0)
    h = t.to(torch.bfloat16)
    assert float(sum_of_squares(h)) == pytest.approx(float((h.double() ** 2).sum()), rel=1e-6)


@pytest.mark.parametrize("n", [1, 2047, 2**14, 2**14 + 1, 2**17, 5_000_003])
def test_sum_of_products_matches_float64(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=g) * 3 + 1, torch.randn(n, generator=g) + 2
    exact = float((x.double() * y.double()).sum())
    got = sum_of_products(x.reshape(-1, 1), y)
    assert got.dtype == torch.float32 and got.shape == ()
    assert float(got) == pytest.approx(exact, rel=3e-7)  # a BLAS dot: 1.1e-6 off at 5M
    assert float(sum_of_products(x.double(), y.double())) == pytest.approx(exact, rel=1e-12)


def test_sum_of_products_low_precision_in_float32() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3000, generator=g).bfloat16(), torch.randn(3000, generator=g).bfloat16()
    got = sum_of_products(x, y)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(float((x.double() * y.double()).sum()), rel=1e-5)


def test_total_sum_of_squares_matches_float64_at_every_size_and_dtype() -> None:
    g = torch.Generator().manual_seed(3)
    sizes = [1, 2047, 2**14, 2**14 + 1, 2**17, 3_000_001, 2 * 2048]
    tensors = [torch.randn(n, generator=g) + 1 for n in sizes]
    tensors += [torch.randn(4, 5, generator=g, dtype=torch.float64), tensors[1].bfloat16()]
    tensors += [torch.randn(3, 2**14 + 7, generator=g, dtype=torch.float64), torch.ones(0)]
    exact = [float((t.double() ** 2).sum()) for t in tensors]
    # one fused float32 norm of up to 2**14 entries: 3e-7 to 5e-7 off (a naive norm of 3M: 5e-5)
    assert total_sum_of_squares(tensors) == pytest.approx(sum(exact), rel=5e-7)
    for t, e in zip(tensors, exact, strict=True):  # each size and dtype alone, the pieces
        assert total_sum_of_squares([t]) == pytest.approx(e, rel=1e-6, abs=0)
    assert total_sum_of_squares([]) == 0.0
