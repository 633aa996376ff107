"""torch FSDP2 engine: `fully_shard` per residual block, then the root (torchtitan's recipe).

Order of application on the meta-device model: compile each block, shard each block, shard the
root, materialise with `to_empty`, then initialise every parameter's local shard from the same
seeded full tensor an unsharded model would draw, so results do not depend on the world size.

Precision: under amp_bf16 / amp every module computes in the compute dtype from fp32 master
weights, through one `MixedPrecisionPolicy` on the blocks and on the root group (patch/token
embeddings, final norms, projections), and gradients are reduced in fp32. That is what DeepSpeed's
bf16/fp16 modes compute too, so a precision means the same on both engines (tests/test_precision_matrix.py);
the loss then runs in fp32 on the features. (Keeping the root in fp32 was measured no closer to OpenCLIP's autocast:
benchmarks/precision_vs_autocast.py; docs/engines-and-precision.md "Precision".)

FSDP2 cannot shard 0-dim parameters, and OpenCLIP's `logit_scale`/`logit_bias` are 0-dim; they are
left replicated (`ignored_params`) and this engine averages their gradients itself in `step`.

At a world of one there is nothing to shard, and FSDP2 would still copy and cast every parameter
and gradient each step, so the model stays a plain module: under a mixed precision its parameters
are in the compute dtype, with fp32 masters that the optimizer steps (engines/master_weights.py; the
same numbers as FSDP2's in less host time: benchmarks/host_overhead.py). Checkpoints hold
the masters under the same names and layout, so a run resumes on any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.engines.base import Engine, StepStats
from bigclip.engines.compile import compile_blocks
from bigclip.engines.master_weights import MasterWeights
from bigclip.engines.optimizer import (
    DynamicLossScaler,
    LocalShardOptimizer,
    Precision,
    clip_by_total_norm_,
    create_optimizer_state,
    get_step,
    is_finite,
    local_tensor,
    param_groups,
    read_moments,
    set_lr,
    set_step,
    squared_norm,
    write_moments,
)
from bigclip.models.contract import TrainableModel, initial_values


@torch.no_grad()
def init_sharded_weights(model: TrainableModel, *, seed: int, device: torch.device) -> None:
    """Fill each parameter's local shard from the full tensor an unsharded model would draw."""
    params = dict(model.named_parameters())
    shapes = {name: param.shape for name, param in params.items()}
    for name, full in initial_values(model, shapes, seed=seed, device=device):
        param = params[name]
        param.copy_(_placed_like(param, full))


