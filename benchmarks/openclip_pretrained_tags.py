"""Write bigclip/models/pretrained_tags.json: OpenCLIP's `--pretrained` tags for bigclip's models.

  PYTHONPATH=$PWD python benchmarks/openclip_pretrained_tags.py [--check]

Reads the table (`_PRETRAINED`) of the installed OpenCLIP's `open_clip/pretrained.py` without
importing the package `open_clip` (its __init__ imports torchvision), keeps the entries of the
models bigclip bundles and of their `-quickgelu` variants, and writes them unchanged (tuples as
JSON lists). Run it again when bigclip moves to a newer OpenCLIP; tests/test_pretrained_tags.py
checks the shipped file against the installed OpenCLIP. `--check` only compares.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.openclip_ref import open_clip_pretrained_module  # noqa: E402

from bigclip.models.pretrained_tags import TABLE_PATH, bundled_tag_models  # noqa: E402


def openclip_table() -> dict[str, dict[str, dict]]:
    """OpenCLIP's entries for bigclip's models, as JSON values (tuples become lists)."""
    table = open_clip_pretrained_module()._PRETRAINED
    return {name: json.loads(json.dumps(table[name])) for name in bundled_tag_models() if name in table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file, write nothing")
    args = parser.parse_args()
    table = openclip_table()
    text = json.dumps(table, indent=1) + "\n"
    if args.check:
        same = TABLE_PATH.read_text() == text
        print("up to date" if same else f"{TABLE_PATH} differs from the installed OpenCLIP's table")
        return 0 if same else 1
    TABLE_PATH.write_text(text)
    count = sum(len(tags) for tags in table.values())
    print(f"wrote {count} tags for {len(table)} models to {os.path.relpath(TABLE_PATH, ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
