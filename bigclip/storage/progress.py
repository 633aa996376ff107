"""A bytes-done progress bar on stderr (redrawn in place on a terminal, a line per 10% elsewhere)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


class Progress:
    def __init__(self, total: int, *, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.label, self.enabled = total, label, enabled  # total 0: unknown
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty and now - self._last_draw >= 0.2:
            self._last_draw = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        decile = 10 * self.done // self.total if self.total else int(now - self.started) // 30
        if not self.tty and decile > self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line(now) + "\n")

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + self._line(time.monotonic()) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-6)
        rate = self.done / elapsed
        if not self.total:
            return f"{self.label} {human_bytes(self.done)}  {human_bytes(rate)}/s"
        fraction = min(self.done / self.total, 1.0)
        filled = int(30 * fraction)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        return (
            f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%} "
            f"{human_bytes(self.done)} / {human_bytes(self.total)}  {human_bytes(rate)}/s  eta {eta:.0f}s"
        )