def _placed_like(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """`full` (the same on every rank) as `param` holds it: this rank's cut of it for a DTensor,
    taken locally (no communication), else itself."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


class FSDPEngine(Engine):
    name = "fsdp"

    def __init__(self, cfg: TrainConfig, runtime: Runtime) -> None:
        super().__init__(cfg, runtime)
        self.world_of_one = runtime.world_size == 1  # a plain module, no FSDP2 (module docstring)
        self.masters: MasterWeights | None = None
        self.group: dist.ProcessGroup | None = None  # FSDP2's mesh's, from `_shard`

    def build(
        self, model: TrainableModel, *, rebuild: Callable[[torch.device], TrainableModel] | None = None
    ) -> None:
        if self.cfg.model.torchcompile:
            compile_blocks(list(model.blocks()), self.cfg.model)
        self._shard(model)
        model.to_empty(device=self.runtime.device)
        init_sharded_weights(model, seed=self.cfg.optim.seed, device=self.runtime.device)
        self._adopt(model)

    def _shard(self, model: TrainableModel) -> None:
        """The precision's parameter dtype, then fully_shard per unit of blocks and on the root,
        all on the meta device (the planner's dry run shares this and `_adopt`)."""
        self.precision = Precision.from_name(self.cfg.engine.precision)
        if self.precision.param_dtype != torch.float32:
            model.to(self.precision.param_dtype)
        if self.world_of_one:
            return
        mesh = init_device_mesh(self.runtime.device.type, (self.runtime.world_size,))
        self.group = mesh.get_group()
        p = self.precision
        policy = (
            MixedPrecisionPolicy(param_dtype=p.compute_dtype, reduce_dtype=p.reduce_dtype)
            if p.mixed
            else MixedPrecisionPolicy()
        )
        blocks, n = list(model.blocks()), self.cfg.engine.fsdp_blocks_per_unit
        for unit in (blocks[i : i + n] for i in range(0, len(blocks), n)):
            # Consecutive blocks in one unit: one gather and one reduction for all, fewer hooks.
            fully_shard(
                unit if len(unit) > 1 else unit[0],
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=self.cfg.engine.reshard_after_forward,
            )
        scalars = {model.get_parameter(name) for name in model.replicated_scalars()}
        # The root's parameters are needed again right at the start of backward: keep them gathered.
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=scalars, reshard_after_forward=False)

    def _adopt(self, model: TrainableModel) -> None:
        """The sharded, materialised model becomes this engine's, with its optimizer and loss scaler."""
        self.module = model
        self.replicated = [p for p in model.parameters() if not isinstance(p, DTensor)]
        if self.world_of_one and self.precision.mixed:  # the scalars stay fp32, as FSDP2 leaves them
            scalars = model.replicated_scalars()
            named = ((n, p) for n, p in model.named_parameters() if n not in scalars)
            self.masters = MasterWeights(named, self.precision.compute_dtype)
        # Stepped over each parameter's local shard, not the DTensors: the update is element-wise,
        # and DTensor's dispatch for ~1,000 parameters cost a fifth of the optimizer step's host
        # time (benchmarks/host_overhead.py); bitsandbytes' optimizers cannot step DTensors at all.
        self.optimizer = LocalShardOptimizer(
            param_groups(model, weight_decay=self.cfg.optim.wd), self.cfg.optim, masters=self.masters
        )
        self.scaler = DynamicLossScaler() if self.precision.loss_scaling else None

    @property
    def image_dtype(self) -> torch.dtype:
        """The compute dtype: the root's policy would cast fp32 images to it anyway (same values,
        since the loader normalises in fp32 first), so the loader skips the fp32 copy."""
        return self.precision.compute_dtype

    def forward(self, images: torch.Tensor | None, texts: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return self.module(images, texts)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
        if self.masters:
            self.masters.accumulate_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.world_of_one:  # nothing to reduce
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @torch.no_grad()  # DTensor.to_local outside no_grad is an autograd op per gradient: host time
    def step(self, *, lr: float) -> StepStats:
        self._average_replicated_grads()
        sharded, replicated = self.optimizer.take_grads()
        grads = sharded + replicated
        if self.scaler:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        norm = self._global_grad_norm(sharded, replicated)
        skipped = False
        if self.scaler:
            skipped = not is_finite(norm)  # a host sync, only in fp16 mode
            self.scaler.update(finite=not skipped)
        if not skipped:
            if self.cfg.optim.grad_clip_norm > 0:
                clip_by_total_norm_(grads, norm, self.cfg.optim.grad_clip_norm)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            if self.masters:
                self.masters.copy_to_params()
        self.optimizer.zero_grad(set_to_none=True)
        self.clamp_scalars()
        return StepStats(
            grad_norm=norm, skipped=skipped, loss_scale=self.scaler.scale if self.scaler else 1.0
        )

    def _average_replicated_grads(self) -> None:
        for p in self.replicated:
            if p.grad is not None and self.runtime.world_size > 1:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.group)

    def _global_grad_norm(self, sharded: list[torch.Tensor], replicated: list[torch.Tensor]) -> torch.Tensor:
        """Norm over all gradients: sharded parts summed across ranks, replicated ones counted once."""
        sq = squared_norm(sharded, device=self.runtime.device)
        if self.runtime.world_size > 1:
            dist.all_reduce(sq, group=self.group)
        return (sq + squared_norm(replicated, device=self.runtime.device)).sqrt()

    def model_state_dict(self, options: StateDictOptions | None = None) -> dict[str, Any]:
        """DCP's model state dict, with each parameter's fp32 master where it has one."""
        state = get_model_state_dict(self.module, options=options)
        return {**state, **self.masters.by_name()} if self.masters else state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.model_state_dict(StateDictOptions(full_state_dict=True))
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}  # not the live masters

    def checkpoint_state(self) -> dict[str, Stateful]:
        return {"model": _ModelState(self), "optim": _OptimState(self)}

    def full_param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.module.named_parameters()}  # DTensor: global

    def _set_full_param(self, name: str, full: torch.Tensor) -> None:
        param = self.module.get_parameter(name)
        master = self.masters.master(param) if self.masters else None
        (param if master is None else master).copy_(_placed_like(param, full))

    def _after_full_load(self) -> None:
        if self.masters:
            self.masters.copy_to_params()

    def _param_state(self, param: nn.Parameter) -> dict:
        """The optimizer's state of a parameter's local shard, created if new."""
        optimizer, shard = self.optimizer.inner, self.optimizer.shard(param)
        if not optimizer.state.get(shard):
            create_optimizer_state(optimizer, [shard])
        return optimizer.state[shard]

    def _set_full_moments(self, name: str, moments: dict[str, torch.Tensor]) -> None:
        param = self.module.get_parameter(name)
        state = self._param_state(param)
        current = read_moments(state)
        for key, full in moments.items():
            full = _placed_like(param, full)
            local_tensor(current[key]).copy_(local_tensor(full).reshape(local_tensor(current[key]).shape))
        write_moments(state, current)

    def _after_full_moments(self, step: int) -> None:
        for name in self.trained_names():
            set_step(self._param_state(self.module.get_parameter(name)), step)


