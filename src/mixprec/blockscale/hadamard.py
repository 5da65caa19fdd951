"""The random Hadamard transform (RHT): ``T = H_n diag(s) / sqrt(n)`` applied in blocks of ``n`` along a dim.

``H_n`` is Sylvester's Hadamard matrix (``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``, symmetric, entries
±1, ``H_n H_n = n I``) and ``s`` a vector of random signs ±1, so ``T`` is orthogonal: ``T^T T = I`` and
``T^{-1} = T^T = diag(s) H_n / sqrt(n)``. Transformed along the contraction dim of a GEMM, both operands with
the same ``s``, a product is unchanged: ``(T a)^T (T b) = a^T b``; what changes is the distribution each block
of a block format sees, an outlier being spread over ``n`` values (Transformer Engine's NVFP4 recipe applies
``n = 16`` to the wgrad GEMM's inputs: transformer_engine/pytorch/tensor/nvfp4_tensor.py ``get_rht_matrix``,
``diag(signs) @ H_16 / 4`` multiplying rows from the right, the same map as ``T`` on columns).

Computed by the fast Walsh-Hadamard butterflies, not a matmul: the signs multiply (exact), then for
``h = 1, 2, 4, ..., n/2`` each pair ``(v[i], v[i + h])`` within a group of ``2h`` becomes
``(v[i] + v[i + h], v[i] - v[i + h])`` (one fp32 rounding per element and stage; this is ``H_n`` in Sylvester's
order), then ``1/sqrt(n)`` multiplies, exact because ``n`` is a power of 4. Every step is an elementwise IEEE
operation, so the result is the same bits on every device and under ``torch.compile``, whatever a matmul
kernel's summation order would be. Error bounds (``u = 2**-24``, ``k = log2(n)``; each stage multiplies norms by
``sqrt(2)`` and adds a relative error of at most ``u`` per element):

* ``||fl(T a) - T a||_2 <= ((1 + u)**k - 1) ||a||_2`` (``~ k u ||a||``: ``2**-22`` for ``n = 16``), and so
  ``|fl(T a)^T fl(T b) - a^T b| <= (2 e + e**2) ||a||_2 ||b||_2`` with ``e = (1 + u)**k - 1``, the dot product
  itself taken exactly;
* :func:`hadamard_matrix` (the transform of the identity's columns) is exact: its entries are ``±1/sqrt(n)``, a
  power of 2, and ``T T^T`` in fp32 is exactly ``I`` whatever the summation order, its products being ``±1/n``
  and every partial sum a multiple of ``1/n`` of magnitude at most 1.

All fp32 tensor arithmetic; no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["random_signs", "sylvester", "hadamard_matrix", "hadamard_transform", "inverse_hadamard_transform"]


def _check_size(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1) or n.bit_length() % 2 == 0:
        raise ValueError(f"Hadamard size {n!r} must be a power of 4 (1, 4, 16, 64, ...)")


def _check_signs(signs: torch.Tensor) -> int:
    if not isinstance(signs, torch.Tensor) or signs.dim() != 1:
        raise ValueError("signs must be a 1-d tensor of ±1 (random_signs)")
    _check_size(signs.numel())
    return signs.numel()


def random_signs(n: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``n`` random signs ±1 (fp32, on ``device``) drawn from a CPU ``torch.Generator`` seeded with ``seed``:
    the same vector on every machine and rank for the same seed."""
    _check_size(n)
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64)
    return (bits * 2 - 1).to(device=device, dtype=torch.float32)


def sylvester(n: int) -> torch.Tensor:
    """Sylvester's ``H_n`` (fp32 ``(n, n)``, entries ±1; ``H_n H_n = n I``) for a power of 4 ``n``."""
    _check_size(n)
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def _butterflies(blocks: torch.Tensor, axis: int) -> torch.Tensor:
    """``H_n`` along ``axis`` (size ``n``) of ``blocks``, by the fast Walsh-Hadamard transform (module docstring):
    a new tensor in ``blocks``' layout (stage by stage into two scratch buffers, ``blocks`` left as it is; for
    ``n = 1``, ``blocks`` itself)."""
    n = blocks.shape[axis]
    if n == 1:
        return blocks
    source, targets = blocks, (torch.empty_like(blocks), torch.empty_like(blocks))
    h, stage = 1, 0
    while h < n:
        pairs = source.unflatten(axis, (n // (2 * h), 2, h))  # (..., groups, [first half, second half], h, ...)
        out = targets[stage % 2].unflatten(axis, (n // (2 * h), 2, h))
        first, second = pairs.select(axis + 1, 0), pairs.select(axis + 1, 1)
        torch.add(first, second, out=out.select(axis + 1, 0))
        torch.sub(first, second, out=out.select(axis + 1, 1))
        source = targets[stage % 2]
        h, stage = 2 * h, stage + 1
    return source


def _blockwise(x: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, int]:
    """``x`` in fp32 with ``dim`` cut into blocks of ``n`` in place (no copy for fp32 ``x``): ``(blocks, axis)``,
    the blocks' elements along ``axis``."""
    if x.dim() == 0 or x.shape[dim] % n:
        raise ValueError(f"hadamard_transform: x has shape {tuple(x.shape)}; dim {dim} must be a multiple of the "
                         f"Hadamard size {n} (pad it with zeros first)")
    dim = dim % x.dim()
    return x.to(torch.float32).unflatten(dim, (-1, n)), dim + 1


def _along(signs: torch.Tensor, blocks: torch.Tensor, axis: int) -> torch.Tensor:
    """``signs`` in fp32 on ``blocks``' device, shaped to broadcast along ``axis``."""
    shape = [1] * blocks.dim()
    shape[axis] = signs.numel()
    return signs.to(device=blocks.device, dtype=torch.float32).reshape(shape)


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``T = H_n diag(signs) / sqrt(n)`` applied to every block of ``n = len(signs)`` consecutive elements of
    ``x`` along ``dim`` (whose size must be a multiple of ``n``). Returns fp32, ``x``'s shape and layout. Module
    docstring for the algorithm and its error bound."""
    n = _check_signs(signs)
    blocks, axis = _blockwise(x, n, dim)
    out = _butterflies(blocks * _along(signs, blocks, axis), axis).mul_(1.0 / n ** 0.5)
    return out.flatten(axis - 1, axis)


def inverse_hadamard_transform(y: torch.Tensor, signs: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``T^{-1} = diag(signs) H_n / sqrt(n)`` along ``dim`` in blocks of ``len(signs)``: undoes
    :func:`hadamard_transform` (to its rounding). fp32, ``y``'s shape."""
    n = _check_signs(signs)
    blocks, axis = _blockwise(y, n, dim)
    out = _butterflies(blocks, axis) * (1.0 / n ** 0.5) * _along(signs, blocks, axis)
    return out.flatten(axis - 1, axis)


def hadamard_matrix(signs: torch.Tensor) -> torch.Tensor:
    """``T = H_n diag(signs) / sqrt(n)`` as an fp32 ``(n, n)`` matrix (exact), on ``signs``' device:
    ``hadamard_transform(x, signs)`` is ``T @ x`` on each block, to rounding."""
    n = _check_signs(signs)
    eye = torch.eye(n, device=signs.device)
    return hadamard_transform(eye, signs, dim=0)
