"""Bad `bigclip slurm` renderings: contradictions between the time limit, the signal and the planned
checkpoint, no data, a plan that does not fit (with the advice for its largest term), a requeue cap
or working directory that cannot be, and `-o` paths, each one line before anything is written (an
existing script stays as it was).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.bad_input import SETTLED_BEFORE_WORK_S, Case, bigclip, check
from support.no_torch import refusals_without_torch

DATA = ("--train-data", "s3://bucket/laion/{00000..41407}.tar")
JOB = ("--nodes", "2", "--gpus-per-node", "8")
# Rows whose check needs the plan (`bigclip plan`): the planner imports torch, torch.distributed.tensor
# (engines.optimizer) and builds the model on the meta device: about 4 s on an idle 2-core box, 10 s at a
# load of 7. Every other row is settled by the flags, before torch (test_flag_settled_refusals_import_no_torch).
PLAN_S = 15.0


def slurm(name: str, *flags: str, says: tuple[str, ...], job: tuple[str, ...] = JOB, **kw) -> Case:
    return Case(name, bigclip("slurm", *job, *flags), says, **kw)


CASES = [
    slurm("time-inside-signal-window", *DATA, "--time", "00:05:00",
          says=("--time 00:05:00 (300 s)", "--signal-seconds 600", "requeued forever", "at least 660 s")),
    slurm("time-equal-to-signal", *DATA, "--time", "00:10:00", says=("--time 00:10:00", "at least 660 s")),
    slurm("time-inside-short-signal", *DATA, "--time", "00:01:30", "--signal-seconds", "60",
          says=("--time 00:01:30 (90 s)", "at least 120 s")),
    slurm("time-unparsable", *DATA, "--time", "a day", says=("--time 'a day'", "HH:MM:SS")),
    slurm("time-minutes-only", *DATA, "--time", "90", says=("--time '90'", "HH:MM:SS")),
    slurm("signal-too-short", *DATA, "--signal-seconds", "30", says=("--signal-seconds below 60",)),
    slurm("no-train-data", says=("no --train-data", "--train-data 's3://")),
    slurm("signal-shorter-than-checkpoint", *DATA, "--model", "ViT-bigG-14", "--batch-size", "160",
          "--grad-checkpointing", "--signal-seconds", "60", job=("--nodes", "1", "--gpus-per-node", "8"),
          says=("--signal-seconds 60 is shorter than the planned checkpoint time", "--checkpoint-seconds"),
          max_s=PLAN_S),
    slurm("plan-does-not-fit", *DATA, "--model", "ViT-bigG-14", "--batch-size", "512",
          job=("--nodes", "1", "--gpus-per-node", "1"),
          says=("GiB per GPU, more than --gpu-memory-gib 80", "--grad-checkpointing", "--force"), max_s=PLAN_S),
    slurm("plan-does-not-fit-small-gpu", *DATA, "--model", "ViT-L-14", "--batch-size", "256",
          "--gpu-memory-gib", "16", says=("more than --gpu-memory-gib 16", "bigclip plan"), max_s=PLAN_S),
    slurm("plan-does-not-fit-loss", *DATA, "--model", "ViT-bigG-14", "--batch-size", "160", "--grad-checkpointing",
          job=("--nodes", "128", "--gpus-per-node", "8"),
          says=("its largest term is the loss buffers", "--loss-chunk-size 1024 (peak", "--force"), max_s=PLAN_S),
    slurm("max-requeues-negative", *DATA, "--max-requeues", "-1", says=("--max-requeues -1", "give 1 or more")),
    slurm("chdir-with-space", *DATA, "--chdir", "/my jobs", says=("--chdir '/my jobs'", "no spaces")),
    slurm("output-exists", *DATA, "-o", "job.sbatch", says=("-o job.sbatch: the file exists", "--force")),
    slurm("output-is-a-folder", *DATA, "-o", "scripts", says=("-o scripts: a folder", "scripts/job.sbatch")),
    slurm("output-under-a-file", *DATA, "-o", "notes.txt/job.sbatch",
          says=("-o notes.txt/job.sbatch: cannot create it", "writable folder")),
    slurm("resume-elsewhere", *DATA, "--resume", "s3://other/run/step_00000100",
          says=("--resume 's3://other/run/step_00000100'", "its own latest checkpoint", "--pretrained")),
    slurm("nodes-zero", *DATA, job=("--nodes", "0", "--gpus-per-node", "8"), says=("--nodes", "at least 1")),
    slurm("cpu-partition-without-ranks", *DATA, job=("--nodes", "2", "--gpus-per-node", "0"),
          says=("--gpus-per-node 0", "--ranks-per-node N")),
    slurm("constraint-with-space", *DATA, "--constraint", "a100 ib", says=("--constraint 'a100 ib'", "no spaces")),
    slurm("job-name-with-space", *DATA, "--job-name", "my run", says=("--job-name 'my run'", "letters, digits")),
    slurm("logs-with-dollar", *DATA, "--logs", "/scratch/$USER/logs", says=("--logs '/scratch/$USER/logs'", "no $")),
    slurm("launcher-unknown", *DATA, "--launcher", "mpirun", says=("--launcher", "invalid choice: 'mpirun'")),
    slurm("nodes-missing", *DATA, job=("--gpus-per-node", "8"), says=("required: --nodes", "bigclip slurm --help")),
    slurm("unknown-flag", *DATA, "--gpus-per-nodes", "8", says=("unrecognized arguments: --gpus-per-nodes", "--help")),
    slurm("deepspeed-without-config", *DATA, "--engine", "deepspeed", says=("--engine deepspeed needs --deepspeed-config",)),
    slurm("bad-train-flag", *DATA, "--lr", "nan", says=("--lr nan", "finite number")),
]  # fmt: skip


@pytest.fixture(scope="module")
def home(module_tmp) -> Path:
    home = module_tmp("slurm")
    (home / "job.sbatch").write_text("#!/bin/bash\n# an earlier job script\n")
    (home / "scripts").mkdir()
    (home / "notes.txt").write_text("not a folder\n")
    return home


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_rendering(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])
    assert sorted(p.name for p in home.iterdir()) == ["job.sbatch", "notes.txt", "scripts"]


def test_flag_settled_refusals_import_no_torch(home: Path) -> None:
    """Every row but the plan's is refused without importing torch (which alone costs seconds)."""
    rows = [c for c in CASES if c.max_s <= SETTLED_BEFORE_WORK_S]
    result = refusals_without_torch(rows, cwd=home)
    assert result["torch"] is False, f"torch was imported by row {list(result['codes'])[-1]}"
    assert result["codes"] == {c.name: c.code for c in rows}


def test_output_folder_is_created_and_force_replaces(home: Path, tmp_path: Path) -> None:
    """The two -o behaviours beside the refusals: a missing folder is made; --force overwrites."""
    from bigclip.launch.slurm import main

    out = tmp_path / "new" / "deeper" / "job.sbatch"
    assert main([*JOB, *DATA, "-o", str(out)]) == 0 and out.read_text().startswith("#!/bin/bash")
    out.write_text("old\n")
    assert main([*JOB, *DATA, "-o", str(out), "--force"]) == 0 and out.read_text() != "old\n"
