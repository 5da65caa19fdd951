"""The numerics inspector and precision advisor, through the public API (CPU, small, seeded)."""

import argparse
import copy
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, Policy, get_format
from mixprec.engine.loss_scale import DynamicLossScale
from mixprec.numerics import NumericsReport, Recommendation, inspect
from mixprec.numerics.advice import LOSS_SCALE_MARGIN, keep_fp32_patterns, safe_loss_scale
from mixprec.policy.policy import PRESETS
from mixprec.programs.inspect import add_inspect_parser, advised_policy, inspect_workload, run_inspect

FP16, BF16, E4M3, E5M2 = (get_format(n) for n in ("fp16", "bf16", "e4m3", "e5m2"))


def mse_loss(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def regression_batches(n, width, *, scale=1.0, offset=0.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, width, generator=g) * scale + offset, "y": torch.randn(8, 1, generator=g)}
            for _ in range(n)]


# ---------------------------------------------------------------- a planted fp16 overflow
class Overflowing(nn.Module):
    """``big`` produces about 8 * 40 * 300 = 96000 > fp16 max; its output is scaled down (not by a
    module) before ``out``, so only ``big`` itself leaves fp16's range."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.big = nn.Linear(8, 4)
        self.out = nn.Linear(4, 1)
        with torch.no_grad():
            self.inp.weight.copy_(torch.eye(8))
            self.inp.bias.zero_()
            self.big.weight.fill_(300.0)
            self.big.bias.zero_()

    def forward(self, x):
        return self.out(self.big(self.inp(x)) / 1e5)


def train_losses(model, policy, batches, loss_scale=None):
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), policy=policy, device="cpu",
                        loss_scale=loss_scale)
    losses, applied = [], []
    for batch in batches:
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = mse_loss(mp.model, batch)
        mp.backward(loss)
        applied.append(mp.step().applied)
        losses.append(loss.item())
    return losses, applied


def test_planted_fp16_overflow_is_flagged_by_name_kept_fp32_and_the_advice_trains_finite():
    batches = regression_batches(3, 8, scale=0.1, offset=40.0)
    torch.manual_seed(0)
    report = inspect(Overflowing(), batches, mse_loss, policy="fp16-mixed", steps=3)

    overflow = [f for f in report.flagged("fp16") if f.kind == "overflow"]
    assert [f.module for f in overflow] == ["big"]
    assert overflow[0].value == report.modules["big"].activation["fp16"].amax > FP16.max
    assert "> fp16 max 65504" in overflow[0].reason and report.modules["big"].activation["fp16"].overflow == 1.0
    assert "big" not in {f.module for f in report.flagged("bf16")}
    assert report.modules["big"].activation["bf16"].overflow == 0.0

    rec = report.recommend()
    assert isinstance(rec, Recommendation)
    assert rec.policy.compute_dtype == torch.float16 and rec.policy.keep_fp32 == ("big",)
    assert Policy.parse(str(rec.policy)) == rec.policy
    assert rec.initial_loss_scale == report.recommended_loss_scale
    assert any("big" in r and "fp16" in r for r in rec.reasons)

    torch.manual_seed(0)
    plain_losses, plain_applied = train_losses(Overflowing(), "fp16-mixed", batches)
    assert not any(math.isfinite(x) for x in plain_losses) and not any(plain_applied)
    torch.manual_seed(0)
    advised_losses, advised_applied = train_losses(Overflowing(), rec.policy, batches,
                                                   DynamicLossScale(init_scale=rec.initial_loss_scale))
    assert all(math.isfinite(x) for x in advised_losses) and all(advised_applied)


# ---------------------------------------------------------------- planted tiny gradients
class TinyGradients(nn.Module):
    """``aux``'s output enters the loss times 1e-9, so its output gradients are exactly 1e-9."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x))), self.aux(x)


def tiny_gradient_loss(model, batch):
    pred, aux = model(batch["x"])
    return F.mse_loss(pred, batch["y"]) + 1e-9 * aux.sum()


