"""The Checkpointer's cadence on a real CheckpointStore: minutes of training on an injected clock
(no test waits for wall-clock time), what the clock does not count, and ranks that agree on when
to save even when their clocks disagree (two processes over gloo), and on a stop signal one of
them caught. What a failed save means, on the loopback S3 behind the fault proxy: a periodic one
is one warning line and the next save commits; a stop request's raises SaveFailed (the loop then
exits with the requeue code: test_checkpoint_failures.py runs that end to end).
"""

from __future__ import annotations

import logging
import os
import signal
import uuid

import pytest
import torch
from support.s3_fault_proxy import FaultProxy

from bigclip.checkpoint import CheckpointStore
from bigclip.cli_args import parse_train_args
from bigclip.config import CheckpointConfig
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.storage.settings import storage_configured
from bigclip.train import phases
from bigclip.train.checkpoint_contents import TrainState
from bigclip.train.checkpointer import Checkpointer, SaveFailed
from bigclip.train.metrics import Scalars
from bigclip.train.signals import SignalFlag, catch_preemption_signals

MINUTE = 60.0


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, minutes: float) -> None:
        self.now += minutes * MINUTE


class SmallContents:
    """A small real state for the store to write; a save takes `save_minutes` on the clock."""

    def __init__(self, clock: Clock, *, save_minutes: float = 0.0) -> None:
        self.clock, self.save_minutes = clock, save_minutes

    def state(self, train_state: TrainState) -> dict:
        self.clock.advance(self.save_minutes)
        return {"w": torch.full((4,), float(train_state.step)), "train": {"step": train_state.step}}

    def rank_state(self, data_position: dict | None) -> dict:
        return {"data": data_position}

    def meta(self, *, most_recent_only: bool = False) -> dict:
        return {"most_recent_only": most_recent_only}


def checkpoint_flags(*flags: str) -> CheckpointConfig:
    """The checkpoint section as `bigclip train` parses it."""
    return parse_train_args(["--model", "tiny", "--train-data", "d/{0..1}.tar", *flags]).checkpoint


def open_checkpointer(
    root: str, cfg: CheckpointConfig, clock: Clock, preemption: SignalFlag, **contents: float
) -> Checkpointer:
    return Checkpointer(CheckpointStore(root), SmallContents(clock, **contents), cfg=cfg, preemption=preemption,
                        scalars=Scalars([]), clock=clock)  # fmt: skip


@pytest.fixture
def preemption():
    watcher = catch_preemption_signals()
    yield watcher
    watcher.close()  # this process's signal handlers as they were


def test_minutes_of_training_exclude_evaluation_and_the_save_itself(tmp_path, preemption):
    clock = Clock()
    cfg = checkpoint_flags("--save-every-n-minutes", "2.5", "--save-frequency", "0")
    checkpointer = open_checkpointer(str(tmp_path), cfg, clock, preemption, save_minutes=10)
    state, asked, saved = TrainState(), [], []
    for step in range(1, 13):
        clock.advance(1)  # every step takes one minute
        state.step = state.epoch_step = step
        checkpointer.maybe_save(state, data_position=lambda: asked.append(state.step))
        saved += [step] if checkpointer.saved_step == step else []
        if step == 4:
            with checkpointer.paused():  # an evaluation of 100 minutes
                clock.advance(100)
    # Saves at 2.5+ minutes of steps: 3, 6 (not 5: the evaluation does not count), 9 (not 7: nor
    # do the 10 minutes the save at 6 blocked), 12. The data position is asked for only then.
    assert saved == asked == [3, 6, 9, 12]
    checkpointer.save_at_end(state, data_position=lambda: asked.append(-1))  # step 12 is saved
    checkpointer.close()
    assert [step for step, _ in checkpointer.store.committed()] == [12, 9, 6, 3]
    assert asked == [3, 6, 9, 12]


def test_any_save_restarts_the_minutes(tmp_path, preemption):
    clock = Clock()
    cfg = checkpoint_flags("--save-every-n-minutes", "3", "--save-every-n-steps", "4")
    checkpointer = open_checkpointer(str(tmp_path), cfg, clock, preemption)
    state = TrainState()
    for step in range(1, 11):
        clock.advance(1)
        state.step = step
        checkpointer.maybe_save(state, data_position=dict)
    checkpointer.close()
    # 3 (minutes), 4 (steps), then three minutes after 4: 7, then 8 (steps), and no more by 10
    assert [step for step, _ in checkpointer.store.committed()] == [8, 7, 4, 3]


