"""DeepSpeed checkpoint state as DCP `Stateful`s keyed by OpenCLIP names with true shapes.

Each rank contributes the fragments it owns (see `deepspeed_layout`) as a `LocalShards` of the
parameter's global shape whose shards are boxes of it. torch.distributed.checkpoint then saves
chunks with global offsets, exactly as it does for FSDP2's DTensors, so:
  - a checkpoint saved at N ranks loads at M ranks (DCP reads whatever chunks overlap);
  - the layout is the FSDP engine's (`model.<name>`, `optim.optimizer.state.<name>.exp_avg`, ...),
    so one consolidation tool reads both and a checkpoint can cross engines;
  - loading is in place: the shard tensors are views of DeepSpeed's master partitions and
    optimizer states, DCP writes into them, and the compute copy is re-derived afterwards;
  - building the state costs each rank O(its own fragments): an entry lists this rank's boxes
    only, never the other ranks' (DCP does not need them), so at 1024 ranks it costs a rank
    what it costs at 16 (benchmarks/scale_zero3_state.py), and DCP's async stager copies it
    to CPU like any DTensor.
0-dim parameters (logit_scale/bias) are saved whole from every rank, as FSDP2 does.

Optimizer states are fp32 "exp_avg"/"exp_avg_sq" per parameter. bitsandbytes' 8-bit AdamW keeps
them block-quantised over the flat partition (256-element blocks that straddle parameters), so
they are dequantised on save and re-quantised on load (`common.read_moments`/`write_moments`)
over whatever blocks the loading world size has: a load moves the moments by at most one 8-bit
rounding (weights and steps stay exact), at any world size and across engines.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from bigclip.engines.deepspeed_layout import ZeroLayout, flat_boxes
from bigclip.engines.local_shards import LocalShards
from bigclip.engines.optimizer import (
    MOMENTS,
    create_optimizer_state,
    get_step,
    read_moments,
    set_step,
    weight_decay_split,
    write_moments,
)


def sharded(layout: ZeroLayout, name: str, local: torch.Tensor | None, *, dtype: torch.dtype) -> LocalShards:
    """Parameter `name` at its true shape, holding this rank's fragment as boxes: views of
    `local` (the fragment, flat). Only this rank's boxes: O(1) in the world size."""
    shape, fragment = layout.shapes[name], layout.local[name]
    device = local.device if local is not None else layout.flats[0].device
    pinned = bool(local is not None and local.is_pinned())
    if fragment is None:
        # A rank without a fragment holds one empty box past the last row, as bigclip's
        # checkpoints have always recorded it (every such rank puts it there, and DCP's save
        # planner merges chunks that share an offset): a checkpoint stays byte for byte what it
        # was. (It was needed when entries were ShardedTensors: DCP drops one without local
        # shards from the state, then misreads the checkpoint as one written before torch 2.4.)
        empty = torch.empty(0, *shape[1:], dtype=dtype, device=device)
        offsets = [shape[0], *[0] * (len(shape) - 1)]
        return LocalShards([empty], [offsets], size=shape, dtype=dtype, device=device, pinned=pinned)
    shards, corners, pos = [], [], 0
    for offsets, sizes in flat_boxes(shape, fragment.start, fragment.start + fragment.numel):
        n = math.prod(sizes)
        shards.append(local[pos : pos + n].view(sizes))
        corners.append(offsets)
        pos += n
    return LocalShards(shards, corners, size=shape, dtype=dtype, device=device, pinned=pinned)


def write_back(value: Any, target: torch.Tensor | None) -> None:
    """Copy a loaded entry's shards into the flat fragment they describe (a no-op when DCP
    already loaded in place, i.e. the shards are views of `target`)."""
    if target is None or not isinstance(value, LocalShards):
        return
    pos = 0
    for shard in value.local_shards():
        piece, n = shard.tensor.reshape(-1), shard.tensor.numel()
        if piece.data_ptr() != target[pos:].data_ptr():
            target[pos : pos + n].copy_(piece)
        pos += n


class DeepSpeedModelState(Stateful):
    """The master weights, one entry per parameter."""

    def __init__(self, layout: ZeroLayout, *, device: torch.device) -> None:
        self.layout, self.device = layout, device

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        dtype = self.layout.flats[0].dtype
        for name in self.layout.params:
            if len(self.layout.shapes[name]) == 0 or name in self.layout.replicated:
                out[name] = self.layout.full_master(name, device=self.device)
            else:
                local = self.layout.master(name)  # frozen ZeRO-3 partitions: compute dtype, so a copy
                local = local.to(dtype) if local is not None and local.dtype != dtype else local
                out[name] = sharded(self.layout, name, local, dtype=dtype)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in state_dict.items():
            if isinstance(value, LocalShards):
                write_back(value, self.layout.master(name))
            else:
                self.layout.write_master(name, value.to(self.device))
        self.layout.refresh_low_precision()


