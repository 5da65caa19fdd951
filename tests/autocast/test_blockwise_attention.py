"""The blockwise attention kernel (mixprec.autocast.blockwise_attention): gradients within an error bound derived
from bf16's arithmetic (and fused's own error beside it), fp64 gradcheck, the forward and the saved bytes equal
fused's, masks / GQA / scale / several blocks, the bounded transient, and its place in the op plan."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixprec.autocast.blockwise_attention as blockwise
from mixprec.autocast import op_plan
from mixprec.autocast.attention_kernels import CANDIDATES, offered, saved_per_call
from mixprec.autocast.blockwise_attention import block_rows, blockwise_attention
from mixprec.memory.live import peak_live_bytes

U = 2.0 ** -8        # bf16 unit roundoff: |round(x) - x| <= u |x|
EPS32 = 2.0 ** -24   # fp32 unit roundoff (GEMM accumulation, the fp32 elementwise work)
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _data(shape_q, shape_kv, magnitude, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape_q, generator=gen) * magnitude).bfloat16()
    k, v = ((torch.randn(shape_kv, generator=gen) * m).bfloat16() for m in (magnitude, 1.0))
    g = torch.randn(shape_q, generator=gen).bfloat16()
    return q, k, v, g


def _grads(fn, q, k, v, g, mask=None):
    """(dq, dk, dv[, dmask]) of ``fn`` at copies of the inputs (a float mask gets a gradient)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().clone().requires_grad_()
        leaves.append(mask)
    out = fn(*leaves[:3], mask)
    return torch.autograd.grad(out, leaves, g.to(out.dtype))


