"""Tests for mixprec.EMA: an fp32 shadow of the trainable weights, next to the engine."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.checkpoint.local import CheckpointError, load_checkpoint, save_checkpoint

TESTS = Path(__file__).parent


def build(policy: str = "bf16-pure", lr: float = 1e-4, seed: int = 0, width: int = 16) -> mixprec.MixedPrecision:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 1))
    return mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=lr), policy, device="cpu")


def batch(k: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + k))  # (B, 8)


def step(mp: mixprec.MixedPrecision, k: int, loss_factor: float = 1.0):
    with mp.autocast():
        out = mp.model(mp.cast_inputs(batch(k)))
    mp.backward(out.float().pow(2).mean() * loss_factor)
    return mp.step()


def masters_by_name(mp: mixprec.MixedPrecision) -> dict[str, torch.Tensor]:
    names = [n for n, _ in mp.module.named_parameters()]
    return {n: m.detach().clone() for n, m in zip(names, mp.master_parameters())}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def params_by_name(mp: mixprec.MixedPrecision) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in mp.module.named_parameters()}


# ---------------------------------------------------------------- the shadow moves like an fp32 EMA
def test_bf16_pure_shadow_moves_like_an_fp32_ema_of_the_masters_and_a_bf16_ema_would_not():
    mp = build("bf16-pure", lr=1e-4)
    ema = mixprec.EMA(mp, decay=0.999)
    start = masters_by_name(mp)
    assert same_bits(ema.shadow, start) and all(s.dtype == torch.float32 for s in ema.shadow.values())
    ref_fp32 = {n: v.clone() for n, v in start.items()}            # textbook formula, fp32
    ref_fp64 = {n: v.double() for n, v in start.items()}           # the same, exact enough to judge both
    ema_bf16 = {n: p.detach().clone() for n, p in mp.module.named_parameters()}  # what a bf16 EMA would do
    for k in range(60):
        assert step(mp, k).applied
        masters = masters_by_name(mp)
        for n, w in masters.items():
            ref_fp32[n] = 0.999 * ref_fp32[n] + (1 - 0.999) * w
            ref_fp64[n] = 0.999 * ref_fp64[n] + (1 - 0.999) * w.double()
            ema_bf16[n] = torch.lerp(ema_bf16[n], mp.module.get_parameter(n).detach(), 1 - 0.999)
        for n, s in ema.shadow.items():
            # not bitwise with the textbook fp32 formula: lerp (an FMA of s + w*(m - s)) rounds twice, the
            # formula three times (d*s, (1-d)*m, the sum); both stay a few fp32 ulps from the exact EMA
            assert (s - ref_fp32[n]).abs().max() <= 1e-6, n
            assert (s.double() - ref_fp64[n]).abs().max() <= 1e-6, n
    assert ema.updates == ema.steps_seen == 60
    moved = max((ema.shadow[n] - start[n]).abs().max().item() for n in start)
    masters_moved = max((masters_by_name(mp)[n] - start[n]).abs().max().item() for n in start)
    assert moved > 1e-5 and masters_moved > 1e-3   # the shadow moves (about lr * steps^2 / 2 * (1 - decay))
    # each bf16 EMA update is (1 - decay) * (w - s) <= 1e-3 * 1e-2, below half a bf16 ulp (2**-15 at |w| >= 2**-6):
    # such weights never move; only a few near zero (finer ulps) do, so the bf16 EMA is no average at all
    moved_elements = total = 0
    for n, e in ema_bf16.items():
        initial = start[n].to(torch.bfloat16)
        big = start[n].abs() >= 2**-6
        assert torch.equal(e[big], initial[big]), n
        moved_elements += int((e != initial).sum())
        total += e.numel()
    assert moved_elements <= 0.05 * total


def test_bf16_kahan_shadow_is_fed_the_kahan_folded_values():
    mp = build("bf16-kahan", lr=1e-3)
    ema = mixprec.EMA(mp, decay=0.5)   # a short average, so the compensation's share is far above fp32 rounding
    ref = {n: v.clone() for n, v in ema.shadow.items()}
    unfolded = {n: v.clone() for n, v in ema.shadow.items()}
    for k in range(8):
        assert step(mp, k).applied
        folded = mp.trainable_state_dict()   # the engine's own fp32 values: param + Kahan compensation
        for n, w in folded.items():
            ref[n] = torch.lerp(ref[n], w, 0.5)
            unfolded[n] = torch.lerp(unfolded[n], mp.module.get_parameter(n).detach().float(), 0.5)
    comps = [mp.optimizer.compensation(p) for p in mp.module.parameters()]
    assert all(c is not None and c.dtype == torch.bfloat16 for c in comps) and any(c.abs().max() > 0 for c in comps)
    for n, s in ema.shadow.items():
        assert torch.equal(s, ref[n]), n    # same op on the same fp32 values: bitwise
    gap = max((ref[n] - unfolded[n]).abs().max().item() for n in ref)
    assert gap > 1e-5   # leaving the compensation out would be visibly wrong


def test_skipped_steps_do_not_update_the_shadow():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)   # tiny: fp16 is slow on some CPUs
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-mixed", device="cpu")
    ema = mixprec.EMA(mp, decay=0.9)
    before = {n: v.clone() for n, v in ema.shadow.items()}
    x = torch.randn(3, 4)

    def one(factor):
        with mp.autocast():
            out = mp.model(mp.cast_inputs(x))
        mp.backward(out.float().mean() * factor)
        return mp.step()

    result = one(1e30)   # scaled by 2**16, the fp16 grads overflow
    assert not result.applied and result.skipped_reason == "overflow"
    assert same_bits(ema.shadow, before) and ema.steps_seen == ema.updates == 0
    result = one(1.0)
    assert result.applied and ema.steps_seen == ema.updates == 1
    expect = {n: torch.lerp(before[n], p.detach(), 0.1) for n, p in model.named_parameters()}
    assert same_bits(ema.shadow, expect)


# ---------------------------------------------------------------- every, swapped()
def test_every_three_and_swapped_restores_params_exactly_and_training_continues_identically():
    runs = {}
    for swap in (False, True):
        mp = build("bf16-pure", lr=1e-3)
        ema = mixprec.EMA(mp, decay=0.9, every=3)
        shadows = []
        for k in range(7):
            step(mp, k)
            shadows.append({n: v.clone() for n, v in ema.shadow.items()})
        assert (ema.steps_seen, ema.updates) == (7, 2)   # updated after applied steps 3 and 6 only
        assert same_bits(shadows[2], shadows[3]) and same_bits(shadows[3], shadows[4])
        assert not same_bits(shadows[1], shadows[2]) and not same_bits(shadows[4], shadows[5])
        if swap:
            params, masters = params_by_name(mp), masters_by_name(mp)
            tensors = {n: p.data for n, p in mp.module.named_parameters()}
            versions = {n: p._version for n, p in mp.module.named_parameters()}
            x = mp.cast_inputs(batch(99))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with ema.swapped():
                    for n, p in mp.module.named_parameters():   # the shadow, as stored (bf16 under -pure)
                        assert p.dtype == torch.bfloat16 and torch.equal(p, ema.shadow[n].to(torch.bfloat16))
                    with torch.no_grad(), mp.autocast():
                        out_ema = mp.model(x)
                    with pytest.raises(RuntimeError, match="inside `with ema.swapped"):
                        mp.optimizer.step()
                    with pytest.raises(RuntimeError, match="already active"):
                        with ema.swapped():
                            pass
            reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)).to(torch.bfloat16)
            reference.load_state_dict({n: v.to(torch.bfloat16) for n, v in ema.shadow.items()})
            with torch.no_grad(), mp.autocast():
                assert torch.equal(out_ema, reference(x).float())
            assert same_bits(params_by_name(mp), params) and same_bits(masters_by_name(mp), masters)
            assert all(p.data.data_ptr() == tensors[n].data_ptr() and p._version == versions[n]
                       for n, p in mp.module.named_parameters())
        for k in range(7, 10):
            step(mp, k)
        assert not [e for e in mp.events if e["kind"] == "adopt"]   # the swap was not taken for a user edit
        runs[swap] = (params_by_name(mp), masters_by_name(mp), ema.shadow)
    for a, b in zip(runs[False], runs[True]):
        assert same_bits(a, b)


def test_bad_arguments_are_refused_naming_the_value_and_the_range():
    mp = build("fp32")
    for decay in (0, 1, 1.5, -0.1, float("nan"), True, "0.9"):
        with pytest.raises(ValueError, match=r"decay=.* must be a float in \(0, 1\)"):
            mixprec.EMA(mp, decay=decay)
    for every in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"every=.* must be an int >= 1"):
            mixprec.EMA(mp, every=every)
    with pytest.raises(TypeError, match="needs a mixprec.MixedPrecision"):
        mixprec.EMA(mp.module)


def test_state_dict_round_trip_is_exact_and_refuses_another_ema():
    mp = build("bf16-pure", lr=1e-3)
    ema = mixprec.EMA(mp, decay=0.99, every=2)
    for k in range(5):
        step(mp, k)
    other = mixprec.EMA(build("bf16-pure", seed=1), decay=0.99, every=2)
    other.load_state_dict(ema.state_dict())
    assert same_bits(other.shadow, ema.shadow)
    assert (other.steps_seen, other.updates, other.engine_step) == (5, 2, 5)
    with pytest.raises(ValueError, match=r"decay=0.99, every=2.*EMA\(mp, decay=0.99, every=2\)"):
        mixprec.EMA(mp, decay=0.9).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="averages other params"):
        mixprec.EMA(build("bf16-pure", width=4), decay=0.99, every=2).load_state_dict(
            {**ema.state_dict(), "shadow": {"0.weight": ema.shadow["0.weight"]}})


def test_a_guard_style_rollback_warns_once_that_the_shadow_is_not_rewound():
    mp = build("bf16-pure", lr=1e-3)
    ema = mixprec.EMA(mp, decay=0.9)
    step(mp, 0)
    state = {k: v for k, v in mp.state_dict().items()}
    snapshot = {"model": {k: v.clone() for k, v in state["model"].items()},
                "masters": {k: v.clone() for k, v in state["masters"].items()}}
    step(mp, 1)
    step(mp, 2)
    mp.load_state_dict({**mp.state_dict(), **snapshot, "counters": {**state["counters"], "applied_steps": 1}})
    with pytest.warns(UserWarning, match="went back from applied step 3 to 1"):
        step(mp, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(mp, 4)
    assert (ema.steps_seen, ema.updates, ema.engine_step) == (5, 5, 3)   # the undone steps stay averaged in


# ---------------------------------------------------------------- checkpoints
def resume_half(root: str) -> None:
    """Subprocess half: a fresh engine and EMA (other weights, other RNG), loaded, trained 3 more steps."""
    torch.manual_seed(123)
    mp = build("bf16-pure", lr=1e-3, seed=1)
    ema = mixprec.EMA(mp, decay=0.9, every=2)
    load_checkpoint(Path(root, "half"), mp, ema=ema)
    for k in range(4, 7):
        step(mp, k)
    save_checkpoint(Path(root, "resumed"), mp, ema=ema)


def test_checkpoint_resume_is_bit_exact_in_a_fresh_process(tmp_path):
    straight = build("bf16-pure", lr=1e-3)
    ema = mixprec.EMA(mp=straight, decay=0.9, every=2)
    for k in range(7):
        step(straight, k)
        if k == 3:
            save_checkpoint(tmp_path / "half", straight, ema=ema)
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_ema; test_ema.resume_half({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = build("bf16-pure", lr=1e-3, seed=2)
    resumed = mixprec.EMA(fresh, decay=0.9, every=2)
    load_checkpoint(tmp_path / "resumed", fresh, ema=resumed)
    assert same_bits(resumed.shadow, ema.shadow)
    assert same_bits(params_by_name(fresh), params_by_name(straight))
    assert same_bits(masters_by_name(fresh), masters_by_name(straight))
    assert (resumed.steps_seen, resumed.updates, resumed.engine_step) == (7, 3, 7)


def test_load_checkpoint_refuses_a_missing_or_foreign_ema_state_before_touching_the_engine(tmp_path):
    mp = build("bf16-pure", lr=1e-3)
    step(mp, 0)
    save_checkpoint(tmp_path / "plain", mp)
    ema = mixprec.EMA(mp, decay=0.9)
    save_checkpoint(tmp_path / "with", mp, ema=ema)
    fresh = build("bf16-pure", lr=1e-3, seed=1)
    before = params_by_name(fresh)
    with pytest.raises(CheckpointError, match="holds no EMA state"):
        load_checkpoint(tmp_path / "plain", fresh, ema=mixprec.EMA(fresh, decay=0.9))
    with pytest.raises(CheckpointError, match="decay=0.9, every=1; this EMA has decay=0.99"):
        load_checkpoint(tmp_path / "with", fresh, ema=mixprec.EMA(fresh, decay=0.99))
    with pytest.raises(ValueError, match="EMA built on this engine"):
        load_checkpoint(tmp_path / "with", fresh, ema=ema)
    with pytest.raises(ValueError, match="weights_only=True"):
        load_checkpoint(tmp_path / "with", fresh, ema=mixprec.EMA(fresh, decay=0.9), weights_only=True)
    assert same_bits(params_by_name(fresh), before) and fresh.applied_steps == 0
    load_checkpoint(tmp_path / "with", fresh)   # without ema=: the EMA state is simply not read
    assert same_bits(params_by_name(fresh), params_by_name(mp))


# ---------------------------------------------------------------- mixprec train --ema
def test_train_with_ema_evaluates_both_and_resumes_bit_exactly(tmp_path, capsys):
    import json

    from mixprec.checkpoint.local import read_manifest, resolve_checkpoint
    from mixprec.programs.cli import main

    common = ["train", "--workload", "gpt", "--config", "tiny", "--policy", "bf16-pure", "--eval-every", "2",
              "--checkpoint-every", "2", "--device", "cpu", "--ema", "0.9"]
    assert main([*common, "--steps", "4", "--out", str(tmp_path / "straight")]) == 0
    assert "(EMA " in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:   # both evaluations, and they differ: the averaged weights are not the raw ones
        assert r["eval_loss"] > 0 and r["eval_ema_loss"] > 0 and r["eval_loss"] != r["eval_ema_loss"]
    manifest = read_manifest(tmp_path / "straight" / "checkpoints")
    assert manifest["ema"]["decay"] == 0.9 and manifest["ema"]["updates"] == 4
    assert manifest["extra"]["final_eval"]["ema_loss"] == evals[-1]["eval_ema_loss"]

    # resume from the straight run's step-2 checkpoint (same --steps: the LR schedule is the same)
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    (resumed / "checkpoints" / "latest").write_text("step-2\n")
    capsys.readouterr()
    assert main([*common[:-2], "--steps", "4", "--out", str(resumed), "--resume"]) != 0
    assert "trained with --ema 0.9, this run has --ema None" in capsys.readouterr().err
    assert main([*common, "--steps", "4", "--out", str(resumed), "--resume"]) == 0
    a = resolve_checkpoint(tmp_path / "straight" / "checkpoints")
    b = resolve_checkpoint(resumed / "checkpoints")
    from safetensors.torch import load_file

    for file in ("model.safetensors", "masters.safetensors", "state.safetensors"):
        ta, tb = load_file(a / file), load_file(b / file)
        assert any(k.startswith("ema/shadow/") for k in ta) == (file == "state.safetensors")
        assert same_bits(ta, tb), file
    records_b = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records_b if r["kind"] == "eval"][-1] == evals[-1]
