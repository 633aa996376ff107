"""Contrastive losses across the data-parallel group: chunked (exact, flat memory) and baselines.

`build_loss(cfg, group=)` returns a module with `forward(image_features, text_features,
logit_scale, logit_bias=None) -> scalar`: this rank's L2-normalised features [n, dim],
`logit_scale` already exponentiated, `logit_bias` the SigLIP bias (ignored by CLIP).

Chunked (`--loss-chunk-size c > 0`, ChunkedContrastiveLoss): exact CLIP or SigLIP loss in
c x c tiles (contrastive_chunked.py) over features streamed between ranks
(exchange.py). Rank r returns L_r, the loss of its own rows (global loss = mean_r
L_r); after backward its features hold sum_r' dL_r'/d(features_r) and logit_scale/bias hold
dL_r/ds, so the engine's averaging of parameter gradients gives dL/dtheta exactly (OpenCLIP's
--local-loss --gather-with-grad convention, which the chunked loss always follows).

Memory bound (per rank, beyond its inputs; n local rows, N = world * n, d = embed dim, c chunk):
  ring (default)  O(n*(c + d)): fp32 gradients of its own features (2nd), 3n floats of
                  statistics, two payload chunks in flight (2cd), three fp32 accumulator chunks
                  (3c(d+1)) and a few c x c fp32 tiles (+2nd for an fp32 copy of bf16 inputs on
                  CPU). Nothing depends on the world size.
  allgather       O(N*d): every rank's text features plus an N x (d+1) fp32 gradient buffer.
  unchunked       O(n*N + N*d): OpenCLIP's two n x N logit matrices, their log-softmax and
                  gradients, and the gathered features.
Exchange choice, from benchmarks/loss_memory.py (rank 0 of 16, d = 1280, fp32, c = 512, CPU,
results/loss_memory.json; peak loss memory, and time relative to unchunked):
  global batch           8,192          32,768          65,536
  unchunked         160 MiB  1.00x  1364 MiB  1.00x  4776 MiB  1.00x
  ring               22 MiB  0.68x    38 MiB  0.62x    58 MiB  0.67x
  allgather          89 MiB  0.65x   345 MiB  0.64x   686 MiB  0.66x
The ring is the default: only it stays flat as the world grows (83x less than unchunked at
65,536, 12x less than allgather) at nearly the all-gather's compute time (within 5% here,
where the fake process group makes communication free; on GPUs its transfers overlap the tiles).
The all-gather makes fewer, larger collectives and remains selectable (--loss-exchange).
Both chunked variants beat the unchunked loss on time: one matmul per tile serves both CLIP
directions (4 tile matmuls per forward + backward against the baseline's 6), and tiles stay
in cache.

Unchunked (`--loss-chunk-size 0`): ClipLoss is OpenCLIP's ClipLoss, with its --local-loss and
--gather-with-grad meanings; SigLipLoss is OpenCLIP's SigLipLoss computed from all-gathered
(with gradient) text features, the same loss and gradients as its neighbour exchange.

Every loss first checks its inputs across ranks (checks.py): shape or dtype mismatches raise
ConfigError naming the rank, non-finite logits raise NonFiniteLossError, on all ranks together.
Without a host sync per step: after the first call, non-finite inputs are found by `verify()`,
which the training loop calls on log steps and before each checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bigclip.config import LossConfig
from bigclip.errors import ConfigError
from bigclip.ops.loss.checks import InputChecks
from bigclip.ops.loss.chunked import ChunkedContrastiveFunction, LossPlan
from bigclip.ops.loss.collectives import all_gather_single, reduce_scatter_single
from bigclip.ops.loss.exchange import EXCHANGES, world_of


class AllGatherWithGrad(torch.autograd.Function):
    """All-gather rows in forward; reduce-scatter (sum) the gradient in backward.

    The same collectives on every backend (torch.distributed.nn's all_gather emulates the
    reduce-scatter with an all-to-all plus a stack on gloo, which holds two more N x d buffers).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        ctx.group = group
        _, world = world_of(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        _, world = world_of(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_features(
    features: torch.Tensor, *, group: dist.ProcessGroup | None, with_grad: bool, keep_local_grad: bool
) -> torch.Tensor:
    """Concatenate every rank's features in rank order.

    with_grad: gradients flow to every rank's features (all-gather backward is a reduce-scatter).
    keep_local_grad: without with_grad, put this rank's own tensor back so its gradient flows.
    """
    rank, world = world_of(group)
    if world == 1:
        return features
    if with_grad:
        return AllGatherWithGrad.apply(features, group)
    gathered = [torch.empty_like(features) for _ in range(world)]
    dist.all_gather(gathered, features.detach().contiguous(), group=group)
    if keep_local_grad:
        gathered[rank] = features
    return torch.cat(gathered, dim=0)


class ContrastiveLoss(nn.Module):
    """Shared entry point: cross-rank input checks, then the loss of this rank's rows."""

    needs_bias = False

    def __init__(self, *, group: dist.ProcessGroup | None = None, check_inputs: bool = True) -> None:
        super().__init__()
        self.group = group
        self.check_inputs = check_inputs
        self.checks = InputChecks(group)

    def verify(self) -> None:
        """Collective: raise the input errors of the steps since the last call (one host read;
        see checks.InputChecks). The loop calls it on log steps and before saving."""
        if self.check_inputs:
            self.checks.verify()

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.needs_bias and logit_bias is None:
            raise ConfigError(
                "--loss siglip needs the model's logit_bias (build it with init_logit_bias, e.g. -10)"
            )
        bias = logit_bias if self.needs_bias else None
        if self.check_inputs:
            self.checks(image_features, text_features, logit_scale, bias)
        scale = logit_scale.float().reshape(())
        # Logits stay fp32 even when called inside the training step's autocast region.
        with torch.autocast(image_features.device.type, enabled=False):
            return self.compute(image_features, text_features, scale, None if bias is None else bias.float())

    def compute(
        self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError


class ClipLoss(ContrastiveLoss):
    """OpenCLIP's ClipLoss: mean of image->text and text->image cross-entropy (unchunked)."""

    def __init__(
        self,
        *,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(group=group)
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad

    def compute(
        self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rank, _ = world_of(self.group)
        image, text = image.float(), text.float()
        kwargs = dict(group=self.group, with_grad=self.gather_with_grad, keep_local_grad=not self.local_loss)
        all_image = gather_features(image, **kwargs)
        all_text = gather_features(text, **kwargs)
        n = image.shape[0]
        if self.local_loss:
            logits_per_image = scale * image @ all_text.T
            logits_per_text = scale * text @ all_image.T
            labels = torch.arange(n, device=image.device) + n * rank
        else:
            logits_per_image = scale * all_image @ all_text.T
            logits_per_text = logits_per_image.T
            labels = torch.arange(all_image.shape[0], device=image.device)
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


class SigLipLoss(ContrastiveLoss):
    """OpenCLIP's SigLipLoss (unchunked): this rank's images against every rank's texts."""

    needs_bias = True

    def compute(
        self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rank, _ = world_of(self.group)
        image, text = image.float(), text.float()
        all_text = gather_features(text, group=self.group, with_grad=True, keep_local_grad=True)
        n = image.shape[0]
        logits = scale * image @ all_text.T + bias
        labels = -torch.ones_like(logits)
        labels[:, rank * n : (rank + 1) * n] += 2 * torch.eye(n, device=image.device)
        return -F.logsigmoid(labels * logits).sum() / n


class ChunkedContrastiveLoss(ContrastiveLoss):
    """Exact CLIP or SigLIP loss in chunk x chunk tiles; memory flat in the world size with 'ring'."""

    def __init__(
        self,
        *,
        kind: str = "clip",
        chunk_size: int = 1024,
        exchange: str = "ring",
        group: dist.ProcessGroup | None = None,
        check_inputs: bool = True,
    ) -> None:
        super().__init__(group=group, check_inputs=check_inputs)
        if kind not in ("clip", "siglip") or exchange not in EXCHANGES or chunk_size < 1:
            raise ConfigError(
                f"chunked loss: kind {kind!r} (clip|siglip), exchange {exchange!r} "
                f"({'|'.join(EXCHANGES)}), chunk size {chunk_size} (>= 1)"
            )
        self.needs_bias = kind == "siglip"
        self.plan = LossPlan(kind=kind, chunk=chunk_size, exchange=EXCHANGES[exchange](group))

    def compute(
        self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return ChunkedContrastiveFunction.apply(image, text, scale, bias, self.plan)


def build_loss(cfg: LossConfig, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """The loss module for a run's LossConfig."""
    if cfg.loss_chunk_size > 0:
        return ChunkedContrastiveLoss(
            kind=cfg.loss, chunk_size=cfg.loss_chunk_size, exchange=cfg.loss_exchange, group=group
        )
    if cfg.loss == "siglip":
        return SigLipLoss(group=group)
    return ClipLoss(local_loss=cfg.local_loss, gather_with_grad=cfg.gather_with_grad, group=group)
