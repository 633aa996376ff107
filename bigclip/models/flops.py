"""Model FLOPs of a forward pass, counted from a model's static shape (2 per multiply-add of every matmul).

The planner's step time and the training log's MFU both divide by this, so they share one count;
it equals what torch's FlopCounterMode counts on the real model (tests/test_model_shape.py).
A training step costs 3x the forward (backward is twice the forward).
"""

from __future__ import annotations

from bigclip.models.shape import ModelShape, TowerShape


def block_flops_per_token(tower: TowerShape) -> int:
    """One block, per token: the MLP (2 w m per linear); with attention the QKV and output
    projections (4 w^2) and the scores and values over the sequence (2 s w)."""
    w, s = tower.width, tower.tokens
    attention = 2 * 4 * w * w + 4 * s * w if tower.heads else 0
    return 2 * 2 * w * tower.mlp + attention


def tower_flops(tower: TowerShape) -> int:
    """The tower's residual blocks for one sample."""
    return tower.layers * tower.tokens * block_flops_per_token(tower)


def forward_flops(shape: ModelShape) -> int:
    """Forward FLOPs of one image-text pair: every tower's blocks and what lies outside them."""
    return sum(tower_flops(t) + t.outside_flops for t in shape.towers.values())
