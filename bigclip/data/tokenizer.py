"""Text tokenizers, chosen by `--tokenizer`; the name is recorded with every checkpoint.

  open_clip  the default: the tokenizer OpenCLIP pairs with the model, so weights move both ways.
             OpenCLIP's BPE (OpenAI CLIP's vocabulary, `bpe_tokenizer.py`), or the Hugging Face
             tokenizer the model config names (`text_cfg.hf_tokenizer_name`: CLIPA, MetaCLIP 2;
             `hf_tokenizer.py`), whose own layout (its special tokens) the model pools by.
  hashing    opt-in: words mapped to ids by a stable hash, with no vocabulary. Only for models
             trained from scratch on small, known vocabularies (tests, toy data); its ids mean
             nothing to OpenCLIP weights.

Both return OpenCLIP's layout: `LongTensor[N, context_length]`, each row
`[start, tok, ..., end, 0, 0, ...]`, truncated to the context length with the end token kept
last. The model pools at `text.argmax(-1)`, so the end-of-text id is the highest id in every
row: 49406 / 49407 for OpenCLIP's 49408 ids, `vocab_size - 2` / `vocab_size - 1` for hashing.

`HashingTokenizer` splits lower-cased text into words, numbers and punctuation (CLIP's
pre-tokenisation, without BPE) and maps each piece to an id with blake2b (not Python's salted
`hash`), so it gives the same ids in every process and on every machine. Distinct words may
share an id (probability ~ words / vocab_size per pair); `collisions()` checks a vocabulary.
"""

from __future__ import annotations

import hashlib
import html
import logging
import re
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from bigclip.config import TOKENIZERS
from bigclip.data.bpe_tokenizer import VOCAB_SIZE, ClipBpeTokenizer, pad_rows
from bigclip.errors import ConfigError

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
    """Word-level tokenizer with hashed ids (opt-in: `--tokenizer hashing`); picklable."""

    name = "hashing"

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
        rows = [[self.sot_token_id, *self.encode(text), self.eot_token_id] for text in texts]
        return pad_rows(rows, context_length=self.context_length, eot_token_id=self.eot_token_id)

    def collisions(self, texts: Iterable[str]) -> dict[int, set[str]]:
        """Ids shared by more than one distinct word of `texts` (empty when there are none)."""
        by_id: dict[int, set[str]] = {}
        for text in texts:
            for word in self.words(text):
                by_id.setdefault(self.word_id(word), set()).add(word)
        return {i: ws for i, ws in by_id.items() if len(ws) > 1}


def build_tokenizer(
    name: str, *, context_length: int, vocab_size: int, text_pool: str = "argmax", eos_id: int = 0,
    hf_name: str = "", hf_kwargs: dict[str, Any] | None = None, cache_dir: str = "", model: str = "",
) -> Tokenizer:  # fmt: skip
    """`name` is `--tokenizer`: 'open_clip' (the default: the tokenizer OpenCLIP pairs with the
    model, its BPE or, where the config names one, `hf_name` from Hugging Face; `cache_dir`: where
    it is cached) or 'hashing' (opt-in). `text_pool`: how the text tower pools (text_cfg.pool_type;
    'eos' pools at `eos_id`, which the tokenizer must write)."""
    if name == "open_clip" and hf_name:
        from bigclip.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(
            hf_name, context_length=context_length, vocab_size=vocab_size, cache_dir=cache_dir, model=model,
            pools_at=eos_id if text_pool == "eos" else None, **(hf_kwargs or {}),
        )  # fmt: skip
    if name == "hashing" and text_pool == "eos":
        raise ConfigError(
            "--tokenizer hashing ends each text with its own highest id, but this model's text tower pools at "
            "the end-of-sequence id its Hugging Face tokenizer writes (text_cfg.pool_type 'eos'); use "
            "--tokenizer open_clip"
        )
    if name == "open_clip":
        if vocab_size < VOCAB_SIZE:
            raise ConfigError(
                f"--tokenizer open_clip has {VOCAB_SIZE} ids but the model's text_cfg.vocab_size is "
                f"{vocab_size}; use a model with vocab_size {VOCAB_SIZE} (or a config naming its tokenizer, "
                "text_cfg.hf_tokenizer_name)"
            )
        return ClipBpeTokenizer(context_length=context_length)
    if name == "hashing":
        return HashingTokenizer(context_length=context_length, vocab_size=vocab_size)
    raise ConfigError(f"unknown tokenizer {name!r}; use one of {', '.join(TOKENIZERS)}")


# Checkpoints from before the tokenizer was recorded name it only in their saved config, where
# bigclip's former default 'simple' was the word-hashing tokenizer.
_FORMER_NAMES = {"simple": "hashing"}


def saved_tokenizer(meta: dict[str, Any], saved_config: dict[str, Any] | None = None) -> str:
    """The tokenizer weights were trained with, from a manifest's (or safetensors file's) metadata,
    else from the run's saved config; '' when neither says."""
    name = meta.get("tokenizer") or ((saved_config or {}).get("data") or {}).get("tokenizer", "")
    return _FORMER_NAMES.get(name, name)


def check_tokenizer(saved: str, tokenizer: str, *, allow: bool, what: str) -> None:
    """Refuse weights trained with another tokenizer (unless `allow`, --allow-tokenizer-change):
    their text tower would read ids it never learned."""
    if not saved or saved == tokenizer:
        return
    message = (
        f"{what}: the weights were trained with --tokenizer {saved}, this run has --tokenizer {tokenizer}"
    )
    if allow:
        logging.getLogger("bigclip").warning(f"{message}; continuing (--allow-tokenizer-change)")
        return
    raise ConfigError(
        f"{message}; their text tower would read ids it never learned. Pass --tokenizer {saved}, or "
        "--allow-tokenizer-change to train on with the new ids"
    )
