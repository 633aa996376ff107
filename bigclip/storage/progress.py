"""Progress bars for the offline tools (tqdm, on stderr) and human-readable byte counts, both ways
(`human_bytes` writes them, `parse_size` reads the sizes users give, e.g. --max-shard-size 5GB)."""

from __future__ import annotations

import re
import sys

from tqdm import tqdm

from bigclip.errors import ConfigError

NON_TTY_INTERVAL_S = 30.0  # in CI logs and files a redrawn bar is noise: one line every 30 s
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '512MiB' -> 2**29 (decimal and binary units, as Hugging Face)."""
    match = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def progress_bar(total: float | None, *, label: str, unit: str = "B", enabled: bool = True) -> tqdm:
    """A bar over `total` units (None or 0: unknown), redrawn in place on a terminal.

    Bytes are shown with decimal prefixes (kB, MB, GB), as `human_bytes` prints them."""
    tty = sys.stderr.isatty()
    return tqdm(
        total=total or None,
        desc=label,
        unit=unit,
        unit_scale=unit == "B",
        disable=not enabled,
        file=sys.stderr,
        mininterval=0.2 if tty else NON_TTY_INTERVAL_S,
        dynamic_ncols=tty,
        leave=True,
    )
