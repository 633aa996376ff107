"""The Hugging Face tokenizer files OpenCLIP's `push_to_hf_hub` uploads beside the weights.

For OpenCLIP's default tokenizer it saves `HFTokenizer('openai/clip-vit-large-patch14')`: bigclip
writes those offline from its copy of the same vocabulary (`bigclip.data.bpe_tokenizer`). A model
whose config names its own Hugging Face tokenizer (CLIPA, MetaCLIP 2) gets that tokenizer's files,
as transformers saves them (`model_tokenizer_files`).

The ids are OpenCLIP's: the 256 byte characters, the same with `</w>`, one token per merge,
then the start and end of text, 49,408 in all. Hugging Face spells the two special tokens
`<|startoftext|>` and `<|endoftext|>`; OpenCLIP spells them `<start_of_text>` and
`<end_of_text>` (same ids).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from bigclip.data.bpe_tokenizer import ClipBpeTokenizer

HF_SPECIAL = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}


def tokenizer_files(*, context_length: int) -> dict[str, bytes]:
    """{file name: contents} of the CLIP tokenizer in Hugging Face's layout."""
    tokenizer = ClipBpeTokenizer(context_length=context_length)
    vocab = {HF_SPECIAL.get(piece, piece): i for piece, i in tokenizer.encoder.items()}
    merges = [" ".join(pair) for pair, _ in sorted(tokenizer.ranks.items(), key=lambda item: item[1])]
    start, end = HF_SPECIAL["<start_of_text>"], HF_SPECIAL["<end_of_text>"]
    special = {"bos_token": start, "eos_token": end, "unk_token": end, "pad_token": end}
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": context_length, "do_lower_case": True,
              "errors": "replace", **special}  # fmt: skip
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False).encode(),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode(),
        "special_tokens_map.json": json.dumps(special, indent=2).encode(),
        "tokenizer_config.json": json.dumps(config, indent=2).encode(),
    }


def model_tokenizer_files(text_cfg: dict[str, Any], *, model: str) -> dict[str, bytes]:
    """The tokenizer files for a model's OpenCLIP `text_cfg`: CLIP's, or those of the Hugging Face
    tokenizer it names (from the Hugging Face cache or the Hub; a ConfigError, before anything is
    written, when transformers cannot load it)."""
    if not text_cfg.get("hf_tokenizer_name"):
        return tokenizer_files(context_length=text_cfg["context_length"])
    from bigclip.data.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(text_cfg["hf_tokenizer_name"], cache_dir="", model=f"model {model}")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