def _bound(q, k, v, g, mask, causal, scale):
    """The elementwise error bound of the blockwise backward's dq, dk, dv (and dmask) against the exact gradients
    on the same bf16 inputs, following the kernel's operations (module docstring of blockwise_attention), each
    bf16 rounding a relative error <= u, fp32 GEMM accumulation <= n·2^-24·(|a||b|), first and second order kept:

    * exponent ``E = S - L``: the GEMM ``q·kᵀ - (L-c)/scale`` rounded once (u·|scale·q·kᵀ - L + c|), the add of the
      mask and the scale rounded once (u·|S - L|), the forward's logsumexp error |L̃ - L| (torch's, measured), the
      hi/lo pair's u²·|L|; so ``|P̃ - P| <= P·(exp(ΔE)·(1 + u)·(1 + 2^-22) - 1)`` (exp in fp32, rounded to bf16);
    * ``D = rowsum(dO ∘ O)`` in fp32 from the forward's bf16 output (|Õ - O| measured: torch's forward);
    * ``Y = dO·vᵀ - D`` rounded once relative to itself (u·|Y|) plus D's error and the hi/lo pair's u²·|D|;
    * ``dS = P̃ ∘ Ỹ`` rounded once; dq and dk: ``scale·(dS·k)`` with two roundings (GEMM, scale), the blocks'
      partials (several blocks) one more within the same 2u; dv: ``P̃ᵀ·dO`` likewise; GQA's group sum one more u."""
    q64, k64, v64, g64 = (t.double() for t in (q, k, v, g))
    groups = q.size(-3) // k.size(-3)
    k64, v64 = (t.repeat_interleave(groups, dim=-3) for t in (k64, v64))
    T, S = q.size(-2), k.size(-2)
    bias = torch.zeros(T, S, dtype=torch.float64)
    if causal:
        bias = bias.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), -math.inf)
    elif mask is not None:
        bias = (torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf) if mask.dtype == torch.bool
                else mask.double())
    raw = scale * q64 @ k64.transpose(-2, -1)
    s = raw + bias
    lse = torch.logsumexp(s, -1, keepdim=True)
    finite = torch.isfinite(s) & torch.isfinite(lse)   # a fully masked row: P = 0 (torch's convention), exactly
    lse = lse.nan_to_num(0.0, neginf=0.0)
    p = torch.where(finite, torch.exp(s - lse), torch.zeros_like(s))
    o = p @ v64
    mask_arg = mask if mask is None or mask.dtype == torch.bool else mask.bfloat16()
    bool_as_add = (None if mask is None else torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(
        ~mask, -math.inf) if mask.dtype == torch.bool else mask_arg)
    o_kernel, lse_kernel = _FLASH(q, k, v, 0.0, causal, attn_mask=bool_as_add, scale=scale)
    e_l = (lse_kernel.double().unsqueeze(-1) - lse).abs().nan_to_num(0.0)
    e_o = (o_kernel.double() - o).abs()
    top = bias.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    d_e = torch.where(finite, U * (raw - lse + top).abs() + U * (s - lse).abs() + U * (bias - top).abs()
                      * (top != 0) + e_l + U * U * (lse - top).abs(), torch.zeros_like(s))
    e_p = torch.where(finite, p * (torch.exp(d_e) * (1 + U) * (1 + 2.0 ** -22) - 1), torch.zeros_like(s))
    depth = q.size(-1) + 2
    delta = (g64 * o).sum(-1, keepdim=True)
    e_d = (g64.abs() * e_o).sum(-1, keepdim=True) + depth * EPS32 * (g64.abs() * o_kernel.double().abs()).sum(
        -1, keepdim=True)
    y = g64 @ v64.transpose(-2, -1) - delta
    e_y = e_d + U * (y.abs() + e_d) + U * U * delta.abs() + depth * EPS32 * (
        g64.abs() @ v64.abs().transpose(-2, -1) + delta.abs())
    ds = p * y
    e_ds = e_y * (p + e_p) + y.abs() * e_p + U * (y.abs() + e_y) * (p + e_p)
    ds_abs = ds.abs() + e_ds
    gamma_s, gamma_t = S * EPS32, T * EPS32
    e_dq = scale * (e_ds @ k64.abs() + (2 * U + gamma_s) * (ds_abs @ k64.abs()))
    e_dk = scale * (e_ds.transpose(-2, -1) @ q64.abs() + (2 * U + gamma_t) * (ds_abs.transpose(-2, -1) @ q64.abs()))
    e_dv = e_p.transpose(-2, -1) @ g64.abs() + (2 * U + gamma_t) * ((p + e_p).transpose(-2, -1) @ g64.abs())
    if groups > 1:   # summed over each group's heads, rounded once more
        b, h = q.shape[:2]
        e_dk, e_dv = (e.view(b, h // groups, groups, *e.shape[2:]).sum(2) * (1 + U) for e in (e_dk, e_dv))
    out = [e_dq, e_dk, e_dv]
    if mask is not None and mask.is_floating_point():
        dims = [i for i, n in enumerate(mask.shape) if n == 1]
        reduce = (lambda t: t.sum(dims, keepdim=True)) if dims else (lambda t: t)
        lead = tuple(range(4 - mask.dim()))
        e_dm = reduce(e_ds.sum(lead) if lead else e_ds) + U * reduce(ds_abs.sum(lead) if lead else ds_abs)
        out.append(e_dm)
    return out


CASES = {   # name: (q shape, k/v shape, causal, mask, scale)
    "causal": ((2, 3, 40, 16), (2, 3, 40, 16), True, None, None),
    "scale": ((2, 3, 40, 16), (2, 3, 40, 16), False, None, 0.3),
    "cross, causal T<S": ((2, 2, 24, 16), (2, 2, 40, 16), True, None, None),
    "gqa": ((2, 4, 40, 16), (2, 2, 40, 16), True, None, None),
    "bool mask, a row fully masked": ((2, 3, 40, 16), (2, 3, 40, 16), False, "bool", None),
    "additive mask with grad": ((2, 3, 40, 16), (2, 3, 40, 16), False, "additive", None),
}


def _mask(kind, q_shape, k_shape):
    gen = torch.Generator().manual_seed(5)
    T, S = q_shape[-2], k_shape[-2]
    if kind == "bool":
        m = torch.rand(q_shape[0], 1, T, S, generator=gen) > 0.3
        m[:, :, 3] = False
        return m
    if kind == "additive":
        return torch.randn(1, q_shape[1], T, S, generator=gen).bfloat16()
    return None


@pytest.mark.parametrize("magnitude", [0.5, 4.0])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [None, 16])
def test_gradients_lie_within_the_derived_bf16_bound_and_beside_fuseds(case, magnitude, rows, monkeypatch):
    """Every gradient element within the bound derived in ``_bound`` (no fudge factor); the same inputs through
    ``fused`` (torch's bf16 kernel) measured against fp64 beside it: blockwise's SQNR stays within 12 dB of fused's
    at small logits (where fused runs its flash kernel) and above 35 dB everywhere (the op plan's threshold for a candidate's gradients). ``rows=16``
    forces several blocks (fp32 sums of each block's partial)."""
    if rows is not None:
        monkeypatch.setattr(blockwise, "block_rows", lambda *a: rows)
    shape_q, shape_kv, causal, mask_kind, scale = CASES[case]
    q, k, v, g = _data(shape_q, shape_kv, magnitude)
    mask = _mask(mask_kind, shape_q, shape_kv)
    kw = dict(is_causal=causal, scale=scale)
    gqa = shape_q[1] != shape_kv[1]
    got = _grads(lambda a, b, c, m: blockwise_attention(a, b, c, m, **kw), q, k, v, g, mask)
    ref = _grads(lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, m, enable_gqa=gqa, **kw),
                 *(t.double() for t in (q, k, v, g)), None if mask is None else mask if mask.dtype == torch.bool
                 else mask.double())
    fused = _grads(lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, m, enable_gqa=gqa, **kw), q, k, v, g,
                   mask)
    bound = _bound(q, k, v, g, mask, causal, scale if scale is not None else 1 / math.sqrt(shape_q[-1]))
    for name, ours, theirs, r, b in zip(("dq", "dk", "dv", "dmask"), got, fused, ref, bound):
        assert ours.dtype == q.dtype and ours.shape == r.shape
        err = (ours.double() - r).abs()
        worst = (err / b.clamp_min(1e-30)).max()
        assert (err <= b).all(), f"{case} {name}: error {err.max():.3g}, {worst:.2f}x the bound at its worst"
        sqnr_ours = 10 * torch.log10(r.pow(2).sum() / err.pow(2).sum())
        sqnr_fused = 10 * torch.log10(r.pow(2).sum() / (theirs.double() - r).pow(2).sum())
        assert sqnr_ours >= 35, f"{case} {name}: {sqnr_ours:.1f} dB (fused {sqnr_fused:.1f} dB)"
        if magnitude < 1 and mask_kind != "additive":   # a mask taking a gradient sends fused to torch's math path
            assert sqnr_ours >= sqnr_fused - 12, f"{case} {name}: {sqnr_ours:.1f} dB, fused {sqnr_fused:.1f} dB"


