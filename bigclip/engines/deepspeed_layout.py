"""Where each parameter lives inside a DeepSpeed ZeRO engine, addressed by OpenCLIP name.

ZeRO keeps the master (fp32, "hp") weights as flat partitions, one per optimizer parameter
group (ZeRO-1/2: the group's parameters concatenated and cut into world-size pieces; ZeRO-3:
each parameter cut into ceil(numel / world) pieces, concatenated per sub-group). Either way
this rank owns one contiguous row-major range [start, start + numel) of each parameter it
touches: a `Fragment`. The fragment addresses come from DeepSpeed's own bookkeeping:
  ZeRO-1/2  `param._hp_mapping` (lp_fragment_address in the parameter, hp_fragment_address in
            the flat partition; the same objects `deepspeed.utils.safe_get_full_fp32_param` uses)
  ZeRO-3    the partition rank and `partition_numel()` of the parameter, and the optimizer's
            `grad_position` (sub-group, offset) that `safe_get_local_fp32_param` reads.
Views into the flat partitions (`master`, `flat_slice`) are real views, so writing through them
updates DeepSpeed's state in place; `refresh_low_precision` then re-derives the compute copy
(bf16/fp16 or fp32 parameters) from the masters, as DeepSpeed does after an optimizer step.

Frozen parameters (--lock-image/--lock-text) are in no optimizer group, so they have no master
copy: DeepSpeed keeps them in the compute dtype only. Under ZeRO-3 they are partitioned like the
others and their "master" here is the partition itself (`ds_tensor`); under ZeRO-1/2 every rank
holds them whole (`replicated`), and they are saved and loaded whole, as 0-dim parameters are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Fragment:
    start: int  # first element (row-major) of the parameter owned by this rank
    numel: int
    flat_index: int  # which flat master partition holds it (a key of the optimizer's state)
    flat_offset: int  # where in that partition it starts


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[list[int], list[int]]]:
    """A row-major range [start, end) of a tensor as boxes (offsets, sizes), in order.

    A range of a 2-d tensor is at most three boxes (a partial first row, whole rows, a partial
    last row); each extra dimension adds at most two more, peeled the same way."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [([start], [end - start])] if shape else [([], [])]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def in_row(row: int, lo: int, hi: int) -> list[tuple[list[int], list[int]]]:
        return [([row, *o], [1, *s]) for o, s in flat_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    boxes = []
    if c0:
        boxes += in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(([r0] + [0] * (len(shape) - 1), [r1 - r0, *shape[1:]]))
    if c1:
        boxes += in_row(r1, 0, c1)
    return boxes


class ZeroLayout:
    """This rank's fragment of every parameter of a DeepSpeed engine (built from this rank's own
    bookkeeping: no collective, nothing per other rank)."""

    def __init__(self, ds_engine: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        self.optimizer = ds_engine.optimizer
        self.stage = int(ds_engine.zero_optimization_stage())
        self.group = group
        self.params: dict[str, nn.Parameter] = dict(ds_engine.module.named_parameters())
        self.frozen = {n for n, p in self.params.items() if not p.requires_grad}
        self.replicated = self.frozen if self.stage != 3 else set()  # whole on every rank
        if self.stage == 3:
            self.flats = list(self.optimizer.fp32_partitioned_groups_flat)
            self.shapes = {n: tuple(p.ds_shape) for n, p in self.params.items()}
            self.local = {n: self._zero3_fragment(n, p) for n, p in self.params.items()}
            sub_groups = self.optimizer.sub_group_to_group_id
            self.flat_groups = [sub_groups[i] for i in range(len(self.flats))]
        else:
            self.flats = list(self.optimizer.single_partition_of_fp32_groups)
            self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
            self.local = {n: self._zero12_fragment(p) for n, p in self.params.items()}
            self.local |= {n: Fragment(0, self.params[n].numel(), -1, 0) for n in self.replicated}
            self.flat_groups = list(range(len(self.flats)))  # optimizer group of each flat partition

    @property
    def trained(self) -> list[str]:
        """Names of the parameters the optimizer updates (and holds state for), in model order."""
        return [n for n in self.params if n not in self.frozen]

    @staticmethod
    def _zero12_fragment(param: nn.Parameter) -> Fragment | None:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        return Fragment(lp.start, lp.numel, mapping.param_group_index, hp.start)

    def _zero3_fragment(self, name: str, param: nn.Parameter) -> Fragment | None:
        if name in self.frozen:  # partitioned like the others, in no optimizer sub-group
            sub_group, offset, partition = -1, 0, param.ds_tensor.ds_numel
        else:
            sub_group, offset, partition = self.optimizer.grad_position[self.optimizer.get_param_id(param)]
        start = dist.get_rank(group=param.ds_process_group) * partition
        numel = min(partition, param.ds_numel - start)  # the last partitions hold padding
        return Fragment(start, numel, sub_group, offset) if numel > 0 else None

    def flat_slice(self, flat: torch.Tensor, name: str) -> torch.Tensor | None:
        """This rank's fragment of `name` inside a flat tensor shaped like a master partition
        (the partition itself, or an optimizer state of it); a detached view."""
        f = self.local[name]
        return None if f is None else flat.detach().narrow(0, f.flat_offset, f.numel)

    def master(self, name: str) -> torch.Tensor | None:
        """This rank's fragment of the weights the optimizer steps (a frozen parameter's own storage)."""
        f = self.local[name]
        if f is None:
            return None
        if name in self.frozen:
            param = self.params[name]
            data = param.ds_tensor.data if self.stage == 3 else param.data
            return data.detach().reshape(-1).narrow(0, 0, f.numel)
        return self.flat_slice(self.flats[f.flat_index], name)

    def fragment_of(self, name: str, full: torch.Tensor) -> torch.Tensor | None:
        """This rank's range of a full-size tensor of parameter `name`, flattened."""
        f = self.local[name]
        return None if f is None else full.reshape(-1)[f.start : f.start + f.numel]

    @torch.no_grad()
    def write_master(self, name: str, full: torch.Tensor) -> None:
        """Set this rank's master fragment from a full-size value (no communication).
        Call `refresh_low_precision` once after the last write."""
        piece = self.fragment_of(name, full)
        if piece is not None:
            self.master(name).copy_(piece)

    @torch.no_grad()
    def full_master(self, name: str, *, device: torch.device) -> torch.Tensor:
        """Collective: the whole master value of one parameter (fragments summed into zeros)."""
        flat = self.master(name)
        dtype = self.flats[0].dtype
        full = torch.zeros(math.prod(self.shapes[name]), dtype=dtype, device=device)
        f = self.local[name]
        if f is not None:
            full[f.start : f.start + f.numel].copy_(flat)
        if dist.get_world_size(self.group) > 1 and name not in self.replicated:
            dist.all_reduce(full, group=self.group)
        return full.view(self.shapes[name])

    @torch.no_grad()
    def refresh_low_precision(self) -> None:
        """Collective: re-derive the compute parameters from the (changed) master weights."""
        if self.stage != 3:
            self.optimizer.update_lp_params()  # copy into the bit16 partition, all-gather the groups
            return
        self.optimizer.checkpoint_event_prologue()  # release any gathered parameters
        for name in self.trained:  # a frozen parameter's "master" is its partition itself
            master = self.master(name)
            if master is not None:
                self.params[name].ds_tensor.data[: master.numel()].copy_(master)
        self.optimizer.checkpoint_event_epilogue()  # re-gather the persistent (small) parameters

    @torch.no_grad()
    def clamp_(self, name: str, low: float, high: float) -> None:
        """Clamp a parameter everywhere it is stored (master, partition, gathered copy)."""
        param = self.params[name]
        master = self.master(name)
        if master is not None:
            master.clamp_(low, high)
        if self.stage == 3:
            param.ds_tensor.data.clamp_(low, high)
        if param.data.numel() == math.prod(self.shapes[name]):
            param.data.clamp_(low, high)
