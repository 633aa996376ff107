"""Hugging Face tokenizers in the layouts OpenCLIP's configs name, saved as transformers saves
them: BERT's (CLIPA's bert-base-uncased) and XLM-R's (MetaCLIP 2's XLM-V), on a small vocabulary."""

from __future__ import annotations

from pathlib import Path

from support.openclip_ref import transformers_package

WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "cat",
    "dog",
    "small",
    "large",
    "red",
    "blue",
    "green",
    "circle",
    "square",
    "triangle",
    "on",
    "at",
    "top",
    "left",
    "right",
    "background",
]


def saved(folder: Path, tokenizer, **special: str) -> Path:
    """`tokenizers`' object saved as transformers saves a fast tokenizer (AutoTokenizer loads it)."""
    transformers = transformers_package()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(folder)
    (folder / "config.json").write_text("{}")  # a Hub repository's model config: AutoTokenizer reads it
    return folder


def bert_folder(folder: Path) -> Path:
    """A WordPiece tokenizer in BERT's layout ([CLS] ... [SEP], padding 0), as CLIPA's bert-base-uncased."""
    transformers_package()
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", ",", "!", "&", "-", "_"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return saved(folder, tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]")


def eos_folder(folder: Path) -> Path:
    """A tokenizer in XLM-R's layout (<s>=0 ... </s>=2, padding 1), as MetaCLIP 2's XLM-V."""
    transformers_package()
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return saved(folder, tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
