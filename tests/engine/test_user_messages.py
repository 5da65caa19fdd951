"""The messages a new user meets in the bench, the memory budget, checkpoints and policy text: each names the value, what is allowed and the fix."""

from __future__ import annotations

import pytest
import torch

from mixprec import Policy
from mixprec.policy.policy import PRESETS


@pytest.mark.parametrize("text, fixes", [
    ("saved=fp32", "'bf16-mixed,saved=fp32';"),   # 'fp32,saved=fp32' is fp32 itself: no suggestion
    ("state=int8", "'bf16-mixed,state=int8' or 'fp32,state=int8'"),
    (" saved=compute , state=bf16", "'bf16-mixed,saved=compute,state=bf16';"),   # fp32 cannot save in bf16
])
def test_a_policy_of_overrides_alone_is_refused_not_silently_fp32(text, fixes):
    with pytest.raises(ValueError, match=r"names no preset and no params=/compute= dtype, so it would silently be "
                                         r"the fp32 preset with .*; name a preset first, e.g. ") as err:
        Policy.parse(text)
    assert fixes in str(err.value)
    for fix in fixes.rstrip(";").split(" or "):                 # each suggested text parses
        Policy.parse(fix.strip("'"))


def test_a_policy_of_keys_that_set_the_precision_still_parses():
    assert Policy.parse("params=bf16,compute=bf16,master=fp32") == PRESETS["bf16-pure"]
    assert Policy.parse("compute=fp16").compute_dtype == torch.float16
    assert Policy.parse("fp32,state=int8").state_dtype == torch.int8     # a preset first: as before
    with pytest.raises(ValueError, match=r"rounding='up' is not allowed"):   # a bad value is named first
        Policy.parse("rounding=up")


# ------------------------------------------------------------------------------------------ memory_budget's words
def test_size_words_reads_in_the_unit_that_fits():
    from mixprec.engine.memory_budget import size_words

    assert [size_words(n) for n in (0, 512, 1023, 1024, 1536, 2**20, 13 * 2**20 + 2**20 * 2 // 5, 150 * 2**20,
                                    4 * 2**30, 2**40, None)] == \
        ["0 B", "512 B", "1023 B", "1 KiB", "1.5 KiB", "1 MiB", "13.4 MiB", "150 MiB", "4 GiB", "1 TiB", "unknown"]


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class _Blocks(torch.nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean()


def _over_budget(checkpoint):
    """A 1 KiB budget (the fp32 params alone take more), two steps: the second is measured."""
    import warnings

    from mixprec import MixedPrecision
    from mixprec.engine.memory_budget import size_words
    from mixprec.optim import AdamW

    torch.manual_seed(0)
    model = _Blocks()
    mp = MixedPrecision(model, AdamW(model.parameters(), lr=1e-3), "bf16-mixed", device="cpu",
                        recompute=checkpoint, memory_budget="1KiB")
    assert "memory_budget 1 KiB: pending" in mp.decision
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with mp.autocast():
                loss = mp.model(torch.randn(4, 16))
            mp.backward(loss)
            mp.step()
    state = mp.state_dict()["memory_budget"]
    assert state["budget_bytes"] == 1024 and state["peak_bytes"] > 1024
    head = (f"memory_budget 1 KiB: peak {size_words(state['peak_bytes'])} is "
            f"{size_words(state['peak_bytes'] - 1024)} OVER the budget")
    warned = [str(w.message) for w in caught if "OVER the budget" in str(w.message)]
    assert len(warned) == 1 and head in warned[0] and head in mp.decision and "0.000977" not in mp.decision
    return mp.decision


def test_over_budget_without_recompute_suggests_it():
    assert 'to fit: recompute="auto" (recompute blocks in backward), a smaller batch, or a larger budget' in \
        _over_budget(None)


def test_over_budget_with_every_block_recomputed_in_full_does_not_suggest_recompute_again():
    decision = _over_budget("layers.*")
    assert 'recompute="auto"' not in decision
    assert ("to fit: a smaller batch or a larger budget (recompute='layers.*' already recomputes every one of its "
            "2 blocks in full)") in decision


def test_over_budget_with_selective_blocks_suggests_the_full_plan():
    decision = _over_budget("selective:layers.*")
    assert 'recompute="auto"' not in decision
    assert ("to fit: full recompute of the 2 of 2 blocks recompute='selective:layers.*' leaves selective or not "
            "recomputed (recompute='layers.*'), a smaller batch, or a larger budget") in decision


# ------------------------------------------------------------------------------- a DCP checkpoint, another model
def _engine(policy="fp32", **model_args):
    from mixprec import MixedPrecision
    from mixprec.optim import AdamW

    torch.manual_seed(0)
    model = _Blocks(**model_args)
    return MixedPrecision(model, AdamW(model.parameters(), lr=1e-3), policy, device="cpu")


def _train(mp, steps=2):
    for step in range(steps):
        with mp.autocast():
            loss = mp.model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step)))
        mp.backward(loss)
        mp.step()


