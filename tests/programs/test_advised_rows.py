"""`mixprec bench --policies advised:<block format>`: the block policy the inspector advises, as a bench row."""

import json
import textwrap

import pytest
import torch

from mixprec.numerics.workload import inspect_workload
from mixprec.policy.policy import Policy
from mixprec.programs.bench.advised_rows import advise_rows, is_advised
from mixprec.programs.cli import main
from mixprec.workloads import get_workload

PLANTED = textwrap.dedent('''
    import torch
    from mixprec.workloads import get_workload


    def make_workload(config="tiny"):
        """gpt/tiny with blocks.0.fc's weight made of 16x16 tiles of one 0.02 among 0.001s: its NVFP4 SQNR
        is far below what normal data gets (tests/numerics/test_block_inspect.py's planted linear)."""
        workload = get_workload("gpt", config=config)
        build = workload.build_model

        def planted():
            model = build()
            with torch.no_grad():
                w = model.blocks[0].fc.weight
                w.fill_(0.001)
                w[::16, ::16] = 0.02
            return model

        workload.build_model = planted
        return workload
''')
PLANTED_KEEP = ("blocks.0.fc", "blocks.0.proj")   # fc by its W's SQNR, proj by its x's underflow


def _planted(tmp_path, monkeypatch):
    (tmp_path / "planted_workload.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))   # the bench's workers import it too
    return "planted_workload:make_workload"


class _Counted:
    """inspect_workload, counting its calls and the policy each studied (the real inspection runs)."""

    def __init__(self):
        self.studied: list[str] = []

    def __call__(self, **kwargs):
        self.studied.append(str(kwargs["policy"]))
        return inspect_workload(steps=1, **kwargs)


@pytest.mark.parametrize("request_text, words", [
    ("advised:", "name a block format after 'advised:', e.g. advised:nvfp4 (block formats a recipe runs: "
                  "mxfp8_e4m3, nvfp4)"),
    ("advised:bf16", "'bf16' is not a block format; e.g. advised:nvfp4"),
    ("advised:mxfp4", "no policy runs mxfp4_e2m1 linears"),
    ("advised:nvfp4,block=mxfp8", "the overrides leave nvfp4 (block=mxfp8)"),
    ("advised:nvfp4,block=none", "the overrides leave nvfp4 (block=None)"),
])
def test_a_bad_advised_block_request_is_refused_before_any_inspection(request_text, words):
    counted = _Counted()
    with pytest.raises(ValueError, match="--policies") as err:
        advise_rows(["advised", request_text], counted, workload="gpt", config="tiny", device="cpu")
    assert words in str(err.value) and counted.studied == []


def test_advised_requests_are_recognised_by_name_only():
    assert is_advised("advised") and is_advised(" Advised:nvfp4,block_disable=sr")
    assert not is_advised("bf16-mixed") and not is_advised("advisedx")


def test_requests_that_need_the_same_inspection_share_it_and_overrides_are_judged_under_their_recipe():
    counted = _Counted()
    rows = advise_rows(["advised", "advised:nvfp4", "advised:mxfp8", "advised:nvfp4,block_disable=sr"], counted,
                       workload="gpt", config="tiny", device="cpu")
    # one inspection under fp32 for the 16-bit advice and both plain block requests, one under the override
    assert counted.studied == ["fp32", "nvfp4-mixed,block_disable=sr"]
    assert rows.names["advised:nvfp4"] == "nvfp4-mixed" and rows.names["advised:mxfp8"] == "mxfp8-mixed"
    assert rows.names["advised:nvfp4,block_disable=sr"] == "nvfp4-mixed,block_disable=sr"
    assert rows.record["policy"] == rows.names["advised"] and rows.record["reasons"]
    blocks = {b["request"]: b for b in rows.record["block"]}
    assert blocks["advised:nvfp4,block_disable=sr"]["recipe"].startswith("nvfp4 without sr(")
    assert "sr(dy)" in blocks["advised:nvfp4"]["recipe"]
    assert blocks["advised:mxfp8"]["format"] == "mxfp8_e4m3" and "lm_head" in blocks["advised:mxfp8"]["kept_in_bf16"]
    for name, policy in rows.names.items():
        assert Policy.parse(policy) is not None, name


def test_the_advised_block_policy_keeps_a_planted_linear(tmp_path, monkeypatch):
    spec = _planted(tmp_path, monkeypatch)
    rows = advise_rows(["advised:nvfp4"], _Counted(), workload=spec, device="cpu")
    (block,) = rows.record["block"]
    assert tuple(block["block_keep_added"]) == PLANTED_KEEP and "policy" not in rows.record
    policy = Policy.parse(rows.names["advised:nvfp4"])
    assert policy.block == "nvfp4" and set(policy.block_keep) in ({"blocks.0.fc", "blocks.0.proj"},
                                                                  {"blocks.*.fc", "blocks.0.proj"})


@pytest.mark.slow   # ~40 s on a busy 2-core machine: an inspection, then a bench of one emulated NVFP4 row
def test_bench_runs_the_advised_nvfp4_policy_and_judges_it(tmp_path, monkeypatch):
    spec = _planted(tmp_path, monkeypatch)
    out = tmp_path / "bench"
    assert main(["bench", "--workload", spec, "--policies", "advised:nvfp4", "--steps", "5", "--quick",
                 "--out", str(out), "--device", "cpu", "--seeds", "1", "--eval-every", "0", "--no-peer"]) == 0
    results = json.loads((out / "results.json").read_text())
    (block,) = results["advice"]["block"]
    row = results["policies"][block["policy"]]
    assert list(results["policies"]) == ["fp32", block["policy"]] and row["verdict"] == "SMOKE"
    assert "block_keep: " in row["decision"] and "blocks.0.proj" in row["decision"]
    assert torch.isfinite(torch.tensor(row["final_eval_loss"]))
    report = (out / "report.md").read_text()
    assert (f"Advised nvfp4 policy (`advised:nvfp4`, as `mixprec inspect --formats nvfp4` advises): "
            f"`{block['policy']}`; its row is `{block['policy']}`; linears kept in bf16: ") in report


def test_the_bench_refuses_a_bad_advised_request_by_name(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--config", "tiny", "--policies", "advised:mxfp6", "--steps", "5", "--quick",
                 "--out", str(out), "--device", "cpu", "--seeds", "1", "--no-peer"]) == 2
    assert "--policies 'advised:mxfp6': 'mxfp6' is not a block format" in capsys.readouterr().err
    assert not out.exists()


