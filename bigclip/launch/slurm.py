"""`bigclip slurm`: render an sbatch script for a multi-node run from training flags.

    bigclip slurm --nodes 128 --gpus-per-node 8 --model ViT-bigG-14 --engine fsdp [training flags] \\
        [--launcher srun|torchrun|deepspeed] [--time 24:00:00] [--partition P] [--account A] [--qos Q] \\
        [--constraint C] [--gres none|SPEC] [-o job.sbatch]

The training flags are parsed (and so checked) by bigclip's own parser, then written back into the
script's TRAIN_ARGS with every option explicit and every local path absolute (launch/recipe_args.py),
so the job trains the same wherever it is submitted from and whatever bigclip's defaults become; the
script runs in --chdir (default: the current directory). Requeueing needs the rerun to find the
same checkpoints, so the script always trains with `--resume latest` and a fixed `--name` (the job
name unless given) under a fixed `--logs`; it requeues itself at most --max-requeues times (default:
MIN_REQUEUE_CAP, or twice the job runs the plan needs at its step time). Launch layouts:
  srun      one task per rank; bigclip reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
  torchrun  one task per node running torchrun with the c10d rendezvous on the first node.
  deepspeed one task per node running DeepSpeed's launcher (`deepspeed --no_ssh`, node rank
            SLURM_NODEID) with a hostfile the script writes; launch/deepspeed_node.py says why
            it holds back SIGTERM/SIGUSR1 from the launchers.
Resources: one rank per GPU, requested as `--gpus-per-node` unless `--gres` says otherwise
(`--gres none` for clusters without GPU GRES, or a GRES spec such as gpu:a100:8);
`--gpus-per-node 0 --ranks-per-node N` for CPU partitions.
The template (bigclip/launch/slurm_template.py) carries the preemption and requeue logic; the
planned checkpoint time (`planned_checkpoint_seconds`) sets torchrun's shutdown timeout and is
checked against --signal-seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path

from bigclip.cli_args import ArgumentParser, parse_train_args
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.launch.recipe_args import train_args_lines, with_absolute_paths
from bigclip.launch.slurm_job import MIN_REQUEUE_CAP, Job, check_plan, job_plan, requeue_cap, time_seconds
from bigclip.launch.slurm_template import BODY, DEEPSPEED_LAUNCH, HEADER, SRUN_LAUNCH, TORCHRUN_LAUNCH, fill

LAUNCHERS = {"srun": SRUN_LAUNCH, "torchrun": TORCHRUN_LAUNCH, "deepspeed": DEEPSPEED_LAUNCH}
# After the requeue marker, how long the script waits for the launcher before it stops waiting (a
# lost node's tasks never end): room for start-up noise, a slow step, a retried upload.
LAUNCHER_GRACE_S = 30
# The least time a job run must have between its start and the SIGUSR1 before its limit: a time
# limit inside the signal window would signal the job before it trains, and requeue it forever.
MIN_TRAIN_WINDOW_S = 60
SBATCH_VALUE = re.compile(r"[^\s'\"\\$`]+")  # values that land unquoted on #SBATCH lines


def job_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="bigclip slurm",
        description="Render an sbatch script: the options below, plus any `bigclip train` flag.",
    )
    p.add_argument("--nodes", type=int, required=True, help="Nodes to allocate.")
    p.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs per node, one rank each (0: a CPU partition; give --ranks-per-node).")  # fmt: skip
    p.add_argument("--ranks-per-node", type=int, default=0, help="Ranks per node (default: one per GPU).")
    p.add_argument("--gres", default="", help="GPU request: 'none' (no GRES on this cluster) or a spec "
                   "such as gpu:a100:8 (default: --gpus-per-node).")  # fmt: skip
    p.add_argument("--launcher", choices=LAUNCHERS, default="srun", help="Process layout (see module doc).")
    p.add_argument("--time", default=Job.time, help="Time limit per job run, HH:MM:SS or D-HH:MM:SS.")
    p.add_argument("--signal-seconds", type=int, default=Job.signal_seconds,
                   help="SIGUSR1 this long before the time limit: checkpoint, exit, requeue.")  # fmt: skip
    p.add_argument("--checkpoint-seconds", type=int, default=0,
                   help="Time the ranks may take to checkpoint after a signal (torchrun's shutdown "
                   "timeout; default: planned from the model and world size, at least 120).")  # fmt: skip
    p.add_argument("--cpus-per-gpu", type=int, default=Job.cpus_per_gpu, help="CPU cores per rank.")
    for name in ("partition", "account", "qos", "constraint"):
        p.add_argument(f"--{name}", default="", help=f"SLURM --{name} (passed through).")
    p.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=True,
                   help="Whole nodes (default); --no-exclusive lets other jobs share them.")  # fmt: skip
    p.add_argument("--job-name", default="", help="Job name (default: MODEL-ENGINE-GPUS).")
    p.add_argument("--python", default="python", help="Python interpreter on the nodes.")
    p.add_argument(
        "--setup", default="", help="Shell line run first on each job, e.g. 'source .venv/bin/activate'."
    )
    p.add_argument("--gpu-memory-gib", type=float, default=Job.gpu_memory_gib,
                   help="Memory per GPU the run's plan must fit in (`bigclip plan` computes it).")  # fmt: skip
    p.add_argument("--chdir", default="", metavar="DIR",
                   help="The job's working directory (#SBATCH --chdir); relative paths in the training "
                   "flags are made absolute against it. (default: the current directory)")  # fmt: skip
    p.add_argument("--max-requeues", type=int, default=0, metavar="N",
                   help=f"Requeue the job at most N times, then stop saying so (default: {MIN_REQUEUE_CAP}, or "
                   "twice the job runs the plan needs when more).")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="Render a plan that does not fit --gpu-memory-gib, and over an existing -o file.")  # fmt: skip
    p.add_argument("-o", "--output", default="",
                   help="Write the script here, creating its folder (default: stdout).")  # fmt: skip
    return p


def validate_job(job: Job) -> Job:
    if job.nodes < 1 or job.cpus_per_gpu < 1 or job.gpus_per_node < 0 or job.ranks_per_node < 0:
        raise ConfigError(
            "--nodes and --cpus-per-gpu must be at least 1, --gpus-per-node and --ranks-per-node 0 or more"
        )
    if job.ranks < 1:
        raise ConfigError("--gpus-per-node 0 (a CPU partition) needs --ranks-per-node N")
    if job.max_requeues < 0:
        raise ConfigError(f"--max-requeues {job.max_requeues}: give 1 or more, or 0 for the planned cap")
    if job.signal_seconds < 60:
        raise ConfigError("--signal-seconds below 60 leaves too little time to checkpoint before the limit")
    _check_time(job)
    if job.job_name and not re.fullmatch(r"[A-Za-z0-9._-]+", job.job_name):
        raise ConfigError(f"--job-name {job.job_name!r}: use letters, digits, '.', '_' and '-'")
    for flag in ("gres", "partition", "account", "qos", "constraint", "chdir"):
        value = getattr(job, flag)
        if value and not SBATCH_VALUE.fullmatch(value):
            raise ConfigError(
                f"--{flag} {value!r}: no spaces, quotes, $, ` or \\ (it is written on a #SBATCH line)"
            )
    return job


def _check_time(job: Job) -> None:
    limit = time_seconds(job.time)
    if limit < job.signal_seconds + MIN_TRAIN_WINDOW_S:
        raise ConfigError(
            f"--time {job.time} ({limit} s) leaves no time to train before the SIGUSR1 --signal-seconds "
            f"{job.signal_seconds} sends ahead of it (each run would be signalled at once and requeued forever); "
            f"give --time of at least {job.signal_seconds + MIN_TRAIN_WINDOW_S} s or a smaller --signal-seconds"
        )


def default_job_name(cfg: TrainConfig, job: Job) -> str:
    unit = "gpu" if job.gpus_per_node else "rank"
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{cfg.model.model}-{cfg.engine.engine}-{job.world}{unit}")


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


def resource_lines(job: Job) -> str:
    lines = []
    if job.gpus_per_node and job.gres != "none":
        lines.append(f"--gres={job.gres}" if job.gres else f"--gpus-per-node={job.gpus_per_node}")
    lines.append(f"--cpus-per-task={job.cpus_per_gpu * (1 if job.launcher == 'srun' else job.ranks)}")
    return "".join(f"#SBATCH {line}\n" for line in lines)


def render(job: Job, cfg: TrainConfig, *, command: str = "") -> str:
    name = job.job_name or default_job_name(cfg, job)
    chdir = Path(job.chdir or os.getcwd()).expanduser().absolute()
    if not SBATCH_VALUE.fullmatch(str(chdir)):
        raise ConfigError(f"the job's working directory {str(chdir)!r} holds a space, a quote, $, ` or \\ (it is "
                          "written on a #SBATCH line): give --chdir DIR without them")  # fmt: skip
    cfg = with_absolute_paths(requeue_ready(cfg, name), chdir)
    _check_safe_values(cfg)
    plan = job_plan(cfg, job)
    checkpoint_s = check_plan(job, plan)
    cap, cap_why = requeue_cap(cfg, job, plan)
    extra = [f"#SBATCH --{flag}={getattr(job, flag)}" for flag in ("partition", "account", "qos", "constraint")
             if getattr(job, flag)]  # fmt: skip
    values = {
        "TITLE": f"{cfg.model.model} on {job.nodes} x {job.gpus_per_node or job.ranks} "
        f"{'GPUs' if job.gpus_per_node else 'CPU ranks'}, {name}",
        "COMMAND": command, "JOB_NAME": name, "NODES": str(job.nodes),
        "TASKS_PER_NODE": str(job.ranks if job.launcher == "srun" else 1), "RANKS_PER_NODE": str(job.ranks),
        "RESOURCES": resource_lines(job), "EXCLUSIVE": "#SBATCH --exclusive\n" * job.exclusive, "TIME": job.time, "SIGNAL_SECONDS": str(job.signal_seconds),
        "CHECKPOINT_SECONDS": str(checkpoint_s), "OUTPUT": "%x-%j.out",
        "EXTRA_SBATCH": "".join(line + "\n" for line in extra), "LOGS": cfg.log.logs, "NAME": cfg.log.name,
        "OMP_THREADS": str(max(1, job.cpus_per_gpu // 2)),
        "ENV_SETUP": job.setup + "\n" if job.setup else "", "WORLD": str(job.world),
        "TRAIN_ARGS": train_args_lines(cfg), "PYTHON": job.python, "LAUNCHER_GRACE": str(LAUNCHER_GRACE_S),
        "CHDIR": str(chdir), "MAX_REQUEUES": str(cap), "MAX_REQUEUES_WHY": cap_why,
    }  # fmt: skip
    launch = fill(LAUNCHERS[job.launcher], values)
    return fill(HEADER, values) + fill(BODY, {**values, "LAUNCH": launch})


def _check_has_data(cfg: TrainConfig) -> None:
    """A job without data would start, fail and be requeued."""
    if not cfg.data.train_data:
        raise ConfigError("no --train-data: the job would start, fail and be requeued; give the shards, e.g. "
                          "--train-data 's3://bucket/laion/{00000..41407}.tar'")  # fmt: skip


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
    options = {k: v for k, v in vars(args).items() if k != "output"}
    job = validate_job(Job(**options))
    cfg = parse_train_args(train_argv)
    _check_has_data(cfg)
    if args.output:
        _check_output(Path(args.output), force=job.force)
    # Planning imports torch (seconds on a cold node): said on stderr, the script may be on stdout.
    start = time.monotonic()
    print(f"bigclip slurm: planning {cfg.model.model} on {job.world} ranks (memory per GPU, checkpoint time; "
          "loading torch...)", file=sys.stderr, flush=True)  # fmt: skip
    script = render(job, cfg, command=" ".join(shlex.quote(a) for a in _without_output(argv)))
    took = f"rendered in {time.monotonic() - start:.1f} s"
    if args.output:
        _write(Path(args.output), script)
        print(f"wrote {args.output} ({took}): sbatch {args.output}", file=sys.stderr)
    else:
        print(script, end="")
        print(f"bigclip slurm: {took}", file=sys.stderr)
    return 0


def _write(path: Path, script: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
    except OSError as e:
        raise ConfigError(
            f"-o {path}: cannot write it ({e.strerror}); give a path in a writable folder"
        ) from None


def _check_output(path: Path, *, force: bool) -> None:
    if path.is_dir():
        raise ConfigError(f"-o {path}: a folder; give the script's file name, e.g. -o {path / 'job.sbatch'}")
    if path.exists() and not force:
        raise ConfigError(f"-o {path}: the file exists; give another name, or --force to replace it")
    folder = next(p for p in path.absolute().parents if p.exists())  # the one mkdir would start from
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"-o {path}: cannot create it under {folder}; give a path in a writable folder")
