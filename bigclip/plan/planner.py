"""`bigclip plan`: per-GPU memory, FLOPs, step time and checkpoint traffic of a run, before running it.

    bigclip plan --gpus 1024 --gpu-memory-gib 80 --model ViT-bigG-14 --batch-size 160 \\
        --grad-checkpointing --loss-chunk-size 1024 [any other training flag]   [--dry-run] [--json]

It takes the training command's own flags, so the plan describes the run they would start.
All it knows of the model is the model's static shape (`ModelShape`, models/shape.py, from the
--model name's family): it builds no model, except for --dry-run.
Memory (rank 0, the largest shard) comes from `plan_state` (model state, replaying each engine's
sharding; checked against a fake-process-group dry run of the real engines, `--dry-run`) and
`plan_memory` (activations from each block's saved tensors, loss and communication buffers).
FLOPs count every matmul of the forward (2 per multiply-add; patch dropout shortens the vision
sequence), x3 for forward + backward; recomputation under --grad-checkpointing is hardware work,
not model work, so it is not in the model FLOPs that MFU divides. Checkpoints hold, per parameter,
the master weight and two Adam moments (4 + 8 bytes; 2 + 4 with pure_bf16). S3 requests follow what
a save does (measured against a loopback endpoint, tests/test_plan.py): per rank its objects'
and its record's multipart uploads of (2 + parts) requests each (objects and parts as
storage/save_requests.py cuts them), under a key prefix of its own; rank 0 adds the step
folder's listing, `.metadata` and the manifest (checkpoint_cost.py, with what rank 0 does alone
per save, what a rank reads to resume, and whether a stop request's save fits a preemption
window). The chunked loss's exchange is
priced in bytes sent per GPU and seconds at --link-gbps (plan/comm.py). The run's length is its
optimizer steps (`run_steps`: what ends it first, --max-steps or its epochs of --train-num-samples,
counted as the loader counts them) at the planned step time, and its GPU-hours those hours times
the GPUs. A plan that does not fit prints the advice for its largest term (advice.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from bigclip.config import TrainConfig
from bigclip.models.flops import forward_flops as model_forward_flops
from bigclip.plan.advice import advise
from bigclip.plan.checkpoint_cost import PREEMPTION_WINDOW_S, CheckpointCost, checkpoint_cost
from bigclip.plan.comm import loss_exchange_bytes, transfer_seconds
from bigclip.plan.engine_plan import engine_plan
from bigclip.plan.memory import MemoryPlan, plan_memory, recomputed_flops
from bigclip.plan.options import Hardware, PlanOptions
from bigclip.plan.spec import PlanSpec, dtype_bytes, from_train_config
from bigclip.storage.save_requests import files_for, upload_requests

GiB = 2**30
S3_WRITES_PER_PREFIX_PER_S = 3500  # AWS's documented PUT/COPY/POST/DELETE rate per partitioned prefix


@dataclass(frozen=True)
class Plan:
    spec: PlanSpec
    hardware: Hardware
    memory: MemoryPlan
    forward_flops_per_sample: float
    checkpoint_total_bytes: int
    checkpoint_rank0_bytes: int
    s3_requests_per_save: int
    loss_exchange_bytes: int | None  # sent per rank per step by the chunked loss (plan/comm.py)
    checkpoint: CheckpointCost | None = None  # coordination, requests per prefix, resume reads

    @property
    def fits(self) -> bool:
        usable = self.hardware.gpu_memory_gib * (1 - self.hardware.headroom) * GiB
        return self.memory.peak <= usable

    @property
    def model_flops_per_step(self) -> float:
        return 3 * self.forward_flops_per_sample * self.spec.global_batch

    @property
    def recomputed_flops_per_step(self) -> float:
        """Hardware work --grad-checkpointing adds (not in MFU's numerator): compare settings by it."""
        return recomputed_flops(self.spec)

    @property
    def step_time_s(self) -> float:
        per_gpu = self.model_flops_per_step / self.spec.gpus
        return per_gpu / (self.hardware.mfu * self.hardware.peak_tflops * 1e12)

    @property
    def loss_exchange_s(self) -> float | None:
        """The loss exchange's time per step at --link-gbps (not in step_time_s: the ring overlaps it)."""
        if self.loss_exchange_bytes is None:
            return None
        return transfer_seconds(self.loss_exchange_bytes, link_gbps=self.hardware.link_gbps)


def run_steps(cfg: TrainConfig, *, gpus: int) -> int | None:
    """Optimizer steps the run takes: --max-steps, or all its epochs when they end it first (each of
    --train-num-samples // global micro-batch // --accum-freq steps, at least one, as the training
    loop counts them); None when neither --max-steps nor --train-num-samples says."""
    samples, max_steps = cfg.data.train_num_samples, cfg.optim.max_steps
    if not samples:
        return max_steps or None
    per_epoch = max(1, samples // (cfg.data.batch_size * gpus) // cfg.optim.accum_freq)
    return min(max_steps, per_epoch * cfg.optim.epochs) if max_steps else per_epoch * cfg.optim.epochs


def human_duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days ({seconds / 3600:,.0f} h)"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def run_rows(plan: Plan, steps: int | None, *, bounded: bool = False) -> list[tuple[str, str]]:
    """The run's steps, length and GPU-hours at the planned step time. `bounded`: --max-steps is
    known but not the epochs' length, so the run may end sooner."""
    if steps is None:
        return [("run time", "unknown: give --train-num-samples (or --max-steps) to price the whole run")]
    hours = steps * plan.step_time_s / 3600
    up_to = "at most " if bounded else ""
    return [
        ("optimizer steps", f"{up_to}{steps:,}"),
        (f"run time at {plan.hardware.mfu:.0%} MFU", up_to + human_duration(hours * 3600)),
        ("GPU-hours", f"{up_to}{hours * plan.spec.gpus:,.0f} ({plan.spec.gpus:,} GPUs)"),
    ]


def forward_flops(spec: PlanSpec) -> float:
    """Forward FLOPs of one image-text pair of the planned model (see models/flops.py)."""
    return model_forward_flops(spec.model_shape())


def s3_requests(object_sizes: list[int], *, part_size: int) -> int:
    """Requests of one rank's multipart uploads (create, parts, complete)."""
    return sum(upload_requests(size, part_bytes=part_size) for size in object_sizes)


def build_plan(spec: PlanSpec, hardware: Hardware) -> Plan:
    params = spec.model_shape().params
    per_element = 3 * dtype_bytes(spec.dtypes.param_dtype)  # master weight + two moments
    rank0 = engine_plan(spec.engine).rank0_numel(spec, params) * per_element
    objects = spec.io_threads or files_for(rank0)
    files = [math.ceil(rank0 / objects)] * objects
    part = int(hardware.part_size_mib * 2**20)
    plan = Plan(
        spec=spec,
        hardware=hardware,
        memory=plan_memory(spec, params),
        forward_flops_per_sample=forward_flops(spec),
        checkpoint_total_bytes=sum(p.numel for p in params) * per_element,
        checkpoint_rank0_bytes=rank0,
        s3_requests_per_save=spec.gpus * s3_requests(files, part_size=part),  # + records, rank 0's: below
        loss_exchange_bytes=loss_exchange_bytes(spec),
    )
    cost = checkpoint_cost(
        spec, rank_bytes=rank0, part_bytes=part, objects_per_rank=objects, step_s=plan.step_time_s
    )
    if cost is None:
        return plan
    requests = spec.gpus * cost.rank_prefix_writes + cost.step_folder_writes
    return replace(plan, checkpoint=cost, s3_requests_per_save=requests)


def human_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def report_rows(plan: Plan) -> list[tuple[str, str]]:
    """The plan as (quantity, value) rows, for the terminal and the README."""
    m, s = plan.memory, plan.memory.state
    gib = human_bytes
    phase = "end of forward" if m.forward_peak >= m.step_peak else "optimizer step"
    verdict = "yes" if plan.fits else "NO"
    rows = [
        ("parameters", gib(s.parameters)),
        ("gradients", gib(s.gradients)),
        ("optimizer state", gib(s.optimizer)),
        ("activations", gib(m.activations + m.backward_workspace)),
        ("loss buffers", gib(m.loss_buffers)),
        ("communication buffers", gib(m.communication)),
        ("optimizer-step temporaries", gib(m.step_temporaries)),
        ("peak per GPU", f"{gib(m.peak)} ({phase})"),
        (
            f"fits {plan.hardware.gpu_memory_gib:g} GiB",
            f"{verdict} ({1 - plan.hardware.headroom:.0%} usable)",
        ),
    ]
    if s.host_total:
        rows.append(("CPU memory per rank (offload)", gib(s.host_total)))
    return rows + _throughput_rows(plan) + _checkpoint_rows(plan)


def _throughput_rows(plan: Plan) -> list[tuple[str, str]]:
    hw = plan.hardware
    return [
        ("global batch", f"{plan.spec.global_batch:,}"),
        ("model FLOPs per step", f"{plan.model_flops_per_step:.3e}"),
        (
            "recomputed by checkpointing",
            f"{plan.recomputed_flops_per_step:.3e} (+{plan.recomputed_flops_per_step / plan.model_flops_per_step:.0%})",
        ),
        (f"step time at {hw.mfu:.0%} MFU", f"{plan.step_time_s:.2f} s ({hw.peak_tflops:g} TFLOP/s peak)"),
        ("samples per second", f"{plan.spec.global_batch / plan.step_time_s:,.0f}"),
        ("loss exchange per step", _exchange_text(plan)),
    ]


def _exchange_text(plan: Plan) -> str:
    if plan.loss_exchange_s is None:
        return "not priced (unchunked loss)"
    sent = human_bytes(plan.loss_exchange_bytes or 0)
    return f"{sent} sent per GPU, {plan.loss_exchange_s:.3f} s at {plan.hardware.link_gbps:g} Gbit/s"


def _checkpoint_rows(plan: Plan) -> list[tuple[str, str]]:
    cost = plan.checkpoint
    how = (
        f"{cost.rank_prefix_writes} per rank under its own prefix, {cost.step_folder_writes} more from rank 0"
        if cost
        else "the ranks' shards only"
    )
    rows = [
        ("checkpoint size", f"{plan.checkpoint_total_bytes / GiB:.1f} GiB"),
        ("checkpoint per rank", human_bytes(plan.checkpoint_rank0_bytes)),
        ("S3 requests per save", f"{plan.s3_requests_per_save:,} ({how})"),
    ]
    return rows + _coordination_rows(plan.checkpoint)


def _coordination_rows(cost: CheckpointCost | None) -> list[tuple[str, str]]:
    if cost is None:
        return [("checkpoint coordination", "not priced for this engine (its layout is not simulated)")]
    fits = "fits" if cost.fits_window else "does NOT fit"
    return [
        (".metadata", f"{human_bytes(cost.metadata_bytes)}, assembled by rank 0 from every rank's piece"),
        ("rank 0 alone per save", f"{cost.rank0_serial_s:.1f} s (joins and hashes .metadata, one report per rank)"),
        ("S3 writes per prefix per save",
         f"{cost.rank_prefix_writes} on each rank's own, {cost.step_folder_writes} on the step folder (S3: ~3,500/s each)"),
        ("resume reads per rank", f"{human_bytes(cost.resume_read_bytes)} of metadata and state besides its shards"),
        ("save after a stop request",
         f"~{cost.save_s:.0f} s (a step, the upload, rank 0's commit): {fits} a {PREEMPTION_WINDOW_S} s preemption window"),
    ]  # fmt: skip


def format_rows(rows: list[tuple[str, str]], *, markdown: bool = False) -> str:
    if markdown:
        return "\n".join(["| quantity | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def to_json(plan: Plan) -> dict[str, Any]:
    m = plan.memory
    return {
        "spec": asdict(plan.spec),
        "hardware": asdict(plan.hardware),
        "memory_bytes": {
            **asdict(m.state),
            "activations": m.activations,
            "backward_workspace": m.backward_workspace,
            "loss_buffers": m.loss_buffers,
            "communication": m.communication,
            "step_temporaries": m.step_temporaries,
            "persistent_gradients": m.persistent_gradients,
            "forward_peak": m.forward_peak,
            "step_peak": m.step_peak,
            "peak": m.peak,
        },  # fmt: skip
        "fits": plan.fits,
        "forward_flops_per_sample": plan.forward_flops_per_sample,
        "model_flops_per_step": plan.model_flops_per_step,
        "recomputed_flops_per_step": plan.recomputed_flops_per_step,
        "step_time_s": plan.step_time_s,
        "checkpoint_total_bytes": plan.checkpoint_total_bytes,
        "checkpoint_rank0_bytes": plan.checkpoint_rank0_bytes,
        "s3_requests_per_save": plan.s3_requests_per_save,
        "loss_exchange_bytes": plan.loss_exchange_bytes,
        "loss_exchange_s": plan.loss_exchange_s,
        "checkpoint_coordination": asdict(plan.checkpoint) if plan.checkpoint else None,
    }


def dry_run_rows(plan: Plan, train_argv: list[str]) -> list[tuple[str, str]]:
    from bigclip.plan.dryrun import run_dry_run

    measured = run_dry_run(["--gpus", str(plan.spec.gpus), *train_argv], progress=True)
    rows = []
    for key in ("parameters", "gradients", "optimizer"):
        planned = getattr(plan.memory.state, key) + getattr(plan.memory.state, f"host_{key}")
        error = planned / measured[key] - 1 if measured[key] else 0.0
        rows.append((f"dry run: {key}", f"{measured[key] / 2**20:.2f} MiB (plan {error:+.2%})"))
    return rows


def print_plan(options: PlanOptions) -> int:
    """`bigclip plan`'s output for options parsed and checked by plan/options.py."""
    plan = build_plan(from_train_config(options.train, gpus=options.gpus), options.hardware)
    steps = run_steps(options.train, gpus=options.gpus)
    bounded = steps is not None and not options.train.data.train_num_samples
    if options.json:
        hours = steps * plan.step_time_s / 3600 if steps is not None else None
        run = {"optimizer_steps": steps, "steps_bounded": bounded, "run_time_s": hours and hours * 3600,
               "gpu_hours": hours and hours * plan.spec.gpus}  # fmt: skip
        print(json.dumps({**to_json(plan), **run}, indent=2))
        return 0
    rows = report_rows(plan) + run_rows(plan, steps, bounded=bounded)
    if options.dry_run:
        rows += dry_run_rows(plan, options.train_argv)
    print(f"{plan.spec.model} on {plan.spec.gpus} GPUs, {plan.spec.engine}, {plan.spec.precision}, rank 0:")
    print(format_rows(rows, markdown=options.markdown))
    if not plan.fits:
        print(f"\ndoes not fit: {advise(plan, build_plan).text()}")
    if plan.checkpoint is not None and not plan.checkpoint.fits_window:
        print(f"\nwarning: a stop request's save takes ~{plan.checkpoint.save_s:.0f} s, longer than a "
              f"{PREEMPTION_WINDOW_S} s preemption window: give the partition a longer GraceTime (and the "
              "script a larger --signal-seconds), or checkpoint to faster storage")  # fmt: skip
    return 0
