"""The stochastic-rounding stream of a block-scaled linear: its key is SplitMix64's (published test vectors), one
call's bits do not depend on how many bits earlier calls drew (why ranks with other token counts stay in lockstep),
and its state is the call count."""

from __future__ import annotations

import pytest
import torch

from mixprec.blockscale import BlockScaledLinear
from mixprec.blockscale.streams import RoundingStream, stream_key

_GOLDEN, _M64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


def _splitmix64_outputs(seed: int, n: int) -> list[int]:
    """SplitMix64 as published (Steele, Lea, Flood 2014; Vigna's splitmix64.c): the state advances by the golden
    gamma, each output is the state's finalizer."""
    out, state = [], seed
    for _ in range(n):
        state = (state + _GOLDEN) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


def test_the_reference_reproduces_splitmix64s_published_outputs():
    assert _splitmix64_outputs(0, 1) == [0xE220A8397B1DCDAF]
    assert _splitmix64_outputs(1234567, 3) == [6457827717110365317, 3203168211198807973, 9817491932198370423]


@pytest.mark.parametrize("seed, calls", [(0, 0), (0, 1), (5, 0), (5, 12345), (2 ** 62 + 3, 2 ** 40)])
def test_the_key_is_splitmix64_of_the_seeds_output_and_the_count(seed, calls):
    first = _splitmix64_outputs(seed, 1)[0]
    assert stream_key(seed, calls) == _splitmix64_outputs(first ^ calls, 1)[0]


def test_a_calls_bits_do_not_depend_on_how_many_bits_earlier_calls_drew():
    a, b = RoundingStream(3), RoundingStream(3)
    ga, gb = a.generator("cpu"), b.generator("cpu")
    torch.randint(0, 2 ** 32, (10,), generator=a.serve(ga))       # call 0: a rank with 10 elements
    torch.randint(0, 2 ** 32, (1000,), generator=b.serve(gb))     # call 0: a rank with 1000
    bits_a = torch.randint(0, 2 ** 32, (64,), generator=a.serve(ga), dtype=torch.int64)
    bits_b = torch.randint(0, 2 ** 32, (64,), generator=b.serve(gb), dtype=torch.int64)
    assert torch.equal(bits_a, bits_b) and a.calls == b.calls == 2
    other = torch.randint(0, 2 ** 32, (64,), generator=RoundingStream(4).serve(ga), dtype=torch.int64)
    assert not torch.equal(other, bits_a)   # another seed, another stream


def test_the_state_is_the_seed_and_the_count_and_loads_back():
    stream = RoundingStream(9)
    generator = stream.generator(torch.device("cpu"))
    assert stream.generator("cpu") is generator   # one generator per device, kept
    for _ in range(3):
        stream.serve(generator)
    state = stream.state()
    assert state.dtype == torch.int64 and state.tolist() == [9, 3]
    again = RoundingStream(9)
    again.load(state)
    assert again.calls == 3
    with pytest.raises(ValueError, match=r"stream is \[9, 3\], but this module's sr_seed is 8"):
        RoundingStream(8).load(state, "linear 8")
    with pytest.raises(ValueError, match=r"RoundingStream seed=-1"):
        RoundingStream(-1)


def test_a_linear_counts_one_call_per_backward_and_none_per_forward():
    module = BlockScaledLinear(32, 32, recipe="nvfp4", index=4)
    x = torch.randn(16, 32, requires_grad=True)
    with torch.no_grad():
        module(x)                      # evaluation: nothing drawn
    module(x).sum().backward()
    assert module.get_extra_state().tolist() == [4, 1]
    module(x).sum().backward()
    assert module.get_extra_state().tolist() == [4, 2]
    plain = BlockScaledLinear(32, 32, recipe="mxfp8", index=4)
    plain(x).sum().backward()
    assert plain.get_extra_state().tolist() == [4, 0]   # no stochastic rounding: no stream to advance
