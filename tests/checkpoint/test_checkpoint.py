"""Tests for mixprec.checkpoint.local (save/load, crash safety, verification, conversion) and the
checkpointing of mixprec.programs.train / ``mixprec train --resume``."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.checkpoint.local import CheckpointError, load_checkpoint, read_manifest, resolve_checkpoint, save_checkpoint

PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr")
N = 3  # steps before and after the checkpoint
TESTS = Path(__file__).parent


# ---------------------------------------------------------------- a tiny run (also used by the subprocess)
class TinyLM(nn.Module):
    """Embedding → Linear → GELU → head tied to the embedding (so the checkpoint stores an alias)."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(F.gelu(self.mid(self.emb(idx))))  # (B, T, V)


def build(policy: str, init_seed: int = 0, width: int = 8) -> mixprec.MixedPrecision:
    torch.manual_seed(init_seed)
    model = TinyLM(width=width)
    optimizer = mixprec.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    return mixprec.MixedPrecision(model, optimizer, policy=policy, device="cpu", scheduler=scheduler,
                                  max_grad_norm=1.0)


def batch(k: int) -> torch.Tensor:
    """Batch number ``k`` of the data stream: the data position is ``k`` itself."""
    return torch.randint(16, (2, 6), generator=torch.Generator().manual_seed(1000 + k))  # (B, T)


def train(mp: mixprec.MixedPrecision, start: int, stop: int) -> None:
    for k in range(start, stop):
        idx = mp.cast_inputs(batch(k))
        with mp.autocast():
            logits = mp.model(idx)
        mp.backward(F.cross_entropy(logits.flatten(0, 1), idx.roll(1, dims=1).flatten()))
        mp.step()


def resume_all(root: str) -> None:
    """Subprocess half of the bit-exact test: load each preset's checkpoint and train N more steps."""
    for policy in PRESETS:
        torch.manual_seed(123)   # a different RNG state and different weights: the load must restore both
        mp = build(policy, init_seed=1)
        load_checkpoint(Path(root, policy, "half"), mp)
        position = read_manifest(Path(root, policy, "half"))["data_position"]["batches"]
        train(mp, position, 2 * N)
        save_checkpoint(Path(root, policy, "resumed"), mp, data_position={"batches": 2 * N})


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t


def _without(manifest: dict, *keys: str) -> dict:
    return {k: v for k, v in manifest.items() if k not in keys}