def test_planted_tiny_gradients_flush_in_fp16_at_scale_one_but_not_at_the_recommended_scale():
    torch.manual_seed(0)
    report = inspect(TinyGradients(), regression_batches(2, 8), tiny_gradient_loss, policy="fp16-mixed", steps=2)
    at_one = report.flagged("fp16", loss_scale=1.0)
    assert {f.module for f in at_one if f.kind == "grad underflow"} == {"aux"}
    assert report.modules["aux"].grad_output["fp16"][report.scale_index(1.0)].flushed == 1.0

    rec = report.recommend()
    scale = rec.initial_loss_scale
    assert scale == report.recommended_loss_scale > 1
    assert report.flagged("fp16") == report.flagged("fp16", loss_scale=scale) == []
    assert report.modules["aux"].grad_output["fp16"][report.scale_index(scale)].flushed == 0.0
    # the scale is the largest power of two keeping every gradient under fp16 max with the margin
    assert report.grad_amax * scale * LOSS_SCALE_MARGIN <= FP16.max < report.grad_amax * 2 * scale * LOSS_SCALE_MARGIN
    assert "aux" not in rec.policy.keep_fp32 and rec.policy.loss_scale == "dynamic"
    assert any("loss scale 1" in r and "aux" in r for r in rec.reasons)
    with pytest.raises(ValueError, match=r"loss_scale=3\.0 was not evaluated"):
        report.flagged("fp16", loss_scale=3.0)


def test_safe_loss_scale_is_the_largest_power_of_two_within_the_margin():
    for amax in (1.0, 0.546, 3e-9, 2e4):
        s = safe_loss_scale(amax)
        assert math.log2(s) == int(math.log2(s))
        assert amax * s * LOSS_SCALE_MARGIN <= FP16.max < amax * 2 * s * LOSS_SCALE_MARGIN
    assert safe_loss_scale(0.0) == math.inf and safe_loss_scale(math.inf) == 0.0


# ---------------------------------------------------------------- lost updates
def layer_norm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))


def test_layernorm_gains_lose_every_update_in_bf16_and_none_with_fp32_masters():
    report = inspect(layer_norm_model(), regression_batches(3, 8), mse_loss, lr=1e-4, steps=3)
    gains = report.params["1.weight"]
    assert gains.updated == 3 * 16
    assert gains.lost_update("bf16") == 1.0      # AdamW moves each gain by ~1e-4 < half a bf16 ulp at 1.0
    assert gains.lost_update("fp32") == 0.0      # fp32 masters keep them
    assert report.lost_update("bf16") > report.lost_update("fp32") == 0.0

    rec = report.recommend()                     # fp32 under study: bf16-mixed keeps fp32 params
    assert rec.policy == Policy.parse("bf16-mixed") and rec.initial_loss_scale is None
    text = " ".join(rec.reasons)
    assert "lost-update fraction in bf16" in text and "keep master weights" in text
    assert "Kahan" in text and "stochastic" in text

    pure = inspect(layer_norm_model(), regression_batches(3, 8), mse_loss, lr=1e-4, steps=3,
                   policy="params=bf16,compute=bf16")
    rec = pure.recommend()                       # bf16 params without masters: the advice adds them
    assert rec.policy.param_dtype == torch.bfloat16 and rec.policy.master_dtype == torch.float32
    assert any("master=fp32" in r and "Kahan" in r for r in rec.reasons)
    assert Policy.parse(str(rec.policy)) == rec.policy

    kahan = inspect(layer_norm_model(), regression_batches(3, 8), mse_loss, lr=1e-4, steps=3, policy="bf16-kahan")
    rec = kahan.recommend()                      # compensated rounding already keeps the updates
    assert rec.policy == Policy.parse("bf16-kahan")
    assert any("rounding=kahan compensates" in r for r in rec.reasons)


# ---------------------------------------------------------------- fp8 against a hand computation
class Emit(nn.Module):
    """Outputs its parameter (a tensor chosen by the test); the loss makes the output gradient
    equal to the same values."""

    def __init__(self, values):
        super().__init__()
        self.w = nn.Parameter(values.clone())

    def forward(self, x):
        return self.w * x


