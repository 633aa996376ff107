"""`bigclip slurm`: render an sbatch script for a multi-node run from training flags.

    bigclip slurm --nodes 128 --gpus-per-node 8 --model ViT-bigG-14 --engine fsdp [training flags] \\
        [--launcher srun|torchrun] [--time 24:00:00] [--partition P] [--account A] [-o job.sbatch]

The training flags are parsed (and so checked) by bigclip's own parser, then written back in
canonical form (`cli_args.to_argv`) into the script's TRAIN_ARGS. Requeueing needs the rerun to
find the same checkpoints, so the script always trains with `--resume latest` and a fixed
`--name` (the job name unless given) under a fixed `--logs`. Launch layouts:
  srun      one task per GPU; bigclip reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
  torchrun  one task per node running torchrun with the c10d rendezvous on the first node.
The template (bigclip/launch/slurm_template.py) carries the preemption and requeue logic.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bigclip.cli_args import parse_train_args, to_argv
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.launch.slurm_template import BODY, HEADER, SRUN_LAUNCH, TORCHRUN_LAUNCH, fill

LAUNCHERS = ("srun", "torchrun")


@dataclass(frozen=True)
class Job:
    nodes: int
    gpus_per_node: int
    launcher: str = "srun"
    time: str = "24:00:00"
    signal_seconds: int = 600
    cpus_per_gpu: int = 12
    partition: str = ""
    account: str = ""
    job_name: str = ""
    python: str = "python"
    setup: str = ""  # a shell line run before launching (e.g. `source .venv/bin/activate`)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bigclip slurm",
        description="Render an sbatch script: the options below, plus any `bigclip train` flag.",
    )
    p.add_argument("--nodes", type=int, required=True, help="Nodes to allocate.")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node (one rank each).")
    p.add_argument("--launcher", choices=LAUNCHERS, default="srun", help="Process layout (see module doc).")
    p.add_argument("--time", default=Job.time, help="Time limit per job run, HH:MM:SS or D-HH:MM:SS.")
    p.add_argument("--signal-seconds", type=int, default=Job.signal_seconds,
                   help="SIGUSR1 this long before the time limit: checkpoint, exit, requeue.")  # fmt: skip
    p.add_argument("--cpus-per-gpu", type=int, default=Job.cpus_per_gpu, help="CPU cores per rank.")
    p.add_argument("--partition", default="", help="SLURM partition.")
    p.add_argument("--account", default="", help="SLURM account.")
    p.add_argument("--job-name", default="", help="Job name (default: MODEL-ENGINE-GPUS).")
    p.add_argument("--python", default="python", help="Python interpreter on the nodes.")
    p.add_argument(
        "--setup", default="", help="Shell line run first on each job, e.g. 'source .venv/bin/activate'."
    )
    p.add_argument("-o", "--output", default="", help="Write the script here (default: stdout).")
    return p


def validate_job(job: Job) -> Job:
    if job.nodes < 1 or job.gpus_per_node < 1 or job.cpus_per_gpu < 1:
        raise ConfigError("--nodes, --gpus-per-node and --cpus-per-gpu must be at least 1")
    if job.signal_seconds < 60:
        raise ConfigError("--signal-seconds below 60 leaves too little time to checkpoint before the limit")
    if not re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", job.time):
        raise ConfigError(f"--time {job.time!r}: use HH:MM:SS or D-HH:MM:SS")
    if job.job_name and not re.fullmatch(r"[A-Za-z0-9._-]+", job.job_name):
        raise ConfigError(f"--job-name {job.job_name!r}: use letters, digits, '.', '_' and '-'")
    return job


def default_job_name(cfg: TrainConfig, job: Job) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{cfg.model.model}-{cfg.engine.engine}-{job.world}gpu")


def requeue_ready(cfg: TrainConfig, name: str) -> TrainConfig:
    """The run settings a requeued job needs to find its own checkpoints again."""
    if cfg.checkpoint.resume not in ("", "latest"):
        raise ConfigError(
            f"--resume {cfg.checkpoint.resume!r}: a requeued job must resume its own latest checkpoint; "
            "start from other weights with --pretrained, or use --checkpoint-dir pointing at that run"
        )
    cfg.checkpoint.resume = "latest"
    cfg.log.name = cfg.log.name or name
    return cfg


def train_args_lines(cfg: TrainConfig) -> str:
    argv, lines = to_argv(cfg), []
    i = 0
    while i < len(argv):  # one flag (and its value) per line
        flag = argv[i]
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        pair = [flag, argv[i + 1]] if has_value else [flag]
        lines.append("    " + " ".join(shlex.quote(x) for x in pair))
        i += len(pair)
    return "\n".join(lines)


def render(job: Job, cfg: TrainConfig, *, command: str = "", title: str = "") -> str:
    name = job.job_name or default_job_name(cfg, job)
    cfg = requeue_ready(cfg, name)
    srun = job.launcher == "srun"
    extra = [f"#SBATCH --partition={job.partition}"] * bool(job.partition)
    extra += [f"#SBATCH --account={job.account}"] * bool(job.account)
    values = {
        "TITLE": title or f"{cfg.model.model} on {job.nodes} x {job.gpus_per_node} GPUs, {name}",
        "COMMAND": command, "JOB_NAME": name,
        "NODES": str(job.nodes), "TASKS_PER_NODE": str(job.gpus_per_node if srun else 1),
        "GPUS_PER_NODE": str(job.gpus_per_node),
        "CPUS_PER_TASK": str(job.cpus_per_gpu * (1 if srun else job.gpus_per_node)),
        "TIME": job.time, "SIGNAL_SECONDS": str(job.signal_seconds), "OUTPUT": "%x-%j.out",
        "EXTRA_SBATCH": "".join(line + "\n" for line in extra), "LOGS": cfg.log.logs, "NAME": cfg.log.name,
        "OMP_THREADS": str(max(1, job.cpus_per_gpu // 2)),
        "ENV_SETUP": job.setup + "\n" if job.setup else "", "WORLD": str(job.world),
        "TRAIN_ARGS": train_args_lines(cfg), "PYTHON": job.python,
    }  # fmt: skip
    launch = fill(SRUN_LAUNCH if srun else TORCHRUN_LAUNCH, values)
    return fill(HEADER, values) + fill(BODY, {**values, "LAUNCH": launch})


def _check_safe_values(cfg: TrainConfig) -> None:
    """Values that land in the script unquoted (inside double quotes) must not expand."""
    for value, flag in ((cfg.log.logs, "--logs"), (cfg.log.name, "--name")):
        if re.search(r'[$`"\\\n]', value):
            raise ConfigError(f"{flag} {value!r}: no $, `, \\, quotes or newlines in paths the script uses")


def _without_output(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith(("--output=", "-o=")):
            skip = False
            continue
        if arg in ("-o", "--output"):
            skip = True
            continue
        out.append(arg)
    return out


def main(argv: list[str]) -> int:
    args, train_argv = job_parser().parse_known_args(argv)
    job = validate_job(Job(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, launcher=args.launcher, time=args.time,
        signal_seconds=args.signal_seconds, cpus_per_gpu=args.cpus_per_gpu, partition=args.partition,
        account=args.account, job_name=args.job_name, python=args.python, setup=args.setup,
    ))  # fmt: skip
    cfg = parse_train_args(train_argv)
    _check_safe_values(cfg)
    script = render(job, cfg, command=" ".join(shlex.quote(a) for a in _without_output(argv)))
    if args.output:
        Path(args.output).write_text(script)
        print(f"wrote {args.output}: sbatch {args.output}", file=sys.stderr)
    else:
        print(script, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
