"""The random Hadamard transform: the matrix against its definition, orthogonality facts with derived bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mixprec.blockscale import (hadamard_matrix, hadamard_transform, inverse_hadamard_transform, random_signs,
                                sylvester)

U = 2.0 ** -24  # fp32 unit roundoff


def _kronecker_hadamard(n: int) -> np.ndarray:
    """Sylvester's construction by Kronecker powers of [[1, 1], [1, -1]], independently of the implementation."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


@pytest.mark.parametrize("n", [1, 4, 16, 64])
def test_sylvester_and_the_transform_matrix_match_the_definition(n):
    assert np.array_equal(sylvester(n).numpy(), _kronecker_hadamard(n))
    signs = random_signs(n, seed=n)
    expected = _kronecker_hadamard(n) @ np.diag(signs.numpy().astype(np.float64)) / math.sqrt(n)
    assert np.array_equal(hadamard_matrix(signs).numpy().astype(np.float64), expected)


@pytest.mark.parametrize("n", [4, 16, 64, 256])
def test_t_times_t_transposed_is_exactly_the_identity_in_fp32(n):
    """Entries ±1/sqrt(n) (powers of 2), products ±1/n, and every partial sum a multiple of 1/n of magnitude <= 1:
    exact in fp32 in any summation order, so the bound derived is 0."""
    t = hadamard_matrix(random_signs(n, seed=1))
    assert torch.equal(t @ t.t(), torch.eye(n)) and torch.equal(t.t() @ t, torch.eye(n))


def test_signs_are_plus_minus_one_from_the_seed():
    a, b = random_signs(16, seed=5), random_signs(16, seed=5)
    assert torch.equal(a, b) and set(a.tolist()) == {-1.0, 1.0}
    assert not torch.equal(a, random_signs(16, seed=6))


def _transform_error_bound(n: int) -> float:
    """``||fl(T a) - T a|| <= ((1 + u)**k - 1) ||a||`` for ``k = log2(n)`` butterfly stages (hadamard.py)."""
    return (1 + U) ** int(math.log2(n)) - 1


@pytest.mark.parametrize("n", [4, 16, 64])
def test_the_transform_is_t_times_each_block_within_the_derived_bound(n):
    signs = random_signs(n, seed=2)
    x = torch.randn(6, 4 * n) * torch.logspace(-3, 3, 4 * n)  # wide dynamic range within blocks
    t64 = torch.from_numpy(_kronecker_hadamard(n) @ np.diag(signs.numpy().astype(np.float64)) / math.sqrt(n))
    exact = (x.double().unflatten(-1, (-1, n)) @ t64.t()).flatten(-2)
    got = hadamard_transform(x, signs).double()
    block_err = (got - exact).unflatten(-1, (-1, n)).norm(dim=-1)
    block_norm = x.double().unflatten(-1, (-1, n)).norm(dim=-1)
    assert (block_err <= _transform_error_bound(n) * block_norm).all()


def test_dot_products_survive_within_the_stated_bound():
    """``|fl(T a)^T fl(T b) - a^T b| <= (2e + e**2) ||a|| ||b||``, ``e = (1 + u)**4 - 1`` for n = 16 (dot in fp64)."""
    signs = random_signs(16, seed=3)
    e = _transform_error_bound(16)
    for trial in range(20):
        a, b = torch.randn(2, 1024, dtype=torch.float64).float()
        a[trial] = 1e4  # an outlier
        got = torch.dot(hadamard_transform(a, signs).double(), hadamard_transform(b, signs).double())
        exact = torch.dot(a.double(), b.double())
        assert abs(got - exact) <= (2 * e + e * e) * a.double().norm() * b.double().norm()


def test_inverse_undoes_the_transform_along_any_dim():
    signs = random_signs(16, seed=4)
    x = torch.randn(32, 5, 3)
    y = hadamard_transform(x, signs, dim=0)
    assert torch.equal(y, hadamard_transform(x.movedim(0, -1), signs).movedim(-1, 0))
    back = inverse_hadamard_transform(y, signs, dim=0)
    bound = (2 * _transform_error_bound(16) + _transform_error_bound(16) ** 2) * x.norm(dim=0)
    assert ((back - x).norm(dim=0) <= bound).all()


def test_an_outlier_is_spread_over_its_block():
    x = torch.zeros(16)
    x[3] = 8.0
    y = hadamard_transform(x, random_signs(16, seed=0))
    assert torch.equal(y.abs(), torch.full((16,), 2.0))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="power of 4"):
        random_signs(8, seed=0)
    with pytest.raises(ValueError, match="multiple of the Hadamard size 16"):
        hadamard_transform(torch.ones(3, 20), random_signs(16, seed=0))
    with pytest.raises(ValueError, match="1-d tensor"):
        hadamard_transform(torch.ones(16), torch.ones(4, 4))
