"""Stochastic rounding's counter-based stream (issue 26; issue 28's shard property).

The random bits are a hash of (sr_seed, param index, step, purpose, global element index): torch's global RNG
never moves, an optimizer's ``state_dict()`` alone resumes stochastic rounding bit for bit, the seed decides
the run, the C kernel takes the same bits as the torch ops, and a slice of a parameter rounds exactly as those
elements of the whole parameter. A state dict saved before ``sr_seed`` existed is refused by name where rounding
is stochastic, and continues on the seeded stream under ``mixprec.optim.adopt_sr_seed``.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision
from mixprec.optim import quantized_adamw
from mixprec.optim import quantized_state as qs
from mixprec.optim.rounding import stochastic_round_to_bf16
from mixprec.optim.sr_stream import SRKey, bits32, element_bits, mix32, uniform

_M32 = 0xFFFFFFFF


def _as_uint32(t: torch.Tensor) -> list[int]:
    return (t.to(torch.int64) & _M32).tolist()


# ------------------------------------------------------------------------------------------ the hash, exactly
def test_mix32_is_lowbias32():
    # Wellons' lowbias32 written out on ints (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
    # x ^= x >> 16): fixed points of the definition, checked by hand-computed small cases
    assert mix32(0) == 0
    x = 1
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    assert mix32(1) == x
    assert len({mix32(i) for i in range(4096)}) == 4096   # a bijection: no collisions


@pytest.mark.parametrize("offset", [0, 12345, 2**32 - 7])   # the last run crosses the index's 2**32 boundary
def test_torch_bits_equal_the_integer_reference(offset):
    key = SRKey(2**63 + 12345, 7, 1001, "param", offset)
    got = _as_uint32(bits32(key, 300))
    want = []
    for j in range(300):
        k1, k2 = key.words((offset + j) >> 32)
        want.append(element_bits(k1, k2, (offset + j) & _M32))
    assert got == want


def test_bits_are_uniform():
    # 2**16 draws: each of the 32 bits is set with frequency 1/2 within 5 binomial sigmas (sigma = 2**-9),
    # and the low 16 bits (bf16 rounding's noise) fill 256 bins of their top 8 bits evenly (chi-square, 255 dof:
    # mean 255, sd 22.6; bound mean + 6 sd)
    n = 2**16
    bits = bits32(SRKey(1, 0, 1, "param"), n).to(torch.int64) & _M32
    for b in range(32):
        freq = ((bits >> b) & 1).double().mean().item()
        assert abs(freq - 0.5) <= 5 * 0.5 / math.sqrt(n), b
    counts = torch.bincount(((bits & 0xFFFF) >> 8), minlength=256).double()
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)
    u = uniform(SRKey(1, 0, 1, "exp_avg"), (n,))
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert torch.equal(u * 2**24, (u * 2**24).floor())   # exact multiples of 2**-24


def test_keys_give_independent_streams():
    base = SRKey(5, 0, 1, "param")
    n = 4096
    streams = [bits32(k, n) for k in (base, base.of("exp_avg"), SRKey(6, 0, 1, "param"), SRKey(5, 1, 1, "param"),
                                      SRKey(5, 0, 2, "param"))]
    for i in range(len(streams)):
        for j in range(i):
            # two independent uniform 32-bit streams agree in an element with probability 2**-32
            assert int((streams[i] == streams[j]).sum()) == 0, (i, j)


# ------------------------------------------------------------------------------------------ rounding with it
def test_sr_with_the_stream_is_unbiased():
    # x = lo + f * ulp: each element rounds up with probability f; over 2**16 elements the fraction rounded up
    # equals f within 5 binomial sigmas, and the mean equals x within the same bound (times the ulp)
    lo = torch.tensor(1.0, dtype=torch.bfloat16).float()
    ulp = 2.0**-7
    n = 2**16
    for f in (0.25, 0.7, 1 / 3):
        x = torch.full((n,), (lo + f * ulp).item())
        f_exact = (x[0].item() - lo.item()) / ulp
        up = (stochastic_round_to_bf16(x, generator=SRKey(3, 2, 1, "param")).float() > lo).double().mean().item()
        assert abs(up - f_exact) <= 5 * math.sqrt(f_exact * (1 - f_exact) / n)
    # one element over many steps: the same bound
    steps = torch.stack([stochastic_round_to_bf16(x[:1], generator=SRKey(3, 2, t, "param")) for t in range(4096)])
    up = (steps.float() > lo).double().mean().item()
    assert abs(up - f_exact) <= 5 * math.sqrt(f_exact * (1 - f_exact) / 4096)


def test_a_slice_rounds_as_those_elements_of_the_whole():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 53, generator=gen)
    key = SRKey(11, 4, 9, "param")
    whole = stochastic_round_to_bf16(x, generator=key).reshape(-1)
    flat = x.reshape(-1)
    for offset, n in ((0, 100), (517, 300), (1900, 61)):
        part = stochastic_round_to_bf16(flat[offset:offset + n], generator=key.at(offset))
        assert torch.equal(part.view(torch.int16), whole[offset:offset + n].view(torch.int16))
    # 8-bit state: a block-aligned shard quantizes to the whole tensor's codes and scales
    v = torch.randn(8 * qs.BLOCK_SIZE, generator=gen) * 1e-3
    code = qs.CODES["dynamic-signed"]
    codes, absmax = qs.quantize(v, code, rounding="stochastic", generator=key.of("exp_avg"))
    start = 3 * qs.BLOCK_SIZE
    shard_codes, shard_absmax = qs.quantize(v[start:start + 2 * qs.BLOCK_SIZE], code, rounding="stochastic",
                                            generator=key.of("exp_avg").at(start))
    assert torch.equal(shard_codes, codes[start:start + 2 * qs.BLOCK_SIZE])
    assert torch.equal(shard_absmax, absmax[3:5])


def test_the_c_kernel_takes_the_stream_s_bits_as_the_torch_ops():
    if not quantized_adamw.fusable(torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 64),
                                   torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 64, dtype=torch.uint8),
                                   rounding="stochastic"):
        pytest.skip(f"no C kernel here: {quantized_adamw.kernel_status()}")
    gen = torch.Generator().manual_seed(1)
    hyper = dict(step=4.0, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    # offsets: hashed in the kernel (0, a shard's 1000), and a run crossing index 2**32 (drawn in torch, passed in)
    for (m_code, v_code), offset in itertools.product((("dynamic-signed", "dynamic-sqrt"), ("e4m3", "e5m2")),
                                                     (0, 1000, 2**32 - 300)):
        key = SRKey(2**40 + 3, 5, 4, "param", offset)
        param = torch.randn(64, 80, generator=gen).to(torch.bfloat16)
        grad = torch.randn(64, 80, generator=gen) * 1e-2
        m = qs.quantize(torch.randn(64, 80, generator=gen) * 1e-3, qs.CODES[m_code])
        v = qs.quantize(torch.rand(64, 80, generator=gen) * 1e-5, qs.CODES[v_code])
        ref = [param.clone(), m[0].clone(), m[1].clone(), v[0].clone(), v[1].clone()]
        ref_fp32 = ref[0].float()
        rng = torch.get_rng_state()
        quantized_adamw.reference_update_(ref_fp32, grad, (ref[1], ref[2]), (ref[3], ref[4]),
                                          state_rounding="stochastic", generator=key, **hyper)
        ref[0].copy_(stochastic_round_to_bf16(ref_fp32, generator=key))
        quantized_adamw.fused_step_(param, grad, m, v, rounding="stochastic", state_rounding="stochastic",
                                    generator=key, **hyper)
        assert torch.equal(rng, torch.get_rng_state())
        for got, want in zip((param, m[0], m[1], v[0], v[1]), ref):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (m_code, offset)


# ------------------------------------------------------------------------------------------ the optimizer's seed
def test_sr_seed_is_the_user_s_seed_or_given_and_checked():
    p = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    opt = mixprec.optim.AdamW([p], rounding="stochastic")
    assert torch.equal(state, torch.get_rng_state())           # reading the seed draws nothing
    assert opt.param_groups[0]["sr_seed"] == 1234
    assert opt.state_dict()["param_groups"][0]["sr_seed"] == 1234
    assert mixprec.optim.SGD([p], sr_seed=7).param_groups[0]["sr_seed"] == 7
    assert "sr_seed=7" in mixprec.optim.SGD([p], sr_seed=7).sr_stream
    for bad in (-1, 2**64, 1.5, "3", True):
        with pytest.raises(ValueError, match="sr_seed"):
            mixprec.optim.AdamW([p], sr_seed=bad)


def _sr_run(sr_seed: int, steps: int = 5) -> torch.Tensor:
    p = nn.Parameter(torch.linspace(-1, 1, 4096).reshape(64, 64).to(torch.bfloat16))
    opt = mixprec.optim.AdamW([p], lr=1e-3, rounding="stochastic", state_dtype="int8", sr_seed=sr_seed)
    for t in range(steps):
        p.grad = torch.cos(torch.arange(4096.0) * (t + 1)).reshape(64, 64).to(torch.bfloat16)
        opt.step()
    return p.detach().clone()


def test_the_same_seed_gives_the_same_run_another_seed_another():
    torch.manual_seed(0)
    a = _sr_run(1)
    torch.manual_seed(99)   # torch's RNG plays no part
    assert torch.equal(_sr_run(1).view(torch.int16), a.view(torch.int16))
    assert not torch.equal(_sr_run(2), a)


def _without_sr_seed(state_dict: dict) -> dict:
    """``state_dict`` as saved before ``sr_seed`` existed: its param groups without it."""
    return {**state_dict, "param_groups": [{k: v for k, v in g.items() if k != "sr_seed"}
                                           for g in state_dict["param_groups"]]}


def _stepped_sgd(sr_seed: int) -> tuple[nn.Parameter, mixprec.optim.SGD]:
    """A bf16 param (and an SGD rounding it stochastically) after two steps: momentum state to load."""
    p = nn.Parameter(torch.linspace(0.5, 1.5, 256).to(torch.bfloat16))
    opt = mixprec.optim.SGD([p], lr=1e-3, momentum=0.9, rounding="stochastic", sr_seed=sr_seed)
    for t in range(2):
        p.grad = torch.cos(torch.arange(256.0) * (t + 1)).to(torch.bfloat16)
        opt.step()
    return p, opt


def test_a_state_dict_without_sr_seed_is_refused_by_name_where_rounding_is_stochastic():
    """The legacy global-RNG stream is gone: such a load names the groups, the missing sr_seed and the fix (and
    that the run will not continue bit for bit), and loads nothing; so does one rounding only the state."""
    _, saved = _stepped_sgd(3)
    old = _without_sr_seed(copy.deepcopy(saved.state_dict()))
    p = nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    opt = mixprec.optim.SGD([p], lr=1e-3, momentum=0.9, rounding="stochastic", sr_seed=9)
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(old)
    for part in ("SGD.load_state_dict: saved param group 0 has no 'sr_seed'", "rounds stochastically "
                 "(rounding='stochastic')", "it loaded nothing", "with mixprec.optim.adopt_sr_seed(optimizer, "
                 "sr_seed=<int>): <the same load>", "not bit for bit with the old run's global-RNG draws"):
        assert part in str(err.value), part
    assert not opt.state and opt.param_groups[0]["sr_seed"] == 9 and opt.param_groups[0]["lr"] == 1e-3
    two = mixprec.optim.AdamW([{"params": [nn.Parameter(torch.ones(4))]}, {"params": [nn.Parameter(torch.ones(4))]}],
                              state_dtype="bf16")   # state_rounding: 'stochastic' (bf16 state's default)
    with pytest.raises(ValueError, match=r"saved param groups 0, 1 have no 'sr_seed'.*\(state_rounding='stochastic'\)"):
        two.load_state_dict(_without_sr_seed(two.state_dict()))


def test_adopt_sr_seed_continues_an_old_state_dict_on_the_seeded_stream():
    """Under adopt_sr_seed the old groups take the seed given, and the next step equals, bit for bit, a fresh
    optimizer with that sr_seed given the same state; torch's RNG does not move; the block changes nothing
    else: the state dict is not modified, groups that have a seed keep it, and a load after it is refused."""
    _, saved = _stepped_sgd(3)
    state = copy.deepcopy(saved.state_dict())
    old = _without_sr_seed(state)

    def step_after_load(sr_seed: int, load) -> torch.Tensor:
        p = nn.Parameter(torch.linspace(0.5, 1.5, 256).to(torch.bfloat16))
        opt = mixprec.optim.SGD([p], lr=1e-3, momentum=0.9, rounding="stochastic", sr_seed=sr_seed)
        load(opt)
        assert opt.param_groups[0]["sr_seed"] == 7 and opt.sr_stream == "counter-based stream, sr_seed=7"
        p.grad = torch.full_like(p, 0.3)
        opt.step()
        return p.detach().clone()

    def adopted(opt):
        with mixprec.optim.adopt_sr_seed(opt, sr_seed=7) as same:
            assert same is opt
            opt.load_state_dict(old)

    rng = torch.get_rng_state()
    got = step_after_load(1, adopted)
    assert torch.equal(rng, torch.get_rng_state())                  # the seeded stream draws nothing from torch
    want = step_after_load(7, lambda opt: opt.load_state_dict({**state, "param_groups": [
        {**g, "sr_seed": 7} for g in state["param_groups"]]}))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert all("sr_seed" not in g for g in old["param_groups"])      # the state dict itself is unchanged
    opt = mixprec.optim.SGD([nn.Parameter(torch.ones(256, dtype=torch.bfloat16))], momentum=0.9, rounding="stochastic")
    with mixprec.optim.adopt_sr_seed(opt, sr_seed=7):
        opt.load_state_dict(state)                                   # a group with its seed keeps it
    assert opt.param_groups[0]["sr_seed"] == 3
    with pytest.raises(ValueError, match="has no 'sr_seed'"):
        opt.load_state_dict(old)                                     # outside the block: refused again


def test_a_state_dict_without_sr_seed_loads_where_nothing_rounds_stochastically():
    """Nothing to continue: the old groups take this optimizer's own seeds, which a later switch to stochastic
    rounding (the engine's move_state) draws from."""
    _, saved = _stepped_sgd(3)
    old = _without_sr_seed(copy.deepcopy(saved.state_dict()))
    p = nn.Parameter(torch.linspace(0.5, 1.5, 256).to(torch.bfloat16))
    opt = mixprec.optim.SGD([p], lr=1e-3, momentum=0.9, sr_seed=11)   # rounding='nearest'
    opt.load_state_dict(old)
    assert opt.param_groups[0]["sr_seed"] == 11 and torch.equal(opt.state[p]["momentum_buffer"],
                                                                 saved.state[saved.param_groups[0]["params"][0]]["momentum_buffer"])
    opt.move_state([(p, p)], rounding="stochastic", state_dtype=torch.float32)
    assert opt.sr_stream == "counter-based stream, sr_seed=11"


def test_adopt_sr_seed_refuses_what_has_no_stream_and_checks_the_seed():
    with pytest.raises(TypeError, match="adopt_sr_seed takes a mixprec.optim optimizer"):
        with mixprec.optim.adopt_sr_seed(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), sr_seed=1):
            pass
    opt = mixprec.optim.SGD([nn.Parameter(torch.ones(2))])
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="adopt_sr_seed sr_seed="):
            with mixprec.optim.adopt_sr_seed(opt, sr_seed=bad):
                pass
    torch.manual_seed(21)
    with mixprec.optim.adopt_sr_seed(opt):   # None: torch.initial_seed(), as the constructors' default
        opt.load_state_dict(_without_sr_seed(opt.state_dict()))
    assert opt.param_groups[0]["sr_seed"] == 21


