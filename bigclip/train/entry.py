"""The training entry that both doors share: `python -m bigclip.train` (__main__.py, also under
torchrun and the deepspeed launcher's `--module`) and the console script's `bigclip train` (cli.py);
`bigclip eval` is the same entry for a run with no --train-data (it evaluates, trainer.evaluate_only).

One function, so the two behave the same. In order:
1. the stop-signal handlers, before torch is imported (seconds), so a SIGUSR1/SIGTERM/SIGINT during
   start-up is answered (a line at once, exit 85: nothing to checkpoint yet; signals.py) instead
   of killing the rank;
2. the flags, parsed and checked without torch (preflight.check_flags): a bad flag fails in well
   under a second; then what the machine settles (preflight.check_machine: torch, no process group);
3. the loop, under torch.distributed.elastic's `record`, so an unexpected exception lands
   in torchrun's error file and its failure summary.
A BigclipError (bad input) at any step exits 2 with one line and no traceback; under torchrun the
line also goes into the rank's error file (TORCHELASTIC_ERROR_FILE), so the summary torchrun prints
last names it instead of "To enable traceback see ...". Imports only the standard library and
signal-safe, torch-free bigclip modules at module level (tests/test_preemption.py checks the
handlers come before torch, through both doors).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bigclip.errors import BigclipError, StorageError
from bigclip.train.phases import launcher_rank, say
from bigclip.train.signals import REQUEUE_EXIT_CODE, catch_preemption_signals, preemption_flag

if TYPE_CHECKING:
    from bigclip.config import TrainConfig
    from bigclip.train.signals import SignalFlag

EVAL_PROG = "bigclip eval"  # the evaluation-only run by name (cli.py's `eval`)


def main(argv: list[str], *, prog: str = "bigclip train") -> int:
    """Train with `argv`; returns the exit code (85: requeue me). Without --train-data and with an
    evaluation set, the run evaluates its weights and ends (OpenCLIP's evaluation-only run)."""
    try:
        catch_preemption_signals()  # in the try: a signal pending at the unblock raises here
        return _train(argv, prog=prog)
    except BaseException as e:
        # A stop before the first step, however it surfaced: StopRequested, wrapped by a library
        # (DCP re-raises what its load raised as its own error), or a collective that failed first
        # because a peer left for the same signal.
        if preemption_flag().exits_now:
            return stopped_before_training(preemption_flag(), argv)
        peer = preemption_flag().peer_stop()
        if peer:
            return failed_after_peer_stop(e, peer, prog=prog)
        if isinstance(e, BigclipError):
            return refuse(f"{prog}: error: {_explained(e)}")
        raise


def _in_process_group() -> bool:
    """A process group exists already (a caller made it, as tests' spawn does): torch not imported here."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _explained(error: BigclipError) -> str:
    """A storage error that says the endpoint went away is led by what that means (access_checks.py)."""
    if not isinstance(error, StorageError):
        return str(error)
    from bigclip.storage.access_checks import explained

    return explained(error)


def eval_main(argv: list[str]) -> int:
    """`bigclip eval`: the evaluation-only run by name (`bigclip train` with no --train-data)."""
    return main(argv, prog=EVAL_PROG)


def _train(argv: list[str], *, prog: str) -> int:
    cfg = checked_config(argv, prog=prog)
    from torch.distributed.elastic.multiprocessing.errors import record

    from bigclip.train.trainer import main as train

    with _nothing_left_if_refused(cfg):
        return record(train)(cfg)


def checked_config(argv: list[str], *, prog: str = "bigclip train") -> TrainConfig:
    """The flags parsed and checked (no torch), then what the machine settles (torch, no process
    group): every check the trainer leaves to its door, once."""
    from bigclip.cli_args import parse_train_args
    from bigclip.rank_env import check_rendezvous
    from bigclip.train.preflight import check_flags, check_machine

    cfg = parse_train_args(argv, prog=prog if prog == EVAL_PROG else "bigclip train")
    note_run_dir(cfg)
    if prog == EVAL_PROG:
        _check_eval_command(cfg)
    if not _in_process_group():  # else whoever made the group was the launcher
        check_rendezvous(os.environ)  # rank variables set by hand: one line, not torch's traceback later
    check_flags(cfg)
    say("start-up: started (loading torch, then the process group and the checks of data, storage and "
        "the resume target)")  # fmt: skip
    check_machine(cfg)  # torch: only now, and only torch (the trainer's imports take seconds more)
    return cfg


def note_run_dir(cfg: TrainConfig) -> None:
    """Where a stop from now on leaves its requeue marker: LOGS/NAME, which the sbatch script made.
    A kill that reaches one node's ranks alone while they import torch or wait at the rendezvous
    must have the job requeued, not ended FAILED on srun's exit code (signals.py). A run without
    --name is named once its process group is up (trainer.py notes it then)."""
    if cfg.log.name:
        preemption_flag().note(run_dir=Path(cfg.log.logs) / cfg.log.name, rank=launcher_rank())


def _check_eval_command(cfg: TrainConfig) -> None:
    """`bigclip eval` evaluates and never trains: say so rather than start a training run."""
    from bigclip.errors import ConfigError

    if cfg.data.train_data.strip():
        raise ConfigError(
            f"--train-data {cfg.data.train_data!r}: {EVAL_PROG} only evaluates weights; to train, run "
            "`bigclip train` with the same flags"
        )
    if not cfg.data.evaluation_sets():
        weights = cfg.model.pretrained or cfg.checkpoint.resume
        raise ConfigError(
            "nothing to evaluate on: give --val-data SHARDS (retrieval), --imagenet-val DIR or --imagenet-v2 DIR "
            "(zero-shot classification)" + ("" if weights else ", and the weights: --pretrained or --resume")
        )


@contextlib.contextmanager
def _nothing_left_if_refused(cfg: TrainConfig) -> Iterator[None]:
    """A run refused before its folder opens (train/run_dir.py) leaves nothing behind: the checks
    before that make the checkpoint folder (LOGS/NAME/checkpoints or --checkpoint-dir) to probe that
    it is writable; the folders they made are removed. A folder holding a file is never removed."""
    logs = Path(cfg.log.logs)
    runs = {p.name for p in logs.iterdir()} if logs.is_dir() else set()
    made = [_first_missing(logs)]
    if cfg.checkpoint.checkpoint_dir:  # an s3:// URI is no local path, and stays missing
        made.append(_first_missing(Path(cfg.checkpoint.checkpoint_dir)))
    try:
        yield
    except BigclipError:
        if cfg.log.name and cfg.log.name not in runs:  # named once the run starts
            made.append(logs / cfg.log.name)
        for folder in made:
            if folder is not None and _holds_no_file(folder):
                shutil.rmtree(folder, ignore_errors=True)  # every rank may try: all are refused
        raise


def _holds_no_file(folder: Path) -> bool:
    """True for a folder with no file under it. Every refused rank cleans up at once, so another
    rank may remove the folder mid-walk: gone is as good as empty."""
    try:
        return folder.is_dir() and not any(p.is_file() for p in folder.rglob("*"))
    except FileNotFoundError:
        return False  # removed meanwhile: nothing left to do


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None: `path` exists)."""
    missing = None
    for folder in (path.absolute(), *path.absolute().parents):
        if folder.exists():
            return missing
        missing = folder
    return missing


def stopped_before_training(flag: SignalFlag, argv: list[str]) -> int:
    """A stop signal before the first step completed: say so (if the watcher has not yet), leave
    the requeue marker, exit 85 (the requeued run starts where this one did)."""
    flag.say_once()
    if flag.run_dir is None:  # a signal that waited for the handlers: the flags were not read yet
        from bigclip.cli_args import parse_train_args

        # Bad flags: no folder to leave it in, and their error is said when the rerun reads them.
        with contextlib.suppress(Exception, SystemExit), contextlib.redirect_stderr(io.StringIO()):
            note_run_dir(parse_train_args(argv))
    flag.requeue_marker()
    return REQUEUE_EXIT_CODE


def failed_after_peer_stop(error: BaseException, peer: str, *, prog: str) -> int:
    """Set-up failed here because a peer stopped for a signal first (a kill that reached its node
    alone): name that peer rather than leave "Connection closed by peer" as the cause, and exit 85
    like it; its marker has the job requeued."""
    what = _explained(error) if isinstance(error, BigclipError) else f"{type(error).__name__}: {error}"
    what = (what.splitlines() or [""])[0]
    refuse(
        f"{prog}: {peer}; so this rank's set-up failed: {what}; exiting with {REQUEUE_EXIT_CODE} (requeue)"
    )
    return REQUEUE_EXIT_CODE


def refuse(line: str) -> int:
    """Print the one line, leave it in torchrun's error file when there is one; exit code 2."""
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # torchrun's format (ErrorHandler.record_exception): its summary shows "py_callstack".
        info = {"py_callstack": line, "timestamp": str(int(time.time()))}
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": info}}, f)
        except OSError:
            pass  # the line is on stderr already; the summary then says less
    return 2
