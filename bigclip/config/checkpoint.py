"""Where checkpoints go, when they are saved, what is kept and how runs resume."""

from __future__ import annotations

import os
from dataclasses import dataclass

from bigclip.config.fields import opt
from bigclip.errors import ConfigError

# `registry:NAME`: weights/sources.py opens it (importing the registry only then) and
# registry/published.py parses it; it lives here, below both and free of torch, so neither imports
# the other for it and `bigclip publish`/`checkpoints`/`consolidate` check their options with it.
REGISTRY_SCHEME = "registry:"


def registry_uri(explicit: str = "") -> str:
    """The registry `registry:NAME` refers to: --registry, else $BIGCLIP_REGISTRY."""
    return explicit or os.environ.get("BIGCLIP_REGISTRY", "")


@dataclass
class CheckpointConfig:
    checkpoint_dir: str = opt(
        "", "Where checkpoints go: a path or s3://bucket/prefix (default: LOGS/NAME/checkpoints)."
    )
    save_frequency: int = opt(1, "Save every N epochs (0: never at epoch ends).")
    save_every_n_steps: int = opt(0, "Also save every N optimizer steps (0: off).")
    save_every_n_minutes: float = opt(
        0.0, "Also save after every N minutes of training, e.g. 30 on preemptible capacity (0: off)."
    )
    resume: str = opt("", "Resume from 'latest', a checkpoint path, or an s3:// URI.")
    async_save: bool = opt(False, "Stage state in CPU memory and upload in the background.")
    save_most_recent: bool = opt(
        False, "Also save at each epoch end; only the newest such checkpoint is kept."
    )
    delete_previous_checkpoint: bool = opt(False, "Keep only the newest local checkpoint.")
    keep_last: int = opt(0, "Keep the newest K local checkpoints (0: all).")
    remote_keep_last: int = opt(
        0, "Keep the newest K checkpoints on S3 or in the --remote-sync copy (0: all)."
    )
    overwrite_run: bool = opt(
        False, "Start over in a run folder that holds checkpoints, deleting them first."
    )
    allow_batch_size_change: bool = opt(False, "Allow resuming with a different global batch size.")
    allow_tokenizer_change: bool = opt(
        False, "Allow weights of another --tokenizer (--resume, --pretrained)."
    )
    s3_endpoint: str = opt("", "S3 endpoint URL (default: AWS_ENDPOINT_URL, else AWS).")
    s3_region: str = opt("", "S3 region (default: AWS_REGION / AWS config, else us-east-1).")
    registry: str = opt(
        "",
        "Checkpoint registry (a path or s3:// prefix) that registry:NAME refers to (default: $BIGCLIP_REGISTRY).",
    )

    def validate(self) -> None:
        if min(self.save_frequency, self.save_every_n_steps, self.keep_last, self.remote_keep_last) < 0:
            raise ConfigError("checkpoint frequencies and retention counts must not be negative")
        if self.save_every_n_minutes < 0:
            raise ConfigError(
                f"--save-every-n-minutes {self.save_every_n_minutes} must not be negative: give minutes of "
                "training between checkpoints, or 0 for no time-based saves"
            )
        if self.resume and self.overwrite_run:
            raise ConfigError(
                f"--resume {self.resume} and --overwrite-run contradict each other: --resume continues from a "
                "checkpoint, --overwrite-run deletes the run's checkpoints and starts over; give one of them"
            )
        if self.delete_previous_checkpoint and self.keep_last > 1:
            raise ConfigError(
                f"--delete-previous-checkpoint keeps one checkpoint, --keep-last {self.keep_last} keeps "
                f"{self.keep_last}; give one of them"
            )
