"""Run folders, log lines, metric sinks and remote sync."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bigclip.config.fields import METRIC_SINKS, installed, opt
from bigclip.errors import ConfigError


@dataclass
class LogConfig:
    logs: str = opt("./logs", "Root folder for run directories.")
    name: str = opt("", "Run name (default: date-model-lr-batch-precision).")
    log_every_n_steps: int = opt(100, "Print a log line (and write scalars) every N steps.")
    log_metric_every_n_steps: int = opt(
        10,
        "Write scalars (--report-to) every N steps, denser than the log line; the loss logged is the "
        "global batch's (OpenCLIP main's --log-metric-every-n-steps).",
    )
    report_to: str = opt(
        "tensorboard",
        "Metric sinks, comma-separated: tensorboard, wandb (pip install wandb), or '' for none.",
    )
    wandb_project_name: str = opt("open-clip", "wandb project (WANDB_MODE=offline: written locally).")
    wandb_notes: str = opt("", "wandb run notes.")
    log_local: bool = opt(False, "Every node's local rank 0 logs too, to out-RANK.log (else rank 0 only).")
    debug: bool = opt(False, "Log at DEBUG level.")
    remote_sync: str = opt("", "Back the run up to URI/NAME (logs, checkpoints), e.g. s3://b/runs.")
    remote_sync_frequency: int = opt(300, "Seconds between remote syncs (a commit also starts one).")
    remote_sync_protocol: str = opt("s3", "How to reach --remote-sync.", choices=("s3", "fsspec"))
    batch_keys_file: str = opt("", "Append each step's sample keys to FILE.rankN.jsonl, to audit data order.")

    def validate(self) -> None:
        if self.log_every_n_steps < 1 or self.log_metric_every_n_steps < 1:
            raise ConfigError(
                f"--log-every-n-steps and --log-metric-every-n-steps must be at least 1, got "
                f"{self.log_every_n_steps} and {self.log_metric_every_n_steps}"
            )
        if self.remote_sync_frequency < 1:
            raise ConfigError(
                f"--remote-sync-frequency must be at least 1 (seconds), got {self.remote_sync_frequency}"
            )
        from bigclip.storage.schemes import scheme_of  # only storage/ reads URI schemes

        if scheme_of(self.logs):  # a URI: else a folder literally named 's3:' would appear
            raise ConfigError(f"--logs {self.logs}: --logs is a local folder; to keep the logs there too, pass "
                              f"--logs ./logs --remote-sync {self.logs} (OpenCLIP's way)")  # fmt: skip
        self._check_remote_outside_logs()
        self._check_name()
        unknown = set(self.sinks()) - set(METRIC_SINKS)
        if unknown:
            raise ConfigError(
                f"--report-to {self.report_to!r}: unknown {sorted(unknown)}; use {', '.join(METRIC_SINKS)}"
            )
        if "wandb" in self.sinks() and not installed("wandb"):
            raise ConfigError("--report-to wandb needs wandb: pip install 'bigclip[wandb]'")

    def _check_name(self) -> None:
        """The run folder is --logs/NAME: a name with '..' or an absolute one would put the run (and
        --overwrite-run's deletions) outside --logs."""
        parts = Path(self.name).parts
        if Path(self.name).is_absolute() or any(part in (".", "..") for part in parts):
            raise ConfigError(f"--name {self.name!r}: the run folder is --logs/NAME, inside --logs; give a name "
                              "without '.' or '..' parts that is not an absolute path")  # fmt: skip

    def _check_remote_outside_logs(self) -> None:
        """A --remote-sync folder at or under --logs is a copy of the run folder into itself (REMOTE/NAME
        is LOGS/NAME when they are equal): its pruning deletes the checkpoints it just backed up."""
        from bigclip.storage.schemes import is_local, local_path

        if not self.remote_sync or not is_local(self.remote_sync):
            return
        logs, remote = (
            Path(self.logs).expanduser().resolve(),
            Path(local_path(self.remote_sync)).expanduser().resolve(),
        )
        if remote == logs or logs in remote.parents:
            raise ConfigError(
                f"--remote-sync {self.remote_sync} is inside --logs {self.logs}: the backup would copy the run "
                "folder into itself and delete the checkpoints it backs up; give a location on other storage "
                "(e.g. s3://bucket/runs, or a folder outside --logs)"
            )

    def sinks(self) -> list[str]:
        """OpenCLIP's --report-to: 'all' or a comma list."""
        names = [n.strip() for n in self.report_to.split(",") if n.strip()]
        return list(METRIC_SINKS) if "all" in names else names
