"""Per-GPU memory of a training step: model state, activations, loss and communication buffers.

Activations come from what each residual block saves for backward on a GPU (bf16 compute,
flash attention), per token of width W, MLP width M, H heads, a bytes per compute element:
    ln_1 input, ln_1 output (QKV input), QKV output (q, k, v are views of it), attention output
    (SDPA's output, also out_proj's input), ln_2 input, ln_2 output (c_fc input): 8 W x a
    c_fc output (GELU input), GELU output (c_proj input):                          2 M x a
    LayerNorm mean and rstd (2 x 2 fp32) and the attention log-sum-exp (H fp32):   (4 + H) x 4
SwitchBack int8 `memefficient` saves an int8 copy (+ an fp32 absmax per row) of each swapped
linear's input instead of the 16-bit one (the attention output stays, SDPA keeps it); `global`
and `vectorwise` save the same as a plain linear. With --grad-checkpointing a checkpointed block
keeps only its input (W x a; policy `ops` also keeps the QKV output, SDPA's output and log-sum-exp
and c_fc's output: 5 W + M elements + H fp32), the blocks left out by --grad-checkpointing-every
keep everything, and one block at a time is recomputed in backward. Outside the blocks:
the vision tower keeps ln_pre's input and its last block's
output (ln_post reads the class token through a view of it); the inputs themselves (fp32 images,
int64 tokens). Backward needs a workspace of about one block's MLP and residual gradients
(2 M + 3 W per token x a). Patch dropout shortens the vision sequence to 1 + kept patches.

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

from dataclasses import dataclass

from bigclip.models import get_model_config
from bigclip.models.vision import kept_patches
from bigclip.plan.model_state import StateBytes, model_state
from bigclip.plan.spec import ParamInfo, PlanSpec, dtype_bytes

TEXT_TOKEN_BYTES = 8  # int64 token ids


@dataclass(frozen=True)
class Tower:
    layers: int
    width: int
    mlp: int
    heads: int
    tokens: int  # sequence length per sample


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


def towers(spec: PlanSpec) -> dict[str, Tower]:
    cfg = get_model_config(spec.model)
    v, t = cfg.vision_cfg, cfg.text_cfg
    patches = (v.image_size // v.patch_size) ** 2
    kept = kept_patches(patches, spec.patch_dropout)
    return {
        "vision": Tower(v.layers, v.width, int(v.width * v.mlp_ratio), v.width // v.head_width, 1 + kept),
        "text": Tower(t.layers, t.width, int(t.width * t.mlp_ratio), t.heads, t.context_length),
    }


def block_saved_per_token(tower: Tower, spec: PlanSpec) -> int:
    """Bytes one residual block saves for backward per token (see the module docstring)."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    w, m = tower.width, tower.mlp
    saved = a * (8 * w + 2 * m) + 4 * (4 + tower.heads)
    if spec.linear_kind == "switchback-memefficient":
        saved -= (a - 1) * (w + m) - 2 * 4  # c_fc and c_proj inputs as int8 + absmax
        if spec.int8_attention:
            saved -= (a - 1) * w - 4  # QKV input as int8
            saved += w + 4  # out_proj's int8 copy, beside SDPA's saved output
    return saved


def checkpointed_saved_per_token(tower: Tower, spec: PlanSpec) -> int:
    """Bytes a checkpointed block keeps per token until its backward (module docstring)."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    if spec.checkpoint_policy == "ops":
        return a * (5 * tower.width + tower.mlp) + 4 * tower.heads
    return a * tower.width


def checkpointed_blocks(tower: Tower, spec: PlanSpec) -> int:
    """Blocks of the tower checkpointed: 0, or one in --grad-checkpointing-every (blocks 0, k, 2k...)."""
    return -(-tower.layers // spec.checkpoint_every) if spec.grad_checkpointing else 0


def activation_bytes(spec: PlanSpec) -> int:
    """Saved activations of one micro-batch on one rank, both towers and outside the blocks."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    total = 0
    for name, tower in towers(spec).items():
        tokens = spec.batch_size * tower.tokens
        per_block = block_saved_per_token(tower, spec)
        ckpt = checkpointed_blocks(tower, spec)
        kept = ckpt * checkpointed_saved_per_token(tower, spec) + (tower.layers - ckpt) * per_block
        recomputing = per_block if ckpt else 0  # one block's activations, rebuilt in backward
        total += tokens * (kept + recomputing)
        if name == "vision":
            total += tokens * tower.width * 2 * a  # ln_pre's input and the last block's output
    return total + input_bytes(spec)


