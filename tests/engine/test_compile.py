"""Compiled models under the engine (mixprec.engine.regions, mixprec.autocast.compiled): inductor against eager.

Tolerances come from the formats' arithmetic, not from one machine's numbers. Inductor fuses
pointwise ops and keeps their fp32 intermediates where eager rounds each op's output to 16 bits, and
reorders reductions, so a compiled 16-bit run is not bitwise eager; fp32 runs differ by reduction
order only.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision
BF16, FP16, FP32 = (mixprec.get_format(f) for f in ("bf16", "fp16", "fp32"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean dynamo cache (no guard or recompile limit carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(mp, call, batches, loss_fn):
    """Eager-style loop through ``call`` (mp.model or a compiled wrapper); the fp32 losses, every step applied."""
    losses = []
    for batch in batches:
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = loss_fn(call, batch)
        mp.backward(loss)
        result = mp.step()
        assert result.applied, f"step {len(losses)} skipped: {result.skipped_reason}"
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _images(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (8,), generator=g)} for _ in range(n)]


def _cnn_loss(call, batch):
    return F.cross_entropy(call(batch["x"]).float(), batch["y"])


def test_user_compiled_cnn_with_batchnorm_regions_matches_eager_under_bf16_pure():
    """BatchNorm is an fp32 region under bf16-pure; torch.compile(mp.model) used to crash in its hooks."""
    batches = _images(20)
    eager_model = _cnn()
    eager = MixedPrecision(eager_model, mixprec.optim.AdamW(eager_model.parameters(), lr=1e-2), policy="bf16-pure",
                           device="cpu")
    eager_losses = _train(eager, eager.model, batches, _cnn_loss)
    model = _cnn()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    compiled_losses = _train(mp, torch.compile(mp.model), batches, _cnn_loss)
    # The loss is an fp32 mean of terms computed from bf16 activations; the two graphs round each
    # op's output differently by at most half a bf16 ulp (inductor keeps fused fp32 intermediates),
    # and the updates those differences make land on bf16 weights: allow two bf16 ulps of the loss.
    tolerance = 2 * BF16.ulp(eager_losses)
    assert ((compiled_losses - eager_losses).abs() <= tolerance).all(), (compiled_losses, eager_losses)
    assert compiled_losses[-1] < compiled_losses[0]   # it trains
    assert "compiled" not in mp.decision   # a compile after the build is the user's: docs/engine.md says so
    # the regions still pickle, deep-copy and come off without a trace
    x = mp.cast_inputs(batches[0])["x"]
    with mp.autocast():
        y = mp.model(x)
        for clone in (pickle.loads(pickle.dumps(mp.model)), copy.deepcopy(mp.model)):
            assert torch.equal(clone(x), y)
    assert mp.unwrap() is model and "forward" not in vars(model[1]) and not model[1]._forward_hooks


# ---------------------------------------------------------------- the GPT workload, compiled by the engine
@pytest.fixture(scope="module")
def gpt():
    from mixprec.workloads.gpt import GPTWorkload

    workload = GPTWorkload("tiny")
    return workload, [b for _, b in zip(range(20), workload.batches("train", seed=0))]


def _gpt_run(workload, batches, policy, compile):
    torch.manual_seed(0)
    model = workload.build_model()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=3e-3), policy=policy, device="cpu",
                        compile=compile)
    return mp, _train(mp, mp.model, batches, lambda call, batch: workload.loss(call, batch))


# fp32: inductor only reorders the fp32 reductions (over at most n_embd * 4 = 128 terms, error <= n * eps
# of the sum's magnitude), so 128 fp32 ulps of the loss; 16-bit: see the CNN test (two bf16 ulps).
@pytest.mark.parametrize("policy, ulps, fmt", [("fp32", 128, FP32), ("bf16-mixed", 2, BF16), ("bf16-pure", 2, BF16)])
def test_gpt_compiled_by_the_engine_matches_eager(gpt, policy, ulps, fmt):
    workload, batches = gpt
    _, eager_losses = _gpt_run(workload, batches, policy, compile=False)
    mp, compiled_losses = _gpt_run(workload, batches, policy, compile=True)
    assert mp.model is not mp.module and type(mp.module).__name__ == "GPT"
    assert "compiled (backend inductor, by the engine" in mp.decision
    assert "backward_pass_autocast='off'" in mp.decision
    tolerance = ulps * fmt.ulp(eager_losses)
    assert ((compiled_losses - eager_losses).abs() <= tolerance).all(), (compiled_losses - eager_losses) / tolerance
    assert compiled_losses[-5:].mean() < compiled_losses[:5].mean()   # it trains
    state = mp.state_dict()   # the user's module's names, not the compiled wrapper's ("_orig_mod.")
    assert not any(k.startswith("_orig_mod") for k in state["model"])


# ---------------------------------------------------------------- fp16: eager's backward dtypes and overflow
class _LoudRegion(nn.Module):
    """``big`` sees inputs near 2000: its weight gradient, times the loss scale, is ~1.2e5 (fp16 max
    65504), fine in fp32 and inf in fp16. Its fp32 region is a keep_fp32 pattern, or the model's own
    ``torch.autocast(enabled=False)`` block."""

    def __init__(self, own_block: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.big, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)
        with torch.no_grad():
            self.big.weight.mul_(0.01)
        self.own_block = own_block

    def forward(self, x):
        h = self.inp(x) * 2000.0
        if self.own_block:
            with torch.autocast(x.device.type, enabled=False):
                return self.out(self.big(h.float()))
        return self.out(self.big(h))


def _first_grads(own_block, compile):
    model = _LoudRegion(own_block)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                        policy="fp16-mixed" if own_block else "fp16-mixed,keep_fp32=big", device="cpu",
                        compile=compile, loss_scale=mixprec.DynamicLossScale(init_scale=2.0**10))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(x)).float().mean()
    mp.backward(loss)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, mp.step(), mp


@pytest.mark.parametrize("own_block", [False, True], ids=["keep_fp32", "own_autocast_off_block"])
def test_fp16_mixed_compiled_fp32_region_gets_eager_gradients_and_applies(own_block):
    eager_grads, eager_result, _ = _first_grads(own_block, compile=False)
    grads, result, mp = _first_grads(own_block, compile=True)
    assert eager_result.applied and result.applied, result.skipped_reason   # torch's default: inf, skipped
    assert eager_grads["big.weight"].abs().max() > FP16.max   # only an fp32 backward holds it
    for name, eager in eager_grads.items():
        # the 16-bit layers' grads are fp16 values (k = 1 fp16 ulp for the rounding of a reordered
        # sum); the fp32 region's are fp32 (1 fp16 ulp is far wider than their fp32 rounding)
        assert (grads[name] - eager).abs().max() <= FP16.ulp(eager.abs().max()), name
    assert "emulate_precision_casts=True" in mp.decision


class _FusedOverflow(nn.Module):
    """``x * 300 * 300 / 1e5`` under fp16: eager rounds ``x * 300 * 300`` (about 9e4 for x ~ 1) to
    fp16, where it overflows to inf; a fused inductor kernel keeps it in fp32 unless it emulates
    eager's casts."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))
            self.lin.bias.fill_(1.0)

    def forward(self, x):
        return self.lin(x) * 300.0 * 300.0 / 1e5


