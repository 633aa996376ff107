"""What the run is doing now, said in the log: a line when a long phase starts and when it ends, a
heartbeat while it lasts, and what a stop signal does during it.

    with phase("reading checkpoint s3://b/run/step_00001000", on_stop=OnStop.EXIT_NOW):
        ...              # "reading checkpoint ...: started", then ": done in 31.2 s"
    first = begin("the first step", on_stop=OnStop.EXIT_NOW, detail="...")   ...   first.end()

Phases nest (an upload waited for while training): the innermost is current and inherits what
a stop does from the phases around it unless it says. With none open, the run is starting up.
The main thread opens and closes phases; the signal watcher (signals.py) reads the current one
from its own thread the moment a signal arrives, and gives the open phases their heartbeats: an
announced phase says it is still running every HEARTBEAT_S, a quiet one (no start line, e.g. a
save that is usually quick) once it has taken QUIET_S, then every HEARTBEAT_S. Opening or closing
a phase also runs the transition hooks (signals.py's: a stop that is due now raises there).
Standard library only: signals.py imports it before torch.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

LOGGER_NAME = "bigclip"  # train/metrics.py's logger (that module imports torch)
HEARTBEAT_S = 60.0
QUIET_S = 10.0  # a quiet phase says it is still running once it takes this long
START_UP = "start-up"


class OnStop(enum.Enum):
    """What a stop signal does during a phase."""

    EXIT_NOW = "exit now"  # no step taken since the run started: nothing to checkpoint
    AT_BOUNDARY = "at the next step boundary"  # checkpoint there, then exit
    FINISH = "finish"  # training is over: the run completes and exits


@dataclass
class Phase:
    name: str
    on_stop: OnStop | None = None  # None: as the phase around it
    detail: str = ""  # said in the start line
    progress: Callable[[], str] | None = None  # said in heartbeats and the end line
    announced: bool = True  # a start line (then an end line too)
    quiet_s: float = math.inf  # unannounced: say it still runs after this long
    started: float = field(default_factory=time.monotonic)
    beats: int = 0
    ended: bool = False

    def __post_init__(self) -> None:
        self.next_beat = self.started + (HEARTBEAT_S if self.announced else self.quiet_s)

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def beat(self, now: float) -> str | None:
        """The heartbeat line if one is due at `now` (the watcher thread calls this)."""
        if self.ended or now < self.next_beat:
            return None
        self.beats += 1
        self.next_beat = now + HEARTBEAT_S
        return f"{self.name}: still running after {self.elapsed(now):.0f} s{self._progress()}"

    def end(self) -> float:
        """Close this phase (and any left open inside it); returns its seconds. Logs the end line
        if it said anything before."""
        seconds = self.elapsed()
        if not self.ended:
            self.ended = True
            if self in _STACK:
                del _STACK[_STACK.index(self) :]
            if self.announced or self.beats:
                say(f"{self.name}: done in {seconds:.1f} s{self._progress()}")
        _transition()
        return seconds

    def _progress(self) -> str:
        text = self.progress() if self.progress is not None else ""
        return f" ({text})" if text else ""


_STACK: list[Phase] = []
_HOOKS: list[Callable[[], None]] = []
_START = [time.monotonic()]  # when the run started (signals.py resets it at install)


def begin(
    name: str, *, on_stop: OnStop | None = None, detail: str = "", progress: Callable[[], str] | None = None,
    announce: bool = True, quiet_s: float = math.inf, base: bool = False,
) -> Phase:  # fmt: skip
    """Open a phase (inside the current one; `base`: closing every open one first)."""
    if base:
        for open_phase in reversed(list(_STACK)):
            open_phase.ended = True
        _STACK.clear()
    opened = Phase(name, on_stop, detail, progress, announced=announce, quiet_s=quiet_s)
    _STACK.append(opened)
    if announce:
        say(f"{name}: started" + (f" ({detail})" if detail else ""))
    _transition()
    return opened


@contextmanager
def phase(name: str, **options: object) -> Iterator[Phase]:
    """`begin` ... `end` around a block; on an exception the phase closes without its end line."""
    opened = begin(name, **options)  # type: ignore[arg-type]
    try:
        yield opened
    except BaseException:
        opened.ended = True
        if opened in _STACK:
            del _STACK[_STACK.index(opened) :]
        raise
    opened.end()


def current() -> Phase | None:
    return _STACK[-1] if _STACK else None


def current_name() -> str:
    return _STACK[-1].name if _STACK else START_UP


def stop_rule() -> OnStop:
    """What a stop does now: the innermost phase that says, else start-up's (exit now)."""
    for open_phase in reversed(list(_STACK)):
        if open_phase.on_stop is not None:
            return open_phase.on_stop
    return OnStop.EXIT_NOW


def heartbeat(now: float) -> str | None:
    """The line due at `now`, from the innermost phase that has heartbeats."""
    for open_phase in reversed(list(_STACK)):
        if open_phase.announced or open_phase.quiet_s < math.inf:
            return open_phase.beat(now)
    return None


def since_start() -> float:
    return time.monotonic() - _START[0]


def reset() -> None:
    """A run starts: no phase open, the start-up clock at 0."""
    _STACK.clear()
    _START[0] = time.monotonic()


def add_transition_hook(hook: Callable[[], None]) -> None:
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def _transition() -> None:
    for hook in list(_HOOKS):
        hook()


def launcher_rank() -> int:
    """This process's rank as the launcher set it (before any process group exists)."""
    for variable in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


def exit_now(code: int) -> None:
    """Leave from a helper thread while the main one is stuck: flush the logs, skip the interpreter's
    shutdown (it would wait for the stuck thread); data workers follow by PR_SET_PDEATHSIG."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def say(text: str) -> None:
    """One line through the run's logger; before the logger is set up (the first seconds of
    start-up), on stdout in its format, on rank 0 only."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers:
        logger.info(text)
    elif launcher_rank() == 0:
        stamp = time.strftime("%Y-%m-%d,%H:%M:%S")
        print(f"{stamp} | INFO | {text}", file=sys.stdout, flush=True)
