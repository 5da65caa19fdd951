"""Tokenisation and BERT masking for the MiniLM workload (see :mod:`mixprec.workloads.minilm`).

The tokenizer is the checkpoint's ``tokenizer.json`` (the ``[hf]`` extra's ``tokenizers``), read once per
process; a corpus is tokenized once per process too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch

from mixprec.workloads.corpus import Corpus
from mixprec.workloads.minilm_model import IGNORE_INDEX, _import_extra

__all__ = ["mask_tokens"]


@functools.lru_cache(maxsize=1)
def _tokenizer(directory: Path):
    """The checkpoint's WordPiece tokenizer without its 128-token truncation and padding."""
    tokenizers = _import_extra("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


@functools.lru_cache(maxsize=2)
def _token_ids(directory: Path, corpus: Corpus) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 token ids ``(N_train,)`` and ``(N_val,)`` of the corpus's train and val text (no specials)."""
    tok = _tokenizer(directory)
    train, val = (tok.encode(text, add_special_tokens=False).ids for text in (corpus.train_text, corpus.val_text))
    return torch.tensor(train, dtype=torch.int64), torch.tensor(val, dtype=torch.int64)


def mask_tokens(input_ids: torch.Tensor, *, special_ids: Iterable[int], mask_id: int, vocab_size: int,
                mask_rate: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of int64 ``input_ids`` ``(B, T)``: returns ``(masked_ids, labels)``, both ``(B, T)``.

    Draws, in this order from ``generator``: selection scores ``(B, T)``, the 80/10/10 choice
    ``(B, T)`` and random tokens ``(B, T)``. A position is selected when its score is below
    ``mask_rate`` and it holds no special id; a row with none selects its lowest-scoring
    non-special position (if it has one). ``labels`` = original id where selected, -100
    elsewhere. Does not modify ``input_ids``.
    """
    special = torch.isin(input_ids, torch.tensor(sorted(special_ids), dtype=input_ids.dtype))  # (B, T) bool
    scores = torch.rand(input_ids.shape, generator=generator)  # (B, T)
    choice = torch.rand(input_ids.shape, generator=generator)  # (B, T)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator)  # (B, T) int64
    selected = (scores < mask_rate) & ~special  # (B, T)
    fallback = scores.masked_fill(special, 2.0).argmin(dim=1, keepdim=True)  # (B, 1)
    empty_row = ~selected.any(dim=1, keepdim=True) & ~special.all(dim=1, keepdim=True)  # (B, 1)
    selected |= empty_row & (torch.arange(input_ids.shape[1]) == fallback)  # (B, T)
    labels = torch.where(selected, input_ids, IGNORE_INDEX)  # (B, T)
    masked_ids = torch.where(selected & (choice < 0.8), mask_id, input_ids)
    masked_ids = torch.where(selected & (choice >= 0.8) & (choice < 0.9), random_ids, masked_ids)
    return masked_ids, labels

