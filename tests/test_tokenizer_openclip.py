"""bigclip's default tokenizer gives OpenCLIP's ids, compared with OpenCLIP's own tokenizer module.

The reference is `open_clip/tokenizer.py` from the installed open_clip_torch (loaded without the
package's __init__, which imports torchvision). Missing, it skips locally and fails under CI.
"""

from __future__ import annotations

import pickle
import random
import string

import ftfy
import pytest
import torch
from support.openclip_ref import open_clip_tokenizer_module

from bigclip.data import bpe_tokenizer
from bigclip.data.bpe_tokenizer import VOCAB_SIZE, ClipBpeTokenizer, clean
from bigclip.data.tokenizer import build_tokenizer

WORDS = ["a", "photo", "of", "the", "red", "circle", "on", "blue", "square", "small", "large", "dog", "cat's",
         "they're", "don't", "42", "3.14", "x-ray"]  # fmt: skip
PIECES = {
    "accents": ["café", "naïve", "Ærøskøbing", "Straße", "ñandú", "Ünïcödé", "ça va", "İstanbul", "ǅ"],
    "scripts": ["Ελληνικά", "русский", "עברית", "العربية", "हिन्दी", "ภาษาไทย", "한국어", "ქართული"],
    "emoji": ["🐱", "🚀🔥", "👩\u200d💻", "👍🏽", "🇫🇷", "❤️", "🫠", "☃"],
    "html": ["&amp;", "&amp;amp;", "&lt;b&gt;", "&#39;", "&#x27;", "&nbsp;", "&quot;hi&quot;", "&copy;", "&bogus;"],
    "numbers": ["0", "1234567", "3.14159", "1e-3", "٣٤٥", "１２３", "½", "²", "ⅷ", "-7"],
    "punctuation": ["!!!", "?!", "...", "—", "–", "«»", "“quoted”", "‘single’", "#hashtag", "@user", "(x)", "[]{}"],
    "whitespace": [" ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2009", "  \t\n "],
    "control": ["\x00", "\x07", "\x1b[31mred\x1b[0m", "\x7f", "\x85", "\x9d", "\u200b", "\ufeff", "\u202e"],
    "mojibake": ["â€™", "Ã©tÃ©", "Ã¼ber", "â€œhelloâ€\x9d", "Ã\xa0 la"],
    "special": ["<start_of_text>", "<end_of_text>", "<END_OF_TEXT>", "<start_of_text", "</w>", "<|endoftext|>"],
    "forms": ["ｈｅｌｌｏ", "ﬁne", "e\u0301", "Å", "Ω", "ſ", "ß", "ǈ", "ﬀ"],
}  # fmt: skip


def cjk(rng: random.Random, n: int) -> str:
    blocks = [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3)]
    return "".join(chr(rng.randint(*rng.choice(blocks))) for _ in range(n))


def generated_strings(n: int = 2400, seed: int = 12) -> list[str]:
    """Edge cases first, then random mixtures of every kind of piece, some far over 77 tokens."""
    rng = random.Random(seed)
    out = ["", " ", "\t\n", "a", "A", "'s", "x" * 400, " ".join(WORDS * 20)]
    out += [p for pieces in PIECES.values() for p in pieces]
    kinds = list(PIECES)
    while len(out) < n:
        parts = []
        for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 40, 120])):
            roll = rng.random()
            if roll < 0.35:
                parts.append(rng.choice(WORDS))
            elif roll < 0.45:
                parts.append(cjk(rng, rng.randint(1, 6)))
            elif roll < 0.55:
                parts.append("".join(rng.choice(string.printable) for _ in range(rng.randint(1, 8))))
            elif roll < 0.6:
                parts.append(chr(rng.randint(0x20, 0x2FFF)))
            else:
                parts.append(rng.choice(PIECES[rng.choice(kinds)]))
        sep = rng.choice([" ", "", "  ", "\n", ", "])
        text = sep.join(parts)
        out.append(text.upper() if rng.random() < 0.1 else text)
    return out


@pytest.fixture(scope="module")
def reference():
    return open_clip_tokenizer_module()


