"""OpenCLIP's CLIP tokenizer as the Hugging Face tokenizer files `push_to_hf_hub` uploads beside
the weights (it saves `HFTokenizer('openai/clip-vit-large-patch14')` for OpenCLIP's default
tokenizer), derived offline from the BPE merges that ship inside open_clip_torch.

The ids are SimpleTokenizer's: the 256 byte characters, the same with `</w>`, one token per
merge (the first 48,894 merges of `bpe_simple_vocab_16e6.txt.gz`), then the start and end of
text, 49,408 in all. Hugging Face spells the two special tokens `<|startoftext|>` and
`<|endoftext|>`; OpenCLIP spells them `<start_of_text>` and `<end_of_text>` (same ids).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from functools import cache
from pathlib import Path

BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
MERGES = 49152 - 256 - 2  # SimpleTokenizer keeps merges[1 : MERGES + 1]
START, END = "<|startoftext|>", "<|endoftext|>"


def bpe_path() -> Path | None:
    """The BPE file inside the installed open_clip package, found without importing it (its
    __init__ imports torchvision)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / BPE_FILE
    return path if path.is_file() else None


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, as OpenCLIP's tokenizer uses it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def vocab_and_merges(path: Path) -> tuple[dict[str, int], list[str]]:
    merges = gzip.decompress(path.read_bytes()).decode("utf-8").split("\n")[1 : MERGES + 1]
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges] + [START, END]
    return {token: i for i, token in enumerate(tokens)}, merges


def tokenizer_files(*, context_length: int) -> dict[str, bytes]:
    """{file name: contents} of the CLIP tokenizer in Hugging Face's layout ({} without open_clip)."""
    path = bpe_path()
    if path is None:
        return {}
    vocab, merges = vocab_and_merges(path)
    special = {"bos_token": START, "eos_token": END, "unk_token": END, "pad_token": END}
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": context_length, "do_lower_case": True,
              "errors": "replace", **special}  # fmt: skip
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False).encode(),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode(),
        "special_tokens_map.json": json.dumps(special, indent=2).encode(),
        "tokenizer_config.json": json.dumps(config, indent=2).encode(),
    }
