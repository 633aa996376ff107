"""Run the real training entry point on real ranks (bigclip.distributed.spawn) over demo data."""

from __future__ import annotations

from typing import Any

from bigclip.cli_args import parse_train_args
from bigclip.train.entry import checked_config
from bigclip.train.trainer import train


def train_worker(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """Worker for spawn: the same code path as `torchrun -m bigclip.train -- ARGV`."""
    return train(checked_config(argv))


def demo_argv(demo_data, tmp_path, *extra: str, name: str = "run") -> list[str]:
    return [
        "--model", "tiny", "--train-data", demo_data.train_pattern, "--val-data", demo_data.val_pattern,
        "--precision", "fp32", "--batch-size", "32", "--workers", "1", "--epochs", "1", "--lr", "2e-3",
        "--warmup", "5", "--log-every-n-steps", "5", "--logs", str(tmp_path), "--name", name,
        "--local-loss", "--gather-with-grad", *extra,
    ]  # fmt: skip


def train_and_weights(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """Worker: train, then return the summary with the full weights (rank 0)."""
    from bigclip.train.trainer import fit, setup

    run = setup(parse_train_args(argv))
    summary = fit(run)
    weights = run.engine.full_state_dict()
    return {**summary, "weights": weights if rank == 0 else None}


def resume_and_inspect(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """Worker: set up with --resume and report what was restored, before any step."""
    from bigclip.train.trainer import close_run, setup

    run = setup(parse_train_args(argv))
    weights = run.engine.full_state_dict()
    close_run(run)
    return {
        "state": vars(run.progress.state).copy(),
        "data_position": run.progress.data_position,
        "weights": weights if rank == 0 else None,
    }
