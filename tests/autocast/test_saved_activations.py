"""saved=compute (issue 27): norms autocast computes in fp32 save their input for backward in bf16.

Before, every bf16 policy saved the fp32 input of each LayerNorm (bf16-mixed: the fp32 residual stream; -pure: an
fp32 copy of the bf16 one), 23 % of GPT's activations; now they save it rounded to bf16 (under -pure the bf16
input itself) plus the fp32 row statistics, and still compute in fp32.

The bound (bf16-mixed's fp32 input; u = 2^-8, bf16's unit roundoff). LayerNorm's backward, per row of n
elements with rstd r, xhat = (x - mean) r, g' = g w (w = 1 without affine):
    dx = r (g' - mean(g') - xhat mean(g' xhat)),  dw = sum_rows g xhat,  db = sum_rows g.
The backward reads x~ = x (1 + d), |d| <= u, with the fp32 mean and r of the exact x, so xhat~ = xhat + r x d:
    |D xhat_i| <= e_i := u r |x_i|,
    |D dx_i| <= r (e_i (|mean(g' xhat)| + M) + |xhat_i| M),  M = mean(|g'| e)   (exact, not first-order),
    |D dw_j| <= sum_rows |g_j| e_j,   D db = 0.
Both runs compute in fp32 and the reference here is fp64, so each bound adds fp32's evaluation error of the same
sums: gamma(n) = n 2^-24 / (1 - n 2^-24) times the sums of magnitudes (x 4 for the statistics' own rounding).
Where the input is bf16 (every -pure/-sr/-kahan/-lean policy) the upcast is exact: bit-identical gradients.
RMSNorm (mean = 0, rstd = rsqrt(mean(x^2) + eps)) recomputes rstd from x~ in its backward: r~ = r (1 + rho),
|rho| <= u / (1 - u), so |D xhat_i| <= |xhat_i| 2u / (1 - u) and dx carries the factor (1 + rho) besides.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision, Policy
from mixprec.autocast.portable import portable_ops
from mixprec.autocast.saved_dtype import saved_in_compute
from mixprec.memory.saved import saved_bytes
from mixprec.workloads.gpt import GPTConfig, GPTWorkload

U = 2.0 ** -8          # bf16's unit roundoff
FP32_U = 2.0 ** -24


def _gamma(n: int) -> float:
    return n * FP32_U / (1 - n * FP32_U)


def _under_bf16(fn, *, saved: bool):
    """``fn()`` under CPU bf16 autocast with the portable op lists (CUDA's: norms in fp32), saving in bf16 or not."""
    with torch.autocast("cpu", dtype=torch.bfloat16), portable_ops("cpu"), saved_in_compute("cpu", enabled=saved):
        return fn()


def _norm_grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor, *, saved: bool):
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    out, counted = _under_bf16(lambda: saved_bytes(lambda: module(x), exclude=list(module.parameters())), saved=saved)
    out.backward(g)
    return out.detach(), x.grad, [p.grad for p in module.parameters()], counted


