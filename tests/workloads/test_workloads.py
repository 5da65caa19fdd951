"""Tests for mixprec.workloads: corpus, GPT, digits, the Workload contract and get_workload."""

from __future__ import annotations

import itertools
import json
import math
import sys
import textwrap

import pytest
import torch

from mixprec.workloads import (
    DigitsWorkload,
    GPTConfig,
    GPTWorkload,
    Workload,
    generate,
    get_workload,
    load_corpus,
)
from mixprec.workloads.corpus import MIN_CHARS
from mixprec.workloads.digits import load_digits_tensors
from mixprec.workloads.gpt import VAL_BATCHES


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tiny() -> GPTWorkload:
    return GPTWorkload("tiny")


def _write_text(tmp_path, text: str):
    path = tmp_path / "data.txt"
    path.write_text(text, encoding="utf-8")
    return path


# --- corpus -------------------------------------------------------------------------------


def test_default_corpus_is_sorted_pydoc_topics_split_90_10():
    from pydoc_data.topics import topics

    corpus = load_corpus()
    assert corpus.text == "\n\n".join(topics[k] for k in sorted(topics))
    n = len(corpus.text)
    assert n > 400_000
    assert len(corpus.train_text) == n * 9 // 10
    assert len(corpus.val_text) == n - n * 9 // 10
    assert corpus.train_text + corpus.val_text == corpus.text
    assert list(corpus.vocab) == sorted(set(corpus.text))


def test_data_file_split_boundary_and_vocab_from_whole_text(tmp_path):
    text = "ab" * 5_000 + "xyz" * 1_000  # 13,000 chars; "xyz" lies only in the last 10%+
    corpus = load_corpus(_write_text(tmp_path, text))
    assert len(corpus.train_text) == 11_700 and len(corpus.val_text) == 1_300
    assert corpus.vocab == ("a", "b", "x", "y", "z")  # includes the val-only characters
    assert corpus.decode(corpus.encode(corpus.val_text)) == corpus.val_text
    assert corpus.source == str(tmp_path / "data.txt")


def test_encode_decode_round_trip_and_unknown_character():
    corpus = load_corpus()
    sample = corpus.val_text[:500]
    ids = corpus.encode(sample)
    assert all(0 <= i < corpus.vocab_size for i in ids)
    assert corpus.decode(ids) == sample
    assert corpus.decode(torch.tensor(ids)) == sample
    with pytest.raises(ValueError, match="'☃'"):
        corpus.encode("snow ☃")
    with pytest.raises(ValueError, match="outside"):
        corpus.decode([corpus.vocab_size])


