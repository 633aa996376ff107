"""What a training run checks before any work: before a process group is formed, a model built or
data read, so a bad input costs a second and loses nothing.

`check_flags` needs the flags only and imports no torch: `bigclip train` runs it before importing
torch, so a contradiction fails in well under a second. `check_machine` asks the machine (torch's
devices, DeepSpeed's accelerator) and the launcher's environment (world size, the open-file
limit), still before the process group. The checks that need data (shards, sizes.json) or a
checkpoint's manifest stay with the data and checkpoint code; each section's own value checks are
its `validate`. One check needs the checkpoint store's process group and runs as it opens: a local
checkpoint folder must be one every node sees (`check_shared_folder`).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING

from bigclip.config import EngineConfig, TrainConfig
from bigclip.config.linear_kinds import linear_kind
from bigclip.errors import ConfigError
from bigclip.models.families import family_of
from bigclip.rank_env import read_launch_env

if TYPE_CHECKING:
    from bigclip.checkpoint import CheckpointStore


def check_flags(cfg: TrainConfig) -> None:
    """Checks a run needs beyond `TrainConfig.validate` (which `bigclip plan`/`slurm` share), with
    the world size the launcher's environment declares."""
    if cfg.evaluates_only:
        check_evaluation_only(cfg)
    elif not cfg.data.train_data.strip():
        raise ConfigError(
            "--train-data is empty; give a shard pattern such as /data/{00000..00099}.tar (or, to evaluate "
            "weights without training, --val-data, --imagenet-val or --imagenet-v2 with --pretrained or --resume)"
        )
    _check_tag_tokenizer(cfg)
    _check_global_batch(cfg, world_size=launch_world_size())
    folder = Path(
        cfg.log.batch_keys_file
    ).parent  # (not in validate: `bigclip slurm` renders for a job's folder)
    if cfg.log.batch_keys_file and not folder.is_dir():
        raise ConfigError(f"--batch-keys-file {cfg.log.batch_keys_file}: the folder {folder} does not exist; "
                          "create it or give a file in an existing folder")  # fmt: skip


def check_evaluation_only(cfg: TrainConfig) -> None:
    """A run without --train-data evaluates weights (OpenCLIP's way): it needs weights to evaluate
    and an evaluation that runs (a frequency of 0 turns one off, as in training)."""
    name = cfg.model.model
    weights = cfg.model.pretrained or cfg.checkpoint.resume or family_of(name).has_own_weights(name)
    if not weights:
        raise ConfigError(
            "no --train-data: this run only evaluates, and has no weights to evaluate; give them with "
            "--pretrained FILE|TAG|URI or --resume PATH|latest (or add --train-data to train)"
        )
    sets = cfg.data.evaluation_sets()
    if not any(sets.values()):
        off = {"--val-frequency 0" if flag == "--val-data" else "--zeroshot-frequency 0" for flag in sets}
        frequencies = " and ".join(sorted(off, reverse=True))
        raise ConfigError(
            f"no --train-data and {frequencies}: {', '.join(sets)} would never be evaluated, so the run would do "
            "nothing; leave the frequency at its default (or any N > 0)"
        )


def launch_world_size() -> int:
    """The world size the launcher's environment declares, read as bigclip.distributed.launch_env
    reads it (both use rank_env.py; tests/test_bad_input_flags.py checks the two agree)."""
    return read_launch_env(dict(os.environ))[1]


def _check_tag_tokenizer(cfg: TrainConfig) -> None:
    """OpenCLIP's pretrained tags were trained on its BPE ids (as data.check_tokenizer says later for
    weights whose metadata records a tokenizer)."""
    from bigclip.models.pretrained_tags import looks_like_tag

    tokenizer, allow = cfg.data.tokenizer, cfg.checkpoint.allow_tokenizer_change
    if looks_like_tag(cfg.model.pretrained) and tokenizer != "open_clip" and not allow:
        raise ConfigError(
            f"--pretrained {cfg.model.pretrained}: the weights were trained with --tokenizer open_clip, this run "
            f"has --tokenizer {tokenizer}; their text tower would read ids it never learned. Pass --tokenizer "
            "open_clip, or --allow-tokenizer-change to train on with the new ids"
        )


def check_machine(cfg: TrainConfig) -> None:
    """Checks that need torch (and DeepSpeed for its engine), but no process group."""
    check_device(cfg.engine)
    check_open_files(cfg.engine, world_size=launch_world_size())
    _check_linear_kind(cfg)
    _check_engine(cfg)
    from bigclip.engines.optimizer import check_opt_kwargs

    check_opt_kwargs(cfg.optim)


def _check_engine(cfg: TrainConfig) -> None:
    """The engine's own checks (Engine.check_machine: DeepSpeed's JSON against the flags)."""
    from bigclip.engines import engine_class
    from bigclip.models.families import model_shape
    from bigclip.models.run_options import model_options

    width = model_shape(cfg.model.model, model_options(cfg)).hidden_width
    engine_class(cfg.engine.engine).check_machine(cfg, world_size=launch_world_size(), model_width=width)


def check_device(engine: EngineConfig) -> None:
    """--device must name a device this machine has (else torch fails deep in set-up)."""
    import torch

    if not engine.device:
        return
    device = torch.device(engine.device)  # cpu, cuda or cuda:N (EngineConfig.validate)
    if device.type == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"--device {engine.device}: this machine has no GPU torch can use (torch.cuda.is_available() is "
            "False); leave --device out to train on the CPU, or run on a GPU node"
        )
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"--device {engine.device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}; "
            "leave --device out (cuda:LOCAL_RANK) or name one of them"
        )


