"""What a save and a resume cost at the plan's world size, beyond the bytes: the work rank 0 does
alone, the `.metadata` it writes, the S3 requests per key prefix, what a rank reads to resume,
and whether a stop request's save fits the preemption window.

Each rank's metadata is what checkpoint_sim.py gives (saved rank 0's and rank 1's, as the
rank-local save writes them; every other rank's is the size of rank 1's). Rank 0's serial work
per save (checkpoint/save_commit.py) is joining and hashing `.metadata` and, per rank of the
world, one gathered report and its manifest lines; its rates are what benchmarks/scale_dcp.py
measures on one CPU core (the JSON's `later_save_rank0_cpu_s`), rounded down. Requests follow the
writer: one object and one record per rank under the rank's own prefix, each a multipart upload;
rank 0 adds the folder's listing, `.metadata` and the manifest to the step folder.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

from bigclip.checkpoint import metadata_stream
from bigclip.plan import checkpoint_sim
from bigclip.plan.engine_plan import engine_plan
from bigclip.plan.spec import PlanSpec
from bigclip.storage.save_requests import upload_requests

JOIN_AND_HASH_BYTES_PER_S = 0.5e9  # rank 0, one core: assembling `.metadata` and its SHA-256
PER_RANK_S = 2e-4  # rank 0 per rank of the world: its gathered report and manifest lines
RECORD_TRAIN_BYTES = 32 << 10  # a rank's training state in its record (RNG, data position)
NODE_UPLOAD_BYTES_PER_S = 500e6  # one node's S3 upload rate, as the recipes plan it
PREEMPTION_WINDOW_S = 120  # the shipped recipes' grace: SIGTERM to kill, at its shortest
STEP_FOLDER_REQUESTS = 1 + 1  # rank 0's listing of the step folder, and the manifest (one PUT)


@dataclass(frozen=True)
class CheckpointCost:
    metadata_bytes: int  # DCP's `.metadata`, assembled by rank 0 from every rank's piece
    record_bytes: int  # one rank's record (its DCP metadata and training state)
    rank0_serial_s: float  # rank 0's coordination per save, while the others wait for the commit
    save_s: float  # from the stop request to the commit: a step, the upload, the coordination
    rank_prefix_writes: int  # write requests per save on each rank's own prefix
    step_folder_writes: int  # rank 0's write requests per save on the step folder's prefix
    resume_read_bytes: int  # what one rank reads to resume at the saved world size, its shards aside

    @property
    def fits_window(self) -> bool:
        return self.save_s <= PREEMPTION_WINDOW_S


def checkpoint_cost(
    spec: PlanSpec, *, rank_bytes: int, part_bytes: int, objects_per_rank: int, step_s: float
) -> CheckpointCost | None:
    """The cost at `spec`'s world size (None for an engine checkpoint_sim does not lay out)."""
    engine = spec.engine
    if not engine_plan(engine).lays_out_checkpoints:
        return None
    shapes = {p.name: p.shape for p in spec.model_shape().params}
    rank0 = checkpoint_sim.rank_metadata(shapes, engine=engine, world=spec.gpus, rank=0)
    other = checkpoint_sim.rank_metadata(shapes, engine=engine, world=spec.gpus, rank=min(1, spec.gpus - 1))
    keys = metadata_stream.tensor_keys(rank0)
    head, _ = metadata_stream.skeleton(rank0)
    pieces = len(metadata_stream.rank_piece(rank0, keys)) + (spec.gpus - 1) * len(
        metadata_stream.rank_piece(other, keys)
    )
    metadata = len(head) + pieces
    record = len(pickle.dumps(other)) + RECORD_TRAIN_BYTES
    serial = metadata / JOIN_AND_HASH_BYTES_PER_S + spec.gpus * PER_RANK_S
    upload = rank_bytes * min(spec.gpus, 8) / NODE_UPLOAD_BYTES_PER_S + metadata / NODE_UPLOAD_BYTES_PER_S
    per_object = math.ceil(rank_bytes / objects_per_rank)
    rank_writes = objects_per_rank * upload_requests(per_object, part_bytes=part_bytes)
    rank_writes += upload_requests(record, part_bytes=part_bytes)
    return CheckpointCost(
        metadata_bytes=metadata,
        record_bytes=record,
        rank0_serial_s=serial,
        save_s=step_s + upload + serial,
        rank_prefix_writes=rank_writes,
        step_folder_writes=STEP_FOLDER_REQUESTS + upload_requests(metadata, part_bytes=part_bytes),
        resume_read_bytes=len(pickle.dumps(rank0)) + RECORD_TRAIN_BYTES + record,
    )