def test_fp8_statistics_match_a_hand_computation():
    m, normal, sub = E4M3.max, E4M3.smallest_normal, E4M3.smallest_subnormal
    # amax = 2 * max, so the best scale is 1/2; three elements overflow raw; 1.5 * normal is normal
    # raw but subnormal once halved; sub / 4 flushes either way; one exact zero.
    values = torch.tensor([-2 * m, 1.25 * m, 1.001 * m, m, 1.0, 1.5 * normal, sub / 4, 0.0])
    model = nn.Sequential(Emit(values))
    batch = {"x": torch.ones(8), "values": values}
    report = inspect(model, [batch], lambda mdl, b: (mdl(b["x"]) * b["values"]).sum(), steps=1)
    stats = report.modules["0"]

    raw = stats.activation["e4m3fn"]
    assert (raw.amax, raw.overflow, raw.subnormal, raw.flushed) == (2 * m, 3 / 8, 1 / 7, 1 / 7)
    best = stats.activation_scaled["e4m3fn"]
    assert best.scale == 0.5 and best.scale * best.amax == m       # the best scale maps amax to max
    assert (best.overflow, best.subnormal, best.flushed) == (0.0, 2 / 7, 1 / 7)
    grad_best = stats.grad_output_scaled["e4m3fn"]                  # d loss / d output = values
    assert (grad_best.scale, grad_best.subnormal, grad_best.flushed) == (0.5, 2 / 7, 1 / 7)

    def expected(fmt, scale):
        xs = [abs(v) * scale for v in values.tolist()]
        nonzero = [x for x in xs if x != 0]
        return ((sum(x > fmt.max for x in xs) / len(xs)) if scale == 1 else 0.0,
                sum(x < fmt.smallest_normal for x in nonzero) / len(nonzero),
                sum(x < fmt.smallest_subnormal / 2 for x in nonzero) / len(nonzero))

    for got, scale in ((stats.activation["e5m2"], 1.0), (stats.activation_scaled["e5m2"], E5M2.max / (2 * m))):
        assert (got.overflow, got.subnormal, got.flushed) == pytest.approx(expected(E5M2, scale))