@pytest.fixture
def dcp_run(tmp_path):
    """A DCP checkpoint (what FSDP2 ranks write) of the fp32 engine of _Blocks(16, 2), one process."""
    from mixprec.checkpoint import dcp

    mp = _engine()
    _train(mp)
    dcp.save(tmp_path / "dcp", mp)
    return tmp_path / "dcp", mp


@pytest.mark.parametrize("model_args, words", [
    (dict(d=8), r"tensor 'layers\.0\.norm\.weight' has shape \[16\], the model's is \[8\]; .*"
                r"\(and \d+ more\); build the same model before loading"),
    (dict(n=3), r"missing \['layers\.2\.fc\.bias', 'layers\.2\.fc\.weight', 'layers\.2\.norm\.bias', "
                r"'layers\.2\.norm\.weight'\], unexpected \[\]; build the same model \(workload and config\)"),
    (dict(n=1), r"missing \[\], unexpected \['layers\.1\.fc\.bias', .*build the same model"),
])
def test_a_dcp_checkpoint_into_another_model_is_a_clear_checkpoint_error_before_anything_changes(dcp_run, model_args,
                                                                                                     words):
    import mixprec

    path, _ = dcp_run
    other = _engine(**model_args)
    before = {k: v.clone() for k, v in other.module.state_dict().items()}
    with pytest.raises(mixprec.CheckpointError, match=r"its DCP model state does not fit the model: " + words):
        mixprec.load_checkpoint(path, other)
    assert all(torch.equal(before[k], v) for k, v in other.module.state_dict().items())
    assert other.boundaries == 0


def test_a_dcp_checkpoint_into_another_policy_in_one_process_names_the_route_that_works(dcp_run):
    import mixprec

    path, saved = dcp_run
    with pytest.raises(ValueError, match=r"saved under policy 'fp32' \(mixprec-dcp, 1 rank\(s\)\), this engine runs "
                                         r"bf16-pure; .*build the engine with policy='fp32', load, then "
                                         r"mp.set_policy\('bf16-pure'\)") as err:
        mixprec.load_checkpoint(path, _engine("bf16-pure"))
    assert "sharded run" not in str(err.value)
    mp = _engine("fp32")                                       # the route the message names, followed
    mixprec.load_checkpoint(path, mp)
    mp.set_policy("bf16-pure")
    for (name, w_fp32), master, param in zip(saved.module.named_parameters(), mp.master_parameters(),
                                             mp.module.parameters()):
        assert torch.equal(master, w_fp32), name               # the fp32 masters are the saved values, bit for bit
        assert param.dtype == torch.bfloat16 and torch.equal(param, w_fp32.to(torch.bfloat16)), name