def _ln_bound(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor | None, eps: float, rms: bool = False):
    """The elementwise bounds of the module docstring for dx and dw (fp64), and the fp64 reference dx, dw."""
    x64, g64 = x.double(), g.double()
    n = x.shape[-1]
    mean = torch.zeros_like(x64[..., :1]) if rms else x64.mean(-1, keepdim=True)
    var = x64.square().mean(-1, keepdim=True) if rms else x64.var(-1, correction=0, keepdim=True)
    r = torch.rsqrt(var + eps)
    xhat = (x64 - mean) * r
    gp = g64 * (1.0 if w is None else w.double())
    m = (gp * xhat).mean(-1, keepdim=True)
    dx = r * (gp - (0 if rms else gp.mean(-1, keepdim=True)) - xhat * m)
    # LayerNorm keeps the exact fp32 statistics: only x moves. RMSNorm recomputes rstd from x~: r~ = r (1 + rho),
    # |rho| <= u / (1 - u), so xhat~ = xhat (1 + d)(1 + rho) moves by at most |xhat| 2u / (1 - u)
    rho = U / (1 - U) if rms else 0.0
    e = xhat.abs() * 2 * U / (1 - U) if rms else U * r * x64.abs()
    big_m = (gp.abs() * e).mean(-1, keepdim=True)
    bound_dx = rho * dx.abs() + (1 + rho) * r * (e * (m.abs() + big_m) + xhat.abs() * big_m)
    slack_dx = 4 * _gamma(n + 4) * r * (gp.abs() + gp.abs().mean(-1, keepdim=True)
                                         + (xhat.abs() + 1) * (gp * xhat).abs().mean(-1, keepdim=True))
    rows = g64.reshape(-1, n)
    dw = (rows * xhat.reshape(-1, n)).sum(0)
    bound_dw = (rows.abs() * e.reshape(-1, n)).sum(0)
    slack_dw = 4 * _gamma(rows.shape[0] + n + 4) * (rows * xhat.reshape(-1, n)).abs().sum(0)
    return dx, bound_dx + slack_dx, dw, bound_dw + slack_dw