def test_resume_in_a_fresh_process_is_bit_exact_for_every_preset(tmp_path):
    for policy in PRESETS:
        torch.manual_seed(7)     # stochastic rounding draws from torch's RNG
        straight = build(policy)
        train(straight, 0, 2 * N)
        save_checkpoint(tmp_path / policy / "straight", straight, data_position={"batches": 2 * N})
        torch.manual_seed(7)
        first = build(policy)
        train(first, 0, N)
        save_checkpoint(tmp_path / policy / "half", first, data_position={"batches": N})
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_checkpoint; test_checkpoint.resume_all({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for policy in PRESETS:
        a, b = resolve_checkpoint(tmp_path / policy / "straight"), resolve_checkpoint(tmp_path / policy / "resumed")
        ta, tb = _tensors(a), _tensors(b)
        assert set(ta) == set(tb) and any(k.startswith("masters") for k in ta) == ("pure" in policy)
        for key in ta:   # params, masters, optimizer state, torch RNG: bitwise
            assert ta[key].dtype == tb[key].dtype and torch.equal(_bits(ta[key]), _bits(tb[key])), (policy, key)
        ma, mb = read_manifest(a), read_manifest(b)
        assert ma["counters"] == mb["counters"] == {"micro_step": 0, "applied_steps": ma["counters"]["applied_steps"],
                                                    "skipped_total": 2 * N - ma["counters"]["applied_steps"],
                                                    "boundaries": 2 * N}
        assert ma["data_position"] == mb["data_position"] == {"boundaries": 2 * N, "batches": 2 * N}
        # loss scale, optimizer and scheduler structure, RNG, file hashes: everything else too
        assert _without(ma, "checksum") == _without(mb, "checksum"), policy


# ---------------------------------------------------------------- crash safety
def save_forever(root: str) -> None:
    """Continue the run in ``root`` and save after every step, until killed."""
    mp = build("bf16-pure", width=128)
    load_checkpoint(root, mp)
    while True:
        train(mp, mp.boundaries, mp.boundaries + 1)
        save_checkpoint(root, mp, keep=2, data_position={"batches": mp.boundaries})


# A fresh single-threaded process forks each saver (forking pytest itself could deadlock in OpenMP),
# prints the saver's pid and then its wait status once the test has killed it.
_ZYGOTE = """
import os, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
import test_checkpoint
test_checkpoint.train(test_checkpoint.build("bf16-pure", width=128), 0, 1)  # warm up: savers start at once
print("ready", flush=True)
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            test_checkpoint.save_forever({root!r})
        finally:
            os._exit(1)
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


def test_sigkill_during_save_always_leaves_a_loadable_latest(tmp_path):
    root = tmp_path / "ck"
    save_checkpoint(root, build("bf16-pure", width=128), data_position={"batches": 0})
    zygote = subprocess.Popen([sys.executable, "-c", _ZYGOTE.format(tests=str(TESTS), root=str(root))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rng, last_step, progressed, mid_save = random.Random(0), 0, 0, 0
    assert zygote.stdout.readline() == "ready\n"
    try:
        for _ in range(20):
            zygote.stdin.write("fork\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.02, 0.3))   # a save takes ~40 ms of each ~50 ms step
            os.kill(pid, signal.SIGKILL)
            assert int(zygote.stdout.readline()) == signal.SIGKILL   # killed, not crashed
            mid_save += any(p.name.startswith(".tmp-") for p in root.iterdir())
            for directory in root.glob("step-*"):   # every visible step-N is complete (made by a rename)
                read_manifest(directory)
            fresh = build("bf16-pure", width=128, init_seed=1)
            load_checkpoint(root, fresh)             # latest always resolves to a complete checkpoint
            assert read_manifest(resolve_checkpoint(root))["step"] == fresh.boundaries >= last_step
            progressed += fresh.boundaries > last_step
            last_step = fresh.boundaries
    finally:
        zygote.kill()
        zygote.wait()
    assert progressed >= 5 and mid_save >= 3, (progressed, mid_save)   # kills between and in the middle of saves
    save_checkpoint(root, fresh)   # the next save clears what the killed savers left behind
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------- verification
def _flip_byte(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-3] ^= 0x01
    (d / "model.safetensors").write_bytes(bytes(data))


def _truncate(d: Path) -> None:
    data = (d / "state.safetensors").read_bytes()
    (d / "state.safetensors").write_bytes(data[: len(data) // 2])


def _edit_hash(d: Path, *, fix_checksum: bool) -> None:
    import hashlib

    from mixprec.checkpoint.tree import canonical as _canonical

    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["model.safetensors"]["sha256"] = "0" * 64
    if fix_checksum:   # a consistent but wrong manifest: the file's own hash check must still catch it
        manifest["checksum"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = {
    "one byte flipped": (_flip_byte, "model.safetensors"),
    "truncated file": (_truncate, "state.safetensors"),
    "manifest deleted": (lambda d: (d / "manifest.json").unlink(), "manifest.json"),
    "manifest truncated": (lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text()[:200]),
                           "manifest.json"),
    "hash edited": (lambda d: _edit_hash(d, fix_checksum=False), "manifest.json"),
    "hash and checksum edited": (lambda d: _edit_hash(d, fix_checksum=True), "model.safetensors"),
    "file deleted": (lambda d: (d / "masters.safetensors").unlink(), "masters.safetensors"),
}


def test_damaged_checkpoints_are_refused_naming_the_file_before_touching_the_engine(tmp_path):
    mp = build("bf16-pure")
    train(mp, 0, 2)
    pristine = save_checkpoint(tmp_path / "pristine", mp)
    target = build("bf16-pure", init_seed=1)
    before = [t.clone() for t in (*target.model.parameters(), *target.master_parameters())]
    for case, (damage, name) in DAMAGE.items():
        root = tmp_path / case.replace(" ", "-")
        shutil.copytree(tmp_path / "pristine", root)
        damage(root / pristine.name)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            load_checkpoint(root, target)
        after = [*target.model.parameters(), *target.master_parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)) and target.boundaries == 0, case
    (tmp_path / "pristine" / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match="latest"):
        load_checkpoint(tmp_path / "pristine", target)
    half_written = tmp_path / "pristine" / ".tmp-step-9-1-0123abcd"
    half_written.mkdir()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(half_written, target)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing", target)


class TwoSquare(nn.Module):
    """Two 64x64 weights (int8 state under bf16-lean), registered in either order: the same names and shapes."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        for name in ("b", "a") if swap else ("a", "b"):
            setattr(self, name, nn.Linear(64, 64, bias=False))

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


@pytest.mark.parametrize("policy", ["bf16-lean", "fp32"])
def test_optimizer_state_saved_for_other_params_at_its_indices_is_refused(policy, tmp_path):
    """The model loads by name, the optimizer state by index: a model whose same-shaped params are registered in
    another order got a's moments on b (silently, 8-bit codes too). Refused, naming both params; unchanged."""
    def engine(swap):
        torch.manual_seed(0)
        model = TwoSquare(swap)
        return mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy=policy,
                                      device="cpu")

    mp = engine(False)
    for k in range(2):
        x = mp.cast_inputs({"x": torch.randn(8, 64, generator=torch.Generator().manual_seed(k))})["x"]
        with mp.autocast():
            loss = mp.model(x).float().square().mean()
        mp.backward(loss)
        mp.step()
    save_checkpoint(tmp_path, mp)
    swapped = engine(True)
    with pytest.raises(CheckpointError, match=r"param 0 .*'a\.weight'.*'b\.weight'"):
        load_checkpoint(tmp_path, swapped)
    assert swapped.boundaries == 0 and not swapped.optimizer.state
    same = engine(False)
    load_checkpoint(tmp_path, same)
    assert all(torch.equal(same.optimizer.state[t]["exp_avg"], mp.optimizer.state[u]["exp_avg"])
               for t, u in zip(same.master_parameters(), mp.master_parameters()))


def test_load_checkpoint_returns_the_saved_data_position_in_either_format(tmp_path):
    """Issue 25: save_checkpoint(..., data_position={"batches": 7}) then load_checkpoint returned {}: the
    data position was lost. It comes back as the returned extra's ``data_position``, one-process and DCP."""
    from mixprec.checkpoint import dcp

    mp = build("fp32")
    train(mp, 0, 2)
    mixprec.save_checkpoint(tmp_path / "local", mp, data_position={"batches": 7})
    dcp.save(tmp_path / "dcp", mp, extra={"run": "a"}, data_position={"batches": 7})   # what FSDP2 ranks write
    loaded = mixprec.load_checkpoint(tmp_path / "local", build("fp32"))
    assert loaded == {} and loaded.data_position == {"boundaries": 2, "batches": 7}
    loaded = mixprec.load_checkpoint(tmp_path / "local", build("fp32"), weights_only=True)
    assert loaded.data_position == {"boundaries": 2, "batches": 7}
    loaded = mixprec.load_checkpoint(tmp_path / "dcp", build("fp32"))
    assert loaded == {"run": "a"} and loaded.data_position == {"boundaries": 2, "world_size": 1, "batches": 7}
    assert loaded.data_position == mixprec.checkpoint.read_manifest(tmp_path / "dcp")["data_position"]


def test_read_weights_prefers_masters_fills_tied_names_and_verifies(tmp_path):
    from mixprec.checkpoint.local import read_weights

    mp = build("bf16-pure")
    train(mp, 0, 2)
    saved = save_checkpoint(tmp_path / "ck", mp)
    weights = read_weights(tmp_path / "ck")   # the root: follows latest
    assert set(weights) == set(mp.module.state_dict())   # head.weight (tied, stored once) is there too
    masters = dict(zip((n for n, _ in mp.module.named_parameters()), mp.master_parameters()))
    for name, master in masters.items():     # the fp32 masters, not the rounded bf16 params
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], master), name
    assert torch.equal(weights["head.weight"], weights["emb.weight"])
    _flip_byte(saved)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        read_weights(saved)


