"""Per-GPU memory of a training step: model state, activations, loss and communication buffers.

The model is its static shape (models/shape.py): towers of pre-norm residual blocks.
Activations come from what each block saves for backward on a GPU (bf16 compute, flash
attention), per token of width W, MLP width M, H heads, a bytes per compute element:
    MLP: ln_2 input, ln_2 output (c_fc input), c_fc output (GELU input), GELU output
    (c_proj input); ln_2's mean and rstd:                                     (2 W + 2 M) x a + 2 x 4
    attention (H > 0): ln_1 input, ln_1 output (QKV input), QKV output (q, k, v are views of
    it), attention output (SDPA's output, also out_proj's input); ln_1's mean and rstd and
    the attention log-sum-exp (H fp32):                                       6 W x a + (2 + H) x 4
SwitchBack int8 `memefficient` saves an int8 copy (+ an fp32 absmax per row) of each swapped
linear's input instead of the 16-bit one (the attention output stays, SDPA keeps it); `global`
and `vectorwise` save the same as a plain linear. With --grad-checkpointing a checkpointed block
keeps only its input (W x a; policy `ops` also keeps the QKV output, SDPA's output and log-sum-exp
and c_fc's output: 5 W + M elements + H fp32; W + M without attention), the blocks left out by --grad-checkpointing-every
keep everything, and one block at a time is recomputed in backward. Outside the blocks: what
each tower's shape says it saves per token (CLIP's vision tower: ln_pre's input and its last
block's output), and the inputs themselves. Backward needs a workspace of about one block's MLP
and residual gradients (2 M + 3 W per token x a). A tower's tokens are its sequence after patch
dropout.

Loss buffers follow bigclip/ops/loss/ (chunked.py, exchange.py) (n local rows, N global, d embed dim, c chunk,
fp32): ring 2nd + 3n + 2cd + 3c(d+1) + 3c^2; allgather Nd + N(d+1) + 2nd + 3c^2; OpenCLIP's
unchunked loss 4nN + 2Nd with --local-loss (two n x N logit matrices and their log-softmax), 4N^2 + 2Nd
without. These match benchmarks/results/loss_memory.json within 10% (tests/test_plan.py).

Peak = model state + the larger of (a) the end of forward: activations, backward workspace, loss
and communication buffers, plus gradients that persist across steps (ZeRO's accumulators;
FSDP2's sharded gradients are freed by zero_grad(set_to_none=True), but its --accum-freq passes
keep unsharded gradients), and (b) the optimizer step: all gradients plus its temporaries
(bigclip steps torch's fused AdamW, which allocates none; ZeRO makes an fp32 copy of the gradient
partition).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bigclip.config.linear_kinds import linear_kind
from bigclip.config.linear_speedups import linear_filter
from bigclip.models.flops import block_flops_per_token
from bigclip.models.shape import ParamShape, TowerShape
from bigclip.plan.engine_plan import engine_plan
from bigclip.plan.model_state import StateBytes
from bigclip.plan.spec import PlanSpec, dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    state: StateBytes
    activations: int
    backward_workspace: int
    loss_buffers: int
    communication: int
    step_temporaries: int
    persistent_gradients: int  # gradients alive during forward (subset of state.gradients or extra)

    @property
    def forward_peak(self) -> int:
        s = self.state
        return (s.parameters + s.optimizer + self.persistent_gradients + self.activations
                + self.backward_workspace + self.loss_buffers + self.communication)  # fmt: skip

    @property
    def step_peak(self) -> int:
        s = self.state
        return s.parameters + s.optimizer + s.gradients + self.step_temporaries

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.step_peak)


def towers(spec: PlanSpec) -> dict[str, TowerShape]:
    return spec.model_shape().towers


def block_saved_per_token(tower: TowerShape, spec: PlanSpec) -> int:
    """Bytes one residual block saves for backward per token (see the module docstring)."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    w, m = tower.width, tower.mlp
    int8 = int8_saved_linears(tower, spec)
    saved = a * (2 * w + 2 * m) + 2 * 4  # the MLP half: ln_2's input and output, c_fc's and GELU's outputs
    for linear, inputs in (("c_fc", w), ("c_proj", m)):
        if linear in int8:
            saved -= (a - 1) * inputs - 4  # its input as int8 + absmax
    if tower.heads:
        saved += a * 6 * w + 4 * (2 + tower.heads)  # ln_1's input and output, QKV, SDPA's output and LSE
    if tower.heads and "in_proj" in int8:
        saved -= (a - 1) * w - 4  # QKV input as int8
    if tower.heads and "out_proj" in int8:
        saved += w + 4  # out_proj's int8 copy, beside SDPA's saved output
    return saved


