"""Checkpoints on S3 at a large save's request rate, scaled down to real processes on one box.

S3 admits about 3,500 writes a second per prefix and answers 503 SlowDown beyond; a 1024-rank
save used to send ~17,400 writes into one fresh `step_N/` prefix within about a second. Here
RANKS real gloo ranks save again and again through the fault proxy's per-prefix throttle
(support/s3_fault_proxy.py), which admits BURST requests at once per prefix and RATE a second
after. Every rank's upload starts together, so a save offers at least 15x what one prefix
admits at once (counted, not timed), and every save must commit. They do because each rank
writes one object and its record under a prefix of its own (3 requests each: create, one part,
complete) and the client backs off where S3 throttles: the per-prefix counts show both, exactly.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.s3_fault_proxy import FaultProxy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bigclip.checkpoint import CheckpointStore
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.storage.s3_dcp_writer import JITTER_CAP_S, RANK_BYTES_PER_S, start_delay
from bigclip.storage.save_requests import files_for
from bigclip.storage.settings import configure_storage

RANKS = 10
SAVES = 20
BURST = 2  # requests one prefix admits at once
RATE = 40.0  # and a second after that (S3: ~3,500 writes a second)
OVERLOAD = 15
WRITES = ("PUT", "POST", "DELETE")


def _save_again_and_again(rank: int, world: int, root: str, endpoint: str) -> dict:
    configure_storage(s3_endpoint=endpoint)  # as --s3-endpoint does
    store = CheckpointStore(root)
    prefix = store.location.dcp_writer("step_00000001", world_size=world)[0].prefix_strategy(rank)
    mesh, committed = init_device_mesh("cpu", (world,)), []
    for step in range(1, SAVES + 1):
        # A sharded tensor, as the engines' are: each rank writes its own rows.
        w = DTensor.from_local(torch.full((64, 16), float(step + rank)), mesh, [Shard(0)], run_check=False)
        state = {"model": {"w": w}, "train": {"step": step}}
        committed.append(store.save(state, step=step))  # raises unless committed
    store.close()
    return {"committed": committed, "prefix": prefix.rsplit("/", 1)[0]}


@pytest.mark.dist
def test_every_save_commits_at_15x_what_one_prefix_admits():
    with LoopbackS3() as s3, FaultProxy(upstream=s3.endpoint) as proxy:
        root = s3.create_bucket("request-rate") + "/run"
        proxy.throttle(rate=RATE, burst=BURST)
        ranks = spawn(_save_again_and_again, RANKS, root, proxy.endpoint, timeout_s=600)
        store = CheckpointStore(root)
        assert [step for step, _ in store.committed()] == list(range(SAVES, 0, -1))  # no save failed
        assert all(len(r["committed"]) == SAVES for r in ranks)
        prefixes = [r["prefix"] for r in ranks]
        assert len(set(prefixes)) == RANKS  # a prefix per rank

        for step in range(1, SAVES + 1):
            folder = f"step_{step:08d}"
            per_rank = [
                sum(proxy.tally(method=m, prefix_contains=f"{folder}/{p}", admitted=True) for m in WRITES)
                for p in prefixes
            ]
            # Under its prefix a rank writes its shard and its record (rank_record.py): one object
            # each (create, one part, complete).
            assert per_rank == [6] * RANKS
            assert sum(per_rank) >= OVERLOAD * BURST  # what the ranks' uploads offer at once
            shared = f"/request-rate/run/{folder}"
            rank0 = sum(proxy.counts[(m, shared)] - proxy.refused[(m, shared)] for m in WRITES)
            assert rank0 <= 7  # the folder's listing, .metadata (3), the manifest (3)
        assert sum(proxy.throttled.values()) > 0  # the limit was met and backed off from
        store.close()


def test_one_object_per_gib_of_shard_and_a_start_delay_of_a_tenth_of_the_upload_at_most():
    gib = 1 << 30
    assert [files_for(n) for n in (0, 33 << 20, gib, gib + 1, 3 * gib, 100 * gib)] == [1, 1, 1, 2, 3, 4]
    rng = random.Random(0)
    shard = 33 << 20  # a 1024-rank ViT-bigG-14 shard: ~53 ms at most
    delays = [start_delay(shard, rng=rng) for _ in range(1000)]
    assert min(delays) >= 0 and max(delays) <= 0.1 * shard / RANK_BYTES_PER_S
    assert len(set(delays)) == len(delays)  # spread, not one moment for every rank
    assert max(start_delay(100 * gib, rng=rng) for _ in range(100)) <= JITTER_CAP_S
