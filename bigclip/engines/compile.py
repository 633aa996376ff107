"""--torchcompile: each residual block compiled on its own, before sharding (torchtitan's order),
with OpenCLIP main's --torchcompile-mode and --torchcompile-backend passed to torch.compile.

torch checks a mode or backend name as soon as it is given (no tracing yet), so a misspelt one
fails here, while the engine is built, naming the flag and what torch accepts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigclip.config import ModelConfig
from bigclip.errors import ConfigError


def compile_options(cfg: ModelConfig) -> dict[str, Any]:
    options = {"mode": cfg.torchcompile_mode, "backend": cfg.torchcompile_backend}
    return {k: v for k, v in options.items() if v}  # unset: torch's defaults (inductor, "default")


def compile_blocks(blocks: list[nn.Module], cfg: ModelConfig, *, forward_only: bool = False) -> None:
    """`forward_only`: compile each block's forward, leaving the module's hooks eager (DeepSpeed's:
    dynamo skips its hook functions, so compiling them would break every block's graph)."""
    options = compile_options(cfg)
    for block in blocks:
        try:
            if forward_only:
                block.forward = torch.compile(block.forward, **options)
            else:
                block.compile(**options)
        except RuntimeError as e:  # torch's InvalidBackend, or "Unrecognized mode=..."
            flags = " ".join(f"--torchcompile-{k} {v}" for k, v in options.items())
            raise ConfigError(f"{flags}: {e}") from e