# ---------------------------------------------------------------- conversion between policies
def _exp_avgs(mp) -> list[torch.Tensor]:
    return [mp.optimizer.state[t]["exp_avg"].float() for t in mp.master_parameters()]


def test_conversion_bf16_mixed_to_pure_and_pure_to_fp32_adoption_and_refusal_without_convert(tmp_path):
    mixed = build("bf16-mixed")
    train(mixed, 0, 2)
    save_checkpoint(tmp_path / "mixed", mixed)
    pure = build("bf16-pure", init_seed=1)
    with pytest.raises(CheckpointError, match="convert=True"):
        load_checkpoint(tmp_path / "mixed", pure)
    load_checkpoint(tmp_path / "mixed", pure, convert=True)
    assert str(pure.policy) == "bf16-pure" and pure.events[-1]["kind"] == "convert"
    for p_fp32, p_bf16, master in zip(mixed.model.parameters(), pure.model.parameters(), pure.master_parameters()):
        assert master.dtype == torch.float32 and torch.equal(master, p_fp32)      # masters from the fp32 params
        assert p_bf16.dtype == torch.bfloat16 and torch.equal(p_bf16, p_fp32.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(_exp_avgs(mixed), _exp_avgs(pure)))
    assert pure.applied_steps == mixed.applied_steps and pure.scheduler.last_epoch == mixed.scheduler.last_epoch
    train(pure, 2, 3)   # and it trains on

    save_checkpoint(tmp_path / "pure", pure)
    fp32 = build("fp32", init_seed=2)
    load_checkpoint(tmp_path / "pure", fp32, convert=True)
    for master, p in zip(pure.master_parameters(), fp32.model.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, master)               # the masters become the params
    assert all(torch.equal(a, b) for a, b in zip(_exp_avgs(pure), _exp_avgs(fp32)))

    escalated = build("bf16-pure")    # a run whose guard moved it to fp32, resumed from its original policy
    train(escalated, 0, 2)
    escalated.set_policy("fp32", cause="test")
    train(escalated, 2, 3)
    save_checkpoint(tmp_path / "escalated", escalated)
    adopted = build("bf16-pure", init_seed=1)
    load_checkpoint(tmp_path / "escalated", adopted, adopt_policy=True)
    train(escalated, 3, 5)
    train(adopted, 3, 5)
    assert str(adopted.policy) == "fp32" and adopted.events == escalated.events
    assert all(torch.equal(a, b) for a, b in zip(escalated.model.parameters(), adopted.model.parameters()))

    model = TinyLM()
    weights = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="fp32",
                                     device="cpu")   # inference: another optimizer, weights only
    load_checkpoint(tmp_path / "pure", weights, weights_only=True, convert=True)
    assert all(torch.equal(a, b) for a, b in zip(pure.master_parameters(), weights.model.parameters()))


