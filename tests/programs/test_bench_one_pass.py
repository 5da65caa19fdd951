"""Issue 36: the bench's one pass — ``--quick`` (a SMOKE verdict, never a PASS), the seed-noise band kept per workload
and machine and reused only beside the same fp32 reference, and the partial table printed as the rows advance."""

from __future__ import annotations

import json

import pytest

from mixprec.machine.cache import read_json
from mixprec.programs.bench.schedule import QUICK_STEPS, block_steps_for
from mixprec.programs.cli import main


def test_quick_is_a_smoke_test_that_never_passes_and_says_what_it_did_not_establish(tmp_path, capsys):
    out = tmp_path / "out"
    status = main(["bench", "--config", "tiny", "--quick", "--policies", "bf16-mixed", "--no-peer", "--out", str(out),
                   "--device", "cpu"])
    results = json.loads((out / "results.json").read_text())
    bf16 = results["policies"]["bf16-mixed"]
    assert status == 0 and results["settings"]["quick"] is True and results["settings"]["steps"] == QUICK_STEPS
    assert bf16["verdict"] == "SMOKE" and bf16["steps"] == QUICK_STEPS, bf16["reason"]
    assert bf16["reason"].startswith(f"smoke test (--quick, {QUICK_STEPS} steps)") and "no seed-noise band" in bf16["reason"]
    assert "eval loss" in bf16["reason"]                      # the gate's own words follow
    assert results["seed_noise"] is None and results["portable_ops"] is None
    assert bf16["step_profile"] is None                       # no profiled window in a smoke test
    console = capsys.readouterr()
    assert f"bf16-mixed: SMOKE: smoke test (--quick, {QUICK_STEPS} steps)" in console.out
    # the partial table, at each eval point every row has passed (three points: every 10 steps): losses and step times
    lines = [line for line in console.err.splitlines() if line.startswith("step 10/30: eval loss fp32 ")]
    assert len(lines) == 1 and "bf16-mixed" in lines[0] and "ms/step so far" in lines[0]
    assert [s for s, _ in bf16["eval_curve"]] == [10, 20, 30]
    timing = results["timing"]
    assert timing["one_pass"] and timing["block_steps"] == block_steps_for(QUICK_STEPS, quick=True) == 10
    assert timing["blocks"] == 3 and bf16["timed_steps"] == QUICK_STEPS - 3 - 2   # warm-up 3, each later turn's first
    assert set(timing["phases_s"]) >= {"plan", "build", "turns", "finish", "stop"} and "profile" not in timing["phases_s"]
    assert "retimed" in timing and (timing["retimed"] == 0 or timing.get("retime_skipped") is None)
    assert sum(timing["phases_s"].values()) <= results["wall_s"] + 0.1
    assert f"wall time {results['wall_s']:.0f} s: " in console.out and "building the workers " in console.out


def test_a_quick_run_that_misses_a_target_still_fails(tmp_path):
    """SMOKE replaces PASS only: a target missed in a smoke test is a FAIL (exit status 1)."""
    out = tmp_path / "out"
    status = main(["bench", "--config", "tiny", "--quick", "--steps", "6", "--policies", "bf16-mixed", "--no-peer",
                   "--out", str(out), "--device", "cpu", "--min-speedup", "1000"])
    bf16 = json.loads((out / "results.json").read_text())["policies"]["bf16-mixed"]
    assert status == 1 and bf16["verdict"] == "FAIL", bf16["reason"]


def _band_run(out, *extra):
    assert main(["bench", "--config", "tiny", "--policies", "fp32", "--no-peer", "--steps", "6", "--eval-every", "3",
                 "--out", str(out), "--device", "cpu", *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_the_seed_band_is_kept_and_reused_only_beside_the_same_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "cache"))
    first = _band_run(tmp_path / "a")
    band = first["seed_noise"]
    assert band["source"] == "measured in this run" and band["seeds"] == [0, 1]
    assert (tmp_path / "a" / "workers" / "seed1-fp32.json").exists()       # trained in the pass, beside the rows
    again = _band_run(tmp_path / "b")
    kept = again["seed_noise"]
    assert kept["source"].startswith("kept from the run of ") and not (tmp_path / "b" / "workers" / "seed1-fp32.json").exists()
    assert again["policies"]["fp32"]["final_eval_loss"] == first["policies"]["fp32"]["final_eval_loss"]
    for key in ("seeds", "fp32_eval_losses", "relative_spread", "fp32_eval_curves"):
        assert kept[key] == band[key], key
    # an entry kept beside another reference loss (other code, another machine's kernels) is measured again
    path, = (tmp_path / "cache").glob("seed-band-*.json")
    entries = read_json(path)
    for entry in entries.values():
        entry["reference_loss"] += 1e-3
    path.write_text(json.dumps(entries))
    moved = _band_run(tmp_path / "c")["seed_noise"]
    assert moved["source"] == "measured in this run" and moved["fp32_eval_losses"] == band["fp32_eval_losses"]
    assert next(iter(read_json(path).values()))["reference_loss"] == first["policies"]["fp32"]["final_eval_loss"]
    fresh = _band_run(tmp_path / "d", "--fresh-seed-band")["seed_noise"]   # asked to train again: trained again
    assert fresh["source"] == "measured in this run" and (tmp_path / "d" / "workers" / "seed1-fp32.json").exists()


