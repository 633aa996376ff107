"""Which bf16 compute is closest to OpenCLIP's `--precision amp_bf16` (torch.autocast)?

Why bigclip's amp_bf16 computes every module in bf16 (docs/engines-and-precision.md,
"Precision"): one step's gradients of an unsharded model, with the loss in fp32, under
  - fp32 (the truth), OpenCLIP's autocast(bf16) on fp32 weights,
  - residual blocks in bf16 and the root (embeddings, norms, projections) in fp32 (FSDP2's old amp_bf16),
  - every module in bf16 (bigclip's amp_bf16 on both engines, and DeepSpeed's bf16 mode),
as the relative error of the whole gradient vector against fp32's and against autocast's.

    python benchmarks/precision_vs_autocast.py [--models tiny ViT-B-32] [--batch 16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from common import write_results

from bigclip.config import TrainConfig
from bigclip.models.clip import CLIP, init_weights
from bigclip.models.named_configs import get_model_config
from bigclip.ops.loss.contrastive import build_loss


def batch(name: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = get_model_config(name)
    g = torch.Generator().manual_seed(0)
    s = cfg.vision_cfg.image_size
    images = torch.randn(size, 3, s, s, generator=g)
    texts = torch.randint(1, 1000, (size, cfg.text_cfg.context_length), generator=g)
    texts[:, 10] = 49407
    return images, texts


def loss_and_grads(model: CLIP, images, texts, ctx) -> tuple[float, torch.Tensor]:  # noqa: ANN001
    loss_fn = build_loss(TrainConfig().loss)
    model.zero_grad(set_to_none=True)
    with ctx:
        out = model(images, texts)
        loss = loss_fn(
            out["image_features"].float(), out["text_features"].float(), out["logit_scale"].float()
        )
    loss.backward()
    return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()])


def bf16_copy(model: CLIP, *, root_bf16: bool) -> CLIP:
    """Blocks in bf16 with their inputs cast (what FSDP2's block policy does); the root too if asked."""
    out = copy.deepcopy(model)
    for block in out.blocks():
        block.to(torch.bfloat16)
        block.register_forward_pre_hook(lambda _m, args: (args[0].to(torch.bfloat16), *args[1:]))
    if root_bf16:
        out.to(torch.bfloat16)
    return out


def measure(name: str, size: int) -> list[dict]:
    model = init_weights(CLIP(get_model_config(name)), seed=0)
    images, texts = batch(name, size)
    plain = contextlib.nullcontext()
    ref_loss, ref = loss_and_grads(model, images, texts, plain)
    _, autocast = loss_and_grads(model, images, texts, torch.autocast("cpu", dtype=torch.bfloat16))
    variants = {
        "autocast (OpenCLIP)": (model, torch.autocast("cpu", dtype=torch.bfloat16)),
        "bf16 blocks, fp32 root": (bf16_copy(model, root_bf16=False), plain),
        "all bf16 (bigclip)": (bf16_copy(model, root_bf16=True), plain),
    }
    rows = []
    for label, (m, ctx) in variants.items():
        loss, grads = loss_and_grads(m, images, texts, ctx)
        rows.append(
            {
                "model": name,
                "variant": label,
                "loss": loss,
                "loss_minus_fp32": loss - ref_loss,
                "grad_rel_err_vs_fp32": ((grads - ref).norm() / ref.norm()).item(),
                "grad_rel_err_vs_autocast": ((grads - autocast).norm() / autocast.norm()).item(),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "ViT-B-32"])
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    rows = [row for name in args.models for row in measure(name, args.batch)]
    print(
        f"{'model':10s} {'variant':24s} {'loss - fp32':>12s} {'grad err vs fp32':>17s} {'vs autocast':>12s}"
    )
    for r in rows:
        print(
            f"{r['model']:10s} {r['variant']:24s} {r['loss_minus_fp32']:+12.2e} "
            f"{r['grad_rel_err_vs_fp32']:17.4f} {r['grad_rel_err_vs_autocast']:12.4f}"
        )
    write_results("precision_vs_autocast", rows, batch=args.batch)


if __name__ == "__main__":
    main()