# ---------------------------------------------------------------- mixprec train: SIGTERM, --resume
def _final_tensors(out: Path) -> dict[str, torch.Tensor]:
    return _tensors(resolve_checkpoint(out / "checkpoints"))


def test_train_stopped_by_sigterm_then_resumed_equals_an_uninterrupted_run(tmp_path, capsys):
    from mixprec.programs.cli import main
    from mixprec.programs.train import run_training
    from mixprec.workloads import get_workload

    args = ["--workload", "gpt", "--config", "tiny", "--policy", "bf16-sr", "--steps", "7", "--device", "cpu",
            "--guard"]
    assert main(["train", *args, "--out", str(tmp_path / "a")]) == 0

    def terminate_at_4(step, record):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    outcome = run_training(get_workload("gpt", config="tiny"), policy="bf16-sr", steps=7, out=tmp_path / "b",
                           device="cpu", guard=True, checkpoint_every=3, keep=2, progress=False,
                           on_step=terminate_at_4)
    assert (outcome.status, outcome.step, outcome.stopped_by) == (143, 4, "SIGTERM")
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["latest", "step-3", "step-4"]
    assert signal.getsignal(signal.SIGTERM) is handler   # the previous handler is back
    done = subprocess.run([sys.executable, "-m", "mixprec", "train", *args, "--out", str(tmp_path / "b"),
                           "--checkpoint-every", "3", "--keep", "2", "--resume"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _final_tensors(tmp_path / "a"), _final_tensors(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 8))
    assert (tmp_path / "b" / "events.jsonl").is_file()
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "b"), "--tokens", "10", "--prompt", "a"]) == 0
    assert capsys.readouterr().out.startswith("a")


