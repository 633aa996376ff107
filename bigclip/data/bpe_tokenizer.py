"""OpenCLIP's (OpenAI CLIP's) byte-level BPE tokenizer: the same ids for every string whose words
(runs of letters) are under MAX_WORD_CHARS long, that is every real text.

Why bigclip has its own copy instead of importing `open_clip.tokenizer`: importing the package
`open_clip` runs its `__init__`, which imports torchvision (no CPU build where bigclip trains
on CPU), and a pip dependency on open_clip_torch would pull torchvision, timm and
huggingface-hub into every install, since pip cannot declare "without its dependencies". So
the algorithm is reimplemented here (it is short) and the vocabulary file ships inside bigclip
(`bpe_simple_vocab_16e6.txt.gz`, byte for byte OpenAI's, MIT licence, Copyright (c) 2021
OpenAI): no network, no torchvision. `tests/test_tokenizer_openclip.py` checks the ids equal
OpenCLIP's own module on thousands of generated strings (unicode, emoji, CJK, HTML entities,
control characters, over-long texts, the special tokens written out).

Pipeline, as OpenCLIP's `SimpleTokenizer(clean='lower')`: ftfy.fix_text, HTML-unescape twice,
collapse whitespace, lower-case; split with CLIP's regex (the special tokens written in a text
map to their ids, as in OpenCLIP); each piece's UTF-8 bytes mapped to printable characters;
BPE merges by rank; ids looked up. Rows are `[<start_of_text>, ids..., <end_of_text>, 0...]`,
truncated to the context length with `<end_of_text>` kept last.

Speed: workers tokenize every caption. Merges are cached per word (as OpenCLIP does), bounded
so a worker's memory stays flat over billions of captions; ftfy, the costliest step, is skipped
for printable ASCII without '&', on which it is the identity (checked by a test); a caption
stops being split once its row is full, a word's merges come from a heap (n log n, where
OpenCLIP's rounds are n squared) and only a word's first MAX_WORD_CHARS are merged, so a damaged
megabyte-long caption costs a worker its cleaning (linear; ftfy's seconds on non-ASCII junk), not
the hours OpenCLIP's merges would take.
"""

from __future__ import annotations

import gzip
import heapq
import html
from functools import cache
from importlib import resources

import ftfy
import regex
import torch

from bigclip.errors import ConfigError

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
SPECIAL_TOKENS = ("<start_of_text>", "<end_of_text>")
MERGES = 49152 - 256 - 2  # OpenAI's vocabulary: 256 bytes x 2 (mid/end of word), merges, 2 specials
VOCAB_SIZE = 2 * 256 + MERGES + len(SPECIAL_TOKENS)  # 49408
MAX_WORD_CHARS = 2048  # characters of one piece merged; OpenCLIP's ids are the same for any real text
CACHE_WORDS = 200_000  # a few tens of MB per worker at most; frequent words come back at once
_PATTERN = regex.compile(
    "|".join(SPECIAL_TOKENS) + r"""|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE,
)


@cache
def byte_to_unicode() -> dict[int, str]:
    """OpenAI's reversible map of the 256 bytes to printable characters (no whitespace/control)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@cache
def _tables() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """(piece -> id, merge pair -> rank), read once per process from the shipped vocabulary."""
    with resources.files("bigclip.data").joinpath(VOCAB_FILE).open("rb") as f:
        lines = gzip.decompress(f.read()).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : MERGES + 1]]
    units = list(byte_to_unicode().values())
    vocab = units + [u + "</w>" for u in units] + ["".join(m) for m in merges] + list(SPECIAL_TOKENS)
    return {piece: i for i, piece in enumerate(vocab)}, {m: r for r, m in enumerate(merges)}


def clean_whitespace(text: str) -> str:
    """OpenCLIP's 'whitespace' cleaning: ftfy, HTML unescape (twice), whitespace collapsed."""
    if not (text.isascii() and text.isprintable() and "&" not in text):
        text = ftfy.fix_text(text)  # the identity on printable ASCII without entities
    text = html.unescape(html.unescape(text)).strip()
    return " ".join(text.split())


def clean(text: str) -> str:
    """OpenCLIP's 'lower' cleaning: its 'whitespace' cleaning, lower-cased."""
    return clean_whitespace(text).lower()


