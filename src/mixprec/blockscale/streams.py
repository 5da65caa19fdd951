"""A block-scaled linear's stochastic-rounding stream: counter-based, so every rank draws the same bits.

:class:`~mixprec.blockscale.linear.BlockScaledLinear` rounds ``dy`` stochastically (``recipe.stochastic_rounding``)
with random bits from a ``torch.Generator`` that its :class:`RoundingStream` seeds afresh at every backward call,
with :func:`stream_key` of ``(seed, calls)``: ``seed`` is the linear's ``sr_seed`` (``recipe.seed + index``),
``calls`` the backward calls the stream has served before this one. The call draws dgrad's bits, then wgrad's,
from that generator (the GEMMs whose gradient autograd asks for; a call of a recipe without stochastic rounding
draws nothing and counts nothing). The stream's whole state is ``calls``, so

* every data-parallel rank draws the same bits at the same call, whatever its token count (a generator kept
  from call to call would advance by the number of bits drawn, which differs between ranks whose batches do);
* a checkpoint holds two int64 per linear (:meth:`RoundingStream.state`: ``[seed, calls]``), one value for every
  rank, loaded at any world size and on any device (no generator state tied to a CPU or CUDA generator);
* a forward without backward (evaluation, a recomputed forward) draws nothing and advances nothing.

**The same stream on every rank**, as Transformer Engine under Megatron-LM draws it: TE's NVFP4 stochastic
rounding takes its Philox seed and offset from torch's default CUDA generator, which Megatron-LM seeds with the
same data-parallel seed on every data-parallel rank (``model_parallel_cuda_manual_seed``: ``data_parallel_seed =
seed``; rank-dependent only under ``--data-parallel-random-init``). With every rank fed the same batch, a W-rank run
is then one process's bit for bit. The cost: two ranks round their own ``dy`` with the same uniform numbers, so
their rounding errors are correlated (both round up where the shared number is small). Each error stays unbiased
(the gradient's expectation is exact), but for elements ``a`` and ``b`` at fractions ``f_a``, ``f_b`` of their
grid steps ``d_a``, ``d_b`` the covariance is ``d_a d_b (min(f_a, f_b) - f_a f_b)`` (0 for independent streams),
so the variance of the rounding noise averaged over W ranks can fall more slowly than ``1/W``. In the wgrad GEMM
each rank's errors are multiplied by its own activations: the covariance of two ranks' contributions to an element
of ``dW`` is a sum of such terms weighted by products of two different samples' activations, which carry no common
sign and largely cancel (dgrad's ``dx`` stays on its rank).

The key: SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; the
finalizer of Java's ``SplittableRandom``), ``key = mix(mix(seed) ^ calls)`` with ``mix(x)``: ``z = x + 0x9E3779B97F4A7C15;
z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9; z = (z ^ z >> 27) * 0x94D049BB133111EB; z ^ z >> 31`` (mod 2**64). A CUDA
generator (Philox) takes all 64 bits; a CPU generator (mt19937) takes the low 32 (torch's ``manual_seed``), so
on CPU two of a run's ``(seed, calls)`` pairs share their bits with probability ``2**-32`` each. CPU and CUDA
generators draw different bits for one key: a run moved between device types continues its stream's count, not
its bits.
"""

from __future__ import annotations

import torch

__all__ = ["RoundingStream", "stream_key"]

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's step and finalizer on a Python int (module docstring), exact mod 2**64."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int, calls: int) -> int:
    """The generator seed of call ``calls`` (from 0) of the stream ``seed``: ``mix(mix(seed) ^ calls)``, an int in
    ``[0, 2**64)`` (module docstring)."""
    return _mix64(_mix64(seed) ^ calls)


def _check_state(state: object, seed: int, owner: str) -> int:
    """``calls`` from a saved ``[seed, calls]``, after checking it is one (ValueError naming ``owner``)."""
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.int64 and tuple(state.shape) == (2,)):
        raise ValueError(f"{owner}: extra state {type(state).__name__} is not this module's stochastic-rounding "
                         "stream (an int64 tensor [sr_seed, calls], from a checkpoint of this version of mixprec)")
    saved_seed, calls = (int(v) for v in state.tolist())   # syncs (a load)
    if calls < 0:
        raise ValueError(f"{owner}: the saved stochastic-rounding stream is [{saved_seed}, {calls}]: a negative call "
                         "count is no stream's state (a damaged checkpoint); load the checkpoint the run wrote")
    if saved_seed != seed:
        raise ValueError(f"{owner}: the saved stochastic-rounding stream is [{saved_seed}, {calls}], but this module's "
                         f"sr_seed is {seed} (recipe seed + index): it was saved from another linear or recipe; "
                         "convert the model as the run did (same policy, same linears in the same order)")
    return calls


class RoundingStream:
    """The stochastic-rounding stream of one linear (module docstring): ``seed`` and ``calls`` (backward calls
    served). :meth:`generator` gives the generator a call draws from on a device, :meth:`serve` seeds it for the next
    call and counts the call; :meth:`state` / :meth:`load` are its checkpoint. No host sync but :meth:`load`'s."""

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"RoundingStream seed={seed!r} must be an int in [0, 2**63)")
        self.seed = seed
        self.calls = 0
        self._generators: dict[tuple[str, int | None], torch.Generator] = {}

    def generator(self, device: torch.device | str) -> torch.Generator:
        """This stream's generator on ``device`` (one per device, kept): seeded by :meth:`serve` before each draw."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        where = (device.type, device.index)
        if where not in self._generators:
            self._generators[where] = torch.Generator(device=device)
        return self._generators[where]

    def serve(self, generator: torch.Generator) -> torch.Generator:
        """Seed ``generator`` (this stream's, :meth:`generator`) with the next call's key and count the call;
        returns it. No host sync."""
        generator.manual_seed(stream_key(self.seed, self.calls))
        self.calls += 1
        return generator

    def state(self) -> torch.Tensor:
        """``[seed, calls]``: int64, shape ``(2,)``, on the CPU."""
        return torch.tensor([self.seed, self.calls], dtype=torch.int64)

    def load(self, state: torch.Tensor, owner: str = "RoundingStream") -> None:
        """Continue from a saved :meth:`state`; ValueError (naming ``owner``) for anything else, or another seed's."""
        self.calls = _check_state(state, self.seed, owner)