def test_checkpoint_calls_with_path_and_engine_swapped_are_refused_by_name(tmp_path):
    import mixprec
    mp = mixprec.MixedPrecision(nn.Linear(2, 2), None, "fp32")
    for call in (mixprec.save_checkpoint, mixprec.load_checkpoint):
        with pytest.raises(TypeError, match=r"takes the checkpoint directory first.*mp=PosixPath"):
            call(mp, tmp_path / "ck")


def test_a_save_behind_the_root_s_newest_sets_the_abandoned_future_aside_and_keeps_the_resumed_lineage(tmp_path):
    """Saves at steps 2, 4, 6 with keep=2 leave step-4 and step-6; the run resumes from step-4 (step-6 diverged),
    trains 1 step and saves step-5: step-6 is a future the run left. Pruning by step kept it and deleted step-4;
    now it moves to superseded/ (said), step-4 and step-5 stay, and the new lineage's step-6 gets the plain name.
    The set-aside checkpoint still loads, bit for bit what it was."""
    root = tmp_path / "ck"
    mp = build("fp32")
    for k in range(3):
        train(mp, 2 * k, 2 * k + 2)
        save_checkpoint(root, mp, keep=2)
    assert [d.name for d in sorted(root.glob("step-*"))] == ["step-4", "step-6"]
    diverged = _tensors(root / "step-6")
    load_checkpoint(root / "step-4", mp)
    train(mp, 4, 5)
    with pytest.warns(UserWarning, match=r"step-5 saved .* at or behind the step of 1 checkpoint\(s\).*step-6 -> "
                                         r"superseded/step-6"):
        save_checkpoint(root, mp, keep=2)
    assert [d.name for d in sorted(root.glob("step-*"))] == ["step-4", "step-5"]
    assert resolve_checkpoint(root).name == "step-5"
    assert all(torch.equal(_bits(t), _bits(diverged[k])) for k, t in _tensors(root / "superseded" / "step-6").items())
    train(mp, 5, 6)
    assert save_checkpoint(root, mp, keep=2).name == "step-6"
    assert [d.name for d in sorted(root.glob("step-*"))] == ["step-5", "step-6"]
    assert [d.name for d in (root / "superseded").iterdir()] == ["step-6"]   # never pruned


def test_a_resumed_run_reaching_a_step_the_abandoned_run_saved_sets_that_one_aside_too(tmp_path):
    """Saves every 2 steps with keep=2 leave step-4 and step-6; the run resumes from step-4 and saves at 6 again:
    the abandoned run's step-6 is superseded (it stayed, named above the new step-6.1, and keep=2 deleted step-4).
    A second save at the same step by the same run keeps the first (it descends from it)."""
    root = tmp_path / "ck"
    mp = build("fp32")
    for k in range(3):
        train(mp, 2 * k, 2 * k + 2)
        save_checkpoint(root, mp, keep=2)
    load_checkpoint(root / "step-4", mp)
    train(mp, 4, 6)
    with pytest.warns(UserWarning, match=r"step-6 -> superseded/step-6"):
        assert save_checkpoint(root, mp, keep=2).name == "step-6.1"
    assert [d.name for d in sorted(root.glob("step-*"))] == ["step-4", "step-6.1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing set aside: the run's own step-6.1 is its parent
        assert save_checkpoint(root, mp, keep=2).name == "step-6.2"
    assert [d.name for d in sorted(root.glob("step-*"))] == ["step-6.1", "step-6.2"]
