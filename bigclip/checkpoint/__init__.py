"""The training-time checkpoint store: sharded DCP saves committed by a manifest (store, manifest,
catalog), async saves, their own process group, and loading without trusting the bytes.
May import storage, config, distributed and errors. The loop needs `CheckpointStore`.
"""

from bigclip.checkpoint.catalog import keep_last_for
from bigclip.checkpoint.manifest import Manifest
from bigclip.checkpoint.store import LATEST, CheckpointStore

__all__ = ["LATEST", "CheckpointStore", "Manifest", "keep_last_for"]
