"""Input checks for the contrastive losses, agreed by every rank before any exchange.

A check that fails on one rank only would leave its peers blocked in the next collective, so
each rank summarises its inputs in a few numbers (shapes, dtypes, max |feature|, logit scale and
bias), the summaries are all-gathered, and every rank applies the same rules to the same table:
all ranks raise the same error together, naming the offending rank. Per-step cost: a max-|x|
reduction over each feature tensor, one all-gather of world_size x 12 float64 and one host sync.

Non-finite logits are caught from the summary, before any tile is computed: z = s * I.T (+ b) is
finite exactly when the features, s and b are, and |z| <= s * dim * max|I| * max|T| + |b| does not
overflow float32.

No host sync per training step (`InputChecks`): the whole check, with its host read, runs on the
first call and again whenever this rank's shapes or dtypes change (a misconfigured run fails at
its first step, before the loss's own collectives could mismatch). Between those, the per-step
values (max |feature|, scale, bias) are folded into a device-side running maximum, which
`InputChecks.verify` gathers and checks: the training loop calls it where it reads the device
anyway (log steps) and before every checkpoint, so a checkpoint never holds weights a
non-finite step updated.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from bigclip.errors import ConfigError, NonFiniteLossError
from bigclip.ops.loss.collectives import all_gather_single
from bigclip.ops.loss.exchange import world_of

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_FIELDS = (
    "image_ndim",
    "image_rows",
    "image_dim",
    "text_ndim",
    "text_rows",
    "text_dim",
    "image_dtype",
    "text_dtype",
    "image_maxabs",
    "text_maxabs",
    "scale",
    "bias",
)
_N_STATIC = 8  # shapes and dtypes; the rest are values that change every step
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _shape_fields(x: torch.Tensor) -> list[float]:
    return [x.ndim, x.shape[0] if x.ndim else 0, x.shape[-1] if x.ndim else 0]


def _dtype_code(x: torch.Tensor) -> float:
    return _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1


def _maxabs(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0 or not x.is_floating_point():
        return torch.zeros((), device=x.device)
    # Propagates NaN, so a NaN anywhere makes the summary NaN.
    return torch.linalg.vector_norm(x.detach(), ord=math.inf).float()


def _scalar(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if x is None:
        return torch.zeros((), device=like.device)
    return x.detach().float().reshape(-1)[0] if x.numel() else torch.full((), math.nan, device=like.device)


def summarize(
    image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """This rank's inputs as one float64 vector, in the order of _FIELDS."""
    static = _shape_fields(image) + _shape_fields(text) + [_dtype_code(image), _dtype_code(text)]
    dynamic = summarize_values(image, text, scale, bias)
    return torch.cat([torch.tensor(static, device=image.device, dtype=torch.float64), dynamic])


