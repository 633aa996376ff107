"""DeepSpeed ZeRO engine (stages 1, 2, 3, with CPU offload) behind bigclip's Engine interface.

The config file (ds_configs/) is loaded and checked against bigclip's flags when the engine is
constructed, before any model exists (see `deepspeed_config`). `build` then:
  - ZeRO-1/2: materialises the meta-device model on the device (every rank holds it whole);
  - ZeRO-3: builds it again under `deepspeed.zero.Init`, so each parameter is partitioned as
    soon as its module is constructed and ViT-bigG-14 is never whole on one rank;
  - compiles the residual blocks (--torchcompile), hands model and optimizer to
    `deepspeed.initialize`, and writes the seeded initial weights straight into each rank's
    fp32 master fragment, so the weights do not depend on the world size or the precision
    (the same values the FSDP2 engine and an unsharded model start from).

Accumulation: DeepSpeed sees gradient_accumulation_steps = 1; bigclip's own accumulation
(train_step) marks all but the last backward as non-boundary with
`set_gradient_accumulation_boundary(False)`, DeepSpeed's documented way for a caller to own the
boundary: ZeRO-1 then reduces once per step, ZeRO-2/3 reduce-scatter each backward into
partitioned gradient accumulators (that is how they save memory).

Gradient clipping, fp16 loss scaling and bf16 master weights are DeepSpeed's own, configured
from bigclip's flags. The logit scale is clamped to log(100) after each step, in the master
copy as well, or the next step would undo the clamp.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.engines.base import Engine, StepStats
from bigclip.engines.compile import compile_blocks
from bigclip.engines.deepspeed_config import (
    DeepSpeedPlan,
    ZeroSettings,
    import_deepspeed,
    load_ds_config,
    resolve_ds_config,
)
from bigclip.engines.deepspeed_layout import ZeroLayout
from bigclip.engines.deepspeed_state import DeepSpeedModelState, DeepSpeedOptimState, ensure_optimizer_state
from bigclip.engines.optimizer import (
    Precision,
    make_optimizer,
    param_groups,
    read_moments,
    set_lr,
    set_step,
    write_moments,
)
from bigclip.errors import ConfigError
from bigclip.models.contract import TrainableModel, initial_values, skip_recompute_check


def _check_torch_linear() -> None:
    """Compiled blocks must trace torch's own F.linear: the config turns off ZeRO-3's replacement
    (see deepspeed_config._resolve_linear), but one an earlier ZeRO-3 engine made in this process
    stays (DeepSpeed never puts torch's back)."""
    if torch.nn.functional.linear is not torch._C._nn.linear:
        raise ConfigError(
            "--torchcompile: torch.nn.functional.linear was replaced earlier in this process (by a "
            'DeepSpeed ZeRO-3 engine with "memory_efficient_linear"); build the compiled engine in '
            "a fresh process"
        )


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    @classmethod
    def check_machine(cls, cfg: TrainConfig, *, world_size: int, model_width: int) -> None:
        """The DeepSpeed config against the flags, and the precision against DeepSpeed's accelerator."""
        _resolved(cfg, world_size=world_size, model_width=model_width)
        device = cfg.engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cpu"):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as __init__ does on a CPU device
        import_deepspeed()  # a missing DeepSpeed: one line naming the package
        from deepspeed.accelerator import get_accelerator

        check_supported(cfg, accelerator=get_accelerator())

    @classmethod
    def plan_kind(cls, cfg: TrainConfig, *, gpus: int, model_width: int) -> tuple[str, dict[str, Any]]:
        """zero1, zero2 or zero3, as its JSON asks, and the buckets and offloads it sets."""
        plan = _resolved(cfg, world_size=gpus, model_width=model_width)
        return f"zero{plan.stage}", {"zero": ZeroSettings.of(plan)}

    def __init__(self, cfg: TrainConfig, runtime: Runtime) -> None:
        super().__init__(cfg, runtime)
        if runtime.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed picks its accelerator
        self.deepspeed = import_deepspeed()
        self.precision = Precision.from_name(cfg.engine.precision)
        self.raw_config = load_ds_config(cfg.engine.deepspeed_config)
        # Checked now, before any model; the "auto" sizes that follow the model's width are filled
        # by `resolve_plan` at build.
        self.plan: DeepSpeedPlan = resolve_ds_config(
            self.raw_config,
            cfg,
            world_size=runtime.world_size,
            model_width=None,
            path=cfg.engine.deepspeed_config,
        )
        check_supported(cfg, accelerator=self._accelerator())
        self._pending_moments: dict[int, dict[str, torch.Tensor]] = {}  # see _set_full_moments

    def _accelerator(self) -> Any:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator()

    def resolve_plan(self, model: TrainableModel) -> DeepSpeedPlan:
        """The ds_config with bigclip's flags settled in, its "auto" sizes from the model's width."""
        self.plan = resolve_ds_config(
            self.raw_config, self.cfg, world_size=self.runtime.world_size, model_width=model.hidden_width,
            path=self.cfg.engine.deepspeed_config,
        )  # fmt: skip
        return self.plan

    def build(
        self, model: TrainableModel, *, rebuild: Callable[[torch.device], TrainableModel] | None = None
    ) -> None:
        os.environ.setdefault("LOCAL_RANK", str(self.runtime.local_rank))  # read by zero.Init
        self.resolve_plan(model)
        self.deepspeed.init_distributed(dist_backend=self._backend(), dist_init_required=False)
        with scalar_parameter_fixes():
            model = self._materialise(model, rebuild=rebuild)
            self._prepare_blocks(model)
            groups = param_groups(model, weight_decay=self.cfg.optim.wd)
            client = None if self.plan.deepspeed_builds_optimizer else make_optimizer(groups, self.cfg.optim)
            self.ds_engine, *_ = self.deepspeed.initialize(
                model=model,
                optimizer=client,
                model_parameters=groups if client is None else None,
                config=self.plan.config,
                dist_init_required=False,
            )
        self._check_optimizer_wrapper()
        self.module = self.ds_engine.module
        self.layout = ZeroLayout(self.ds_engine)
        self._initialise_weights()

    def _backend(self) -> str:
        return self.cfg.engine.dist_backend or ("nccl" if self.runtime.device.type == "cuda" else "gloo")

    def _materialise(
        self, model: TrainableModel, *, rebuild: Callable[[torch.device], TrainableModel] | None
    ) -> TrainableModel:
        if self.plan.stage != 3:
            return model.to_empty(device=self.runtime.device) if _on_meta(model) else model
        if rebuild is None:
            raise ValueError("ZeRO-3 creates parameters partitioned: Engine.build needs rebuild=")
        with self.deepspeed.zero.Init(config_dict_or_path=self.plan.config):
            # Inside zero.Init each module's parameters are partitioned right after it is built;
            # the model's own initialisation then touches only empty local tensors, and the
            # real initial values are written into the partitions by `_initialise_weights`.
            partitioned = rebuild(self.runtime.device)
        _check_same_structure(model, partitioned)
        return partitioned

    def _prepare_blocks(self, model: TrainableModel) -> None:
        frozen = any(not p.requires_grad for p in model.parameters())
        if self.plan.stage == 3 and not frozen:
            # Gather each residual block's parameters at once, as FSDP2 does per block: one
            # all-gather per block instead of one per linear/norm, and no ZeRO-3 hooks inside a
            # block, so --torchcompile compiles whole blocks without graph breaks.
            # Not with frozen parameters (--lock-*): DeepSpeed 0.19 reduces a leaf block's
            # gradients from its backward hook, which fires before they exist when the block's
            # input needs no gradient (the first trainable block after frozen ones).
            self.deepspeed.utils.set_z3_leaf_modules(model, list({type(b) for b in model.blocks()}))
        if self.plan.stage == 3 and frozen:
            skip_recompute_check(model.blocks())  # why: see there
        if self.cfg.model.torchcompile:
            _check_torch_linear()
            self.deepspeed.utils.nvtx.enable_nvtx = False  # as engine.compile() does: no graph breaks
            # The forward only: ZeRO-3's gather/release hooks on the block stay eager.
            compile_blocks(list(model.blocks()), self.cfg.model, forward_only=True)

    def _check_optimizer_wrapper(self) -> None:
        kind = type(self.ds_engine.optimizer).__name__
        if kind not in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
            raise ConfigError(
                f"{self.plan.path}: DeepSpeed chose its {kind} wrapper (e.g. bf16 ZeRO-1 with fp32 "
                'gradient accumulation, "data_types.grad_accum_dtype"); bigclip supports the ZeRO optimizers'
            )

    @torch.no_grad()
    def _initialise_weights(self) -> None:
        """Each parameter's full seeded value (one at a time), cut to this rank's fragment."""
        values = initial_values(
            self.module, self.layout.shapes, seed=self.cfg.optim.seed, device=self.runtime.device
        )
        for name, full in values:
            self.layout.write_master(name, full)
        self.layout.refresh_low_precision()

    def forward(self, images: torch.Tensor | None, texts: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return self.ds_engine(images, texts)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds_engine.backward(loss)  # scales by the fp16 loss scale; never by accumulation steps (1)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.ds_engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self.ds_engine.set_gradient_accumulation_boundary(True)

    def step(self, *, lr: float) -> StepStats:
        set_lr(self.ds_engine.optimizer, lr)
        self.ds_engine.step()
        if self.plan.stage == 3:
            # ZeRO-3 copies the first backward's gradient partitions into a persistent buffer and
            # adds the later ones: a parameter with no gradient in the first pass (the logit scale
            # under --accum-freq, see train_step) would add onto the previous step's values.
            self.ds_engine.optimizer.grad_partitions_flat_buffer.zero_()
        for name, (low, high) in self.module.replicated_scalars().items():
            if (low, high) != (None, None):
                self.layout.clamp_(name, low, high)
        norm = self.ds_engine.get_global_grad_norm()
        scale = getattr(self.ds_engine.optimizer, "loss_scale", 1.0)
        return StepStats(
            grad_norm=torch.as_tensor(norm if norm is not None else float("nan")),
            skipped=not self.ds_engine.was_step_applied(),
            loss_scale=float(scale),
        )

    def train(self, mode: bool = True) -> None:
        self.ds_engine.train(mode)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every master weight gathered whole, one parameter at a time, on CPU."""
        return {
            name: self.layout.full_master(name, device=self.runtime.device).cpu()
            for name in self.layout.params
        }

    def full_param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.layout.shapes)

    def _set_full_param(self, name: str, full: torch.Tensor) -> None:
        self.layout.write_master(name, full)  # this rank's fragment of the fp32 master

    def _after_full_load(self) -> None:
        self.layout.refresh_low_precision()  # collective: compute copies from the new masters

    def _set_full_moments(self, name: str, moments: dict[str, torch.Tensor]) -> None:
        f = self.layout.local[name]
        if f is None:
            return
        inner = self.ds_engine.optimizer.optimizer
        ensure_optimizer_state(inner, self.layout.flats, self.layout.flat_groups)
        # One flat partition holds many parameters: its moments are read once (dequantised for
        # 8-bit), filled, and written back in `_after_full_moments`.
        pending = self._pending_moments
        if f.flat_index not in pending:
            pending[f.flat_index] = read_moments(inner.state[self.layout.flats[f.flat_index]])
        for key, full in moments.items():
            self.layout.flat_slice(pending[f.flat_index][key], name).copy_(
                self.layout.fragment_of(name, full)
            )

    def _after_full_moments(self, step: int) -> None:
        inner = self.ds_engine.optimizer.optimizer
        ensure_optimizer_state(inner, self.layout.flats, self.layout.flat_groups)
        for index, moments in self._pending_moments.items():
            write_moments(inner.state[self.layout.flats[index]], moments)
        self._pending_moments = {}
        for flat in self.layout.flats:
            set_step(inner.state[flat], step)

    def checkpoint_state(self) -> dict[str, Any]:
        device = self.runtime.device
        inner = self.ds_engine.optimizer.optimizer
        return {
            "model": DeepSpeedModelState(self.layout, device=device),
            "optim": DeepSpeedOptimState(self.layout, inner, device=device, fp16=self.precision.loss_scaling),
        }


def _resolved(cfg: TrainConfig, *, world_size: int, model_width: int) -> DeepSpeedPlan:
    """--deepspeed-config read and resolved against the flags (before any engine exists)."""
    path = cfg.engine.deepspeed_config
    return resolve_ds_config(
        load_ds_config(path), cfg, world_size=world_size, model_width=model_width, path=path
    )


def check_supported(cfg: TrainConfig, *, accelerator: Any) -> None:
    """Combinations that cannot work, refused before anything is built."""
    if cfg.engine.precision == "amp" and not accelerator.is_fp16_supported():
        raise ConfigError(
            f"--precision amp (fp16) is not supported by DeepSpeed's {accelerator.device_name()} "
            "accelerator; use --precision amp_bf16 (or --engine fsdp)"
        )


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _check_same_structure(expected: nn.Module, built: nn.Module) -> None:
    want = [(n, tuple(p.shape)) for n, p in expected.named_parameters()]
    got = [(n, tuple(getattr(p, "ds_shape", p.shape))) for n, p in built.named_parameters()]
    if want != got:
        raise ValueError(
            "ZeRO-3 rebuilds the model from the run's --model options under deepspeed.zero.Init, "
            "and that model differs from the one passed to build()"
        )


@contextlib.contextmanager
def scalar_parameter_fixes() -> Iterator[None]:
    """DeepSpeed 0.19 broadcasts parameters as `p.data.view(torch.uint8)`, which raises for 0-dim
    tensors such as CLIP's logit_scale (engine start-up for ZeRO-1/2, zero.Init for ZeRO-3).
    For the duration of engine construction, those broadcasts see 0-dim parameters as 1-element
    views; shapes recorded by DeepSpeed are unchanged."""
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.engine import DeepSpeedEngine as Engine_
    from deepspeed.runtime.zero.partition_parameters import Init

    broadcast_model, zero_init_param = Engine_._broadcast_model, Init._zero_init_param

    def _broadcast_model(engine: Any) -> None:
        scalars = [p for p in engine.module.parameters() if p.dim() == 0]
        saved = [p.data for p in scalars]
        for p in scalars:
            p.data = p.data.view(1)
        try:
            broadcast_model(engine)
        finally:
            for p, data in zip(scalars, saved):
                p.data = data

    def _zero_init_param(init: Any, param: nn.Parameter) -> None:
        if param.dim() != 0:
            return zero_init_param(init, param)
        init._convert_to_deepspeed_param(param)  # records the true (0-dim) shape
        group = init.get_partition_dp_group(param)
        src = 0 if ds_dist.get_world_group() == group else ds_dist.get_global_rank(group, 0)
        ds_dist.broadcast(param.data.view(1).view(torch.uint8), src, group)
        param.partition()

    Engine_._broadcast_model, Init._zero_init_param = _broadcast_model, _zero_init_param
    try:
        yield
    finally:
        Engine_._broadcast_model, Init._zero_init_param = broadcast_model, zero_init_param