def _sample(rows: int, n: int, dtype: torch.dtype, offset: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(rows, n, generator=g) * 2 + offset).to(dtype)   # a mean far from 0: |x| r > |xhat|
    return x, torch.randn(rows, n, generator=g)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_on_fp32_input_saves_bf16_computes_fp32_and_its_gradient_is_within_the_bf16_bound(affine):
    torch.manual_seed(0)
    ln = nn.LayerNorm(64, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.normal_(1.0, 0.5), ln.bias.normal_(0.0, 0.5)
    x, g = _sample(48, 64, torch.float32)
    out, dx, grads, counted = _norm_grads(ln, x, g, saved=True)
    out_ref, dx_ref, grads_ref, counted_ref = _norm_grads(ln, x, g, saved=False)
    assert out.dtype == torch.float32 and torch.equal(out, out_ref)   # still computes in fp32, bit for bit
    # saved: the bf16 input (48 x 64 x 2) and fp32 mean and rstd (48 x 4 each); before, the fp32 input itself
    assert counted.by_dtype == {"torch.bfloat16": 48 * 64 * 2, "torch.float32": 2 * 48 * 4}
    assert counted_ref.by_dtype == {"torch.float32": 48 * 64 * 4 + 2 * 48 * 4}
    dx64, bound_dx, dw64, bound_dw = _ln_bound(x, g, ln.weight if affine else None, ln.eps)
    assert ((dx.double() - dx64).abs() <= bound_dx).all()
    assert ((dx_ref.double() - dx64).abs() <= bound_dx).all()   # the fp32-saved op within the same bound
    assert not torch.equal(dx, dx_ref)   # the rounding is really there (the bound is what holds it)
    if affine:
        (dw, db), (dw_ref, db_ref) = grads, grads_ref
        assert ((dw.double() - dw64).abs() <= bound_dw).all()
        assert torch.equal(db, db_ref)   # db = sum of g: independent of x


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_on_bf16_input_saves_the_input_itself_and_gives_bit_identical_gradients(affine):
    """-pure/-sr/-kahan/-lean: the input is bf16, its upcast exact; nothing new is stored (the bf16 input is saved)."""
    ln = nn.LayerNorm(64, elementwise_affine=affine).to(torch.bfloat16)
    if affine:
        with torch.no_grad():
            ln.weight.normal_(1.0, 0.5), ln.bias.normal_(0.0, 0.5)
    x, g = _sample(48, 64, torch.bfloat16)
    out, dx, grads, counted = _norm_grads(ln, x, g, saved=True)
    out_ref, dx_ref, grads_ref, counted_ref = _norm_grads(ln, x, g, saved=False)
    assert out.dtype == torch.float32 and torch.equal(out, out_ref)
    assert dx.dtype == torch.bfloat16 and torch.equal(dx, dx_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
    # saved: the bf16 input (48 x 64 x 2) + mean and rstd; before, its fp32 copy (x 4) and fp32 weight/bias copies
    assert counted.by_dtype == {"torch.bfloat16": 48 * 64 * 2, "torch.float32": 2 * 48 * 4}
    assert counted_ref.by_dtype == {"torch.float32": 48 * 64 * 4 + 2 * 48 * 4 + (2 * 64 * 4 if affine else 0)}


def test_rms_norm_saves_bf16_and_is_within_the_bound_on_fp32_input_and_exact_on_bf16_input():
    norm = nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    x, g = _sample(48, 64, torch.float32)
    out, dx, (dw,), counted = _norm_grads(norm, x, g, saved=True)
    out_ref, dx_ref, (dw_ref,), _ = _norm_grads(norm, x, g, saved=False)
    assert torch.equal(out, out_ref) and counted.by_dtype == {"torch.bfloat16": 48 * 64 * 2}
    dx64, bound_dx, dw64, bound_dw = _ln_bound(x, g, norm.weight, 1e-6, rms=True)
    assert ((dx.double() - dx64).abs() <= bound_dx).all() and ((dw.double() - dw64).abs() <= bound_dw).all()
    norm_bf16 = norm.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    out, dx, (dw,), _ = _norm_grads(norm_bf16, xb, g, saved=True)
    out_ref, dx_ref, (dw_ref,), _ = _norm_grads(norm_bf16, xb, g, saved=False)
    assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)


def test_double_backward_through_a_bf16_saved_layer_norm_reaches_the_input():
    """A gradient penalty through the norm: the second-order path goes through the differentiable bf16 cast."""
    torch.manual_seed(0)
    ln, head = nn.LayerNorm(16), nn.Linear(16, 1)
    x = torch.randn(8, 16).requires_grad_(True)

    def penalty_grad(saved: bool):
        def run():
            (gx,) = torch.autograd.grad(head(ln(x)).float().sum(), x, create_graph=True)
            return gx.square().sum()
        pen = _under_bf16(run, saved=saved)
        return torch.autograd.grad(pen, (x, ln.weight))

    got, ref = penalty_grad(True), penalty_grad(False)
    for a, b in zip(got, ref, strict=True):
        assert a.abs().max() > 0   # the path exists (it would be all zeros without the cast's edge)
        assert torch.allclose(a, b, rtol=16 * U, atol=16 * U * b.abs().max().item())


# ---------------------------------------------------------------------------- through the engine, on the GPT
def _gpt_engine(policy: str, config: GPTConfig | str = "tiny"):
    torch.manual_seed(0)
    wl = GPTWorkload(config)
    model = wl.build_model()
    return wl, MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=3e-3), policy, device="cpu")


