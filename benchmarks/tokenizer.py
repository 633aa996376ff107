"""Tokenizer speed: bigclip's OpenCLIP BPE against OpenCLIP's own SimpleTokenizer, side by side.

  PYTHONPATH=$PWD python benchmarks/tokenizer.py [--captions 20000] [--passes 3]

Both tokenize the same captions into the same ids (checked here too), one caption per call as
a data worker does, each tokenizer with its own warm word cache; passes alternate between the
two so load on a shared box hits both alike. Caption sets: LAION-like English alt-texts (ASCII,
the common case, where bigclip skips ftfy), and the same with accents, CJK, emoji and HTML
entities mixed in (every caption goes through ftfy).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from support.openclip_ref import open_clip_tokenizer_module  # noqa: E402

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.data.bpe_tokenizer import ClipBpeTokenizer  # noqa: E402

NOUNS = [
    "dog",
    "cat",
    "car",
    "house",
    "tree",
    "beach",
    "mountain",
    "city",
    "street",
    "woman",
    "man",
    "child",
    "table",
    "chair",
    "flower",
    "bird",
]
ADJECTIVES = [
    "red",
    "blue",
    "small",
    "large",
    "old",
    "new",
    "beautiful",
    "vintage",
    "modern",
    "wooden",
    "white",
    "black",
    "green",
]
EXTRA = ["café", "naïve", "東京", "写真", "🐶", "🌸", "&amp;", "&quot;", "Straße", "ñ", "—", "“quoted”"]


def captions(n: int, *, mixed: bool, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(ADJECTIVES + NOUNS) for _ in range(rng.randint(4, 18))]
        words += [f"{rng.randint(1, 3000)}", f"img_{i}"]  # numbers and rare tokens, as alt-texts have
        if mixed:
            words += rng.sample(EXTRA, 2)
        rng.shuffle(words)
        out.append(" ".join(words).capitalize() + rng.choice([".", "", "!", " - stock photo"]))
    return out


def per_caption_us(tokenizer, texts: list[str]) -> float:
    start = time.perf_counter()
    for text in texts:
        tokenizer(text)
    return (time.perf_counter() - start) / len(texts) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--captions", type=int, default=20000)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    ours, theirs = ClipBpeTokenizer(context_length=77), open_clip_tokenizer_module().SimpleTokenizer()
    rows = []
    for kind in ("ascii", "mixed"):
        texts = captions(args.captions, mixed=kind == "mixed")
        assert ours(texts[:2000]).equal(theirs(texts[:2000])), "ids differ from OpenCLIP's"
        times: dict[str, list[float]] = {"bigclip": [], "open_clip": []}
        for _ in range(args.passes):
            times["open_clip"].append(per_caption_us(theirs, texts))
            times["bigclip"].append(per_caption_us(ours, texts))
        best = {k: min(v) for k, v in times.items()}
        rows.append({"captions": kind, "open_clip_us": best["open_clip"], "bigclip_us": best["bigclip"],
                     "speedup": best["open_clip"] / best["bigclip"]})  # fmt: skip
    print_table(rows)
    load = os.getloadavg()
    write_results("tokenizer", rows, captions=args.captions, passes=args.passes, load_average=list(load))


if __name__ == "__main__":
    main()