def test_data_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=f"at least {MIN_CHARS}"):
        load_corpus(_write_text(tmp_path, "too short"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café ".encode("latin-1") * 5_000)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_corpus(bad)


def test_gpt_workload_on_data_file(tmp_path):
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(20_000))
    wl = get_workload("gpt", "tiny", data=str(_write_text(tmp_path, text)))
    assert wl.describe()["data"]["vocab"] == "abcdefghijklmnopqrstuvwxyz"
    batch = next(wl.batches("train", seed=0))
    assert wl.decode(batch["idx"][0]) in text


# --- batches ------------------------------------------------------------------------------


def _take(it, n):
    return list(itertools.islice(it, n))


def test_train_stream_deterministic_per_seed(tiny):
    a, b, c = (_take(tiny.batches("train", seed=s), 5) for s in (1, 1, 2))
    assert all(torch.equal(x["idx"], y["idx"]) and torch.equal(x["targets"], y["targets"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["idx"], y["idx"]) for x, y in zip(a, c))
    batch = a[0]
    B, T = tiny.config.batch_size, tiny.config.block_size
    assert batch["idx"].shape == (B, T) and batch["idx"].dtype == torch.int64
    assert torch.equal(batch["idx"][:, 1:], batch["targets"][:, :-1])  # targets = idx shifted
    assert tiny.items_per_batch == B * T and tiny.item_unit == "tokens"


def test_val_batches_fixed_and_seed_independent(tiny):
    first, second = list(tiny.batches("val", seed=0)), list(tiny.batches("val", seed=123))
    assert len(first) == VAL_BATCHES
    assert all(torch.equal(x["idx"], y["idx"]) for x, y in zip(first, second))
    val_ids = tiny.corpus.encode_tensor(tiny.corpus.val_text)
    T = tiny.config.block_size
    assert torch.equal(first[0]["idx"][0], val_ids[:T])  # first window starts the val text
    assert torch.equal(first[-1]["targets"][-1], val_ids[-T:])  # last window ends it
    with pytest.raises(ValueError, match="'test'"):
        tiny.batches("test", seed=0)


# --- GPT model ----------------------------------------------------------------------------


def test_gpt_forward_shape_and_causality(tiny):
    model = tiny.build_model()
    idx = next(tiny.batches("train", seed=0))["idx"]
    logits = model(idx)
    assert logits.shape == (*idx.shape, tiny.corpus.vocab_size) and logits.dtype == torch.float32
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % tiny.corpus.vocab_size
    logits_changed = model(changed)
    torch.testing.assert_close(logits_changed[:, :20], logits[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(logits_changed[:, 20:], logits[:, 20:])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, tiny.config.block_size + 1, dtype=torch.int64))


def test_tied_and_untied_head(tiny):
    tied = tiny.build_model()
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    untied_cfg = GPTConfig(2, 2, 32, block_size=32, batch_size=4, tie_head=False)
    untied = GPTWorkload(untied_cfg).build_model()
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    n_tied, n_untied = (sum(p.numel() for p in m.parameters()) for m in (tied, untied))
    assert n_untied - n_tied == tiny.corpus.vocab_size * 32


def test_build_model_deterministic_under_seed(tiny):
    torch.manual_seed(3)
    a = tiny.build_model()
    torch.manual_seed(3)
    b = tiny.build_model()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _closed_form_params(L: int, C: int, T: int, V: int) -> int:
    per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    return V * C + T * C + L * per_block + 2 * C  # tied head adds nothing


@pytest.mark.parametrize("name, L, C, T", [("baby", 4, 128, 64), ("mid", 4, 256, 128)])
def test_param_count_closed_form(name, L, C, T):
    wl = GPTWorkload(name)
    expected = _closed_form_params(L, C, T, wl.corpus.vocab_size)
    assert wl.num_params() == expected == sum(p.numel() for p in wl.build_model().parameters())
    assert wl.describe()["model"]["n_params"] == expected


def test_flops_per_step_matches_hand_computation():
    wl = GPTWorkload("baby")
    V = wl.corpus.vocab_size
    n_matmul = _closed_form_params(4, 128, 64, V) - 64 * 128  # position table is not a matmul
    per_token = 6 * n_matmul + 12 * 4 * 128 * 64  # 6N + 12 * L * C * T
    assert wl.flops_per_step() == per_token * 64 * 12  # x T tokens x B sequences
    if V == 103:  # the CPython 3.11 pydoc corpus
        assert wl.flops_per_step() == 4_018_470_912


def test_tiny_gpt_trains(tiny):
    model = tiny.build_model()
    before = tiny.evaluate(model)
    assert before["loss"] == pytest.approx(math.log(tiny.corpus.vocab_size), abs=0.3)
    optimizer = tiny.make_optimizer(model)
    scheduler = tiny.make_scheduler(optimizer, total_steps=30)
    for batch in _take(tiny.batches("train", seed=0), 30):
        loss = tiny.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tiny.max_grad_norm)
        optimizer.step()
        scheduler.step()
    after = tiny.evaluate(model)
    assert after["loss"] < before["loss"] - 0.5
    assert after["ppl"] == pytest.approx(math.exp(after["loss"]))
    assert model.training  # evaluate restored the mode


def test_generate_shapes_greedy_and_seeded(tiny):
    model = tiny.build_model()
    prompt = torch.tensor([tiny.encode("def ")])
    out = generate(model, prompt, max_new_tokens=40, temperature=0)  # longer than the context
    assert out.shape == (1, 44) and torch.equal(out[:, :4], prompt)
    assert torch.equal(out, generate(model, prompt, max_new_tokens=40, temperature=0))
    sample_a, sample_b = (
        generate(model, prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    )
    assert torch.equal(sample_a, sample_b)
    assert isinstance(tiny.decode(sample_a[0]), str)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 1, temperature=-1.0)


# --- recipe -------------------------------------------------------------------------------


def test_optimizer_decays_only_matrices_and_schedule():
    wl = GPTWorkload("baby")
    model = wl.build_model()
    optimizer = wl.make_optimizer(model)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert optimizer.defaults["betas"] == (0.9, 0.99) and wl.max_grad_norm == 1.0
    scheduler = wl.make_scheduler(optimizer, total_steps=2000)  # warm-up min(100, 200) = 100
    lrs = []
    for _ in range(2001):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-5) and lrs[99] == pytest.approx(1e-3)
    assert lrs[1050] == pytest.approx(0.5 * (1e-3 + 1e-4))  # cosine midpoint
    assert lrs[2000] == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="total_steps"):
        wl.make_scheduler(optimizer, total_steps=0)


def test_describe_is_json_serialisable(tiny):
    described = json.loads(json.dumps(tiny.describe()))
    assert described["config"] == "tiny" and described["data"]["vocab"] == "".join(tiny.corpus.vocab)
    assert described["data"]["val_batches"] == VAL_BATCHES


# --- digits -------------------------------------------------------------------------------