def recomputed_flops(spec: PlanSpec) -> float:
    """Forward FLOPs per step that checkpointing repeats in backward (hardware work, not model work):
    a `full` block repeats all of its matmuls and attention; an `ops` block only out_proj and c_proj."""
    total = 0.0
    for tower in towers(spec).values():
        w, m, s = tower.width, tower.mlp, tower.tokens
        if spec.checkpoint_policy == "ops":
            per_token = 2 * (w * w + m * w)
        else:
            per_token = 2 * (4 * w * w + 2 * m * w) + 4 * s * w  # QKV, out, MLP; QK^T and AV
        total += checkpointed_blocks(tower, spec) * spec.global_batch * s * per_token
    return total


def input_bytes(spec: PlanSpec) -> int:
    cfg = get_model_config(spec.model)
    image = 3 * cfg.vision_cfg.image_size**2 * 4
    return spec.batch_size * (image + cfg.text_cfg.context_length * TEXT_TOKEN_BYTES)


def backward_workspace(spec: PlanSpec) -> int:
    a = dtype_bytes(spec.dtypes.compute_dtype)
    return max(spec.batch_size * t.tokens * a * (2 * t.mlp + 3 * t.width) for t in towers(spec).values())


def loss_buffer_bytes(spec: PlanSpec) -> int:
    """fp32 buffers of the contrastive loss on one rank (formulas in the module docstring)."""
    d = get_model_config(spec.model).embed_dim
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


def communication_bytes(spec: PlanSpec, params: list[ParamInfo]) -> int:
    """Gathered parameters and unsharded gradients in flight (engine buffers), per rank."""
    a = dtype_bytes(spec.dtypes.compute_dtype)
    blocks: dict[int, int] = {}
    for p in params:
        blocks[p.block] = blocks.get(p.block, 0) + p.numel
    root = blocks.pop(-1, 0)
    largest = max(blocks.values())
    if spec.engine == "fsdp":
        return _fsdp_communication(spec, blocks, root, largest)
    if spec.engine == "zero3":
        persistent = sum(p.numel for p in params if p.numel <= spec.zero.persistence_threshold)
        biggest_root = max(p.numel for p in params if p.block == -1)
        return a * (2 * max(largest, biggest_root) + persistent + spec.zero.reduce_bucket_size + largest)
    return a * 2 * spec.zero.reduce_bucket_size  # ZeRO-1/2: the reduce buckets (overlap_comm: two)


def _fsdp_communication(spec: PlanSpec, blocks: dict[int, int], root: int, largest: int) -> int:
    p = spec.dtypes
    a, reduce_b = dtype_bytes(p.compute_dtype), dtype_bytes(p.reduce_dtype)
    gathered = sum(blocks.values()) if not spec.reshard_after_forward else 2 * largest
    # The unsharded gradients of the block in backward, and their copy in the reduce dtype.
    reduce_scatter = largest * (a + (reduce_b if reduce_b != a else 0))
    return a * (gathered + root) + reduce_scatter  # the root stays gathered, in the compute dtype


def persistent_gradient_bytes(spec: PlanSpec, state: StateBytes, params: list[ParamInfo]) -> int:
    if spec.engine == "fsdp":
        # Under no_sync, FSDP2 accumulates unsharded gradients (reduce dtype) across passes.
        reduce_b = dtype_bytes(spec.dtypes.reduce_dtype)
        return reduce_b * sum(p.numel for p in params) if spec.accum_freq > 1 else 0
    return state.gradients  # DeepSpeed's gradient accumulators live across steps


def step_temporary_bytes(spec: PlanSpec, state: StateBytes) -> int:
    if spec.optimizer == "adamw8bit" or state.optimizer == 0:
        return 0  # blockwise 8-bit kernels update in place; offloaded optimizers step on the CPU
    if spec.engine == "fsdp":
        return 0  # fused AdamW updates in place (foreach would allocate a moment-sized buffer)
    return state.optimizer // 3  # ZeRO's fp32 gradient partition (optimizer: fp32 master + 2 moments)


def plan_memory(spec: PlanSpec, params: list[ParamInfo]) -> MemoryPlan:
    state = model_state(spec, params)
    return MemoryPlan(
        state=state,
        activations=activation_bytes(spec),
        backward_workspace=backward_workspace(spec),
        loss_buffers=loss_buffer_bytes(spec),
        communication=communication_bytes(spec, params),
        step_temporaries=step_temporary_bytes(spec, state),
        persistent_gradients=persistent_gradient_bytes(spec, state, params),
    )
