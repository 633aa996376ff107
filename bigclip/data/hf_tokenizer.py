"""The Hugging Face tokenizer an OpenCLIP config names (`text_cfg.hf_tokenizer_name`: CLIPA's
BERT, MetaCLIP 2's XLM-V and mT5), as OpenCLIP's `HFTokenizer` applies it: the config's cleaning
(`tokenizer_kwargs.clean`: whitespace, lower or canonicalize), `transformers`' own special tokens,
padding and truncation to the context length, and the separator id zeroed with `strip_sep_token`.

`transformers` loads it from the Hugging Face cache (`--cache-dir`, else the default one) or the
Hub; it is an optional dependency, needed only by such models.
"""

from __future__ import annotations

import string
from typing import Any

import torch

from bigclip.data.bpe_tokenizer import clean, clean_whitespace
from bigclip.errors import ConfigError

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _canonicalize(text: str) -> str:
    """big_vision's canonical text (OpenCLIP's 'canonicalize'): no punctuation, lower case."""
    text = clean_whitespace(text).replace("_", " ").translate(_PUNCTUATION).lower()
    return " ".join(text.split())


# named_configs.TOKENIZER_KWARGS lists these names for the torch-free config check.
CLEANERS = {"whitespace": clean_whitespace, "lower": clean, "canonicalize": _canonicalize}


class HFTokenizer:
    """`transformers.AutoTokenizer` with OpenCLIP's cleaning and layout; picklable (loader workers)."""

    name = "open_clip"  # what OpenCLIP pairs with the model, as for its BPE models

    def __init__(
        self,
        hf_name: str,
        *,
        context_length: int,
        vocab_size: int,
        cache_dir: str = "",
        model: str = "",
        pools_at: int | None = None,
        **kwargs: Any,
    ) -> None:
        """`pools_at`: the id an 'eos'-pooled text tower reads its features at (text_cfg.eos_id)."""
        self.hf_name, self.context_length = hf_name, context_length  # kwargs: checked with the model config
        self.clean = CLEANERS[kwargs.get("clean", "whitespace")]
        self.strip_sep_token = bool(kwargs.get("strip_sep_token", False))
        who = f"model {model}" if model else "the model"
        self.tokenizer = load_tokenizer(hf_name, cache_dir=cache_dir, model=who)
        if len(self.tokenizer) > vocab_size:
            raise ConfigError(
                f"tokenizer {hf_name} has {len(self.tokenizer)} ids but {who}'s text_cfg.vocab_size is {vocab_size}: "
                "its text tower cannot read them; is --cache-dir holding another tokenizer?"
            )
        if pools_at is not None and not (self("a photo") == pools_at).any():
            eos = self.tokenizer.eos_token_id
            ends = f"it ends texts with id {eos}" if eos is not None else "it has no end-of-text token"
            raise ConfigError(
                f"tokenizer {hf_name} does not write id {pools_at}, where {who}'s text tower pools (text_cfg "
                f"pool_type 'eos', eos_id {pools_at}; {ends}): every text would be read at its first token; "
                "is --cache-dir holding another tokenizer?"
            )

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        texts = [texts] if isinstance(texts, str) else texts
        ids = self.tokenizer(
            [self.clean(t) for t in texts], return_tensors="pt", max_length=self.context_length,
            padding="max_length", truncation=True,
        ).input_ids  # fmt: skip
        if self.strip_sep_token:
            ids = ids.masked_fill(ids == self.tokenizer.sep_token_id, 0)
        return ids


def load_tokenizer(hf_name: str, *, cache_dir: str, model: str) -> Any:
    """transformers' tokenizer `hf_name`; `model` ('model NAME') is named by the error line."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(
            f"{model} reads Hugging Face's {hf_name} tokenizer, which needs the transformers package: "
            "pip install 'bigclip[hf]' (or transformers)"
        ) from e
    try:
        return AutoTokenizer.from_pretrained(hf_name, cache_dir=cache_dir or None)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{model} reads Hugging Face's {hf_name} tokenizer, and transformers could not load it "
            f"({str(e).splitlines()[0][:200]}): put it in the Hugging Face cache (--cache-dir) or let this "
            "machine reach the Hub"
        ) from e
