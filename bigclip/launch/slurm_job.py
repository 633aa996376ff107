"""A `bigclip slurm` job and what its plan says about it: whether it fits (else the plan's advice
for its largest term), how long the ranks take to checkpoint after a signal, and how many times the
script may requeue it.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bigclip.config import TrainConfig
from bigclip.errors import ConfigError

if TYPE_CHECKING:
    from bigclip.plan.planner import Plan

NODE_UPLOAD_BYTES_PER_S = 500e6  # a conservative S3 upload rate for one node's checkpoint shards
CHECKPOINT_FLOOR_S = 120
# Requeues the script makes before it stops (a job that asks for a requeue at every run, e.g. a node
# that hangs each time, would otherwise cycle for ever): at least this many, more for long runs.
MIN_REQUEUE_CAP = 100


@dataclass(frozen=True)
class Job:
    nodes: int
    gpus_per_node: int
    ranks_per_node: int = 0  # 0: one per GPU
    gres: str = ""  # "": --gpus-per-node; "none": no GPU request; else a --gres spec
    launcher: str = "srun"
    time: str = "24:00:00"
    signal_seconds: int = 600
    checkpoint_seconds: int = 0  # 0: planned from the model and world size
    cpus_per_gpu: int = 12
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclusive: bool = True
    job_name: str = ""
    python: str = "python"
    setup: str = ""  # a shell line run before launching (e.g. `source .venv/bin/activate`)
    gpu_memory_gib: float = 80.0  # what the plan must fit in, per GPU
    force: bool = False  # render a plan that does not fit, over an existing -o file
    chdir: str = ""  # the job's working directory ("": the current one)
    max_requeues: int = 0  # 0: planned (`requeue_cap`)

    @property
    def ranks(self) -> int:
        """Ranks per node."""
        return self.ranks_per_node or self.gpus_per_node

    @property
    def world(self) -> int:
        return self.nodes * self.ranks


def time_seconds(value: str) -> int:
    """Slurm's D-HH:MM:SS (or HH:MM:SS) in seconds."""
    found = re.fullmatch(r"(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})", value)
    if not found:
        raise ConfigError(f"--time {value!r}: use HH:MM:SS or D-HH:MM:SS")
    days, hours, minutes, seconds = (int(x or 0) for x in found.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def job_plan(cfg: TrainConfig, job: Job) -> Plan:
    """`bigclip plan` for this job, sized with FSDP2's sharding: ZeRO's per-rank share is within 15%
    of it, and planning ZeRO would import DeepSpeed to resolve its config (seconds) just to render."""
    from bigclip.plan.planner import Hardware, build_plan
    from bigclip.plan.spec import from_train_config

    as_fsdp = copy.deepcopy(cfg)
    as_fsdp.engine.engine = "fsdp"
    return build_plan(from_train_config(as_fsdp, gpus=job.world), Hardware(gpu_memory_gib=job.gpu_memory_gib))


def planned_checkpoint_seconds(plan: Plan, job: Job) -> int:
    """Seconds from a signal to the ranks' exit: finish the step, save and upload one node's shards
    (at NODE_UPLOAD_BYTES_PER_S, S3 requests at the per-prefix rate), twice over, at least 120."""
    if job.checkpoint_seconds:
        return job.checkpoint_seconds
    from bigclip.plan.planner import S3_WRITES_PER_PREFIX_PER_S

    upload = plan.checkpoint_rank0_bytes * job.ranks / NODE_UPLOAD_BYTES_PER_S
    requests = plan.s3_requests_per_save / S3_WRITES_PER_PREFIX_PER_S
    return max(CHECKPOINT_FLOOR_S, math.ceil(2 * (upload + requests + plan.step_time_s)))


def check_plan(job: Job, plan: Plan) -> int:
    """Refuse a job that cannot run as planned; returns the planned checkpoint seconds."""
    if job.gpus_per_node and not plan.fits and not job.force:
        from bigclip.plan.advice import advise
        from bigclip.plan.planner import build_plan

        advice = advise(plan, build_plan, gpus_word=f"twice the nodes (--nodes {2 * job.nodes})").text()
        raise ConfigError(
            f"the plan needs {plan.memory.peak / 2**30:.1f} GiB per GPU, more than --gpu-memory-gib "
            f"{job.gpu_memory_gib:g} leaves ({plan.hardware.headroom:.0%} kept free); {advice} "
            "(`bigclip plan` with the same flags shows every term), or pass --force"
        )
    checkpoint_s = planned_checkpoint_seconds(plan, job)
    if job.signal_seconds < checkpoint_s:
        raise ConfigError(
            f"--signal-seconds {job.signal_seconds} is shorter than the planned checkpoint time ({checkpoint_s} s): "
            "the time limit would cut the checkpoint short; raise it, or set --checkpoint-seconds"
        )
    return checkpoint_s


def requeue_cap(cfg: TrainConfig, job: Job, plan: Plan) -> tuple[int, str]:
    """The most requeues the script makes, and why that many (a line of the script's header)."""
    if job.max_requeues:
        return job.max_requeues, "--max-requeues"
    from bigclip.plan.planner import human_duration, run_steps

    steps = run_steps(cfg, gpus=job.world)
    if steps is None:
        return MIN_REQUEUE_CAP, "the default; the run's length is unknown without --train-num-samples"
    seconds = steps * plan.step_time_s
    runs = math.ceil(seconds / (time_seconds(job.time) - job.signal_seconds))
    why = (
        f"{steps:,} steps of {plan.step_time_s:.2f} s, {human_duration(seconds)}: {runs} run(s) of {job.time}"
    )
    if 2 * runs <= MIN_REQUEUE_CAP:
        return MIN_REQUEUE_CAP, f"the default; the plan needs {why}"
    return 2 * runs, f"twice the runs the plan needs, {why}"
