"""Exact CLIP and SigLIP losses over feature tiles: a custom autograd Function.

Rank r owns image rows I_r and text rows T_r ([n, dim] each); logits are z_ij = s * I_i . T_j (+ b).
Each rank computes the tiles of its own image rows against every rank's text columns, which
arrive chunk by chunk from an exchange (exchange.py), and returns L_r, the loss of
its own rows (k runs over this rank's pairs):

  CLIP    L_r = 1/(2n) sum_k [softplus(lse_{j!=k} z_kj - z_kk) + softplus(lse_{i!=k} z_ik - z_kk)]
          (= OpenCLIP's (CE(image->text) + CE(text->image)) / 2 over this rank's rows)
  SigLIP  L_r = 1/n sum_{i in r, all j} softplus(-y_ij z_ij), y = +1 for the pair, -1 elsewhere
          (= OpenCLIP's SigLipLoss: -sum logsigmoid(y z) / n)

Positives are handled inside the tiles (masked out of the log-sum-exps, sign-flipped for
SigLIP), so no "lse - z" or "softplus(z) - z" cancellation: a row's loss keeps fp32 relative
precision even when it is tiny. One matmul per tile serves both CLIP directions: a tile's row
statistics belong to this rank's images, its column statistics to the chunk owner's texts, so
they travel with the chunk back to their owner (a log-add-exp accumulator). Forward keeps only
3n floats of statistics; backward recomputes every tile and sends each chunk's text gradient,
plus the logit-scale gradient of the owner's column terms, home the same way. After backward
rank r holds d(sum_r' L_r')/dI_r and /dT_r, and dL_r/ds (and dL_r/db) locally: the gradient
convention of OpenCLIP's --local-loss --gather-with-grad.

Numerics: logits, log-sum-exp, softplus and all accumulators are fp32. On CPU low-precision
features are upcast once; on CUDA bf16/fp16 tiles use tensor cores with fp32 output
(torch.mm out_dtype).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bigclip.ops.loss.exchange import Chunk, Exchange, chunk_slices, combine_

LOW_PRECISION = (torch.bfloat16, torch.float16)


@functools.cache
def _fp32_output_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm(..., out_dtype=torch.float32) runs for `dtype` inputs on `device`."""
    try:
        a = torch.ones(2, 2, device=device, dtype=dtype)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class TileMatmul:
    """fp32 products of features: tensor cores with fp32 output on CUDA, else fp32 throughout."""

    def __init__(self, features: torch.Tensor) -> None:
        dtype, device = features.dtype, features.device
        use_low = device.type == "cuda" and dtype in LOW_PRECISION and _fp32_output_matmul(device, dtype)
        self.low: torch.dtype | None = dtype if use_low else None

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.low) if self.low else x.float()

    def logits(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """rows @ cols.T in fp32, a [len(rows), len(cols)] tile (not yet scaled)."""
        if self.low:
            return torch.mm(rows, cols.T, out_dtype=torch.float32)
        return rows @ cols.T

    def accumulate(self, out: torch.Tensor, dz: torch.Tensor, feats: torch.Tensor) -> None:
        """out += dz @ feats, with out and dz in fp32."""
        if self.low:
            out.add_(torch.mm(dz.to(self.low), feats, out_dtype=torch.float32))
        else:
            out.addmm_(dz, feats)


@dataclass(frozen=True)
class LossPlan:
    """What the Function computes: `kind` ('clip' | 'siglip'), tile size, and the exchange."""

    kind: str
    chunk: int
    exchange: Exchange


@dataclass(frozen=True)
class Diagonal:
    """The positive pairs (image k, text k) inside one tile: tile positions and local rows."""

    tile: tuple[torch.Tensor, torch.Tensor]
    rows: slice


def diagonal_in_tile(rank: int, chunk: Chunk, rows: slice, device: torch.device) -> Diagonal | None:
    """Positive pairs in the tile of local `rows` x `chunk`, if the chunk is this rank's own."""
    lo, hi = max(rows.start, chunk.rows.start), min(rows.stop, chunk.rows.stop)
    if chunk.owner != rank or lo >= hi:
        return None
    k = torch.arange(lo, hi, device=device)
    return Diagonal(tile=(k - rows.start, k - chunk.rows.start), rows=slice(lo, hi))


@dataclass
class ClipStats:
    """Forward statistics: log-sum-exp over the negatives of each local image row and text
    column, and the positive logits z_kk. The loss is built from softplus(lse_neg - z_kk), which
    stays accurate to fp32 precision even when a row's loss is tiny (no LSE - z cancellation)."""

    row_neg: torch.Tensor
    col_neg: torch.Tensor
    pos: torch.Tensor

    def loss(self) -> torch.Tensor:
        image_to_text = F.softplus(self.row_neg - self.pos).sum()
        text_to_image = F.softplus(self.col_neg - self.pos).sum()
        return (image_to_text + text_to_image) / (2 * self.pos.shape[0])


class ChunkedContrastiveFunction(torch.autograd.Function):
    """L_r for this rank's rows (see the module docstring); inputs as given, fp32 scalar out."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        image: torch.Tensor,
        text: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        plan: LossPlan,
    ) -> torch.Tensor:
        mm = TileMatmul(image)
        images = mm.prepare(image)
        if plan.kind == "clip":
            stats = _clip_forward(images, text, scale, plan, mm)
            loss = stats.loss()
            ctx.save_for_backward(image, text, scale, stats.row_neg, stats.col_neg, stats.pos)
        else:
            loss = _siglip_forward(images, text, scale, bias, plan, mm) / image.shape[0]
            ctx.save_for_backward(image, text, scale, bias)
        ctx.plan = plan
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        # Every rank must run this even when it needs no input gradient: its peers' gradients
        # pass through it.
        plan: LossPlan = ctx.plan
        image, text, scale, *saved = ctx.saved_tensors
        grads = Gradients(image, text, scale)
        with torch.autocast(image.device.type, enabled=False):
            if plan.kind == "clip":
                _clip_backward(grads, grad, ClipStats(*saved), plan)
            else:
                _siglip_backward(grads, grad, saved[0], plan)
        return (
            grads.image.to(image.dtype),
            grads.text.to(text.dtype),
            grads.scale.reshape(scale.shape),
            None if plan.kind == "clip" else grads.bias.reshape(saved[0].shape),
            None,
        )


class Gradients:
    """fp32 gradient accumulators of one backward pass, and the recomputation inputs."""

    def __init__(self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> None:
        self.mm = TileMatmul(image)
        self.images, self.texts, self.s = self.mm.prepare(image), text, scale
        self.n, dim = image.shape
        self.image = torch.zeros(self.n, dim, dtype=torch.float32, device=image.device)
        self.text = torch.empty(self.n, dim, dtype=torch.float32, device=image.device)
        self.scale = torch.zeros((), dtype=torch.float32, device=image.device)
        self.bias = torch.zeros((), dtype=torch.float32, device=image.device)

    def add_tile(self, dz: torch.Tensor, rows: slice, cols: torch.Tensor, d_cols: torch.Tensor) -> None:
        """Feature gradients of a tile whose logit gradient (already times s) is dz."""
        self.mm.accumulate(self.image[rows], dz, cols)
        self.mm.accumulate(d_cols, dz.T, self.images[rows])


def _clip_forward(
    images: torch.Tensor, text: torch.Tensor, s: torch.Tensor, plan: LossPlan, mm: TileMatmul
) -> ClipStats:
    """Negatives' log-sum-exps of this rank's image rows and text columns (over all ranks)."""
    n = images.shape[0]
    row_neg = torch.full((n,), -math.inf, dtype=torch.float32, device=images.device)
    col_neg = torch.empty(n, 1, dtype=torch.float32, device=images.device)
    pos = torch.empty(n, dtype=torch.float32, device=images.device)
    stream = plan.exchange.stream(
        (text,), chunk=plan.chunk, acc_widths=(1,), reduce="logaddexp", out=(col_neg,)
    )
    for chunk in stream:
        cols = mm.prepare(chunk.payload[0])
        for rows in chunk_slices(n, plan.chunk):
            z = mm.logits(images[rows], cols).mul_(s)
            diagonal = diagonal_in_tile(plan.exchange.rank, chunk, rows, z.device)
            if diagonal is not None:
                pos[diagonal.rows] = z[diagonal.tile]
                z[diagonal.tile] = -math.inf
            torch.logaddexp(row_neg[rows], torch.logsumexp(z, dim=1), out=row_neg[rows])
            combine_(chunk.acc[0][:, 0], torch.logsumexp(z, dim=0), "logaddexp")
    return ClipStats(row_neg, col_neg[:, 0], pos)


@dataclass(frozen=True)
class ClipBackward:
    """Per-row constants of the CLIP backward pass."""

    row_lse: torch.Tensor  # full log-sum-exp of each local image row
    coef: torch.Tensor  # this rank's upstream gradient / 2n
    pos_row: torch.Tensor  # dL/dz_kk, image->text part: -coef * sigmoid(row_neg - z_kk)
    pos_col: torch.Tensor  # dL/dz_kk, text->image part
    rank: int


def _clip_backward(g: Gradients, grad: torch.Tensor, st: ClipStats, plan: LossPlan) -> None:
    coef = grad / (2 * g.n)
    consts = ClipBackward(
        row_lse=torch.logaddexp(st.row_neg, st.pos),
        coef=coef,
        pos_row=-coef * torch.sigmoid(st.row_neg - st.pos),  # = coef * (softmax_kk - 1), no cancellation
        pos_col=-coef * torch.sigmoid(st.col_neg - st.pos),
        rank=plan.exchange.rank,
    )
    # A chunk carries its owner's column log-sum-exps and upstream gradient.
    stats = torch.stack([torch.logaddexp(st.col_neg, st.pos), coef.expand(g.n)], dim=1)
    ds_cols = torch.empty(g.n, 1, dtype=torch.float32, device=g.image.device)
    stream = plan.exchange.stream(
        (g.texts, stats),
        chunk=plan.chunk,
        acc_widths=(g.image.shape[1], 1),
        reduce="sum",
        out=(g.text, ds_cols),
    )
    for chunk in stream:
        _clip_backward_chunk(g, chunk, consts, plan.chunk)
    g.scale += ds_cols.sum()


def _clip_backward_chunk(g: Gradients, chunk: Chunk, c: ClipBackward, size: int) -> None:
    cols = g.mm.prepare(chunk.payload[0])
    col_lse, col_coef = chunk.payload[1][:, 0], chunk.payload[1][:, 1]
    d_text, ds_cols = chunk.acc
    for rows in chunk_slices(g.n, size):
        raw = g.mm.logits(g.images[rows], cols)
        z = raw * g.s
        p_row = (z - c.row_lse[rows, None]).exp_().mul_(c.coef)  # softmax over texts, image rows
        p_col = z.sub_(col_lse).exp_().mul_(col_coef)  # softmax over images, text columns
        diagonal = diagonal_in_tile(c.rank, chunk, rows, z.device)
        if diagonal is not None:
            p_row[diagonal.tile] = c.pos_row[diagonal.rows]
            p_col[diagonal.tile] = c.pos_col[diagonal.rows]
        g.scale += (p_row * raw).sum()
        ds_cols[:, 0] += (p_col * raw).sum(dim=0)  # the owner's dL/ds: travels home with d_text
        g.add_tile(p_row.add_(p_col).mul_(g.s), rows, cols, d_text)


@dataclass(frozen=True)
class SigLipTiles:
    """Label-signed SigLIP logits of one tile: -z on the positive pairs, z elsewhere."""

    mm: TileMatmul
    scale: torch.Tensor
    bias: torch.Tensor
    rank: int

    def logits(self, images: torch.Tensor, cols: torch.Tensor, rows: slice, chunk: Chunk) -> tuple:
        """(raw products, signed logits, the tile's positive pairs or None)."""
        raw = self.mm.logits(images[rows], cols)
        signed = raw * self.scale + self.bias
        diagonal = diagonal_in_tile(self.rank, chunk, rows, raw.device)
        if diagonal is not None:
            signed[diagonal.tile] = -signed[diagonal.tile]
        return raw, signed, diagonal


def _siglip_forward(
    images: torch.Tensor,
    text: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    plan: LossPlan,
    mm: TileMatmul,
) -> torch.Tensor:
    """sum over this rank's image rows and all text columns of -logsigmoid(label * z)."""
    total = torch.zeros((), dtype=torch.float32, device=images.device)
    tiles = SigLipTiles(mm, s, b, plan.exchange.rank)
    # -logsigmoid(-z) = softplus(z): with the label folded into the logits, one softplus per
    # tile, and no large-minus-large cancellation on the positives.
    for chunk in plan.exchange.stream((text,), chunk=plan.chunk, acc_widths=(), reduce="sum", out=()):
        cols = mm.prepare(chunk.payload[0])
        for rows in chunk_slices(images.shape[0], plan.chunk):
            total += F.softplus(tiles.logits(images, cols, rows, chunk)[1]).sum()
    return total


def _siglip_backward(g: Gradients, grad: torch.Tensor, b: torch.Tensor, plan: LossPlan) -> None:
    coef = grad / g.n
    tiles = SigLipTiles(g.mm, g.s, b, plan.exchange.rank)
    stream = plan.exchange.stream(
        (g.texts,), chunk=plan.chunk, acc_widths=(g.image.shape[1],), reduce="sum", out=(g.text,)
    )
    for chunk in stream:
        cols = g.mm.prepare(chunk.payload[0])
        for rows in chunk_slices(g.n, plan.chunk):
            raw, signed, diagonal = tiles.logits(g.images, cols, rows, chunk)
            dz = torch.sigmoid(signed).mul_(coef)  # d softplus(-yz)/dz = -y sigmoid(-yz)
            if diagonal is not None:
                dz[diagonal.tile] = -dz[diagonal.tile]
            g.scale += (dz * raw).sum()
            g.bias += dz.sum()
            g.add_tile(dz.mul_(g.s), rows, cols, chunk.acc[0])