def test_fp16_compiled_overflows_where_eager_does():
    results = {}
    for compile in (False, True):
        model = _FusedOverflow()
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), policy="fp16-mixed", device="cpu",
                            compile=compile)
        with mp.autocast():
            results[compile] = mp.model(mp.cast_inputs(torch.zeros(2, 4)))
    assert torch.isinf(results[False]).all() and torch.isinf(results[True]).all()


# ---------------------------------------------------------------- a model the user compiled first; bad input
def test_model_compiled_before_the_engine_is_prepared_inside_its_wrapper():
    model = _cnn()
    compiled = torch.compile(model, backend="aot_eager")
    mp = MixedPrecision(compiled, mixprec.optim.AdamW(compiled.parameters(), lr=1e-2), policy="bf16-pure",
                        device="cpu")
    assert mp.model is compiled and mp.module is model
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32   # prepared
    assert "compiled (backend aot_eager, by you" in mp.decision
    eager_model = _cnn()
    eager = MixedPrecision(eager_model, mixprec.optim.AdamW(eager_model.parameters(), lr=1e-2), policy="bf16-pure",
                           device="cpu")
    batches = _images(3)
    # aot_eager runs eager's kernels on the traced graph: the same ops, bitwise
    assert torch.equal(_train(mp, mp.model, batches, _cnn_loss), _train(eager, eager.model, batches, _cnn_loss))
    assert set(mp.state_dict()["model"]) == set(model.state_dict())
    mp.set_policy("fp32")
    assert "compiled (backend aot_eager" in mp.decision   # a new policy keeps the record