def test_large_logits_keep_their_accuracy_where_rounding_the_scores_loses_it():
    """Logits of tens (a trained model's peaked attention; q and k of standard deviation 6): the scores minus the
    logsumexp rounded once keep dq at fused's accuracy (within 3 dB), where the matmul candidate, which rounds the
    scores themselves (u·|s| each), loses over 10 dB."""
    q, k, v, g = _data((2, 2, 48, 16), (2, 2, 48, 16), magnitude=6.0, seed=3)
    sqnr = {}
    for name, fn in {"blockwise": lambda a, b, c, m: blockwise_attention(a, b, c, is_causal=True),
                     "fused": lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                     "matmul": lambda a, b, c, m: CANDIDATES["matmul"](a, b, c, None, 0.0, True, None, False,
                                                                       torch.bfloat16)}.items():
        dq = _grads(fn, q, k, v, g)[0].double()
        ref = _grads(lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                     *(t.double() for t in (q, k, v, g)))[0]
        sqnr[name] = float(10 * torch.log10(ref.pow(2).sum() / (dq - ref).pow(2).sum()))
    assert sqnr["blockwise"] >= sqnr["fused"] - 3 and sqnr["matmul"] <= sqnr["blockwise"] - 10, sqnr


@pytest.mark.parametrize("causal, with_mask, gqa", [(True, False, False), (False, True, False), (True, False, True)])
def test_gradcheck_in_fp64(causal, with_mask, gqa, monkeypatch):
    """In fp64 every operation of the kernel is exact to fp64's precision: torch.autograd.gradcheck against finite
    differences, with several blocks (rows=4), a mask that takes a gradient, GQA."""
    monkeypatch.setattr(blockwise, "block_rows", lambda *a: 4)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4 if gqa else 2, 9, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    inputs = (q, k, v)
    if with_mask:
        inputs += (torch.randn(1, 2, 9, 9, dtype=torch.float64, generator=gen, requires_grad=True),)
    assert torch.autograd.gradcheck(
        lambda *t: blockwise_attention(*t[:3], t[3] if with_mask else None, is_causal=causal, scale=0.7), inputs)