def pad_rows(rows: list[list[int]], *, context_length: int, eot_token_id: int) -> torch.Tensor:
    """OpenCLIP's layout: `LongTensor[N, context_length]`, zero-padded; a row longer than the
    context keeps its first tokens with the end token in the last slot (the model pools there)."""
    out = torch.zeros(len(rows), context_length, dtype=torch.long)
    for i, ids in enumerate(rows):
        if len(ids) > context_length:
            ids = [*ids[: context_length - 1], eot_token_id]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


class ClipBpeTokenizer:
    """OpenCLIP's `SimpleTokenizer` for CLIP models; picklable (tables reload in each process)."""

    name = "open_clip"

    def __init__(self, *, context_length: int = 77) -> None:
        if context_length < 2:
            raise ConfigError(f"context_length must be at least 2 (start + end tokens), got {context_length}")
        self.context_length = context_length
        self._setup()

    def _setup(self) -> None:
        self.encoder, self.ranks = _tables()
        self.vocab_size = len(self.encoder)
        self.sot_token_id, self.eot_token_id = (self.encoder[t] for t in SPECIAL_TOKENS)
        self._bytes = byte_to_unicode()
        self._cache: dict[str, tuple[int, ...]] = {t: (self.encoder[t],) for t in SPECIAL_TOKENS}

    def __getstate__(self) -> dict:
        return {"context_length": self.context_length}  # tables are rebuilt, not pickled (MBs)

    def __setstate__(self, state: dict) -> None:
        self.context_length = state["context_length"]
        self._setup()

    def bpe(self, word: str) -> list[str]:
        """Merge a byte-encoded word's characters by rank, as OpenCLIP does (each round merges every
        occurrence of the best pair, left to right), but from a heap of the adjacent pairs: n log n
        where OpenCLIP's rounds are n squared (a 16,000-letter word of a damaged caption took 38 s).
        Popping (rank, position) is the same order: a pair a merge creates always ranks after the
        merge that made it (merges were learned in that order), so no round is interleaved."""
        parts: list[str | None] = [*word[:-1], word[-1] + "</w>"]
        ranks, n = self.ranks, len(parts)
        after = [*range(1, n), -1]  # the next live part's index
        before = list(range(-1, n - 1))
        heap = [(r, i) for i in range(n - 1) if (r := ranks.get((parts[i], parts[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = after[i]
            if parts[i] is None or j < 0 or ranks.get((parts[i], parts[j])) != rank:
                continue  # stale: a merge changed this pair since it was pushed
            parts[i], parts[j] = parts[i] + parts[j], None  # type: ignore[operator]
            after[i] = after[j]
            if after[i] >= 0:
                before[after[i]] = i
            for left, right in ((before[i], i), (i, after[i])):
                if left >= 0 and right >= 0 and (r := ranks.get((parts[left], parts[right]))) is not None:
                    heapq.heappush(heap, (r, left))
        return [p for p in parts if p is not None]

    def _word_ids(self, piece: str) -> tuple[int, ...]:
        # No word is this long; a damaged caption's run of letters is, and its first row of ids is all
        # a row keeps: merging a megabyte of one "word" would take a worker seconds even as n log n.
        word = "".join(self._bytes[b] for b in piece[:MAX_WORD_CHARS].encode("utf-8"))
        ids = self._cache.get(word)
        if ids is None:
            ids = tuple(self.encoder[p] for p in self.bpe(word))
            if len(self._cache) >= CACHE_WORDS:
                self._cache = {t: (self.encoder[t],) for t in SPECIAL_TOKENS}
            self._cache[word] = ids
        return ids

    def encode(self, text: str, *, limit: int | None = None) -> list[int]:
        """Token ids of one text, without the start and end tokens; with `limit`, at least the first
        `limit` of them (or all), the rest not computed."""
        ids: list[int] = []
        for piece in _PATTERN.finditer(clean(text)):
            ids.extend(self._word_ids(piece.group()))
            if limit is not None and len(ids) >= limit:
                break
        return ids

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        # a row keeps context_length - 2 ids; one more tells it was cut (a long caption stops there)
        limit = self.context_length - 1
        rows = [[self.sot_token_id, *self.encode(t, limit=limit), self.eot_token_id] for t in texts]
        return pad_rows(rows, context_length=self.context_length, eot_token_id=self.eot_token_id)
