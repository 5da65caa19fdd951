"""The presets ``mxfp8-mixed`` and ``nvfp4-mixed`` through the public API: ``MixedPrecision`` converts the eligible
linears (keeping the Parameter objects the optimizer holds), says what it converted, kept and that the GEMMs are
emulated; trains; ``set_policy`` swaps the linears as a build would; a checkpoint resumes bit for bit; the guard's
first rung drops the recipe. The policy text is tests/policy/test_block_policy.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import MixedPrecision
from mixprec.blockscale import BlockScaledLinear
from mixprec.safety.escalation import next_policy

from block_nets import Net


def _engine(policy: str, **kwargs) -> tuple[Net, torch.optim.Optimizer, MixedPrecision]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, opt, MixedPrecision(model, opt, policy=policy, device="cpu", **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(64, 16, generator=g), torch.randint(0, 8, (64,), generator=g)


def _step(mp: MixedPrecision, step: int) -> float:
    x, y = _batch(step % 4)   # 4 batches over and over: the loss must fall
    with mp.autocast():
        loss = nn.functional.cross_entropy(mp.model(x).float(), y)
    mp.backward(loss)
    mp.step()
    return loss.item()


def _block_linears(model: nn.Module) -> dict[str, BlockScaledLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, BlockScaledLinear)}


def test_mxfp8_mixed_trains_with_block_scaled_linears_holding_the_optimizers_params():
    model, opt, mp = _engine("mxfp8-mixed")
    linears = _block_linears(model)
    assert sorted(linears) == [f"blocks.{i}.fc{j}" for i in range(4) for j in (1, 2)]   # first/last kept
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(m.weight) in held and id(m.bias) in held for m in linears.values())
    assert type(model.inp) is nn.Linear and type(model.head) is nn.Linear
    losses = [_step(mp, i) for i in range(20)]
    assert all(torch.isfinite(torch.tensor(losses))) and mp.applied_steps == 20
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses   # the same 4 batches, over and over: learnt
    _, _, bf16 = _engine("bf16-mixed")
    reference = [_step(bf16, i) for i in range(20)]
    assert abs(sum(losses[-4:]) / sum(reference[-4:]) - 1) < 0.1, (losses, reference)   # MXFP8 tracks bf16


def test_the_decision_names_the_recipe_the_counts_the_kept_linears_and_emulation():
    _, _, mp = _engine("mxfp8-mixed")
    assert "mxfp8-mixed on cpu as asked" in mp.decision
    clause = mp.decision[mp.decision.index("block-scaled linears mxfp8("):]
    assert "8 converted, 2 kept in bf16" in clause
    assert "first Linear of the network: inp" in clause and "last Linear of the network: head" in clause
    assert "emulated on cpu" in clause and "exact dequantize" in clause and "not representative" in clause


def test_nvfp4_mixed_keeps_the_bf16_tail_and_says_why():
    model, _, mp = _engine("nvfp4-mixed")
    assert sorted(_block_linears(model)) == [f"blocks.{i}.fc{j}" for i in range(3) for j in (1, 2)]
    assert type(model.blocks[3].fc1) is nn.Linear   # ceil(4 * 0.15) = 1 block kept
    assert "6 converted, 4 kept in bf16" in mp.decision
    assert "bf16 tail, the last 1 of 4 blocks of 'blocks': blocks.3.fc1, blocks.3.fc2" in mp.decision
    assert "shape: out_features=8 not a multiple of 16" in mp.decision   # the head, also last
    losses = [_step(mp, i) for i in range(12)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_the_ablation_override_converts_every_block():
    model, _, mp = _engine("nvfp4-mixed,block=nvfp4-plain")
    assert len(_block_linears(model)) == 8 and "nvfp4-plain(" in mp.decision
    assert all(m.recipe.name == "nvfp4-plain" and not m.recipe.hadamard for m in _block_linears(model).values())


def test_disabling_transform_rounding_and_tail_trains_bit_for_bit_as_the_plain_recipe():
    model, _, mp = _engine("nvfp4-mixed,block_disable=hadamard|sr|tail")
    plain_model, _, plain = _engine("nvfp4-mixed,block=nvfp4-plain")
    assert sorted(_block_linears(model)) == sorted(_block_linears(plain_model))   # 8: the tail is converted too
    assert "block-scaled linears nvfp4 without hadamard+sr+tail(nvfp4, W=2d, first/last kept): 8 converted" \
        in mp.decision
    assert [_step(mp, i) for i in range(6)] == [_step(plain, i) for i in range(6)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters()))


@pytest.mark.parametrize("part,converted,check", [
    ("sr", 6, lambda m: not m.recipe.stochastic_rounding and m.recipe.hadamard),
    ("2d", 6, lambda m: m.recipe.weight_blocks == "1d" and m.recipe.stochastic_rounding),
    ("ends", 7, lambda m: not m.recipe.keep_first_last),   # inp converts; head's 8 outputs are not 16x16 tiles
])
def test_one_recipe_part_off_changes_that_part_and_the_run_says_so(part, converted, check):
    model, _, mp = _engine(f"nvfp4-mixed,block_disable={part}")
    linears = _block_linears(model)
    assert len(linears) == converted and all(check(m) for m in linears.values())
    assert all(m.recipe.name == f"nvfp4 without {part}" for m in linears.values())
    assert f"nvfp4 recipe without {part})" in mp.decision and "emulated on cpu" in mp.decision and f"{converted} converted" in mp.decision
    assert ("inp" in linears) == (part == "ends")
    losses = [_step(mp, i) for i in range(8)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_set_policy_turns_a_recipe_part_off_mid_run_and_the_guard_drops_it():
    model, _, mp = _engine("nvfp4-mixed")
    _step(mp, 0)
    mp.set_policy("nvfp4-mixed,block_disable=2d")   # the linears keep their stochastic-rounding streams
    assert [m.get_extra_state().tolist() for m in _block_linears(model).values()] == [[i, 1] for i in range(6)]
    mp.set_policy("nvfp4-mixed,block_disable=sr")
    assert all(m.recipe.name == "nvfp4 without sr" for m in _block_linears(model).values())
    assert torch.isfinite(torch.tensor(_step(mp, 1)))
    new, why = next_policy(mp.policy, None, bf16_ok=True)
    assert new == mixprec.Policy.parse("bf16-mixed") and "→ bf16" in why


def test_fp32_regions_are_never_converted():
    model, _, mp = _engine("mxfp8-mixed,keep_fp32=blocks.1")
    assert "blocks.1.fc1" not in _block_linears(model) and "blocks.2.fc1" in _block_linears(model)
    assert "fp32 region (keep_fp32): blocks.1.fc1, blocks.1.fc2" in mp.decision


def test_set_policy_swaps_the_linears_back_and_forth_keeping_the_params():
    model, opt, mp = _engine("nvfp4-mixed")
    params = [id(p) for p in model.parameters()]
    for i in range(3):
        _step(mp, i)
    mp.set_policy("bf16-mixed")
    assert not _block_linears(model) and [id(p) for p in model.parameters()] == params
    assert "block-scaled linears: 6 back to nn.Linear" in mp.decision
    _step(mp, 3)
    mp.set_policy("nvfp4-mixed")
    assert len(_block_linears(model)) == 6 and "emulated on cpu" in mp.decision
    assert [id(p) for p in model.parameters()] == params
    mp.set_policy("nvfp4-mixed,keep_fp32=blocks.0")   # a new fp32 region: its linears go back to nn.Linear
    assert sorted(_block_linears(model)) == [f"blocks.{i}.fc{j}" for i in (1, 2) for j in (1, 2)]
    assert torch.isfinite(torch.tensor(_step(mp, 4)))


def test_block_keep_keeps_the_linears_it_names_in_bf16_and_the_decision_says_so():
    model, _, mp = _engine("nvfp4-mixed,block_keep=blocks.0.fc2|blocks.1")
    assert sorted(_block_linears(model)) == ["blocks.0.fc1", "blocks.2.fc1", "blocks.2.fc2"]
    assert "block_keep: blocks.0.fc2, blocks.1.fc1, blocks.1.fc2" in mp.decision
    assert "(nvfp4 recipe; block_keep blocks.0.fc2|blocks.1)" in mp.decision
    assert dict(mp.block_report.kept)["blocks.1.fc1"].startswith("kept by block_keep pattern 'blocks.1'")
    seen = []
    model.blocks[1].fc1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    losses = [_step(mp, i) for i in range(8)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert seen and set(seen) == {torch.bfloat16}   # a kept linear runs as autocast runs nn.Linear


def test_a_block_keep_pattern_matching_no_linear_is_refused_at_build_and_at_set_policy():
    with pytest.raises(ValueError, match=r"block_keep pattern\(s\) \['blocks.9'\] match no nn.Linear of the model"):
        _engine("nvfp4-mixed,block_keep=blocks.9")
    model, _, mp = _engine("nvfp4-mixed")
    before = _block_linears(model)
    with pytest.raises(ValueError, match=r"block_keep pattern\(s\) \['nope'\] match no nn.Linear"):
        mp.set_policy("nvfp4-mixed,block_keep=nope")
    assert _block_linears(model) == before and str(mp.policy) == "nvfp4-mixed"   # nothing changed
    mp.set_policy("nvfp4-mixed,block_keep=blocks.0")
    assert sorted(_block_linears(model)) == [f"blocks.{i}.fc{j}" for i in (1, 2) for j in (1, 2)]
    assert torch.isfinite(torch.tensor(_step(mp, 0)))


def test_set_policy_to_the_same_block_policy_keeps_the_modules_and_their_streams():
    model, _, mp = _engine("nvfp4-mixed")
    _step(mp, 0)
    before = _block_linears(model)
    states = {n: m.get_extra_state() for n, m in before.items()}
    assert all(s.tolist() == [m.sr_seed, 1] for m, s in zip(before.values(), states.values()))   # one backward
    mp.set_policy("nvfp4-mixed,kernels=native")
    after = _block_linears(model)
    assert all(after[n] is before[n] for n in before)
    assert all(torch.equal(after[n].get_extra_state(), s) for n, s in states.items())


def _trained(mp: MixedPrecision, steps: range) -> list[float]:
    return [_step(mp, i) for i in steps]


def test_a_checkpoint_of_nvfp4_mixed_resumes_bit_for_bit(tmp_path):
    model, _, mp = _engine("nvfp4-mixed")
    _trained(mp, range(3))
    path = mixprec.save_checkpoint(tmp_path, mp)
    straight = _trained(mp, range(3, 6))
    model2, _, mp2 = _engine("nvfp4-mixed")
    _trained(mp2, range(2))   # another place in training, other SR streams: the load must restore them
    mixprec.load_checkpoint(path, mp2)
    resumed = _trained(mp2, range(3, 6))
    assert resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values())
               if torch.is_tensor(a))
    s1, s2 = _block_linears(model), _block_linears(model2)
    assert all(s1[n].get_extra_state().tolist() == s2[n].get_extra_state().tolist() == [s1[n].sr_seed, 6] for n in s1)


def test_a_run_escalated_to_bf16_mixed_resumes_into_an_nvfp4_engine_by_adopting_its_policy(tmp_path):
    model, _, mp = _engine("nvfp4-mixed")
    _trained(mp, range(2))
    mp.set_policy(next_policy(mp.policy, None, bf16_ok=True)[0])   # the guard's first rung
    path = mixprec.save_checkpoint(tmp_path, mp)
    straight = _trained(mp, range(2, 4))
    model2, _, mp2 = _engine("nvfp4-mixed")
    with pytest.raises(mixprec.CheckpointError, match="saved under policy 'bf16-mixed'"):
        mixprec.load_checkpoint(path, mp2)
    mixprec.load_checkpoint(path, mp2, adopt_policy=True)
    assert str(mp2.policy) == "bf16-mixed" and not _block_linears(model2)
    assert _trained(mp2, range(2, 4)) == straight


@pytest.mark.parametrize("weights_only", [True, False])
def test_an_nvfp4_checkpoint_converts_into_a_bf16_mixed_engine(tmp_path, weights_only):
    model, _, mp = _engine("nvfp4-mixed")
    _trained(mp, range(2))
    path = mixprec.save_checkpoint(tmp_path, mp)
    model2, _, mp2 = _engine("bf16-mixed")
    mixprec.load_checkpoint(path, mp2, convert=True, weights_only=weights_only)
    assert str(mp2.policy) == "bf16-mixed" and not _block_linears(model2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    assert torch.isfinite(torch.tensor(_step(mp2, 2)))


def test_the_escalation_ladder_drops_the_block_recipe_first():
    for name in ("mxfp8-mixed", "nvfp4-mixed", "nvfp4-mixed,block=nvfp4-plain"):
        new, why = next_policy(mixprec.Policy.parse(name), "blocks.0.fc1", bf16_ok=True)
        assert new == mixprec.Policy.parse("bf16-mixed") and "block-scaled linears" in why and "→ bf16" in why
    new, _ = next_policy(mixprec.Policy.parse("nvfp4-mixed,keep_fp32=head"), None, bf16_ok=True)
    assert str(new) == "bf16-mixed,keep_fp32=head"
    new, _ = next_policy(mixprec.Policy.parse("nvfp4-mixed,block_keep=blocks.0"), None, bf16_ok=True)
    assert new == mixprec.Policy.parse("bf16-mixed")   # no block recipe, nothing to keep out of it
    new, why = next_policy(mixprec.Policy.parse("nvfp4-mixed"), None, bf16_ok=True, sharded=True)
    assert new is None and "swap the modules fully_shard sharded" in why


def test_a_model_edited_after_build_is_refused_under_a_block_policy():
    model, _, mp = _engine("mxfp8-mixed")
    _step(mp, 0)
    model.head = nn.Linear(64, 8)
    with pytest.raises(RuntimeError, match=r"under a block-scaled \(mxfp8\) policy \(mxfp8-mixed\)"):
        _step(mp, 1)


def test_auto_never_times_a_block_policy():
    from mixprec.auto.trial import time_candidates
    with pytest.raises(ValueError, match=r"candidate 'mxfp8-mixed' must be 'fp32' or a '-mixed' preset \(\['bf16-mixed', "
                                         r"'fp16-mixed'\]\)"):
        time_candidates(nn.Linear(32, 32), (torch.randn(2, 32),), {}, torch.device("cpu"), ("fp32", "mxfp8-mixed"))


def test_the_guard_escalates_a_failing_block_run_to_bf16_mixed():
    """A loss that turns non-finite at the same place again and again: rolled back, then escalated; the first
    rung drops the recipe, the linears go back to nn.Linear and the run goes on under bf16-mixed."""
    torch.manual_seed(0)
    model = Net()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), policy="mxfp8-mixed", device="cpu",
                        guard=mixprec.Guard(snapshot_every=1, escalate_after=2))
    poisoned = True
    for i in range(12):
        x, y = _batch(i % 4)
        with mp.autocast():
            loss = nn.functional.cross_entropy(mp.model(x).float(), y)
        if i >= 3 and poisoned:
            loss = loss * float("inf")
        mp.backward(loss)
        mp.step()
        poisoned = poisoned and str(mp.policy) == "mxfp8-mixed"
    escalations = [e for e in mp.events if e["kind"] == "escalate"]
    assert len(escalations) == 1 and "block-scaled linears (mxfp8) → bf16" in escalations[0]["detail"]
    assert str(mp.policy) == "bf16-mixed" and not _block_linears(model)
    assert "block-scaled linears: 8 back to nn.Linear" in mp.decision
    assert torch.isfinite(torch.tensor(_step(mp, 12)))


def test_the_engine_exposes_the_build_s_block_report():
    """``mp.block_report``: the conversion report of the build (every converted linear, every kept one with its
    reason), as ``mp.fp8_report`` is fp8's; None without a block recipe."""
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="mxfp8-mixed")
    assert mp.block_report is not None and set(mp.block_report.converted) == {"1", "2"}
    assert {name for name, _ in mp.block_report.kept} == {"0", "3"}   # the first and the last linear stay in bf16
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32))
    assert mixprec.MixedPrecision(plain, torch.optim.AdamW(plain.parameters()), policy="bf16-mixed").block_report is None


def test_the_build_caches_each_linear_s_gemm_decision_and_a_fullgraph_compile_runs_as_eager():
    """The engine asks every linear it converts (at build and at set_policy) how its GEMMs run on its device in the
    compute dtype (BlockScaledLinear.gemm_support), so a compiled forward reads the answer and never traces the
    probe (on a Blackwell GPU fullgraph could not); on the CPU: emulated."""
    model, _, mp = _engine("mxfp8-mixed")
    for linear in _block_linears(model).values():
        support = linear.__dict__["_native_by"][(torch.device("cpu"), torch.bfloat16)]
        assert not support.available and "no native block-scaled GEMM on cpu" in support.reason
    x, _ = _batch(0)
    compiled = torch.compile(mp.model, backend="eager", fullgraph=True)
    with mp.autocast():
        got, want = compiled(x), mp.model(x)
    assert torch.equal(got, want)
    got.float().sum().backward()
    assert all(m.weight.grad is not None for m in _block_linears(model).values())
    mp.set_policy("nvfp4-mixed")
    cpu_bf16 = (torch.device("cpu"), torch.bfloat16)
    assert all(cpu_bf16 in m.__dict__["_native_by"] for m in _block_linears(model).values())
