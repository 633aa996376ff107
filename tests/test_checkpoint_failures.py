"""A training run whose checkpoints S3 refuses (503 SlowDown past every try), end to end.

Two real ranks train with async saves to the loopback S3 behind the fault proxy. The periodic
save at step 4 is throttled for good: one warning line, and training goes on; step 8 commits. The
final save (step 12) is throttled too: the run ends with the requeue code (85) and the requeue
marker the sbatch scripts look for, its latest checkpoint still step 8. The requeued run (S3 is
back) resumes there and commits the final checkpoint.
"""

from __future__ import annotations

import json
import uuid

import pytest
from support.s3_fault_proxy import FaultProxy
from support.train_harness import demo_argv

from bigclip.checkpoint import CheckpointStore
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.train.preemption import REQUEUE_EXIT_CODE, REQUEUE_MARKER

pytestmark = pytest.mark.dist


def _train(rank: int, world: int, argv: list[str]) -> int:
    """The exit code `python -m bigclip.train ARGV` would end with (entry.main: the same door)."""
    from bigclip.train.entry import main

    return main(argv)


def test_refused_saves_go_on_periodically_and_requeue_at_the_end(demo_data, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # a refused save fails in seconds, not minutes
    with LoopbackS3() as s3, FaultProxy(upstream=s3.endpoint) as proxy:
        root = f"{s3.create_bucket('failed-saves')}/{uuid.uuid4().hex[:8]}"
        argv = demo_argv(demo_data, tmp_path, "--max-steps", "12", "--save-every-n-steps", "4", "--save-frequency",
                         "0", "--async-save", "--resume", "latest", "--checkpoint-dir", root, "--s3-endpoint",
                         proxy.endpoint, name="refused")  # fmt: skip
        for step in (4, 12):
            proxy.add_rule("slowdown", method="PUT", path_contains=f"step_{step:08d}/", times=-1)
        assert spawn(_train, 2, argv) == [REQUEUE_EXIT_CODE] * 2
        store = CheckpointStore(root)
        assert [step for step, _ in store.committed()] == [8]
        marker = json.loads((tmp_path / "refused" / REQUEUE_MARKER).read_text())
        assert marker["step"] == 12 and marker["reason"] == "checkpoint failed"
        log = (tmp_path / "refused" / "out.log").read_text()
        said = [line for line in log.splitlines() if "checkpoint step 4 (every 4 steps) failed" in line]
        assert len(said) == 1 and "WARNING" in said[0] and "training goes on" in said[0]
        assert (
            "checkpoint step 12 (end of training) failed" in log
            and f"exiting with {REQUEUE_EXIT_CODE}" in log
        )

        proxy.clear_rules()
        (tmp_path / "refused" / REQUEUE_MARKER).unlink()  # as the sbatch script does before each run
        assert spawn(_train, 2, argv) == [0, 0]
        assert [step for step, _ in store.committed()] == [12, 8]
        assert (
            f"resumed {store.location.child_uri('step_00000008')} at step 8"
            in (tmp_path / "refused" / "out.log").read_text()
        )
        store.close()
