"""Resume on a different world size with real FSDP2: saved at N ranks, loaded at M ranks.

A small CLIP (the `tiny` config with a 1000-token vocabulary, so 3 ranks shard it unevenly)
is `fully_shard`ed per block and at the root, trained one AdamW step and saved through
`get_state_dict`; the next run, at another world size, loads it through `set_state_dict`.
The gathered full model and optimizer state must equal, bit for bit, what was saved; each
run then trains a step and saves for the next. Local and S3 roots are saved and loaded side
by side in every run. Chain: 2 -> 3 (grow, uneven shards) -> 1 (shrink to one) -> 4 (grow from one).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from bigclip.checkpoint import CheckpointStore
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.models.clip import CLIP, init_weights
from bigclip.models.factory import get_model_config

CHAIN = [2, 3, 1, 4]
BATCH = 4


class TrainState(Stateful):
    """Model + optimizer as DCP sees them: sharded DTensor state dicts, keyed by FQN."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def build_sharded_clip() -> tuple[CLIP, torch.optim.Optimizer]:
    cfg = get_model_config("tiny")
    cfg.text_cfg.vocab_size = 1000
    model = init_weights(CLIP(cfg, device="cpu"), seed=0)
    for block in model.blocks():
        fully_shard(block)
    # fully_shard rejects 0-d parameters; the scalar logit scale stays a plain replicated
    # tensor (every rank sees the same batch here, so it stays identical across ranks).
    fully_shard(model, ignored_params={model.logit_scale})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: CLIP, optimizer: torch.optim.Optimizer, *, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, 64, 64, generator=g)
    texts = torch.randint(0, 1000, (BATCH, 32), generator=g)
    out = model(images, texts)
    loss = -(out["image_features"] @ out["text_features"].T).diag().mean() * out["logit_scale"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: CLIP, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A copy of every tensor of model and optimizer, gathered unsharded (rank 0 gets them)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, slots in optim_sd.get("state", {}).items():
        flat |= {f"optim.{fqn}.{slot}": torch.as_tensor(v) for slot, v in slots.items()}
    # Unsharded tensors (the logit scale, Adam's step counts) come back as the live objects.
    return {k: v.detach().clone() for k, v in flat.items()}


def _run(rank: int, world: int, roots: list[str], step: int, load: bool, save: bool) -> bytes:
    model, optimizer = build_sharded_clip()
    state = TrainState(model, optimizer)
    loaded = {}
    stores = [CheckpointStore(root) for root in roots]
    for root, store in zip(roots, stores):
        if load:
            train = {"step": -1, "world_size": -1}
            manifest = store.load({"app": state, "train": train}, "latest")
            loaded[root] = (manifest.world_size, dict(train), full_state(model, optimizer))
    train_step(model, optimizer, seed=step)
    saved = full_state(model, optimizer)
    for store in stores:
        if save:
            train = {"step": step, "world_size": world}
            store.save({"app": state, "train": train}, step=step, meta={"model": "tiny"})
        store.close()
    # Tensors go back as bytes: torch's multiprocessing would pass them as shared-memory file
    # descriptors, which vanish when the rank exits before the parent has read them.
    return pack({"loaded": loaded, "saved": saved}) if rank == 0 else b""


def pack(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    different = [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    assert not different, f"differ after resharding: {different[:5]}"


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_state_reshards_bitwise_across_world_sizes(tmp_path):
    with LoopbackS3() as s3:
        roots = [str(tmp_path / "ckpt"), s3.create_bucket("reshard") + "/run/ckpt"]
        previous = None
        for step, world in enumerate(CHAIN):
            load, save = step > 0, step < len(CHAIN) - 1
            result = unpack(spawn(_run, world, roots, step, load, save)[0])
            if load:
                for root in roots:
                    saved_world, train, tensors = result["loaded"][root]
                    assert (saved_world, train) == (
                        CHAIN[step - 1],
                        {"step": step - 1, "world_size": saved_world},
                    )
                    assert_bitwise_equal(tensors, previous)
            previous = result["saved"]
