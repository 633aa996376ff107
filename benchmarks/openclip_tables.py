"""Write OpenCLIP's tables bigclip ships: its `--pretrained` tags for bigclip's models
(bigclip/models/pretrained_tags.json) and its configs of other towers (openclip_other_towers.json).

  PYTHONPATH=$PWD python benchmarks/openclip_tables.py [--check]

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

from bigclip.models.named_configs import OTHER_TOWERS_PATH  # noqa: E402
from bigclip.models.pretrained_tags import TABLE_PATH, bundled_tag_models  # noqa: E402


def openclip_table() -> dict[str, dict[str, dict]]:
    """OpenCLIP's entries for bigclip's models, as JSON values (tuples become lists)."""
    table = open_clip_pretrained_module()._PRETRAINED
    return {name: json.loads(json.dumps(table[name])) for name in bundled_tag_models() if name in table}


def other_tower_table() -> dict[str, list[str]]:
    """OpenCLIP's configs whose towers are not its own ViT and text transformers: name -> the towers
    (bigclip refuses those names saying which; models/named_configs.py)."""
    from support.openclip_ref import open_clip_config, open_clip_config_names

    from bigclip.models.named_configs import other_towers

    table = {}
    for name in open_clip_config_names():
        raw = open_clip_config(name)
        towers = other_towers(raw) or (
            ["OpenCLIP's custom text tower layout"] if raw.get("custom_text") else []
        )
        if towers:
            table[name] = towers
    return table


def write_or_check(path: Path, table: dict, *, check: bool, what: str) -> bool:
    text = json.dumps(table, indent=1) + "\n"
    if check:
        same = path.read_text() == text
        print(f"{path.name}: " + ("up to date" if same else "differs from the installed OpenCLIP's"))
        return same
    path.write_text(text)
    print(f"wrote {what} to {os.path.relpath(path, ROOT)}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file, write nothing")
    args = parser.parse_args()
    tags = openclip_table()
    ok = write_or_check(TABLE_PATH, tags, check=args.check,
                        what=f"{sum(map(len, tags.values()))} tags for {len(tags)} models")  # fmt: skip
    others = other_tower_table()
    ok &= write_or_check(
        OTHER_TOWERS_PATH, others, check=args.check, what=f"{len(others)} other-tower configs"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