def test_digits_data_and_split():
    images, labels = load_digits_tensors()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32
    assert 0.0 <= images.min() and images.max() == 1.0
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    wl = DigitsWorkload("tiny")
    assert len(wl.train_labels) == 1437 and len(wl.val_labels) == 360
    assert sum(len(b["labels"]) for b in wl.batches("val", seed=5)) == 360
    a, b = (_take(wl.batches("train", seed=1), 3) for _ in range(2))
    assert all(torch.equal(x["images"], y["images"]) for x, y in zip(a, b))
    assert wl.items_per_batch == 16 and wl.item_unit == "samples"


def test_digits_tiny_forward_backward_and_evaluate():
    wl = get_workload("digits", "tiny")
    model = wl.build_model()
    batch = next(wl.batches("train", seed=0))
    assert model(batch["images"]).shape == (16, 10)
    loss = wl.loss(model, batch)
    loss.backward()
    assert loss.dim() == 0 and all(p.grad is not None for p in model.parameters())
    metrics = wl.evaluate(model)
    assert set(metrics) == {"loss", "accuracy"} and 0.0 <= metrics["accuracy"] <= 1.0
    json.dumps(wl.describe())


def test_digits_flops_hand_computation():
    # tiny: width 8, blocks 8->8 (8x8) and 8->16 stride 2 (4x4) with a 1x1 projection.
    stem = 2 * 9 * 1 * 8 * 64
    block0 = 2 * (2 * 9 * 8 * 8 * 64)
    block1 = 2 * 9 * 8 * 16 * 16 + 2 * 9 * 16 * 16 * 16 + 2 * 8 * 16 * 16
    head = 2 * 16 * 10
    assert DigitsWorkload("tiny").flops_per_step() == 3 * (stem + block0 + block1 + head) * 16


def test_digits_missing_sklearn_message(monkeypatch):
    load_digits_tensors.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    try:
        with pytest.raises(ImportError, match=r"pip install 'mixprec\[digits\]'"):
            load_digits_tensors()
    finally:
        load_digits_tensors.cache_clear()


# --- get_workload -------------------------------------------------------------------------

_USER_MODULE = '''
import torch
from mixprec.workloads import Workload


class Constant(Workload):
    name, item_unit, items_per_batch = "constant", "samples", 2

    def __init__(self, config="small"):
        self.config_name = config

    def build_model(self):
        return torch.nn.Linear(3, 1)

    def batches(self, split, seed=0):
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield {"x": torch.randn(2, 3, generator=gen)}

    def loss(self, model, batch):
        return model(batch["x"]).float().pow(2).mean()

    def flops_per_step(self):
        return 3 * 2 * 3 * 2.0

    def describe(self):
        return {"workload": self.name, "config": self.config_name}


def make_workload(config="small"):
    return Constant(config)


def no_args():
    return Constant()


def not_a_workload():
    return 42
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_workloads.py").write_text(textwrap.dedent(_USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_workloads"
    sys.modules.pop("user_workloads", None)


def test_get_workload_user_factory(user_module):
    wl = get_workload(f"{user_module}:make_workload", config="large")
    assert isinstance(wl, Workload) and wl.config_name == "large"
    assert get_workload(f"{user_module}:make_workload").config_name == "small"
    assert get_workload(f"{user_module}:no_args").name == "constant"
    model = wl.build_model()
    assert "loss" in wl.evaluate(model, _take(wl.batches("train", seed=0), 2))
    assert isinstance(wl.make_optimizer(model), torch.optim.AdamW)
    with pytest.raises(ValueError, match="does not accept data="):
        get_workload(f"{user_module}:no_args", data="corpus.txt")
    with pytest.raises(TypeError, match="not a mixprec.workloads.Workload"):
        get_workload(f"{user_module}:not_a_workload")
    with pytest.raises(ValueError, match="no callable 'missing'"):
        get_workload(f"{user_module}:missing")


def test_get_workload_errors():
    assert isinstance(get_workload("gpt", "tiny"), GPTWorkload)
    with pytest.raises(ValueError, match=r"'gpt', 'digits'.*'package.module:function'"):
        get_workload("bert")
    with pytest.raises(ValueError, match="malformed"):
        get_workload("a.b:c:d")
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        get_workload("no_such_module_xyz:make")
    with pytest.raises(ValueError, match=r"config='huge' is unknown; choose one of \['baby', 'long', 'mid', "
                                         r"'small', 'tiny'\]$"):   # a name, as --config gives: no GPTConfig
        get_workload("gpt", "huge")
    with pytest.raises(ValueError, match=r"minilm workload: config='big' is unknown; choose one of \['default', "):
        get_workload("minilm", "big")
    with pytest.raises(ValueError, match=r"or pass a GPTConfig"):   # the class itself still names it
        GPTWorkload(config="huge")
    with pytest.raises(ValueError, match="--data"):
        get_workload("digits", data="file.txt")