@pytest.mark.parametrize("steps, block", [(5, 3), (30, 3), (60, 6), (300, 10), (3000, 10)])
def test_turns_are_a_tenth_of_the_run_between_3_and_10_steps(steps, block):
    assert block_steps_for(steps) == block


@pytest.mark.parametrize("steps, block", [(6, 3), (30, 10), (31, 11), (90, 30)])
def test_a_quick_run_takes_three_turns_per_row(steps, block):
    assert block_steps_for(steps, quick=True) == block and -(-steps // block) == min(3, -(-steps // 3))


def _drifting(rows: dict[str, float], rounds: int, steps: int, start: float) -> dict[str, list[tuple[int, float]]]:
    """Each row's steps (base ms × a machine factor falling linearly from ``start`` to 1 over the rounds, the same
    for every row in a round), tagged with their round."""
    factor = [start + (1.0 - start) * r / (rounds - 1) for r in range(rounds)]
    return {n: [(r, base * factor[r]) for r in range(rounds) for _ in range(steps)] for n, base in rows.items()}


def test_a_drift_common_to_every_row_is_not_noise_but_a_row_of_its_own_is():
    from mixprec.programs.bench.noise import SPREAD_LIMIT, drift_corrected_spreads, settle_noise
    from mixprec.programs.bench.measure import percentile
    from mixprec.programs.bench.results import PolicyRun

    bases = {"fp32": 330.0, "bf16-mixed": 200.0, "bf16-pure": 196.0, "peer": 225.0}
    tagged = _drifting(bases, rounds=30, steps=9, start=1.8)   # the machine 1.8x slower at the start
    raw = {n: percentile([ms for _, ms in t], 0.9) / percentile([ms for _, ms in t], 0.1) for n, t in tagged.items()}
    assert min(raw.values()) > SPREAD_LIMIT                    # raw p90/p10: 1.8 → 1 over the run
    assert drift_corrected_spreads(tagged) == {n: 1.0 for n in bases}   # the drift divided out exactly
    # one row whose own turns are disturbed (every third step 1.8x) stays noisy; the others do not
    tagged["bf16-pure"] = [(r, ms * (1.8 if i % 3 == 0 else 1.0)) for i, (r, ms) in enumerate(tagged["bf16-pure"])]
    spreads = drift_corrected_spreads(tagged)
    assert spreads["bf16-pure"] > SPREAD_LIMIT and max(v for n, v in spreads.items() if n != "bf16-pure") < 1.1
    # two rows: a median of two ratios would halve one row's noise, so the raw spread stands (None here)
    assert drift_corrected_spreads({n: tagged[n] for n in ("fp32", "bf16-mixed")}) is None
    # settle_noise decides on the corrected spreads and keeps the raw ones beside them
    pure = _drifting(bases, rounds=30, steps=9, start=1.8)
    rows = {n: PolicyRun(step_time_ms_median=percentile([ms for _, ms in t], 0.5),
                         step_time_ms_p10=percentile([ms for _, ms in t], 0.1),
                         step_time_ms_p90=percentile([ms for _, ms in t], 0.9)) for n, t in pure.items()}
    settled = settle_noise({"method": "interleaved", "one_pass": True}, rows, tagged=pure)
    assert settled["drift_corrected"] and not settled["noisy"] and settled["spread"] == {n: 1.0 for n in bases}
    assert settled["spread_raw"] == {n: round(raw[n], 3) for n in bases}
    assert settle_noise({"method": "interleaved"}, rows)["noisy"]   # without the rounds: the raw spread decides


def test_a_corrected_spread_above_the_raw_one_is_noise_in_the_ratios_and_counts():
    """Bursts that slow two of three rows in every other round read as drift to the round's median and widen the
    steady row's corrected spread above its raw one: the rows moved apart within the rounds (fp32 over bf16-mixed
    is 1.8x off in half of them), so the timing is noisy, as a fresh user's bursty run read (1.36 raw, 2.51)."""
    from mixprec.programs.bench.measure import percentile
    from mixprec.programs.bench.noise import SPREAD_LIMIT, settle_noise
    from mixprec.programs.bench.results import PolicyRun

    bases = {"fp32": 330.0, "bf16-mixed": 200.0, "bf16-pure": 196.0}
    tagged = {n: [(r, base * (1.8 if n != "fp32" and r % 2 == 0 else 1.0)) for r in range(20) for _ in range(6)]
              for n, base in bases.items()}
    rows = {n: PolicyRun(step_time_ms_median=percentile([ms for _, ms in t], 0.5),
                         step_time_ms_p10=percentile([ms for _, ms in t], 0.1),
                         step_time_ms_p90=percentile([ms for _, ms in t], 0.9)) for n, t in tagged.items()}
    settled = settle_noise({"method": "interleaved", "one_pass": True}, rows, tagged=tagged)
    assert settled["spread_raw"]["fp32"] == 1.0 < SPREAD_LIMIT < settled["spread"]["fp32"]
    assert settled["noisy"]