def test_ids_equal_openclips_on_generated_strings(reference):
    texts = generated_strings()
    assert len(texts) >= 2000
    theirs = reference.SimpleTokenizer()
    for context_length in (77, 12):  # 12: most strings truncated
        ours = build_tokenizer("open_clip", context_length=context_length, vocab_size=VOCAB_SIZE)
        a, b = ours(texts), theirs(texts, context_length=context_length)
        mismatches = [t for t, same in zip(texts, (a == b).all(dim=1).tolist()) if not same]
        assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:5]!r}"
        assert (a[:, -1] == 49407).sum() > 100  # truncation with the end token kept, exercised


def test_layout_special_tokens_and_truncation(reference):
    tok = ClipBpeTokenizer(context_length=8)
    assert (tok.vocab_size, tok.sot_token_id, tok.eot_token_id) == (49408, 49406, 49407)
    ids = tok(["a red circle", " ".join(["word"] * 30), ""])
    assert ids[0].tolist() == [49406, 320, 736, 7117, 49407, 0, 0, 0]  # OpenAI CLIP's ids
    assert ids[1, 0] == 49406 and ids[1, -1] == 49407 and ids[1].argmax() == 7
    assert ids[2].tolist() == [49406, 49407, 0, 0, 0, 0, 0, 0]
    assert reference.SimpleTokenizer().encode("a red circle") == [320, 736, 7117]


def test_ftfy_is_skipped_only_where_it_changes_nothing():
    """The fast path: printable ASCII without '&' passes through ftfy unchanged."""
    rng = random.Random(3)
    alphabet = string.printable.replace("&", "")[:-5]  # no '&', no \t\n\r\x0b\x0c
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(3000)]
    texts += ["<b>bold</b>", "a;b", "#x27;", "lt;", "'quoted'", '"double"', "\\u00e9"]
    assert all(ftfy.fix_text(t) == t for t in texts)
    assert clean("Caf\u00e9 &amp; cr\u00e8me") == "café & crème"


def test_pickled_tokenizer_gives_the_same_ids_and_stays_small():
    tok = ClipBpeTokenizer(context_length=16)
    tok("warm the cache with some words")
    data = pickle.dumps(tok)
    assert len(data) < 1000  # the tables are rebuilt in the worker, not pickled
    assert torch.equal(pickle.loads(data)("hello wörld 🐱"), tok("hello wörld 🐱"))


def test_word_cache_is_bounded_and_ids_unchanged(monkeypatch):
    tok = ClipBpeTokenizer(context_length=77)
    words = [f"zq{i}x{i * 7}" for i in range(300)]
    expected = [tok.encode(w) for w in words]
    monkeypatch.setattr(bpe_tokenizer, "CACHE_WORDS", 50)
    fresh = ClipBpeTokenizer(context_length=77)
    assert [fresh.encode(w) for w in words] == expected
    assert len(fresh._cache) <= 50 + 2
    assert fresh.encode("<start_of_text>") == [49406]  # the special tokens survive a reset


def test_long_words_merge_as_openclips(reference):
    """Single pieces of thousands of characters (a damaged caption, a run of CJK without spaces)
    merge to OpenCLIP's ids in full, not only the first 77: the heap's order is OpenCLIP's rounds'."""
    rng = random.Random(5)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(1500)), "a" * 1200, "ab" * 700,
             "la" * 333 + "x", cjk(rng, 400), "".join(rng.choice("!?#$%&*+-/<=>@^_|~") for _ in range(900))]  # fmt: skip
    theirs, ours = reference.SimpleTokenizer(), ClipBpeTokenizer()
    for word in words:
        assert ours.encode(word) == theirs.encode(word), word[:40]


@pytest.mark.timeout(120)  # OpenCLIP's quadratic merges would take hours here: a failure, not a hang
def test_a_megabyte_caption_gives_the_row_of_its_first_words():
    """Splitting stops once a row is full (77 ids), so a damaged caption costs its first words."""
    tok = ClipBpeTokenizer()
    head = " ".join(WORDS * 10)  # over 77 tokens already
    tail = "".join(random.Random(1).choices(string.ascii_letters + " ", k=1 << 20))
    assert torch.equal(tok(head + " " + tail), tok(head))
    # one megabyte-long run of letters: the first MAX_WORD_CHARS are merged (over 77 ids already)
    assert torch.equal(tok("q" * (1 << 20)), tok("q" * bpe_tokenizer.MAX_WORD_CHARS))