class _ModelState(Stateful):
    def __init__(self, engine: FSDPEngine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return self.engine.model_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP loaded the masters in place; this sets the module's parameters (rounded) from them.
        set_model_state_dict(self.engine.module, state_dict)


class _OptimState(Stateful):
    def __init__(self, engine: FSDPEngine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": _local_shard_state_dict(self.engine.module, self.engine.optimizer)}
        if self.engine.scaler:
            state["loss_scaler"] = self.engine.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint's param groups are not loaded: lr is set every step, the rest comes from
        # the flags, and the kernel (fused AdamW) stays this run's whatever wrote the checkpoint.
        _load_local_shard_state(self.engine.module, self.engine.optimizer, state_dict["optimizer"])
        if self.engine.scaler and "loss_scaler" in state_dict:
            self.engine.scaler.load_state_dict(state_dict["loss_scaler"])


def _local_shard_state_dict(model: nn.Module, optimizer: LocalShardOptimizer) -> dict[str, Any]:
    """`get_optimizer_state_dict`'s layout for an optimizer stepped over local shards: fp32
    moments (dequantised for 8-bit) as DTensors placed like their parameters, keyed by name."""
    inner, names = optimizer.inner, {id(p): n for n, p in model.named_parameters()}
    missing = [optimizer.shard(p) for p in optimizer.params if not inner.state.get(optimizer.shard(p))]
    if missing:
        create_optimizer_state(inner, missing)
    state = {}
    for p in optimizer.params:
        shard_state = inner.state[optimizer.shard(p)]
        entry: dict[str, Any] = {"step": torch.tensor(float(get_step(shard_state)))}
        for key, moment in read_moments(shard_state).items():
            local_moment = moment.view(optimizer.shard(p).shape)
            entry[key] = (
                DTensor.from_local(
                    local_moment, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
                if isinstance(p, DTensor)
                else local_moment
            )
        state[names[id(p)]] = entry
    groups = [
        {**{k: v for k, v in hyper.items() if k != "params"}, "params": [names[id(p)] for p in params]}
        for hyper, params in zip(inner.param_groups, optimizer.groups)
    ]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def _load_local_shard_state(model: nn.Module, optimizer: LocalShardOptimizer, saved: dict[str, Any]) -> None:
    _local_shard_state_dict(model, optimizer)  # creates the state if the optimizer has not stepped
    names = {id(p): n for n, p in model.named_parameters()}
    for p in optimizer.params:
        shard_state, entry = optimizer.inner.state[optimizer.shard(p)], saved["state"][names[id(p)]]
        moments = read_moments(shard_state)
        for key, moment in moments.items():
            moment.copy_(local_tensor(entry[key]).reshape(-1).view_as(moment))
        write_moments(shard_state, moments)
        set_step(shard_state, int(entry["step"].item()))