class DeepSpeedOptimState(Stateful):
    """Adam moments and step per parameter, param groups, and the fp16 loss scaler, in the
    layout of `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`."""

    def __init__(
        self, layout: ZeroLayout, optimizer: torch.optim.Optimizer, *, device: torch.device, fp16: bool
    ) -> None:
        self.layout, self.inner, self.device = layout, optimizer, device
        self.loss_scaler = layout.optimizer.loss_scaler if fp16 else None

    def state_dict(self) -> dict[str, Any]:
        ensure_optimizer_state(self.inner, self.layout.flats, self.layout.flat_groups)
        moments = [read_moments(self.inner.state[flat]) for flat in self.layout.flats]
        step = torch.tensor(float(get_step(self.inner.state[self.layout.flats[0]])))
        state = {}
        for name in self.layout.trained:
            state[name] = {"step": step.clone()}
            for key in MOMENTS:
                state[name][key] = self._entry(name, [m[key] for m in moments])
        out: dict[str, Any] = {"optimizer": {"state": state, "param_groups": self._param_groups()}}
        if self.loss_scaler is not None:
            s = self.loss_scaler
            out["loss_scaler"] = {
                "scale": float(s.cur_scale),
                "clean_steps": s.cur_iter - s.last_overflow_iter - 1,
            }
        return out

    def _entry(self, name: str, flats: list[torch.Tensor]) -> Any:
        """One moment of one parameter; `flats` holds it for every flat partition (one dtype:
        fp32, or bf16 under pure_bf16's bf16_optimizer_states)."""
        f = self.layout.local[name]
        local = None if f is None else self.layout.flat_slice(flats[f.flat_index], name)
        if len(self.layout.shapes[name]) == 0:
            return _full_scalar(local, self.layout.group, dtype=flats[0].dtype, device=self.device)
        return sharded(self.layout, name, local, dtype=flats[0].dtype)

    def _param_groups(self) -> list[dict[str, Any]]:
        """bigclip's two groups (no weight decay, weight decay) with the optimizer's hyperparameters."""
        names = weight_decay_split((n, self.layout.shapes[n], n) for n in self.layout.trained)
        groups = []
        for hyper, params in zip(self.inner.param_groups, names):
            groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": params})
        return groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ensure_optimizer_state(self.inner, self.layout.flats, self.layout.flat_groups)
        state = state_dict["optimizer"]["state"]
        for index, flat in enumerate(self.layout.flats):
            moments = read_moments(self.inner.state[flat])
            for name, f in self.layout.local.items():
                if f is None or f.flat_index != index:
                    continue
                for key in MOMENTS:
                    target = self.layout.flat_slice(moments[key], name)
                    value = state[name][key]
                    if isinstance(value, LocalShards):
                        write_back(value, target)
                    else:
                        target.copy_(self.layout.fragment_of(name, value.to(target.device)))
            write_moments(self.inner.state[flat], moments)
            set_step(self.inner.state[flat], int(next(iter(state.values()))["step"].item()))
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            saved = state_dict["loss_scaler"]
            self.loss_scaler.cur_scale = saved["scale"]
            self.loss_scaler.cur_iter, self.loss_scaler.last_overflow_iter = int(saved["clean_steps"]), -1


def _full_scalar(
    local: torch.Tensor | None, group: dist.ProcessGroup | None, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    value = torch.zeros(1, dtype=dtype, device=device)
    if local is not None:
        value.copy_(local)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value.view(())


@torch.no_grad()
def ensure_optimizer_state(
    optimizer: torch.optim.Optimizer, flats: list[torch.Tensor], group_ids: list[int]
) -> None:
    """Create the state of flat partitions that have not stepped yet, changing no parameter, so a
    fresh engine has tensors for DCP to load into (torch's DCP helpers do the same).

    ZeRO-3 puts each sub-group's partition into its optimizer group only while stepping it, so
    the groups are filled here with the missing partitions for the duration."""
    missing = [(flat, gid) for flat, gid in zip(flats, group_ids) if not optimizer.state.get(flat)]
    if not missing:
        return
    saved = [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = []
    for flat, gid in missing:
        optimizer.param_groups[gid]["params"].append(flat)
    try:
        create_optimizer_state(optimizer, [flat for flat, _ in missing])
    finally:
        for g, params in zip(optimizer.param_groups, saved):
            g["params"] = params