# ---------------------------------------------------------------- no trace on the user's model
def test_inspect_leaves_no_hook_and_changes_nothing_on_the_users_model():
    model = layer_norm_model()
    user_hook = model[0].register_forward_hook(lambda *a: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copies = []

    def factory(m):
        copies.append(m)
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    inspect(model, regression_batches(2, 8), mse_loss, steps=2, optimizer=factory)
    inspect(model, regression_batches(2, 8), mse_loss, steps=2, optimizer=optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    # the user's own hook stays (and was copied with the model: hooks can be part of the model);
    # inspect's hooks are gone, from the user's model and from its private copy alike
    reference = copies[0]
    assert reference is not model
    for original, copied in zip(model.modules(), reference.modules()):
        expected = [user_hook.id] if original is model[0] else []
        assert list(original._forward_hooks) == list(copied._forward_hooks) == expected
        for m in (original, copied):
            assert not (m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)

    def failing(mdl, batch):
        if failing.calls == 1:
            raise RuntimeError("boom")
        failing.calls += 1
        return mse_loss(mdl, batch)

    failing.calls = 0
    copies.clear()
    with pytest.raises(RuntimeError, match="boom"):
        inspect(model, regression_batches(3, 8), failing, steps=3, optimizer=factory)
    assert all(len(m._forward_hooks) == (m is copies[0][0]) and not m._forward_pre_hooks for m in copies[0].modules())


def test_measuring_changes_nothing_in_the_reference_run_dropout_and_batchnorm_included():
    """The error re-runs replay the RNG (same dropout mask) and work on copies of the buffers, so the
    inspected copy ends bitwise equal to a plain fp32 run of the same steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    batches = regression_batches(3, 8)
    copies = []

    def factory(m):
        copies.append(m)
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    torch.manual_seed(1)
    report = inspect(model, batches, mse_loss, steps=3, optimizer=factory)
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    torch.manual_seed(1)
    for batch in batches:
        optimizer.zero_grad()
        mse_loss(plain, batch).backward()
        optimizer.step()
    for (name, a), (_, b) in zip(copies[0].state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
    assert report.modules["2"].error["fp16"].sqnr_db > 60     # same mask: only rounding differs


def test_a_non_finite_fp32_reference_is_reported_with_the_module():
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.exp = Exp()

        def forward(self, x):
            return self.exp(self.lin(x) * 1e3)

    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    torch.manual_seed(0)
    batches = [{"x": torch.full((8, 4), 10.0), "y": torch.zeros(8, 1)}]
    with torch.no_grad():
        model = Exploding()
        model.lin.weight.fill_(1.0)
    with pytest.raises(ValueError, match=r"non-finite at step 0: 'exp' \(Exp\)"):
        inspect(model, batches, mse_loss, steps=1)


@pytest.mark.parametrize("kwargs,match", [
    ({"steps": 0}, r"steps=0 must be an int >= 1"),
    ({"steps": 5}, r"steps=5 but batches ran out after 2"),
    ({"lr": -1.0}, r"lr=-1\.0 must be a finite number > 0"),
    ({"formats": ("fp17",)}, r"inspect formats: 'fp17' is neither a format \(\['bf16', 'e4m3', 'e4m3fnuz', 'e5m2', "
                          r"'e5m2fnuz', 'fp16', 'fp32'\]\) nor a block format"),
    ({"optimizer": 3}, r"optimizer=3 must be None"),
])
def test_bad_arguments_say_what_and_how_to_fix(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        inspect(layer_norm_model(), regression_batches(2, 8), mse_loss, **kwargs)
    with pytest.raises(ValueError, match=r"needs an fp32 model"):
        inspect(layer_norm_model().to(torch.bfloat16), regression_batches(2, 8), mse_loss)


# ---------------------------------------------------------------- report views and advice helpers
def test_report_round_trips_through_json_and_renders_markdown_and_heatmap(tmp_path):
    report = inspect(Overflowing(), regression_batches(2, 8, scale=0.1, offset=40.0), mse_loss, steps=2,
                     policy="fp16-mixed")
    text = report.to_json()
    assert '"-inf"' in text                                     # big's fp16 SQNR, as a string
    again = NumericsReport.from_json(text)
    assert again == report and again.recommend() == report.recommend()
    md = report.to_markdown()
    assert "## Recommendation" in md and "| big | overflow |" in md and "keep_fp32=big" in md
    png = report.heatmap(tmp_path / "numerics.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_keep_fp32_patterns_generalise_only_when_every_match_is_flagged():
    names = ("", "blocks", "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.fc", "head")
    assert keep_fp32_patterns(["blocks.0.fc", "blocks.1.fc"], names) == ("blocks.*.fc",)
    assert keep_fp32_patterns(["blocks.1.fc", "head"], names) == ("blocks.1.fc", "head")


# ---------------------------------------------------------------- the baby GPT and the command
def test_baby_gpt_on_the_default_corpus_inspects_in_under_a_minute_and_advice_parses():
    start = time.perf_counter()
    report = inspect_workload("gpt", config="baby", steps=4, device="cpu", speed=False)   # the numerics alone
    elapsed_s = time.perf_counter() - start
    assert elapsed_s < 60, f"inspect took {elapsed_s:.1f} s"
    assert report.steps == 4 and len(report.modules) == 28 and all(math.isfinite(x) for x in report.losses)
    rec = report.recommend()
    assert Policy.parse(str(rec.policy)) == rec.policy
    assert rec.policy.compute_dtype == torch.bfloat16 and rec.initial_loss_scale is None
    assert report.flagged("bf16") == [] and report.flagged("fp16") == []   # fp16 fine at the advised scale
    assert report.flagged("fp16", loss_scale=1.0)                           # ... and not without one


def test_inspect_command_writes_the_three_files(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="mixprec")
    add_inspect_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect", "--workload", "gpt", "--config", "tiny", "--steps", "2",
                              "--device", "cpu", "--out", str(tmp_path)])
    assert run_inspect(args) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"numerics.md", "numerics.json", "numerics.png"}
    report = NumericsReport.from_json((tmp_path / "numerics.json").read_text())
    # bf16-mixed where auto's measurement on this model finds it faster, else fp32 (issue 25): numerics.json keeps it
    assert report.speed is not None and report.recommend().policy.compute_dtype == PRESETS[report.speed.choice].compute_dtype
    assert f"advised policy on this device (as it trains here now): {report.recommend().policy}" in capsys.readouterr().out
    assert report.steps == 2 and report.formats == ("fp16", "bf16", "e4m3fn", "e5m2")


def test_advised_policy_for_a_workload_returns_the_recommended_policy():
    policy, rec = advised_policy("gpt", config="tiny", steps=2, device="cpu", policy="fp16-mixed")
    assert policy == rec.policy and policy.compute_dtype == torch.float16 and policy.loss_scale == "dynamic"
    assert rec.initial_loss_scale is not None and rec.initial_loss_scale >= 1
