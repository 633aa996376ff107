"""The fault matrix's rows: what each job's output says happened, and their Markdown table
(benchmarks/faults.py runs the jobs)."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from pathlib import Path

DELIVERY = {  # fault -> what Slurm (or the test) sends to whom
    "preempt": "SIGTERM to the job steps (partition preemption, GraceTime 60 s)",
    "requeue": "SIGTERM to every process (scontrol requeue, KillWait 30 s)",
    "term-steps": "SIGTERM to the job steps (scancel --signal=TERM)",
    "time-limit": "SIGUSR1 to the job steps (#SBATCH --signal=USR1@60)",
    "b-time-limit": "SIGUSR1 to the batch shell only (sbatch --signal=B:USR1@60)",
    "usr1-full": "SIGUSR1 to every process (scancel --full --signal=USR1)",
    "usr1-batch": "SIGUSR1 to the batch shell only (scancel --batch --signal=USR1)",
    "term-batch": "SIGTERM to the batch shell only (scancel --batch --signal=TERM)",
    "cancel": "SIGTERM to every process (scancel)",
    "hang": "SIGSTOP to rank 1 (a frozen node)",
    "kill": "SIGKILL to rank 1 (out of memory, a lost node)",
}


@dataclass
class Row:
    fault: str
    layout: str
    engine: str
    workers: int
    outcome: str = "not run"
    signal_seen: str = ""
    stopped_step: int | None = None
    resumed_step: int | None = None
    requeued_by: str = ""
    seconds_to_requeue: float | None = None
    seconds_to_resume: float | None = None
    seconds_to_end: float | None = None  # from the fault to the job leaving the node (kill rows)
    batches_equal: bool | None = None
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.fault}-{self.layout}-{self.engine}-w{self.workers}"

    @property
    def endless(self) -> bool:  # time-driven: trains until the test cancels its rerun
        return self.fault in ("time-limit", "b-time-limit")


def log_time(line: str) -> float:
    stamp = datetime.datetime.strptime(line[:19], "%Y-%m-%d,%H:%M:%S")
    return stamp.timestamp()


def output(row_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in row_dir.glob("*.out"))


def read_outcome(
    row: Row, row_dir: Path, state: str, *, fault_at: float, requeued_at: float, ended_at: float
) -> None:
    """Fill the row from its job's output (the batch script's lines and rank 0's log) and the times
    the driver saw (wall clock; 0: did not happen)."""
    out = output(row_dir)
    stops = [json.loads(m) for m in re.findall(r"asked for a requeue \((\{.*\})\)", out)]
    resumed = [int(s) for s in re.findall(r"resumed \S+ at step (\d+)", out)]
    if stops:
        row.signal_seen = stops[0]["signal"] or stops[0]["reason"]
        row.stopped_step = stops[0]["step"]
    row.resumed_step = resumed[0] if resumed else None
    if "bigclip sbatch: requeued job" in out:
        row.requeued_by = "script"
    elif "SLURM has requeued this job already" in out:
        row.requeued_by = "slurm"
    else:
        row.requeued_by = "none"
    fault_at = fault_at or _signal_arrival(row_dir)
    if fault_at and requeued_at:
        row.seconds_to_requeue = round(requeued_at - fault_at, 1)
    if fault_at and ended_at and not requeued_at:
        row.seconds_to_end = round(ended_at - fault_at, 1)
    resume_lines = [line for line in out.splitlines() if re.search(r"\| resumed \S+ at step", line)]
    if fault_at and resume_lines:
        row.seconds_to_resume = round(log_time(resume_lines[0]) - fault_at, 1)
    row.outcome = _outcome(row, out, state)
    if "ranks [1]" in out:
        row.note = (row.note + "; " if row.note else "") + "the others named rank 1 as not answering"


def _signal_arrival(row_dir: Path) -> float:
    """For time-driven rows: when rank 0 got the signal, from its 'received N s ago' log line."""
    for line in output(row_dir).splitlines():
        found = re.search(r"\| preemption: \w+ received ([\d.]+) s ago", line)
        if found:
            return log_time(line) - float(found.group(1))
    return 0.0


def _outcome(row: Row, out: str, state: str) -> str:
    if row.requeued_by != "none":
        if row.resumed_step is None:
            return "requeued once, restarted from step 0 (no checkpoint yet)"
        at = "the stopped step" if row.resumed_step == row.stopped_step else "the last committed checkpoint"
        return f"requeued once, resumed at {at}"
    if "so it is not requeued" in out:
        return f"checkpointed, not requeued ({state.lower()})"
    return f"job {state.lower()}, not requeued"


def markdown(rows: list[dict]) -> str:
    """The fault matrix as a Markdown table (docs/scale-and-slurm.md renders it)."""
    head = ["fault: what is sent, to whom", "layout", "engine", "workers", "outcome", "signal seen",
            "stopped / resumed step", "requeued by", "s to requeue", "s to the rerun's resume", "batches equal"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        resume = r["seconds_to_resume"] or f"(job ended after {r['seconds_to_end']})"
        cells = [f"`{r['fault']}`: {r['delivery']}", r["layout"], r["engine"], r["workers"], r["outcome"],
                 r["signal_seen"] or "-", f"{r['stopped_step'] or '-'} / {r['resumed_step'] or '-'}",
                 r["requeued_by"], r["seconds_to_requeue"] or "-", resume, "yes" if r["batches_equal"] else "NO"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
