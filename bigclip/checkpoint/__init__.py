"""Checkpoints: storage (local / S3), commit manifest, async save, resume, consolidation.

The training loop needs only `CheckpointStore` (see `store.py` for the protocol) and
`keep_last_for`; `bigclip doctor` lives in `doctor.py`.
"""

from bigclip.checkpoint.manifest import Manifest
from bigclip.checkpoint.pending import AsyncSave
from bigclip.checkpoint.store import LATEST, CheckpointStore, keep_last_for

__all__ = ["LATEST", "AsyncSave", "CheckpointStore", "Manifest", "keep_last_for"]