# ------------------------------------------------------------------------- a resume at another number of ranks
@pytest.mark.slow   # default set: tests/distributed/test_distributed.py::test_train_under_torchrun_with_fsdp2_then_resume_in_one_process
# runs the same two commands (and a third resume) and asserts these words
@pytest.mark.timeout(240)
def test_a_resume_at_another_world_size_says_the_global_batch_changes(tmp_path):
    """`mixprec train` under torchrun at 2 FSDP2 ranks, resumed in one process: the console says the checkpoint
    was saved at 2 ranks and the global batch goes from 2 x 128 tokens (the tiny GPT: batch 4 x 32 tokens) to 1 x
    128, with the reshard event's words. A resume at the same world size says nothing of it."""
    import os
    import subprocess
    import sys

    from ranks import free_port

    from mixprec.checkpoint.dcp import reshard_note
    from mixprec.workloads.gpt import GPT_CONFIGS

    out = tmp_path / "run"
    common = ["-m", "mixprec", "train", "--workload", "gpt", "--config", "tiny", "--policy", "bf16-mixed",
              "--strategy", "fsdp2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port())]
    done = subprocess.run([*launch, *common, "--steps", "2"], env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, *common, "--steps", "3", "--resume"], env=env, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    tiny = GPT_CONFIGS["tiny"]
    per = tiny.batch_size * tiny.block_size
    assert (f"mixprec train: --resume: the checkpoint was saved at 2 rank(s), this run has 1: the global batch "
            f"changes from 2 x {per} = {2 * per} tokens per step to 1 x {per} = {per} tokens") in done.stderr
    assert f"for the same global batch resume on 2 rank(s); {reshard_note(2, 1)}" in done.stderr
    done = subprocess.run([sys.executable, *common, "--steps", "4", "--resume"], env=env, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0 and "resuming from" in done.stderr, done.stderr[-3000:]
    assert "global batch" not in done.stderr


# --------------------------------------------------------------------------------------- bench --recompute
def test_bench_recompute_without_a_recompute_row_is_refused_naming_the_fix(tmp_path, capsys):
    from mixprec.programs.bench.runner import BenchConfig
    from mixprec.programs.cli import main

    with pytest.raises(ValueError, match=r"bench --recompute 'auto' applies only to the rows named "
                                         r"<policy>\+recompute, and --policies fp32,bf16-lean names none; add one, "
                                         r"e.g. --policies fp32,bf16-lean,bf16-lean\+recompute, or drop --recompute"):
        BenchConfig(out=tmp_path, policies=("fp32", "bf16-lean"), recompute="auto")
    from dataclasses import replace

    plain = BenchConfig(out=tmp_path, policies=("fp32", "bf16-lean"))   # not given: nothing to refuse
    assert plain.recompute is None and replace(plain, steps=5).recompute is None   # run_bench's replace
    rows = BenchConfig(out=tmp_path, policies=("fp32", "bf16-lean+recompute"))
    assert replace(rows, recompute="blocks.*").recompute == "blocks.*"
    status = main(["bench", "--config", "tiny", "--steps", "5", "--seeds", "1", "--eval-every", "0", "--timing",
                   "sequential", "--policies", "fp32,bf16-lean", "--recompute", "auto", "--out", str(tmp_path / "b")])
    assert status == 2 and "add one, e.g. --policies fp32,bf16-lean,bf16-lean+recompute" in capsys.readouterr().err
    assert not (tmp_path / "b" / "results.json").exists()


def test_bench_recompute_naming_blocks_the_model_lacks_exits_2_before_any_training(tmp_path, capsys):
    from mixprec.programs.cli import main

    status = main(["bench", "--config", "tiny", "--steps", "5", "--seeds", "1", "--eval-every", "0", "--timing",
                   "sequential", "--policies", "fp32,bf16-lean+recompute", "--recompute", "blocks.*.nothing",
                   "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert ("bench --recompute 'blocks.*.nothing' on the gpt model: 'blocks.*.nothing' matches no module") in err
    assert "e.g. blocks.*" in err
    assert not (tmp_path / "b" / "results.json").exists()


def test_bench_recompute_plan_check_passes_blocks_the_model_has():
    from mixprec.programs.bench.recompute_rows import check_plan_fits
    from mixprec.programs.bench.runner import BenchConfig

    def config(text):
        return BenchConfig(out=".", config="tiny", policies=("fp32", "bf16-lean+recompute"), recompute=text)

    for text in ("blocks.*", "selective:blocks.*", "blocks.0,selective:blocks.1", "auto", "auto:2", None):
        check_plan_fits(config(text))
    with pytest.raises(ValueError, match=r"'blocks\.7' matches no module"):   # tiny has 2 blocks
        check_plan_fits(config("blocks.0,blocks.7"))


def _linear_engine(optimizer: bool = True, policy: str = "bf16-mixed"):
    import mixprec

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    return mixprec.MixedPrecision(model, opt, policy, device="cpu")


def test_load_state_dict_of_something_else_is_refused_naming_what_loads_it():
    mp = _linear_engine()
    with pytest.raises(TypeError, match=r"state is a NoneType, not a dict; pass what mp.state_dict\(\) returned"):
        mp.load_state_dict(None)
    with pytest.raises(ValueError, match=r"state lacks \['policy', 'loss_scale', 'counters'\].*mp.module.load_state_dict"):
        mp.load_state_dict({"model": mp.module.state_dict()})   # was KeyError: 'policy'
    mp.load_state_dict(mp.state_dict())   # the real thing still loads


def test_cast_inputs_keep_takes_one_field_name_alone_and_says_each_new_rounded_field():
    mp = _linear_engine(policy="bf16-pure")   # inputs cast to the 16-bit params' dtype
    batch = {"x": torch.randn(2, 4), "label": torch.randn(2), "target": torch.randn(2)}
    out = mp.cast_inputs(batch, keep="label")   # was: ['l', 'a', 'b', 'e', 'l'] not found
    assert out["label"].dtype == torch.float32 and torch.equal(out["label"], batch["label"])
    assert out["x"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"keep=1.5\): keep is a float; pass a key"):
        mp.cast_inputs(batch, keep=1.5)
    mp = _linear_engine(policy="bf16-pure")
    with pytest.warns(UserWarning, match=r"rounded the floating field\(s\) \['label'\]"):
        mp.cast_inputs({"x": torch.randn(2, 4), "label": torch.randn(2)})
    with pytest.warns(UserWarning, match=r"rounded the floating field\(s\) \['target'\]"):   # was silent
        mp.cast_inputs({"x": torch.randn(2, 4), "target": torch.randn(2)})


def test_ema_of_an_engine_without_optimizer_and_a_checkpoint_into_a_file_are_refused_with_the_fix(tmp_path):
    import mixprec

    with pytest.raises(RuntimeError, match=r"no optimizer yet .* mp.attach\(optimizer\), then EMA\(mp\)"):
        mixprec.EMA(_linear_engine(optimizer=False))
    afile = tmp_path / "model.pt"
    afile.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"save_checkpoint: path .*model.pt' is a file, not a directory"):
        mixprec.save_checkpoint(afile, _linear_engine())
    assert afile.read_bytes() == b"x"