@pytest.mark.parametrize("compile, error, words", [
    ("yes", TypeError, r"compile='yes' \(str\) must be False, True or a dict of torch.compile keyword arguments"),
    ({"backnd": "eager"}, ValueError, r"\['backnd'\] are not torch.compile arguments; it takes \[.*'backend'"),
])
def test_bad_compile_argument_is_named_with_the_fix(compile, error, words):
    model = _cnn()
    with pytest.raises(error, match=words):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp32", device="cpu", compile=compile)


def test_compiling_a_compiled_model_twice_is_refused():
    model = torch.compile(_cnn(), backend="eager")
    with pytest.raises(ValueError, match=r"already compiled.*compile=False"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp32", device="cpu", compile=True)


def test_compile_under_a_strategy_is_refused_before_joining_a_process_group():
    model = _cnn()
    with pytest.raises(ValueError, match=r"compile=True .*strategy='ddp'.*compile=False"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp32", device="cpu",
                       strategy="ddp", compile=True)


# ---------------------------------------------------------------- the CLI
def test_bench_compile_reports_compiled_step_times_next_to_eager_and_compile_time_apart(tmp_path, capsys):
    import json

    from mixprec.programs.cli import main

    out = tmp_path / "bench"
    # one seed, no eval points, no peer: nothing asserted here reads them (a shorter run)
    assert main(["bench", "--config", "tiny", "--policies", "fp32", "--steps", "6", "--compile", "--out", str(out),
                 "--device", "cpu", "--seeds", "1", "--eval-every", "0", "--no-peer"]) == 0
    console = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["compile"] is True
    eager, compiled = results["policies"]["fp32"], results["policies"]["fp32+compiled"]
    assert eager["compiled"] is False and compiled["compiled"] is True and eager["compile_time_s"] is None
    assert "compiled (backend inductor, by the engine" in compiled["decision"] and "compiled" not in eager["decision"]
    assert compiled["verdict"] == "PASS" and eager["pid"] != compiled["pid"]   # each in its own process
    # compilation is in the first step, outside the median of the timed steps, and reported apart
    # (compile time against the quality steps' own median: the table's step time, unless a noisy pass was re-timed)
    times = compiled["step_time_ms_per_step"]
    own_median = compiled.get("sequential_step_time_ms_median") or compiled["step_time_ms_median"]
    assert compiled["first_step_ms"] == times[0] > own_median
    assert compiled["compile_time_s"] * 1e3 >= times[0] - own_median > 0
    # same seed, weights and batches: fp32 compiled vs eager, reordered fp32 sums only (128 fp32 ulps, as above)
    losses = torch.tensor([eager["loss_per_step"], compiled["loss_per_step"]])
    assert ((losses[1] - losses[0]).abs() <= 128 * FP32.ulp(losses[0])).all()
    report = (out / "report.md").read_text()
    assert "| skipped steps | compile s |" in report and "| fp32+compiled | PASS |" in report
    assert "- fp32: eager " in report and "compiled" in report and "compile s" in console


def test_train_compile(tmp_path, capsys):
    import json

    from mixprec.programs.cli import main

    out = tmp_path / "run"
    assert main(["train", "--workload", "gpt", "--config", "tiny", "--policy", "bf16-mixed", "--steps", "4",
                 "--out", str(out), "--device", "cpu", "--compile"]) == 0
    assert "compiled (backend inductor, by the engine" in capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["applied"] for r in records if r["kind"] == "train")
    assert records[-1]["kind"] == "eval" and records[-1]["eval_loss"] > 0


def test_model_compiled_in_place_is_recorded_and_trains_as_eager():
    model = _cnn()
    model.compile(backend="aot_eager")
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    assert mp.model is model and "compiled (backend as you chose, by you (model.compile()" in mp.decision
    eager_model = _cnn()
    eager = MixedPrecision(eager_model, mixprec.optim.AdamW(eager_model.parameters(), lr=1e-2), policy="bf16-pure",
                           device="cpu")
    batches = _images(2)
    assert torch.equal(_train(mp, mp.model, batches, _cnn_loss), _train(eager, eager.model, batches, _cnn_loss))
