"""Resume through the real training entry point: exact continuation, other world sizes, guards."""

import pytest
import torch
from support.train_harness import demo_argv, resume_and_inspect, train_and_weights

from bigclip.distributed import spawn
from bigclip.errors import ConfigError

pytestmark = pytest.mark.dist


def _argv(demo_data, tmp_path, name, *extra):
    return demo_argv(demo_data, tmp_path, "--max-steps", "8", "--save-every-n-steps", "4",
                     "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), *extra, name=name)  # fmt: skip


@pytest.mark.parametrize("saved_world, resumed_world", [(2, 3), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_resume_at_another_world_size(demo_data, tmp_path, saved_world, resumed_world):
    batch = {1: 48, 2: 24, 3: 16, 4: 12}  # the same global batch, 48, at every world size
    saved = spawn(train_and_weights, saved_world,
                  _argv(demo_data, tmp_path, "a", "--batch-size", str(batch[saved_world])))[0]  # fmt: skip
    restored = spawn(resume_and_inspect, resumed_world,
                     _argv(demo_data, tmp_path, "b", "--batch-size", str(batch[resumed_world]),
                           "--resume", saved["checkpoint"]))[0]  # fmt: skip
    assert restored["state"]["step"] == 8 and restored["state"]["samples_seen"] == 8 * 48
    assert restored["data_position"] is not None  # mid-epoch: the stream continues where it stopped
    for name, tensor in saved["weights"].items():
        assert torch.equal(restored["weights"][name], tensor), name


def test_global_batch_change_needs_consent(demo_data, tmp_path):
    first = spawn(train_and_weights, 1, _argv(demo_data, tmp_path, "one", "--batch-size", "32"))[0]
    changed = _argv(demo_data, tmp_path, "two", "--batch-size", "16", "--resume", first["checkpoint"])
    with pytest.raises(RuntimeError, match="global batch 32, this run has 16") as info:
        spawn(resume_and_inspect, 1, changed)
    assert ConfigError.__name__ in str(info.value)
    restored = spawn(resume_and_inspect, 1, [*changed, "--allow-batch-size-change"])[0]
    assert restored["state"]["step"] == 8