# ------------------------------------------------------------------------------------------ through the engine
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 4))   # 4096 weights: 8-bit state


def _batches(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(8, 16, generator=gen), "y": torch.randn(8, 4, generator=gen)} for _ in range(n)]


def _train(mp: MixedPrecision, batches: list[dict]) -> None:
    for batch in batches:
        batch = mp.cast_inputs(batch, keep=("y",))
        with mp.autocast():
            loss = F.mse_loss(mp.model(batch["x"]).float(), batch["y"])
        mp.backward(loss)
        mp.step()


def _build(policy: str) -> tuple[nn.Module, torch.optim.Optimizer, MixedPrecision]:
    model = _model()
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2, sr_seed=42)
    return model, opt, MixedPrecision(model, opt, policy, device="cpu")


@pytest.mark.parametrize("policy", ["bf16-sr", "bf16-lean", "bf16-kahan,state=bf16"])
def test_ten_steps_leave_torch_s_global_rng_untouched(policy):
    _, _, mp = _build(policy)
    batches = _batches(10)
    state = torch.get_rng_state()
    _train(mp, batches)
    assert mp.applied_steps == 10
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("policy", ["bf16-sr", "bf16-lean"])
def test_model_and_optimizer_state_dicts_alone_resume_bit_for_bit(policy):
    batches = _batches(20)
    model, _, mp = _build(policy)
    _train(mp, batches)
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, mp = _build(policy)
    _train(mp, batches[:10])
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})   # no torch RNG saved
    torch.manual_seed(12345)                                  # and the RNG moves on, as in another process
    torch.rand(1000)
    model, opt, mp = _build(policy)
    opt.param_groups[0]["sr_seed"] = 0                        # the checkpoint's seed must win
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    _train(mp, batches[10:])
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == straight[name].dtype
        assert torch.equal(tensor.view(torch.uint8) if tensor.is_floating_point() else tensor,
                           straight[name].view(torch.uint8) if tensor.is_floating_point() else straight[name]), name


def test_the_c_write_back_rounds_as_the_torch_ops():
    x = torch.cat([torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 1e3,
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.4028235e38, -3.4028235e38, 1e-42])])
    key = SRKey(2**64 - 1, 3, 17, "param")
    for offset in (0, 4096, 2**32 - 6000):   # a shard's offset; a run that ends just below index 2**32
        got = torch.empty(x.shape, dtype=torch.bfloat16)
        if not quantized_adamw.stochastic_round_into_(got, x, key.at(offset)):
            pytest.skip(f"no C kernel here: {quantized_adamw.kernel_status()}")
        assert torch.equal(got.view(torch.int16), stochastic_round_to_bf16(x, generator=key.at(offset)).view(torch.int16))
    # a run crossing index 2**32 is the torch ops' (the key's high word changes there): refused, nothing written
    assert not quantized_adamw.stochastic_round_into_(got, x, key.at(2**32 - 10))
