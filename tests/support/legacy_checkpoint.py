"""A checkpoint in the layout bigclip wrote before rank records: DCP's coordinated save.

Until rank records (bigclip/checkpoint/rank_record.py), `CheckpointStore.save` was `dcp.save`
through the location's hashing writer (every rank's plan gathered on rank 0, one global
`.metadata`), then the manifest, without a `layout`; the training state (RNG, data position)
lived in DCP under `train`. Such checkpoints must keep loading: this writes one the same way.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp

from bigclip.checkpoint import CheckpointStore
from bigclip.checkpoint.catalog import step_folder
from bigclip.checkpoint.finite import plain_state
from bigclip.checkpoint.manifest import MANIFEST_NAME, Manifest


def save_legacy(store: CheckpointStore, state: dict[str, Any], *, step: int, meta: dict | None = None) -> str:
    """Collective when `store`'s group is: write `state` as checkpoint `step` in the old layout."""
    folder = step_folder(step)
    writer, hashing = store.location.dcp_writer(folder, threads=store.io_threads)
    group = store.group
    dcp.save(
        plain_state(state), storage_writer=writer, process_group=group.group, no_dist=group.group is None
    )
    records = group.gather(hashing.records())
    if group.rank == 0:
        objects = {name: rec for per_rank in records for name, rec in per_rank.items()}
        manifest = Manifest.build(step=step, world_size=group.world_size, objects=objects, meta=meta or {})
        store.location.write_bytes(f"{folder}/{MANIFEST_NAME}", manifest.to_json())
    group.broadcast(None)
    return store.location.child_uri(folder)
