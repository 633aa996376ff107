"""Where a rank's objects of a checkpoint live: the name prefix each rank writes under.

DCP names rank R's files `__R_N.distcp`; on S3 bigclip's writer puts every rank under a key
prefix of its own (`<hex>/__R_`, s3torchconnector's HexPrefixStrategy: s3_dcp_writer.py), since
S3 limits requests per prefix. A checkpoint records its writer's rule (`rule_of`) in its
manifest, so a reader finds rank R's objects (its record, rank_record.py) from the rule, the
rank and the world size alone, without a listing of every rank's objects.
"""

from __future__ import annotations

from typing import Any

from bigclip.errors import StorageError

FLAT = ""  # DCP's own names, `__R_`
HEX = "hex4"  # HexPrefixStrategy(min_prefix_length=4, prefix_count=world size): `<hex>/__R_`
HEX_DIGITS = 4


def rule_of(writer: Any) -> str:
    """The prefix rule of a DCP writer (bigclip's S3 writer names its own; DCP's is flat)."""
    return getattr(writer, "prefix_rule", FLAT)


def prefix(rule: str, rank: int, world_size: int) -> str:
    """Rank `rank`'s prefix under `rule` in a checkpoint saved at `world_size` ranks."""
    if rule == FLAT:
        return f"__{rank}_"
    if rule == HEX:
        digits, room = 1, 16
        while room < world_size:  # as s3torchconnector sizes it: enough digits for every prefix
            digits, room = digits + 1, room * 16
        hexed = format(rank % max(1, world_size), f"0{max(digits, HEX_DIGITS)}x")
        return f"{hexed[::-1]}/__{rank}_"  # its fastest-changing digit first
    raise StorageError(f"this checkpoint names its ranks' objects by rule {rule!r}, unknown to this bigclip")
