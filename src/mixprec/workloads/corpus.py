"""Character-level text corpora: the embedded default, or a UTF-8 file given with ``--data``.

The default corpus is the English reference documentation that ships inside CPython:
``pydoc_data.topics.topics`` (a dict of ~80 help topics, ~465 K characters of prose and code
samples). Its values are joined in sorted-key order with one blank line between topics,
so the text is byte-for-byte deterministic for a given Python version and needs no download.

Split rule (the same for every source): with ``N`` characters, the first
``N * 9 // 10`` characters are the training text and the remaining characters the
validation text. The vocabulary is the sorted set of distinct characters of the WHOLE text,
so every validation character can be encoded; token id ``i`` is ``vocab[i]``.

A ``--data PATH`` file is read as strict UTF-8 (bytes kept as-is: no newline translation)
and must hold at least :data:`MIN_CHARS` characters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "MIN_CHARS", "DEFAULT_SOURCE"]

MIN_CHARS = 10_000  # 9,000 train / 1,000 val: enough for every built-in context length
DEFAULT_SOURCE = "pydoc_data.topics"


@dataclass(frozen=True)
class Corpus:
    """A text, its 90/10 train/val split and its character vocabulary.

    Build one with :meth:`from_text` (or :func:`load_corpus`). ``vocab`` must be the sorted
    distinct characters of ``text``. ``encode`` maps a string to a list of int token ids,
    ``decode`` maps ids back to text.
    """

    text: str
    source: str  # "pydoc_data.topics" or the file path
    vocab: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.vocab != tuple(sorted(set(self.text))):
            raise ValueError(
                "Corpus: vocab must be the sorted distinct characters of text; "
                "build the corpus with Corpus.from_text(text, source)."
            )

    @classmethod
    def from_text(cls, text: str, source: str) -> Corpus:
        return cls(text=text, source=source, vocab=tuple(sorted(set(text))))

    @property
    def split_index(self) -> int:
        """Number of training characters: ``len(text) * 9 // 10``."""
        return len(self.text) * 9 // 10

    @property
    def train_text(self) -> str:
        return self.text[: self.split_index]

    @property
    def val_text(self) -> str:
        return self.text[self.split_index :]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises ``ValueError`` naming any character not in ``vocab``."""
        stoi = {ch: i for i, ch in enumerate(self.vocab)}
        try:
            return [stoi[ch] for ch in text]
        except KeyError as err:
            ch = err.args[0]
            raise ValueError(
                f"encode: character {ch!r} (U+{ord(ch):04X}) at index {text.index(ch)} is not in "
                f"the vocabulary of {self.source!r} ({self.vocab_size} characters); remove it or "
                "train on data that contains it."
            ) from None

    def encode_tensor(self, text: str) -> torch.Tensor:
        """``encode`` as an int64 tensor of shape ``(len(text),)``."""
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of token ids (a list or a 1-D tensor); raises ``ValueError`` for bad ids."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: token ids {bad[:5]} lie outside [0, {self.vocab_size}).")
        return "".join(self.vocab[i] for i in ids)


@functools.lru_cache(maxsize=1)
def _default_corpus() -> Corpus:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return Corpus.from_text(text, source=DEFAULT_SOURCE)


def load_corpus(path: str | Path | None = None) -> Corpus:
    """The embedded pydoc corpus (``path=None``) or the UTF-8 text file at ``path``."""
    if path is None:
        return _default_corpus()
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"load_corpus: data file {str(path)!r} does not exist or is not a file; pass the "
            "path of a UTF-8 text file, or omit --data to use the embedded pydoc corpus."
        )
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"load_corpus: data file {str(path)!r} is not valid UTF-8 (byte {err.start}: "
            f"{err.reason}); convert it, e.g. `iconv -t UTF-8 FILE > FILE.utf8`."
        ) from None
    if len(text) < MIN_CHARS:
        raise ValueError(
            f"load_corpus: data file {str(path)!r} has {len(text)} characters; at least "
            f"{MIN_CHARS} are needed (the last 10% is the validation split). Use a longer file."
        )
    return Corpus.from_text(text, source=str(path))
