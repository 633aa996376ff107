"""Text tokenizers: a built-in one that needs no download, or OpenCLIP's.

Both return OpenCLIP's layout: `LongTensor[N, context_length]`, each row
`[start, tok, ..., end, 0, 0, ...]`, truncated to the context length with the end
token kept last. The model pools at `text.argmax(-1)`, so the end-of-text id must be the
highest id in every row: as in OpenCLIP (49406 / 49407 for a 49408 vocabulary), the start
and end ids are `vocab_size - 2` and `vocab_size - 1`, and every other id is below them.

The built-in `HashingTokenizer` splits lower-cased text into words, numbers and
punctuation (CLIP's pre-tokenisation, without BPE) and maps each piece to an id with a
stable hash (blake2b, not Python's salted `hash`), so it needs no vocabulary file and gives
the same ids in every process and on every machine. Distinct words may share an id
(probability ~ words / vocab_size per pair); for captions built from a small vocabulary,
such as the demo's, `collisions()` checks there are none.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Iterable
from typing import Protocol

import torch

from bigclip.errors import ConfigError

TOKENIZERS = ("simple", "open_clip")

# CLIP's pre-tokenisation: contractions, runs of letters, single digits, runs of other symbols.
_PIECES = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|[^\s\w]+|_", re.IGNORECASE)
_SPACES = re.compile(r"\s+")


class Tokenizer(Protocol):
    context_length: int

    def __call__(self, texts: str | list[str]) -> torch.Tensor: ...


def clean_text(text: str) -> str:
    """OpenCLIP's 'basic + whitespace' cleaning (without ftfy), lower-cased."""
    text = html.unescape(html.unescape(text))
    return _SPACES.sub(" ", text).strip().lower()


class HashingTokenizer:
    """Word-level tokenizer with hashed ids; picklable, so data workers can use it."""

    def __init__(self, *, context_length: int, vocab_size: int) -> None:
        if context_length < 2:
            raise ConfigError(f"context_length must be at least 2 (start + end tokens), got {context_length}")
        if vocab_size < 4:
            raise ConfigError(f"vocab_size must be at least 4 (padding, start, end, words), got {vocab_size}")
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.sot_token_id = vocab_size - 2
        self.eot_token_id = vocab_size - 1
        self._word_ids = vocab_size - 3  # ids 1 .. vocab_size-3: 0 is padding, the top two are special

    def words(self, text: str) -> list[str]:
        return _PIECES.findall(clean_text(text))

    def word_id(self, word: str) -> int:
        digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
        return 1 + int.from_bytes(digest, "little") % self._word_ids

    def encode(self, text: str) -> list[int]:
        return [self.word_id(w) for w in self.words(text)]

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.sot_token_id, *self.encode(text), self.eot_token_id]
            if len(ids) > self.context_length:
                # OpenCLIP's truncation: keep the first tokens, end token in the last slot.
                ids = ids[: self.context_length]
                ids[-1] = self.eot_token_id
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def collisions(self, texts: Iterable[str]) -> dict[int, set[str]]:
        """Ids shared by more than one distinct word of `texts` (empty when there are none)."""
        by_id: dict[int, set[str]] = {}
        for text in texts:
            for word in self.words(text):
                by_id.setdefault(self.word_id(word), set()).add(word)
        return {i: ws for i, ws in by_id.items() if len(ws) > 1}


def _open_clip_tokenizer(*, context_length: int, vocab_size: int, model_name: str) -> Tokenizer:
    try:
        import open_clip

        get_tokenizer = open_clip.get_tokenizer
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            "--tokenizer open_clip needs OpenCLIP with its dependencies importable "
            f"(pip install open_clip_torch ftfy regex); importing it failed: {e}. "
            "Use --tokenizer simple for the built-in tokenizer."
        ) from e
    tokenizer = get_tokenizer(model_name, context_length=context_length)
    tok_vocab = getattr(tokenizer, "vocab_size", vocab_size)
    if tok_vocab > vocab_size:
        raise ConfigError(
            f"OpenCLIP's tokenizer for {model_name or 'the default model'} has {tok_vocab} ids but the "
            f"model's vocab_size is {vocab_size}; pick a model whose text_cfg.vocab_size matches"
        )
    return tokenizer


def build_tokenizer(name: str, *, context_length: int, vocab_size: int, model_name: str = "") -> Tokenizer:
    """`name` is `--tokenizer`: 'simple' (built-in) or 'open_clip' (`open_clip.get_tokenizer(model_name)`)."""
    if name == "simple":
        return HashingTokenizer(context_length=context_length, vocab_size=vocab_size)
    if name == "open_clip":
        return _open_clip_tokenizer(
            context_length=context_length, vocab_size=vocab_size, model_name=model_name
        )
    raise ConfigError(f"unknown tokenizer {name!r}; use one of {', '.join(TOKENIZERS)}")
