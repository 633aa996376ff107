"""ZeRO-3's checkpoint state costs each rank O(its own fragments), whatever the world size.

Rank 0 of 16 and of 64 simulated ranks (torch's fake process group, a real DeepSpeed ZeRO-3
engine for the tiny CLIP; tests/support/zero3_state_scale.py) builds its model and optimizer
state; counted: the boxes of the full tensors its entries describe, and the write items of its
DCP save plan. Neither may grow with the world. The builder this replaced described every
rank's boxes on every rank (O(world) per parameter, then checked pair by pair): its count,
measured in the same processes, grows with the world, so the count is one that can fail.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from support.zero3_state_scale import run_count

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def counts() -> dict[int, dict[str, int]]:
    with ThreadPoolExecutor(max_workers=2) as pool:  # one single-threaded process per world
        return dict(zip((16, 64), pool.map(run_count, (16, 64))))


def test_rank_state_does_not_grow_with_the_world(counts):
    small, large = counts[16], counts[64]
    assert small["entries"] == large["entries"] > 100  # every sharded parameter and moment
    # Rank 0's fragment of a parameter is a row-major range from its first element: at most one
    # box per dimension, at any world size.
    assert large["boxes"] <= large["dims"] == small["dims"]
    assert large["boxes"] <= 1.1 * small["boxes"]
    assert large["write_items"] - large["boxes"] == small["write_items"] - small["boxes"]  # the rest: per key


def test_the_old_builder_grew_with_the_world(counts):
    small, large = counts[16], counts[64]
    assert large["boxes_old"] >= 3 * small["boxes_old"] > 3 * small["boxes"]
