"""OpenCLIP's CLIP tokenizer as the Hugging Face tokenizer files `push_to_hf_hub` uploads beside
the weights (it saves `HFTokenizer('openai/clip-vit-large-patch14')` for OpenCLIP's default
tokenizer), written offline from bigclip's copy of the same vocabulary (`bigclip.data.bpe_tokenizer`).

The ids are OpenCLIP's: the 256 byte characters, the same with `</w>`, one token per merge,
then the start and end of text, 49,408 in all. Hugging Face spells the two special tokens
`<|startoftext|>` and `<|endoftext|>`; OpenCLIP spells them `<start_of_text>` and
`<end_of_text>` (same ids).
"""

from __future__ import annotations

import json

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