def test_the_planted_workload_is_gpt_tiny_with_one_linear_changed():
    """The fixture's own premise: only blocks.0.fc differs from gpt/tiny's model."""
    torch.manual_seed(0)
    plain = get_workload("gpt", config="tiny").build_model().state_dict()
    namespace: dict = {}
    exec(PLANTED, namespace)
    torch.manual_seed(0)
    planted = namespace["make_workload"]().build_model().state_dict()
    assert [k for k in plain if not torch.equal(plain[k], planted[k])] == ["blocks.0.fc.weight"]


def test_advised_rows_take_the_recompute_suffix_and_a_trailing_comma_changes_nothing(monkeypatch):
    """``advised:nvfp4+recompute`` was parsed as the format 'nvfp4+recompute' (the bench's own --recompute hint
    suggested it); ``advised:nvfp4,`` was inspected under the preset as if it carried overrides."""
    from mixprec.programs.bench import row_plan
    from mixprec.programs.bench.config import BenchConfig

    counted = _Counted()
    monkeypatch.setattr(row_plan, "advise_rows", lambda asked, _, **kw: advise_rows(asked, counted, **kw))
    config = BenchConfig(out="unused", workload="gpt", config="tiny", policies=("advised:nvfp4,",), device="cpu")
    names, record = row_plan._advised(config, ["fp32", "advised:nvfp4", "advised:nvfp4+recompute"],
                                      torch.device("cpu"), progress=False)
    assert names == ["fp32", "nvfp4-mixed", "nvfp4-mixed+recompute"] and counted.studied == ["fp32"]
    assert record["block"][0]["request"] == "advised:nvfp4"
    assert advise_rows(["advised:nvfp4,"], counted, workload="gpt", config="tiny", device="cpu").names == {
        "advised:nvfp4,": "nvfp4-mixed"} and counted.studied == ["fp32", "fp32"]


def test_an_advised_request_merged_into_another_row_is_recorded_and_said_on_the_console(monkeypatch):
    """``--policies nvfp4-mixed,advised:nvfp4``: one row, and results.json and the console say which requests it
    answers (only report.md said so)."""
    from mixprec.programs.bench import row_plan
    from mixprec.programs.bench.advised_rows import AdvisedRows, merged_lines
    from mixprec.programs.bench.config import BenchConfig

    advised = AdvisedRows({"advised:nvfp4": "nvfp4-mixed", "advised": "fp32", "advised:mxfp8": "mxfp8-mixed"},
                          {"policy": "fp32", "reasons": ["r"], "block": []})
    monkeypatch.setattr(row_plan, "advise_rows", lambda asked, _, **kw: advised)
    config = BenchConfig(out="unused", workload="gpt", config="tiny", device="cpu",
                         policies=("nvfp4-mixed", "advised:nvfp4", "advised", "advised:mxfp8"))
    names, record = row_plan._advised(config, ["fp32", "nvfp4-mixed", "advised:nvfp4", "advised", "advised:mxfp8"],
                                      torch.device("cpu"), progress=False)
    assert names == ["fp32", "nvfp4-mixed", "mxfp8-mixed"]
    assert record["merged"] == [
        {"request": "advised:nvfp4", "row": "nvfp4-mixed", "also_asked_as": ["nvfp4-mixed"]},
        {"request": "advised", "row": "fp32", "also_asked_as": ["fp32"]}]
    assert merged_lines({"reference": "fp32", "advice": record}) == [
        "advised:nvfp4 resolved to nvfp4-mixed and runs as that row (also asked for as nvfp4-mixed: it ran once)",
        "advised resolved to fp32 and runs as that row (the fp32 reference: it ran once)"]
    names, record = row_plan._advised(config, ["fp32", "advised:nvfp4"], torch.device("cpu"), progress=False)
    assert names == ["fp32", "nvfp4-mixed"] and "merged" not in record and merged_lines({"advice": record}) == []
