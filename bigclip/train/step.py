"""One optimizer step, with OpenCLIP's `--accum-freq` feature caching.

With K micro-batches, features of all K are first computed without gradients and cached;
then each micro-batch is run again with gradients and its loss is taken against the cached
features of the others as negatives, so the contrastive batch is the full K x b local batch.
Gradients of pass j reach only micro-batch j's features, so their sum over j is exactly the
gradient of the full-batch loss. Two details make this exact rather than approximate:
  - the logit scale/bias keep their gradient only in the last pass (otherwise it is counted K
    times, as in OpenCLIP);
  - each re-run restores the RNG state of its cached pass, so patch dropout drops the same
    patches twice.
Gradient sync across ranks happens only in the last pass (`engine.no_sync` before it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from bigclip.engines.base import Engine, StepStats
from bigclip.errors import NonFiniteLossError

FEATURES = ("image_features", "text_features")


@dataclass
class StepOutput:
    loss: torch.Tensor  # this rank's loss, detached (reading it syncs the device: log sparingly)
    logit_scale: torch.Tensor
    stats: StepStats


def contrastive_loss(loss_fn: nn.Module, out: dict[str, torch.Tensor]) -> torch.Tensor:
    return loss_fn(out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"))


def train_step(
    engine: Engine,
    loss_fn: nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float,
) -> StepOutput:
    """Forward, backward and optimizer step over one or more micro-batches of (images, texts)."""
    if len(micro_batches) == 1:
        out = engine.forward(*micro_batches[0])
        loss = contrastive_loss(loss_fn, out)
        engine.backward(loss)
    else:
        out, loss = _accumulate(engine, loss_fn, micro_batches)
    stats = engine.step(lr=lr)
    return StepOutput(loss=loss.detach(), logit_scale=out["logit_scale"].detach(), stats=stats)


def _accumulate(
    engine: Engine, loss_fn: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rng_states, cached = [], []
    with torch.no_grad():
        for images, texts in micro_batches:
            rng_states.append(_rng_state(images.device))
            cached.append(engine.forward(images, texts))
    last = len(micro_batches) - 1
    for j, (images, texts) in enumerate(micro_batches):
        _set_rng_state(rng_states[j], images.device)
        with contextlib.nullcontext() if j == last else engine.no_sync():
            out = engine.forward(images, texts)
            merged = {
                k: torch.cat([out[k] if i == j else c[k] for i, c in enumerate(cached)]) for k in FEATURES
            }
            for k in ("logit_scale", "logit_bias"):
                if k in out:
                    merged[k] = out[k] if j == last else out[k].detach()
            loss = contrastive_loss(loss_fn, merged)
            engine.backward(loss)
    return out, loss


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def verify_inputs(loss_fn: nn.Module, *, step: int) -> None:
    """Collective: raise the loss's deferred input errors (non-finite features, logit scale or
    bias on any rank since the last call). One host read: call it where the loop reads the device
    anyway (log steps) and before a checkpoint is written, never every step."""
    verify = getattr(loss_fn, "verify", None)
    if verify is None:
        return
    try:
        verify()
    except NonFiniteLossError as e:
        raise NonFiniteLossError(f"by step {step}: {e}") from e
