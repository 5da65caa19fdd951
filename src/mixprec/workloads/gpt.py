"""A character-level GPT decoder and its language-modelling workload.

Model (our own code, after nanoGPT's ``model.py``): token + learned position embeddings,
``n_layer`` pre-norm blocks (LayerNorm -> causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``; LayerNorm -> GELU MLP of width
``4 * n_embd``), a final LayerNorm and a bias-free head, tied to the token embedding or not.
Weights start as N(0, 0.02), residual output projections as N(0, 0.02 / sqrt(2 * n_layer)),
biases at zero. No dropout.

Named configurations (``V`` = vocabulary size, 103 characters for the embedded corpus):

========  =======  =======  ======  =======  =====  ==========================
config    n_layer  n_head   n_embd  context  batch  parameters (tied, V = 103)
========  =======  =======  ======  =======  =====  ==========================
``tiny``  2        2        32      32       4      29,792
``baby``  4        4        128     64       12     814,720
``mid``   4        4        256     128      16     3,218,688
``small`` 6        6        384     256      64     10,785,408
``long``  4        4        256     1024     2      3,448,064
========  =======  =======  ======  =======  =====  ==========================

``long`` is ``mid``'s model at an eight times longer context, with the same 2,048 tokens per batch: attention's
T×T work (and its memory) grows eightfold while the rest of the step stays.

All share one recipe: AdamW, lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on 2-D tensors
only, linear warm-up over 10% of the steps (at most 100), cosine decay to 1e-4, gradient
clipping at 1.0 (``tiny`` uses lr 3e-3 so a few steps show learning).

Data: training batches are ``B`` random windows of ``T + 1`` characters of the training text,
start positions drawn by a ``torch.Generator`` seeded with ``seed``; ``targets`` is ``idx``
shifted by one. Validation is :data:`VAL_BATCHES` batches whose ``VAL_BATCHES * B`` windows
start at evenly spaced positions of the validation text (the same for every seed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.workloads.base import Batch, OptimizerConfig, Workload, check_split
from mixprec.workloads.corpus import Corpus, load_corpus

__all__ = ["GPTConfig", "GPT", "GPTWorkload", "GPT_CONFIGS", "VAL_BATCHES", "generate"]

VAL_BATCHES = 8


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model (``block_size`` = context length ``T``) and of a training batch."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    tie_head: bool = True
    optim: OptimizerConfig = OptimizerConfig()

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive int.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                "change one of them."
            )


GPT_CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(2, 2, 32, block_size=32, batch_size=4, optim=OptimizerConfig(lr=3e-3, min_lr=3e-4)),
    "baby": GPTConfig(4, 4, 128, block_size=64, batch_size=12),
    "mid": GPTConfig(4, 4, 256, block_size=128, batch_size=16),
    "small": GPTConfig(6, 6, 384, block_size=256, batch_size=64),
    "long": GPTConfig(4, 4, 256, block_size=1024, batch_size=2),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only transformer: int64 ids ``(B, T)`` -> logits ``(B, T, vocab_size)``.

    Logits come out in the compute dtype (fp32, or bf16/fp16 under autocast); callers cast
    with ``.float()`` before a softmax or cross-entropy.
    """

    def __init__(self, config: GPTConfig, vocab_size: int):
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, vocab_size, bias=False)
        if config.tie_head:
            self.lm_head.weight = self.wte.weight  # one (V, C) tensor, shared storage
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections, GPT-2 scaling
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"GPT.forward: sequence length {T} exceeds block_size={self.config.block_size}; "
                "crop the input to the last block_size tokens."
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend int64 ids ``idx`` ``(B, T0)`` by sampling; returns ``(B, T0 + max_new_tokens)``.

    Each step feeds the last ``block_size`` tokens, takes the final position's logits in
    fp32, divides by ``temperature`` (``0`` means greedy argmax), keeps the ``top_k`` largest
    (``None``: all) and samples with ``generator`` (on the model's device). Runs in eval
    mode and restores the model's previous mode. ``T0`` must be at least 1.
    """
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise ValueError(f"generate: idx must have shape (B, T0) with T0 >= 1, got {tuple(idx.shape)}.")
    if temperature < 0:
        raise ValueError(f"generate: {temperature=} must be >= 0 (0 = greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: {top_k=} must be >= 1, or None to keep all tokens.")
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits_fp32 = model(idx[:, -model.config.block_size :])[:, -1, :].float()  # (B, V)
            if temperature == 0:
                next_id = logits_fp32.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits_fp32 = logits_fp32 / temperature
                if top_k is not None:
                    kth = torch.topk(logits_fp32, min(top_k, logits_fp32.size(-1))).values[:, -1:]  # (B, 1)
                    logits_fp32 = logits_fp32.masked_fill(logits_fp32 < kth, float("-inf"))
                probs = F.softmax(logits_fp32, dim=-1)  # (B, V)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)  # (B, T + 1)
    finally:
        model.train(was_training)
    return idx


class GPTWorkload(Workload):
    """Next-character prediction with :class:`GPT` on a :class:`~mixprec.workloads.corpus.Corpus`.

    Batches: ``{"idx": int64 (B, T), "targets": int64 (B, T)}``; ``items_per_batch = B * T``
    tokens. ``config`` is a name from :data:`GPT_CONFIGS` or a :class:`GPTConfig`; ``data`` is
    a UTF-8 file path (``None``: the embedded pydoc corpus).
    """

    name = "gpt"
    item_unit = "tokens"
    loss_unit = "nats/char"

    def __init__(self, config: str | GPTConfig = "baby", data: str | None = None):
        if isinstance(config, GPTConfig):
            self.config_name, self.config = "custom", config
        elif config in GPT_CONFIGS:
            self.config_name, self.config = config, GPT_CONFIGS[config]
        else:
            raise ValueError(
                f"gpt workload: config={config!r} is unknown; choose one of {sorted(GPT_CONFIGS)} "
                "or pass a GPTConfig."
            )
        self.corpus: Corpus = load_corpus(data)
        self.optim = self.config.optim
        self.items_per_batch = self.config.batch_size * self.config.block_size
        self.train_ids = self.corpus.encode_tensor(self.corpus.train_text)  # (N_train,) int64
        self.val_ids = self.corpus.encode_tensor(self.corpus.val_text)  # (N_val,) int64
        if len(self.val_ids) < self.config.block_size + 1:
            raise ValueError(
                f"gpt workload: the validation text has {len(self.val_ids)} characters, fewer than "
                f"block_size + 1 = {self.config.block_size + 1}; use a longer --data file or a "
                "smaller config."
            )

    def encode(self, text: str) -> list[int]:
        return self.corpus.encode(text)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        return self.corpus.decode(ids)

    def build_model(self) -> GPT:
        return GPT(self.config, self.corpus.vocab_size)

    def _windows(self, ids: torch.Tensor, starts: torch.Tensor) -> Batch:
        offsets = torch.arange(self.config.block_size + 1)  # (T + 1,)
        windows = ids[starts[:, None] + offsets]  # (B, T + 1)
        return {"idx": windows[:, :-1], "targets": windows[:, 1:]}  # (B, T) each

    def batches(self, split: str, seed: int = 0) -> Iterator[Batch]:
        check_split(split)
        return self._val_batches() if split == "val" else self._train_batches(seed)

    def _train_batches(self, seed: int) -> Iterator[Batch]:
        B, T = self.config.batch_size, self.config.block_size
        gen = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(len(self.train_ids) - T, (B,), generator=gen)  # (B,)
            yield self._windows(self.train_ids, starts)

    def _val_batches(self) -> Iterator[Batch]:
        B, T = self.config.batch_size, self.config.block_size
        starts = torch.linspace(0, len(self.val_ids) - T - 1, VAL_BATCHES * B).long()  # (VAL_BATCHES * B,)
        for chunk in starts.split(B):
            yield self._windows(self.val_ids, chunk)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch["idx"])  # (B, T, V), compute dtype
        return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())

    def evaluate(self, model: nn.Module, batches: Iterable[Batch] | None = None) -> dict[str, float]:
        """``{"loss": mean val cross-entropy (nats/char), "ppl": exp(loss)}``; one sync."""
        metrics = super().evaluate(model, batches)
        return {**metrics, "ppl": math.exp(metrics["loss"])}

    def num_params(self) -> int:
        """Trainable parameters, counting a tied head once (model built on the meta device)."""
        with torch.device("meta"):
            model = self.build_model()
        return sum(p.numel() for p in model.parameters())

    def flops_per_step(self) -> float:
        """Training FLOPs per optimizer step, as nanoGPT's ``estimate_mfu`` (PaLM appendix B).

        ``flops = (6 * N + 12 * L * C * T) * T * B`` where ``N`` counts the parameters that
        enter a matmul (all but the position table and, when the head is untied, the token
        table), ``L`` layers, ``C`` width, ``T`` context, ``B`` batch. ``6 N`` per token is
        forward (2) + backward (4); the attention term counts full, unmasked ``QK^T`` and
        ``AV`` products (causal kernels may skip about half of them).
        """
        c = self.config
        n = self.num_params() - c.block_size * c.n_embd
        if not c.tie_head:
            n -= self.corpus.vocab_size * c.n_embd
        per_token = 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
        return float(per_token * c.block_size * c.batch_size)

    def describe(self) -> dict:
        model = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "optim"}
        return {
            "workload": self.name,
            "config": self.config_name,
            "model": {**model, "vocab_size": self.corpus.vocab_size, "n_params": self.num_params()},
            "optimizer": dataclasses.asdict(self.optim),
            "data": {
                "source": self.corpus.source,
                "chars": len(self.corpus.text),
                "train_chars": len(self.corpus.train_text),
                "val_chars": len(self.corpus.val_text),
                "split": "first 90% of characters train, last 10% val",
                "val_batches": VAL_BATCHES,
                "vocab": "".join(self.corpus.vocab),
            },
            "items_per_batch": self.items_per_batch,
            "item_unit": self.item_unit,
            "flops_per_step": self.flops_per_step(),
        }
