"""Count what would make the host wait for the device, on a CPU where nothing does.

Every read of a device value funnels through `aten._local_scalar_dense` (`.item()`, `bool(t)`,
`float(t)`, `int(t)`, `if t:`), which a TorchDispatchMode sees; so do the ops whose output shape
depends on values (`nonzero`, boolean-mask indexing, `masked_select`, `unique`,
`repeat_interleave` without `output_size`), which read a count back. `.tolist()`, `.numpy()`
and `.cpu()` copy without a dispatch on a CPU tensor, so a TorchFunctionMode counts those.
Each event is recorded with the innermost frames of bigclip (or the library) that caused it.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import traceback
from collections.abc import Iterator

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = {"_local_scalar_dense"}
DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
}
COPIES_TO_HOST = {"tolist", "numpy", "cpu"}


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec and spec.origin else None


# The packages' own folders, not name fragments: a checkout in a folder named bigclip puts
# "/bigclip/" in every path of its venv (torch's own frames would then count as bigclip's).
WATCHED = tuple(
    d for d in map(_package_dir, ("bigclip", "deepspeed", "torch.optim", "torch.distributed.fsdp")) if d
)


def call_site(skip: int = 3) -> str:
    """The three innermost frames in bigclip or a library it drives, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-skip] if f.filename.startswith(WATCHED)]
    return " <- ".join(
        f"{f.filename.split('site-packages/')[-1].split('/fast/')[-1]}:{f.lineno}" for f in frames[-3:][::-1]
    )


class _Dispatch(TorchDispatchMode):
    def __init__(self, events: collections.Counter) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.__name__.split(".")[0]
        if name in READS or name in DATA_DEPENDENT:
            self.events[(name, call_site())] += 1
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, events: collections.Counter) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if getattr(func, "__name__", "") in COPIES_TO_HOST:
            self.events[(func.__name__, call_site())] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_syncs() -> Iterator[collections.Counter]:
    """Within the block, a Counter of (op, call site) -> how many times it would sync a device."""
    events: collections.Counter = collections.Counter()
    with _Function(events), _Dispatch(events):
        yield events
