"""A requeued run continues exactly: bitwise the run that never stopped."""

import pytest
import torch
from support.train_harness import train_and_weights
from test_resume import _argv

from bigclip.distributed import spawn

pytestmark = pytest.mark.dist


def test_interrupted_run_continues_exactly(demo_data, tmp_path):
    """Stopping at step 4 and resuming gives bitwise the run that never stopped: same data order,
    optimizer moments, LR schedule, RNG (patch dropout) and weights."""
    extra = ("--force-patch-dropout", "0.3")
    straight = spawn(train_and_weights, 2, _argv(demo_data, tmp_path, "straight", *extra))[0]
    step4 = tmp_path / "ckpt-straight" / "step_00000004"
    resumed = spawn(
        train_and_weights, 2, _argv(demo_data, tmp_path, "resumed", *extra, "--resume", str(step4))
    )[0]
    assert resumed["step"] == straight["step"] == 8
    assert resumed["loss"] == straight["loss"]
    for name, tensor in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name
