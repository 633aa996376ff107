"""--torchcompile: each residual block compiled on its own, before sharding (torchtitan's order),
with OpenCLIP main's --torchcompile-mode and --torchcompile-backend passed to torch.compile.

torch checks a mode or backend name as soon as it is given (no tracing yet), so a misspelt one
fails here, while the engine is built, naming the flag and what torch accepts.

torch.compile compiles lazily: the blocks' graphs (forward, then backward) are built during the
first step, which can take minutes on a large model with inductor. So each compilation is said
in the log as it starts and ends (dynamo's compile callbacks), and `compile_activity()` counts
them for the first step's heartbeat and end line (train/trainer.py).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bigclip.config import ModelConfig
from bigclip.errors import ConfigError


@dataclass
class CompileActivity:
    """This process's torch.compile compilations, counted through dynamo's callbacks."""

    graphs: int = 0  # compilations finished
    seconds: float = 0.0  # spent in them
    started_at: float = 0.0  # the one under way (0: none)
    watching: bool = False

    def started(self, args: Any) -> None:
        self.started_at = time.monotonic()
        logging.getLogger("bigclip").info(
            f"torch.compile: compiling graph {self.graphs + 1} ({_trigger(args)}, frame {args.compile_id})"
        )

    def ended(self, args: Any) -> None:
        took = time.monotonic() - self.started_at if self.started_at else 0.0
        self.started_at = 0.0
        if sys.exc_info()[0] is not None:  # dynamo runs this in a `finally`: the compile raised
            logging.getLogger("bigclip").info(
                f"torch.compile: graph {self.graphs + 1} stopped after {took:.1f} s"
            )
            return
        self.graphs, self.seconds = self.graphs + 1, self.seconds + took
        logging.getLogger("bigclip").info(f"torch.compile: graph {self.graphs} compiled in {took:.1f} s")

    def text(self) -> str:
        """E.g. "torch.compile: 3 graph(s) compiled in 41 s; graph 4 compiling for 12 s"; empty before any."""
        parts = [f"{self.graphs} graph(s) compiled in {self.seconds:.0f} s"] if self.graphs else []
        if self.started_at:
            parts.append(f"graph {self.graphs + 1} compiling for {time.monotonic() - self.started_at:.0f} s")
        return "torch.compile: " + "; ".join(parts) if parts else ""


_ACTIVITY = CompileActivity()


def _trigger(args: Any) -> str:
    name = getattr(getattr(args, "callback_trigger", None), "name", "")
    return {"DYNAMO": "forward", "LAZY_BACKWARD": "backward"}.get(name, name.lower() or "graph")


def compile_activity() -> CompileActivity:
    """The counter, listening to dynamo from the first call on (once per process)."""
    if not _ACTIVITY.watching:
        from torch._dynamo import callback_handler  # torch's own hook for compile start/end

        callback_handler.register_start_callback(_ACTIVITY.started)
        callback_handler.register_end_callback(_ACTIVITY.ended)
        _ACTIVITY.watching = True
    return _ACTIVITY


def compile_options(cfg: ModelConfig) -> dict[str, Any]:
    options = {"mode": cfg.torchcompile_mode, "backend": cfg.torchcompile_backend}
    return {k: v for k, v in options.items() if v}  # unset: torch's defaults (inductor, "default")


def compile_blocks(blocks: list[nn.Module], cfg: ModelConfig, *, forward_only: bool = False) -> None:
    """`forward_only`: compile each block's forward, leaving the module's hooks eager (DeepSpeed's:
    dynamo skips its hook functions, so compiling them would break every block's graph)."""
    options = compile_options(cfg)
    compile_activity()
    for block in blocks:
        try:
            if forward_only:
                block.forward = torch.compile(block.forward, **options)
            else:
                block.compile(**options)
        except RuntimeError as e:  # torch's InvalidBackend, or "Unrecognized mode=..."
            flags = " ".join(f"--torchcompile-{k} {v}" for k, v in options.items())
            raise ConfigError(f"{flags}: {e}") from e