# What a process holds besides the sockets counted below: libraries, devices (CUDA's and NCCL's),
# logs, data-loader pipes and shared memory, S3 connections. A CPU rank with 2 data workers held 45
# (benchmarks/scale_sockets.py); the rest is headroom.
FD_BASE = 512


def open_files_needed(world_size: int, *, hosts_store: bool, gloo_world: bool, lazy: bool) -> dict[str, int]:
    """File descriptors the busiest process of a `world_size`-rank run may hold, by kind (rank 0:
    it coordinates checkpoints, and under srun or DeepSpeed's launcher it hosts the rendezvous store).
    Each gloo group holds a socket per peer it reaches: every peer in a full mesh; lazily only those
    its collectives reach, except where one rank gathers from all (the checkpoint group on rank 0,
    and the default group when it is gloo: the training's all-to-all). benchmarks/scale_sockets.py
    measures them at 4-32 ranks."""
    near = min(world_size, 4 * math.ceil(math.log2(max(2, world_size))) + 4)  # ring, tree, dissemination
    return {
        "store": 2 * world_size if hosts_store else 0,  # a connection per rank, one more for its heartbeats
        "checkpoint group": world_size,
        "cpu group": world_size if (gloo_world or not lazy) else near,
        "the rest": FD_BASE,
    }


def check_open_files(engine: EngineConfig, *, world_size: int) -> None:
    """The open-file limit must hold what the world needs; the soft limit is raised up to the hard
    one first (as launchers do), so only a hard limit too low refuses the run."""
    if world_size <= 1:
        return
    import torch

    from bigclip.distributed import gloo_connects_lazily

    device = engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gloo_world = (engine.dist_backend or ("nccl" if device.startswith("cuda") else "gloo")) == "gloo"
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun's agent hosts it
    kinds = open_files_needed(world_size, hosts_store=hosts_store, gloo_world=gloo_world,
                              lazy=gloo_connects_lazily())  # fmt: skip
    need = sum(kinds.values())
    soft, hard = raise_open_files(need)
    if soft >= need:
        return
    parts = ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)
    raise ConfigError(
        f"the open-file limit (ulimit -n) is {soft}, hard limit {hard}: a {world_size}-rank run needs up to "
        f"{need} per process ({parts}); raise it before the launch, `ulimit -n {need}` in the job script "
        "(the scripts `bigclip slurm` renders raise the soft limit to the hard one; a higher hard limit "
        "takes root: /etc/security/limits.conf, or the node's slurmd/systemd LimitNOFILE)"
    )


def raise_open_files(need: int) -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one if it is below `need`; (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need and soft != hard:
        target = hard if hard != resource.RLIM_INFINITY else need
        # a system cap below the hard limit (macOS's OPEN_MAX) refuses it: the caller's check says so
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def _check_global_batch(cfg: TrainConfig, *, world_size: int) -> None:
    b, k, n = cfg.data.batch_size, cfg.optim.accum_freq, cfg.data.train_num_samples
    per_step = b * k * world_size
    if n and n < per_step and not cfg.data.dataset_resampled:
        raise ConfigError(
            f"--train-num-samples {n} is less than one optimizer step's samples (--batch-size {b} x "
            f"--accum-freq {k} x {world_size} rank(s) = {per_step}): no step could run; lower --batch-size "
            "or --accum-freq, or give more samples"
        )


def _check_linear_kind(cfg: TrainConfig) -> None:
    """The kind's own machine check (fp8: an fp8 GPU where the run computes on a GPU)."""
    kind = linear_kind(cfg.model.linear_kind)
    if kind.implementation:
        import importlib

        from bigclip.models.from_config import run_device_type

        importlib.import_module(kind.implementation).check_machine(kind, run_device_type(cfg))


def check_shared_folder(store: CheckpointStore) -> None:
    """Collective, on the store's group: refuse a local checkpoint folder that is not the same on
    every node. DCP writes each rank's shards on its own node, and rank 0 alone commits and mirrors
    the checkpoint: with a node-local folder (`--logs /local-nvme/...` on several nodes) the manifest
    would describe files rank 0 cannot see. Rank 0 writes a probe holding a random token; each
    node's local rank 0 looks for it (three collectives, one small file: seconds, before the model)."""
    import socket

    from bigclip.distributed import launch_env
    from bigclip.storage import schemes
    from bigclip.storage.access_checks import probe_seen, write_probe

    group, location = store.group, store.location
    if group.world_size == 1 or not schemes.is_local(location.uri):  # an object store is one for all
        return
    name, token = group.broadcast(write_probe(location) if group.rank == 0 else None)
    unseen = None
    if group.rank != 0 and launch_env()[2] == 0 and not probe_seen(location, name, token):
        unseen = f"{socket.gethostname()} (rank {group.rank})"
    hosts = [h for h in group.gather(unseen) if h]
    if group.rank == 0:
        location.delete(name)
    message = group.broadcast(_not_shared(location.uri, hosts) if hosts else None)
    if message:
        raise ConfigError(message)


def _not_shared(uri: str, hosts: list[str]) -> str:
    more = f" and {len(hosts) - 2} more nodes" if len(hosts) > 2 else ""
    see = "does not see" if len(hosts) == 1 else "do not see"
    return (
        f"the checkpoint folder {uri} is not shared across nodes: {', '.join(hosts[:2])}{more} {see} the "
        "file rank 0 wrote there (a node-local disk: each node would keep its own ranks' shards while rank 0 "
        "alone commits); give a folder every node mounts (a shared file system) or an s3:// URI, with "
        "--logs or --checkpoint-dir"
    )