def test_gpt_tiny_bf16_mixed_each_norm_within_the_bound_forward_bit_identical_and_pure_bit_identical():
    """Every LayerNorm of the GPT (blocks and final), inside the engine's backward: its input gradient, given the
    gradient it received, is within the bound of the exact (fp64) backward at its unrounded input; the logits are
    those of saved=fp32 bit for bit. Under bf16-pure every gradient equals saved=fp32's bit for bit."""
    runs = {}
    for policy in ("bf16-mixed", "bf16-mixed,saved=fp32", "bf16-pure", "bf16-pure,saved=fp32"):
        wl, mp = _gpt_engine(policy)
        seen: dict[nn.Module, list[torch.Tensor]] = {}

        def forward_hook(mod, inp, out):
            seen[mod] = [inp[0].detach()]

        def backward_hook(mod, grad_in, grad_out):
            seen[mod] += [grad_out[0], grad_in[0]]

        for m in mp.model.modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_hook(forward_hook)
                m.register_full_backward_hook(backward_hook)
        batch = mp.cast_inputs(next(wl.batches("train")))
        with mp.autocast():
            logits = mp.model(batch["idx"])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())
        mp.backward(loss)
        runs[policy] = (logits.detach(), [g.clone() for g in mp.gradients()], [[m, *v] for m, v in seen.items()],
                        mp.decision)
    assert "saved=compute" in runs["bf16-mixed"][3] and "saved=fp32" in runs["bf16-mixed,saved=fp32"][3]
    assert torch.equal(runs["bf16-mixed"][0], runs["bf16-mixed,saved=fp32"][0])
    assert len(runs["bf16-mixed"][2]) == 2 * 2 + 1
    for ln, x, g_out, g_in in runs["bf16-mixed"][2]:
        assert x.dtype == torch.float32, (ln, x.dtype)   # bf16-mixed: the fp32 residual stream
        dx64, bound, _, _ = _ln_bound(x, g_out.float(), ln.weight, ln.eps)
        assert ((g_in.double() - dx64).abs() <= bound).all()
    assert any(not torch.equal(a, b) for a, b in zip(runs["bf16-mixed"][1], runs["bf16-mixed,saved=fp32"][1]))
    assert torch.equal(runs["bf16-pure"][0], runs["bf16-pure,saved=fp32"][0])
    assert all(torch.equal(a, b) for a, b in zip(runs["bf16-pure"][1], runs["bf16-pure,saved=fp32"][1], strict=True))


# 4 blocks of width 128 over 48 x 128 tokens: activations dominate (autocast's bf16 weight copies are 0.7 % of
# them, the loss's fp32 log-softmax 1.3 %)
_WIDE = GPTConfig(4, 4, 128, block_size=128, batch_size=48)


def test_bf16_policies_save_at_most_0_52_of_fp32s_activations_and_saved_fp32_restores_the_layer_norm_inputs():
    """kernels=native pins torch's fused attention (the measured op plan may pick a candidate that saves fp32
    probabilities: the memory-aware plan is its own work). Forward only: the graph's saved bytes."""
    linear_bf16 = {}

    def measure(policy: str) -> int:
        wl, mp = _gpt_engine(policy, _WIDE)
        batch = mp.cast_inputs(next(wl.batches("train")))
        weights = {id(m.weight): m.weight for m in mp.model.modules() if isinstance(m, torch.nn.Linear)}
        linear_bf16[policy] = sum(2 * w.numel() for w in weights.values())
        with mp.autocast():
            _, counted = saved_bytes(lambda: wl.loss(mp.model, batch), exclude=list(mp.model.parameters()))
        return counted.total

    fp32 = measure("fp32")
    b, t, c, norms = _WIDE.batch_size, _WIDE.block_size, _WIDE.n_embd, 2 * _WIDE.n_layer + 1
    for name in ("bf16-mixed", "bf16-pure", "bf16-lean"):
        compute = measure(f"{name},kernels=native")
        assert compute <= 0.52 * fp32, (name, compute / fp32)
        if name == "bf16-lean":   # its forward is bf16-pure's (bf16 params): the saved=fp32 check is the same
            continue
        as_fp32 = measure(f"{name},kernels=native,saved=fp32")
        # saved=fp32 is torch.autocast's: each norm's fp32 input (4 bytes an element) where saved=compute keeps 2,
        # and each GELU's bf16 output (saved=compute's lean Linear keeps its input only); under bf16 params the fp32
        # copies of the norms' weight and bias too; under fp32 params (bf16-mixed) autocast's bf16 weight copies are
        # kept by both (saved=rebuild would not keep them: tests/autocast/test_saved_rebuilds.py)
        copies = 0 if name == "bf16-mixed" else norms * 2 * c * 4
        gelu_outputs = _WIDE.n_layer * b * t * 4 * c * 2
        assert as_fp32 - compute == norms * b * t * c * 2 + gelu_outputs + copies, name
        assert as_fp32 > 0.55 * fp32


