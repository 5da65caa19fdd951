"""The random bits of stochastic rounding: a counter-based stream, keyed, never torch's global RNG.

Every random number stochastic rounding uses (a bf16 param's write-back, bf16 optimizer state, 8-bit state
codes) is a pure function of ``(seed, parameter, step, purpose, element index)``: a 32-bit integer hash of the
element's *global* flat index under a key derived from the rest (:class:`SRKey`). So

* nothing advances torch's RNG: data order, dropout and initialisation do not depend on the policy;
* the optimizer's ``state_dict()`` holds everything the stream needs (the seed in each param group, the
  ``step`` in the state; the parameter is its index in the optimizer's param order), so any framework's
  checkpoint resumes stochastic rounding bit for bit, whether or not it saves torch's RNG;
* a slice ``[offset, offset + n)`` of a parameter draws exactly the bits those elements draw in the whole
  parameter (:meth:`SRKey.at`): a rank rounds its shard as one process rounds those elements.

The hash (stated once; the C kernel in ``quantized_adamw.c`` computes the same, a test pins them equal):
the key words ``k1, k2`` fold ``seed`` (64 bits), ``param``, ``step`` (64 bits each), the purpose's CRC-32
and the index's high 32 bits through :func:`mix32` (``k = mix32(k ^ word)`` per 32-bit word, from 0;
``k1 = k``, ``k2 = mix32(k ^ 0x9E3779B9)``); an element with index ``i`` (low 32 bits) gets::

    x = i ^ k1;  x ^= x >> 16;  x *= 0x7FEB352D;  x ^= k2;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16

(uint32 arithmetic: Chris Wellons' "lowbias32" integer hash with the second key word injected between its
rounds). A bf16 rounding uses the low 16 bits (:func:`noise16`), an 8-bit code's rounding the top 24 as a
uniform in ``[0, 1)`` (:func:`uniform`). Seeding: an optimizer takes ``sr_seed`` from its constructor, else
``torch.initial_seed()`` (what ``torch.manual_seed`` set; reading it draws nothing).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

__all__ = ["SRKey", "mix32", "element_bits", "bits32", "noise16", "uniform"]

_M32 = 0xFFFFFFFF
_C1, _C2, _GOLDEN = 0x7FEB352D, 0x846CA68B, 0x9E3779B9


def mix32(x: int) -> int:
    """lowbias32 (Wellons): a bijective 32-bit integer hash, on Python ints (exact; the reference)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def element_bits(k1: int, k2: int, index_low32: int) -> int:
    """The stream's 32 bits for one element (module docstring), on Python ints: the exact reference."""
    x = (index_low32 ^ k1) & _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= k2
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class SRKey:
    """Where a stochastic rounding draws its bits: ``seed`` (int, any 64-bit value), ``param`` (the tensor's
    index in its optimizer's param order), ``step`` (the optimizer step, from 1), ``purpose`` (``"param"``,
    or the state key: ``"exp_avg"``...), ``offset`` (global flat index of the first element drawn for)."""

    seed: int
    param: int
    step: int
    purpose: str
    offset: int = 0

    def of(self, purpose: str) -> SRKey:
        """This key for another ``purpose`` (the same seed, param, step and offset)."""
        return replace(self, purpose=purpose)

    def at(self, offset: int) -> SRKey:
        """This key for the elements from global index ``offset + self.offset`` on (a shard or a slice)."""
        return replace(self, offset=self.offset + offset)

    def words(self, index_high32: int = 0) -> tuple[int, int]:
        """``(k1, k2)`` for elements whose global index has high 32 bits ``index_high32``."""
        k = 0
        for word in (self.seed, self.seed >> 32, self.param, self.param >> 32, self.step, self.step >> 32,
                     zlib.crc32(self.purpose.encode()), index_high32):
            k = mix32(k ^ (word & _M32))
        return k, mix32(k ^ _GOLDEN)


def _signed32(x: int) -> int:
    return x - (1 << 32) if x & 0x80000000 else x


def bits32(key: SRKey, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The stream's bits for global indices ``[key.offset, key.offset + n)``: int32 ``(n,)`` on ``device`` (the
    uint32 values' bit patterns). Torch int32 ops (wrapping multiplies), ~10 passes; no host sync."""
    out = torch.empty(n, dtype=torch.int32, device=device)
    start = key.offset
    while start < key.offset + n:   # one run per 2**32-element span of the index (one, but for huge tensors)
        stop = min(key.offset + n, ((start >> 32) + 1) << 32)
        k1, k2 = key.words(start >> 32)
        x = torch.arange(start & _M32, ((stop - 1) & _M32) + 1, dtype=torch.int64, device=device).to(torch.int32)
        x.bitwise_xor_(_signed32(k1))
        x.bitwise_xor_(x.bitwise_right_shift(16).bitwise_and_(0xFFFF))
        x.mul_(_signed32(_C1))
        x.bitwise_xor_(_signed32(k2))
        x.bitwise_xor_(x.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
        x.mul_(_signed32(_C2))
        x.bitwise_xor_(x.bitwise_right_shift(16).bitwise_and_(0xFFFF))
        out[start - key.offset: stop - key.offset] = x
        start = stop
    return out


def noise16(key: SRKey, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 of ``shape`` whose low 16 bits are the stream's (row-major global indices from ``key.offset``): the
    noise :func:`mixprec.optim.rounding.stochastic_round_to_bf16` adds. No host sync."""
    n = 1
    for s in shape:
        n *= s
    return bits32(key, n, device).view(shape)


def uniform(key: SRKey, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 uniforms in ``[0, 1)`` of ``shape``: the top 24 bits of the stream times ``2**-24`` (exact). No sync."""
    bits = noise16(key, shape, device)
    return bits.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).float().mul_(2.0 ** -24)