def test_the_forward_and_the_saved_bytes_are_fuseds():
    """The forward is torch's fused CPU kernel (the same bits as the fused candidate) and keeps exactly its bytes
    for backward (each storage once); a boolean mask is kept as it is (fewer bytes than fused's float copy)."""
    q, k, v, _ = _data((4, 2, 64, 32), (4, 2, 64, 32), 1.0)
    for mask, causal in ((None, True), (torch.rand(4, 1, 64, 64, generator=torch.Generator().manual_seed(1)) > 0.2,
                                        False)):
        args = (q, k, v, mask, 0.0, causal, None, False, torch.bfloat16)
        assert torch.equal(CANDIDATES["blockwise"](*args), CANDIDATES["fused"](*args))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        saved = saved_per_call({n: (lambda n=n: CANDIDATES[n](*leaves, *args[3:])) for n in ("fused", "blockwise")})
        n, rows = q.numel(), q.numel() // q.size(-1)
        if mask is None:
            assert saved == {"fused": 4 * n * 2 + rows * 4, "blockwise": 4 * n * 2 + rows * 4}
        else:   # fused keeps the mask converted to bf16 (2 bytes per element), blockwise the bool one
            assert saved["fused"] - saved["blockwise"] == mask.numel() * (2 - 1)


def test_block_rows_follow_the_shapes():
    assert block_rows(64, 128, 128, 2) == 128                  # gpt/mid: 4 MiB of temporaries, one block
    assert block_rows(8, 1024, 1024, 2) == 128                 # T=1024: 4 MiB = 1/8 of the 32 MiB fp32 probabilities
    assert block_rows(64, 1024, 1024, 2) == 64                 # 16 MiB = 1/16 of 256 MiB
    assert block_rows(2, 16, 16, 2) == 16 and block_rows(1, 5, 7, 8) == 5
    assert block_rows(4096, 128, 4096, 2) == 16                # never fewer than 16 rows


def test_at_a_thousand_tokens_the_probabilities_are_never_held_whole():
    """T = 1024 (B2·H4·D64, causal): the backward's peak of live tensors above its gradients, measured, stays under
    1/8 of the T×T fp32 probabilities (32 MiB) plus the O(T·D) buffers it holds by construction (k and v with two
    columns, fp32 sums of dK and dV, one block's augmented q, dO and GEMM outputs: 9·B·H·T·(D+2)·2 bytes at most)."""
    B, H, T, D = 2, 4, 1024, 64
    q, k, v, g = _data((B, H, T, D), (B, H, T, D), 1.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blockwise_attention(*leaves, is_causal=True)
    _, peak = peak_live_bytes(lambda: out.backward(g), "cpu")
    grads = 3 * B * H * T * D * 2
    probs = B * H * T * T * 4
    buffers = 2 * B * H * T * (D + 2) * 2 + 2 * B * H * T * D * 4 + 5 * B * H * T * (D + 2) * 2
    assert 2 * B * H * block_rows(B * H, T, T, 2) * T * 2 <= probs / 8
    assert peak.bytes - grads <= probs / 8 + buffers, (peak.bytes - grads) / 2**20


# ---------------------------------------------------------------------- in the op plan
def test_offered_on_the_cpu_in_bf16_without_dropout_only():
    q = torch.empty(2, 2, 8, 4)
    assert offered(q, q, None, torch.bfloat16)["blockwise"] == ""
    assert "fp16" in offered(q, q, None, torch.float16)["blockwise"]
    assert "dropout" in offered(q, q, None, torch.bfloat16, dropout_p=0.1)["blockwise"]
    assert "scale=0" in offered(q, q, None, torch.bfloat16, scale=0.0)["blockwise"]
    assert "3-D" in offered(q[0], q[0], None, torch.bfloat16)["blockwise"]
    assert "on meta" in offered(q.to("meta"), q.to("meta"), None, torch.bfloat16)["blockwise"]


def test_the_plan_runs_blockwise_when_it_is_chosen(tmp_path, monkeypatch):
    """A measured plan that chose blockwise (times from a cache file) runs it inside autocast: the output and the
    gradients are blockwise's bit for bit, and the entry names it with +0 MiB over fused."""
    import json

    from mixprec.machine.cache import machine_key
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    op_plan.forget()
    shape = (2, 2, 32, 16)
    key = op_plan.plan_key(torch.empty(shape), torch.empty(shape), torch.empty(shape), is_causal=True,
                           dtype=torch.bfloat16, grad=True)
    saved = {"fused": 100, "fused-fp32": 200, "matmul": 300, "blockwise": 100}
    (tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json").write_text(json.dumps({key: {
        "chosen": "blockwise", "times_ms": {"fused": 2.0, "fused-fp32": 3.0, "matmul": 0.5, "blockwise": 1.0},
        "note": "", "saved_bytes": saved}}))
    q, k, v, g = _data(shape, shape, 1.0)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    entry, = op_plan.entries("cpu")
    assert entry.chosen == "blockwise" and entry.memory.startswith("matmul skipped: 4.00x faster than fused")
    assert "blockwise: 2.00x faster than fused, +0 MiB saved per call" in entry.memory
    got = torch.autograd.grad(out, leaves, g)
    want_leaves = [t.bfloat16().float().requires_grad_() for t in (q, k, v)]
    want = blockwise_attention(*(t.bfloat16() for t in want_leaves), is_causal=True)
    assert torch.equal(out, want)
    for a, b in zip(got, torch.autograd.grad(want, want_leaves, g)):
        assert torch.equal(a, b)
    op_plan.forget()