def _ranks_with_different_clocks(rank: int, world: int, root: str) -> dict:
    clock = Clock()
    cfg = checkpoint_flags("--save-every-n-minutes", "2.5")
    checkpointer = open_checkpointer(root, cfg, clock, catch_preemption_signals())
    phases.begin("training", on_stop=phases.OnStop.AT_BOUNDARY, base=True)  # past the first step, as the loop
    state, saved, stop = TrainState(), [], 0
    for step in range(1, 20):
        clock.advance(1 if rank == 0 else 1000 * step)  # rank 1's clock says "save" at every step
        state.step = step
        if step == 7 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # a stop request that reaches one rank only
        stop = checkpointer.maybe_save(state, data_position=dict)
        saved += [step] if checkpointer.saved_step == step else []
        if stop:
            break
    checkpointer.close()
    checkpointer.preemption.close()
    return {"saved": saved, "stop": stop, "committed": [s for s, _ in checkpointer.store.committed()]}


@pytest.mark.dist
def test_ranks_save_on_rank_0s_clock_and_stop_together(tmp_path):
    ranks = spawn(_ranks_with_different_clocks, 2, str(tmp_path), timeout_s=300)
    # A disagreement would hang the collective save (and fail here by the timeout).
    assert ranks[0] == ranks[1] == {"saved": [3, 6, 7], "stop": signal.SIGUSR1, "committed": [7, 6, 3]}


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("checkpointer-tests")
        yield server


@pytest.fixture
def proxy(s3, monkeypatch):
    """The S3 endpoint, with two tries per request (AWS_MAX_ATTEMPTS): a refused save fails in seconds."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with FaultProxy(upstream=s3.endpoint) as p, storage_configured(s3_endpoint=p.endpoint):
        yield p


def fail_saves_of(proxy: FaultProxy, step: int) -> None:
    proxy.add_rule("slowdown", method="PUT", path_contains=f"step_{step:08d}/", times=-1)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_periodic_save_is_one_warning_and_the_next_save_tries_again(proxy, preemption, mode, caplog):
    flags = ["--save-every-n-steps", "2", "--save-frequency", "0"] + (
        ["--async-save"] if mode == "async" else []
    )
    clock, root = Clock(), f"s3://checkpointer-tests/{uuid.uuid4().hex[:8]}"
    checkpointer = open_checkpointer(root, checkpoint_flags(*flags), clock, preemption)
    state = TrainState()
    fail_saves_of(proxy, 4)
    with caplog.at_level(logging.INFO, logger="bigclip"):
        for step in range(1, 5):
            state.step = state.epoch_step = step
            assert checkpointer.maybe_save(state, data_position=dict) == 0
        checkpointer.wait()  # an async failure is said when its upload ends, and not raised
        assert checkpointer.saved_step == 2  # step 4 was not saved: the end may save it
        proxy.clear_rules()
        checkpointer.save_at_end(state, data_position=dict)  # S3 is back: step 4 again, committed
        checkpointer.close()
    assert [step for step, _ in checkpointer.store.committed()] == [4, 2]
    said = [
        r for r in caplog.records if "checkpoint step 4" in r.getMessage() and r.levelno >= logging.WARNING
    ]
    assert len(said) == 1 and "\n" not in said[0].getMessage()
    assert (
        "training goes on, the latest checkpoint stays step 2 and the next save tries again"
        in said[0].getMessage()
    )
    assert "throttling" in said[0].getMessage()  # and why, in a word the user can act on


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_stop_request_save_ends_the_run(proxy, preemption, mode):
    flags = ["--save-every-n-steps", "0", "--save-frequency", "0"] + (
        ["--async-save"] if mode == "async" else []
    )
    root = f"s3://checkpointer-tests/{uuid.uuid4().hex[:8]}"
    checkpointer = open_checkpointer(root, checkpoint_flags(*flags), Clock(), preemption)
    state = TrainState(step=3)
    fail_saves_of(proxy, 3)
    phases.begin("training", on_stop=phases.OnStop.AT_BOUNDARY, base=True)  # past the first step, as the loop
    os.kill(os.getpid(), signal.SIGUSR1)  # what Slurm sends before the time limit
    with pytest.raises(
        SaveFailed, match=r"checkpoint step 3 \(stop requested by SIGUSR1\) failed: .*throttling"
    ):
        checkpointer.maybe_save(state, data_position=dict)
        checkpointer.wait()  # async: the loop waits for the upload before it stops (stop_for_requeue)
    proxy.clear_rules()
    checkpointer.close()
    assert checkpointer.store.committed() == []
