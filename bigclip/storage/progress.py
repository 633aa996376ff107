"""Progress bars for the offline tools (tqdm, on stderr) and human-readable byte counts."""

from __future__ import annotations

import sys

from tqdm import tqdm

NON_TTY_INTERVAL_S = 30.0  # in CI logs and files a redrawn bar is noise: one line every 30 s


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
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