def test_twenty_training_steps_with_bf16_saved_norms_track_fp32_saved():
    """bf16-pure: the norms' inputs are bf16, so the losses are bit-identical. bf16-mixed: each step's gradients move
    within the norm bound (a few u relative at most); over 20 AdamW steps at lr 3e-3 the loss stays within 2^-6
    relative (4 bf16 ulps) of saved=fp32's, where seeds differ by orders of magnitude more."""
    def losses(policy: str) -> list[float]:
        wl, mp = _gpt_engine(policy)
        out = []
        for _, batch in zip(range(20), wl.batches("train")):
            batch = mp.cast_inputs(batch)
            with mp.autocast():
                loss = wl.loss(mp.model, batch)
            mp.backward(loss)
            mp.step()
            out.append(loss.item())
        return out

    pure, pure_fp32 = losses("bf16-pure"), losses("bf16-pure,saved=fp32")
    assert pure == pure_fp32 and pure[-1] < pure[0]
    mixed, mixed_fp32 = losses("bf16-mixed"), losses("bf16-mixed,saved=fp32")
    assert mixed[-1] < mixed[0]
    assert all(abs(a - b) <= 2 ** -6 * abs(b) for a, b in zip(mixed, mixed_fp32)), list(zip(mixed, mixed_fp32))


# ---------------------------------------------------------------------------- the option
def test_saved_option_defaults_parses_prints_and_refuses_fp16_and_fp32():
    for name in ("bf16-mixed", "bf16-pure", "bf16-sr", "bf16-kahan", "bf16-lean", "fp8-mixed"):
        assert mixprec.PRESETS[name].saved == "compute"
    for name in ("fp32", "fp16-mixed", "fp16-pure"):
        assert mixprec.PRESETS[name].saved == "fp32"
    p = Policy.parse("bf16-pure,saved=fp32")
    assert p.saved == "fp32" and str(p) == "bf16-pure,saved=fp32" and Policy.parse(str(p)) == p
    assert str(Policy.parse("bf16-mixed,saved=compute")) == "bf16-mixed"
    with pytest.raises(ValueError, match="saved='compute' with compute=fp16.*saved=fp32"):
        Policy.parse("fp16-mixed,saved=compute")
    with pytest.raises(ValueError, match="saved='compute' with compute=fp32"):
        Policy.parse("fp32,saved=compute")
    with pytest.raises(ValueError, match="saved='bf16' is not allowed"):
        Policy.parse("bf16-mixed,saved=bf16")
    # a compute change re-resolves the default; a chosen value stays (and is checked)
    assert mixprec.PRESETS["bf16-pure"].replace(param_dtype=torch.float32, compute_dtype=torch.float32,
                                                master_dtype=None).saved == "fp32"
    assert Policy.parse("fp32").replace(compute_dtype=torch.bfloat16).saved == "compute"
    assert Policy.parse("bf16-mixed,saved=fp32").replace(compute_dtype=torch.float16).saved == "fp32"
    assert math.isclose(Policy.parse("bf16-lean,saved=fp32").bytes_per_param(), mixprec.PRESETS["bf16-lean"].bytes_per_param())


def test_the_decision_names_what_norms_save_and_when_the_option_cannot_act():
    decisions = {p: MixedPrecision(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), None, p, device="cpu").decision
                 for p in ("bf16-pure", "bf16-pure,saved=fp32", "bf16-mixed,ops=native", "fp16-mixed")}
    assert "saved=compute: layer_norm and rms_norm compute in fp32 and save their input" in decisions["bf16-pure"]
    assert "saved=fp32: norms computed in fp32 save their fp32 input" in decisions["bf16-pure,saved=fp32"]
    assert "saved=compute has no effect under ops=native on cpu on the norms" in decisions["bf16-mixed,ops=native"]
    for policy in ("bf16-pure", "bf16-mixed,ops=native"):   # the lean Linear acts under either op list
        assert "a Linear fed by gelu/silu keeps the activation's input for backward, not its output" in decisions[policy]
    assert "saved=" not in decisions["fp16-mixed"]