@pytest.mark.filterwarnings("ignore:There is a performance drop")   # torch's: no batching rule for the flash kernel
def test_under_torch_func_a_blockwise_choice_runs_fused(tmp_path, monkeypatch):
    """torch.func.grad and vmap(grad) (per-sample gradients) through the plan where it chose blockwise: its autograd
    function cannot run from the autocast key under a transform (torch raised NotImplementedError), so the call runs
    fused, whose forward is blockwise's own kernel: the gradients equal fused's bit for bit."""
    import json

    from mixprec.machine.cache import machine_key
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    op_plan.forget()
    shape = (1, 2, 8, 16)
    q, k, v, _ = _data(shape, shape, 1.0)
    q, k, v = q.float(), k.float(), v.float()
    for grad in (True, False):   # a key per grad mode: torch.func.grad's inputs do not require grad
        key = op_plan.plan_key(q, k, v, is_causal=True, dtype=torch.bfloat16, grad=grad)
        cache = tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json"
        on_disk = json.loads(cache.read_text()) if cache.exists() else {}
        on_disk[key] = {"chosen": "blockwise", "times_ms": {"fused": 2.0, "fused-fp32": 3.0, "matmul": 2.5,
                                                           "blockwise": 1.0}, "note": "",
                        "saved_bytes": {"fused": 100, "fused-fp32": 200, "matmul": 300, "blockwise": 100}}
        cache.write_text(json.dumps(on_disk))

    def loss(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().pow(2).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        got = torch.func.grad(loss)(q)
        batched = torch.func.vmap(torch.func.grad(loss))(q.unsqueeze(0).expand(2, *q.shape))
    assert {e.chosen for e in op_plan.entries("cpu")} == {"blockwise"}
    leaf = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(CANDIDATES["fused"](leaf, k, v, None, 0.0, True, None, False,
                                                      torch.bfloat16).float().pow(2).sum(), leaf)
    assert torch.equal(got, want) and torch.equal(batched[1], want)
    op_plan.forget()


def test_a_compiled_call_with_a_mask_gives_eagers_gradients():
    """Under torch.compile (AOTAutograd traces the backward) the mask's row offsets take no data-dependent branch;
    the gradients equal eager's bit for bit."""
    q, k, v, g = _data((2, 2, 16, 8), (2, 2, 16, 8), 1.0)
    mask = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(4)) > 0.3
    compiled = torch.compile(lambda a, b, c, m: blockwise_attention(a, b, c, m), backend="aot_eager")
    for got, want in zip(_grads(compiled, q, k, v, g, mask),
                         _grads(lambda a, b, c, m: blockwise_attention(a, b, c, m), q, k, v, g, mask)):
        assert torch.equal(got, want)
