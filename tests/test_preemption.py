"""Preemption as SLURM delivers it: SIGUSR1 to the ranks, checkpoint, exit 85, requeue resumes."""

import signal

import pytest
from support.launch_harness import read_keys, srun_like, wait_all, wait_for_step
from support.train_harness import demo_argv

from bigclip.train.preemption import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.dist


def test_sigusr1_checkpoints_exits_for_requeue_and_resumes_at_the_same_batch(demo_data, tmp_path):
    def argv(name: str) -> list[str]:
        return demo_argv(demo_data, tmp_path, "--max-steps", "14", "--resume", "latest", "--save-every-n-steps", "0",
                         "--save-frequency", "0", "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"),
                         "--batch-keys-file", str(tmp_path / f"keys-{name}"), name=name)  # fmt: skip

    reference = srun_like(argv("reference"), 2, tmp_path)
    assert wait_all(reference) == [0, 0]

    job = argv("job")
    first = srun_like(job, 2, tmp_path)
    wait_for_step(tmp_path / "keys-job", 3, first)
    first[1].send_signal(signal.SIGUSR1)  # one rank is enough: the ranks agree at the step boundary
    assert wait_all(first) == [REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE]
    stopped_at = max(read_keys(tmp_path / "keys-job", 0)) + 1  # steps taken before the checkpoint
    assert (tmp_path / "ckpt-job" / f"step_{stopped_at:08d}" / "manifest.json").exists()

    requeued = srun_like(job, 2, tmp_path)  # the same command line, as a requeued job runs it
    assert wait_all(requeued) == [0, 0]
    for rank in range(2):
        keys, expected = read_keys(tmp_path / "keys-job", rank), read_keys(tmp_path / "keys-reference", rank)
        assert min(k for k in keys if k >= stopped_at) == stopped_at  # resumed at the exact step
        assert keys[stopped_at] == expected[stopped_at]  # with the same next batch
        assert keys == expected  # and the same stream to the end