def int8_saved_linears(tower: TowerShape, spec: PlanSpec) -> set[str]:
    """The block linears that save their inputs for backward as int8: those of a kind that does
    (LinearKind.int8_saved_inputs) which its measured shape table converts at this tower's tokens
    per micro-batch (config/linear_speedups.py, on the GPU family the plan is for)."""
    kind = linear_kind(spec.linear_kind)
    if not kind.int8_saved_inputs:
        return set()
    w, m, tokens = tower.width, tower.mlp, spec.batch_size * tower.tokens
    shapes = {"c_fc": (w, m), "c_proj": (m, w)}
    if kind.includes_attention(spec.int8_attention):
        shapes |= {"in_proj": (w, 3 * w), "out_proj": (w, w)}
    family = spec.linear_filter_family
    return {name for name, (k, n) in shapes.items() if linear_filter(kind.name, family, k, n, tokens).convert}


def checkpointed_saved_per_token(tower: TowerShape, spec: PlanSpec) -> int:
    """Bytes a checkpointed block keeps per token until its backward (module docstring)."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    if spec.checkpoint_policy != "ops":
        return a * tower.width
    kept = a * (tower.width + tower.mlp)  # the block's input, c_fc's output
    if tower.heads:
        kept += a * 4 * tower.width + 4 * tower.heads  # QKV and SDPA's outputs, the log-sum-exp
    return kept


def checkpointed_blocks(tower: TowerShape, spec: PlanSpec) -> int:
    """Blocks of the tower checkpointed: 0, or one in --grad-checkpointing-every (blocks 0, k, 2k...)."""
    return -(-tower.layers // spec.checkpoint_every) if spec.grad_checkpointing else 0


def activation_bytes(spec: PlanSpec) -> int:
    """Saved activations of one micro-batch on one rank, both towers and outside the blocks."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    total = 0
    for tower in towers(spec).values():
        tokens = spec.batch_size * tower.tokens
        per_block = block_saved_per_token(tower, spec)
        ckpt = checkpointed_blocks(tower, spec)
        kept = ckpt * checkpointed_saved_per_token(tower, spec) + (tower.layers - ckpt) * per_block
        recomputing = per_block if ckpt else 0  # one block's activations, rebuilt in backward
        total += tokens * (kept + recomputing + tower.saved_outside * a)
    return total + input_bytes(spec)


def recomputed_flops(spec: PlanSpec) -> float:
    """Forward FLOPs per step that checkpointing repeats in backward (hardware work, not model work):
    a `full` block repeats all of its matmuls and attention; an `ops` block only out_proj and c_proj."""
    total = 0.0
    for tower in towers(spec).values():
        w, m, s = tower.width, tower.mlp, tower.tokens
        if spec.checkpoint_policy == "ops":
            out_proj = w * w if tower.heads else 0
            per_token = 2 * (out_proj + m * w)
        else:
            per_token = block_flops_per_token(tower)  # QKV, out, MLP; QK^T and AV
        total += checkpointed_blocks(tower, spec) * spec.global_batch * s * per_token
    return total


def input_bytes(spec: PlanSpec) -> int:
    return spec.batch_size * sum(t.input_bytes for t in towers(spec).values())


def backward_workspace(spec: PlanSpec) -> int:
    a = dtype_bytes(spec.dtypes.compute_dtype)
    return max(spec.batch_size * t.tokens * a * (2 * t.mlp + 3 * t.width) for t in towers(spec).values())


def loss_buffer_bytes(spec: PlanSpec) -> int:
    """fp32 buffers of the contrastive loss on one rank (formulas in the module docstring)."""
    d = spec.model_shape().embed_dim
    n = spec.batch_size * spec.accum_freq  # the last accumulation pass sees every cached feature
    big_n, c = n * spec.gpus, min(spec.loss_chunk_size, n) if spec.loss_chunk_size else 0
    tiles = 3 * c * c
    if c and spec.loss_exchange == "ring":
        floats = 2 * n * d + 3 * n + 2 * c * d + 3 * c * (d + 1) + tiles
    elif c:
        floats = big_n * d + big_n * (d + 1) + 2 * n * d + tiles
    elif spec.local_loss or spec.loss == "siglip":
        floats = 4 * n * big_n + 2 * big_n * d
    else:
        floats = 4 * big_n * big_n + 2 * big_n * d
    return 4 * floats


def plan_memory(spec: PlanSpec, params: Sequence[ParamShape]) -> MemoryPlan:
    engine = engine_plan(spec.engine)
    state = engine.model_state(spec, params)
    return MemoryPlan(
        state=state,
        activations=activation_bytes(spec),
        backward_workspace=backward_workspace(spec),
        loss_buffers=loss_buffer_bytes(spec),
        communication=engine.communication(spec, params),
        step_temporaries=engine.step_temporaries(spec, state),
        persistent_gradients=engine.persistent_gradients(spec, state, params),
    )