def summarize_values(
    image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The fields that change every step (max |feature|, scale, bias), float64, on the device."""
    values = [_maxabs(image), _maxabs(text), _scalar(scale, image), _scalar(bias, image)]
    return torch.stack(values).to(image.device).double()


def gather_summaries(summary: torch.Tensor, group: dist.ProcessGroup | None) -> list[dict[str, float]]:
    _, world = world_of(group)
    if world > 1:
        table = summary.new_empty(world * summary.numel())  # concatenated: gloo takes no stacked output
        all_gather_single(table, summary, group=group)
        table = table.view(world, -1)
    else:
        table = summary.unsqueeze(0)
    return [dict(zip(_FIELDS, row)) for row in table.tolist()]


def _check_rows(rows: list[dict[str, float]]) -> None:
    for rank, row in enumerate(rows):
        _check_local(rank, row)
    for rank, row in enumerate(rows):
        _check_same_as_rank0(rank, row, rows[0])
    for rank, row in enumerate(rows):
        _check_finite(rank, row)
    _check_overflow(rows)


def _describe(row: dict[str, float], tower: str) -> str:
    dtype = int(row[f"{tower}_dtype"])
    name = str(_DTYPES[dtype]).removeprefix("torch.") if dtype >= 0 else "non-float"
    ndim, n, dim = (int(row[f"{tower}_{k}"]) for k in ("ndim", "rows", "dim"))
    shape = f"[{n}, {dim}]" if ndim == 2 else f"a {ndim}-d tensor"
    return f"{shape} {name}"


def _check_local(rank: int, row: dict[str, float]) -> None:
    image, text = _describe(row, "image"), _describe(row, "text")
    if row["image_ndim"] != 2 or row["image_dtype"] < 0 or row["image_rows"] < 1:
        raise ConfigError(
            f"contrastive loss on rank {rank}: image features are {image}; expected a non-empty "
            "[local_batch, embed_dim] floating-point tensor"
        )
    if image != text:
        raise ConfigError(
            f"contrastive loss on rank {rank}: image features are {image} but text features are {text}; "
            "both towers must give [local_batch, embed_dim] features of one dtype"
        )


def _check_same_as_rank0(rank: int, row: dict[str, float], first: dict[str, float]) -> None:
    if _describe(row, "image") != _describe(first, "image"):
        raise ConfigError(
            f"contrastive loss: rank {rank} has features {_describe(row, 'image')} but rank 0 has "
            f"{_describe(first, 'image')}; every rank must pass the same local batch size, embedding "
            "width and dtype (same --batch-size and --precision everywhere; drop the last partial "
            "batch of an epoch)"
        )


def _check_finite(rank: int, row: dict[str, float]) -> None:
    for name, what in (("image_maxabs", "image features"), ("text_maxabs", "text features")):
        if not math.isfinite(row[name]):
            raise NonFiniteLossError(
                f"non-finite logits: {what} on rank {rank} contain NaN or inf. Stopped before the "
                "update so the weights stay finite; resume from the last checkpoint (e.g. with a "
                f"lower --lr) or inspect rank {rank}'s batch"
            )
    for name in ("scale", "bias"):
        if not math.isfinite(row[name]):
            raise NonFiniteLossError(
                f"non-finite logits: logit {name} on rank {rank} is {row[name]}. Stopped before the "
                "update; resume from the last checkpoint with a lower --lr"
            )


def _check_overflow(rows: list[dict[str, float]]) -> None:
    image_max = max(r["image_maxabs"] for r in rows)
    text_max = max(r["text_maxabs"] for r in rows)
    scale = max(abs(r["scale"]) for r in rows)
    bound = scale * rows[0]["image_dim"] * image_max * text_max + max(abs(r["bias"]) for r in rows)
    if not bound < _FLOAT32_MAX:
        raise NonFiniteLossError(
            f"non-finite logits: logit_scale {scale:.3g} x max |feature| ({image_max:.3g}, "
            f"{text_max:.3g}) overflows float32; the features should be L2-normalised"
        )


def _signature(image: torch.Tensor, text: torch.Tensor) -> tuple:
    """What the static checks depend on: known on the host, no device read."""
    return (tuple(image.shape), tuple(text.shape), image.dtype, text.dtype)


class InputChecks:
    """Cross-rank input checks with the host read deferred to `verify` (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._checked: tuple | None = None  # the signature of the last call that passed in full
        self._static: torch.Tensor | None = None  # its summary's static fields
        self._worst: torch.Tensor | None = None  # running max of the dynamic fields since `verify`

    def __call__(
        self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        signature = _signature(image, text)
        if signature != self._checked:
            self._checked = self._worst = None
            summary = summarize(image, text, scale, bias)
            _check_rows(gather_summaries(summary, self.group))  # one host read, then not again
            self._checked, self._static = signature, summary[:_N_STATIC]
            return
        dynamic = summarize_values(image, text, scale, bias).abs()  # NaN and inf survive abs and max
        self._worst = dynamic if self._worst is None else torch.maximum(self._worst, dynamic)

    def verify(self) -> None:
        """Collective: raise NonFiniteLossError on every rank if any step since the last call saw
        non-finite or overflowing inputs on any rank (one host read)."""
        if self._worst is None:
            return
        worst, self._worst = self._worst, None
        _check_rows(gather_summaries(torch.cat([self._static, worst]), self.group))
