"""SwitchBack under FSDP2 with 2 gloo ranks: int8 layers swapped on the meta model before
sharding train like the unsharded int8 model (the layers see gathered weights).

After one step the weights agree to float reduction order. Later steps start from weights that
differ in the last bits, which flips the rounding of a few int8 values, so from then on the
two runs agree in loss (to 1e-4) rather than bit for bit."""

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from bigclip.distributed import spawn
from bigclip.models.clip import param_initializers
from bigclip.models.contract import param_generator
from bigclip.models.factory import create_model
from bigclip.ops.int8.switchback import SwitchBackLinear, apply_int8

pytestmark = pytest.mark.dist

MODE, STEPS, BATCH = "switchback-global", 3, 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    images, texts = (
        torch.randn(BATCH, 3, 64, 64, generator=g),
        torch.randint(1, 1000, (BATCH, 32), generator=g),
    )
    texts[:, 10] = 49407
    return images, texts


def _local_clip_loss(out: dict) -> torch.Tensor:
    """CLIP's loss within one rank's rows (ClipLoss would gather features across the ranks)."""
    logits = out["logit_scale"] * out["image_features"] @ out["text_features"].t()
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _half_losses(
    model: torch.nn.Module, images: torch.Tensor, texts: torch.Tensor, halves: list[int]
) -> torch.Tensor:
    """Mean of per-half contrastive losses: what 2 data-parallel ranks optimise together."""
    losses = []
    for h in halves:
        rows = slice(h * BATCH // 2, (h + 1) * BATCH // 2)
        out = model(images[rows], texts[rows])
        losses.append(_local_clip_loss(out))
    return torch.stack(losses).mean()


@torch.no_grad()
def _init_sharded(model: torch.nn.Module) -> None:
    rules = param_initializers(model)
    for name, param in model.named_parameters():
        full = torch.empty(param.shape)
        rules[name](full, param_generator(name, 0))
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements)
        param.copy_(full)


def _model(mode: str, device: str) -> torch.nn.Module:
    model = create_model("tiny", device=device, seed=0)
    return apply_int8(model, mode, include_attention=True) if mode != "none" else model


def _fsdp_worker(rank: int, world: int, bf16: bool, mode: str) -> bytes:
    model = _model(mode, "meta")
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for block in model.blocks():
        fully_shard(block, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    model.to_empty(device="cpu")
    _init_sharded(model)
    seen = []
    layer = model.blocks()[0].mlp.c_fc
    layer.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, m.weight.dtype, out.dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    unsharded = [p for p in model.parameters() if not isinstance(p, DTensor)]
    losses, first = [], {}
    for step in range(STEPS):
        loss = _half_losses(model, *_batch(step), [rank])
        loss.backward()
        for p in unsharded:  # FSDP averages the blocks' gradients; the rest is ours to average
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach().float(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        first = first or {
            k: (v.full_tensor() if isinstance(v, DTensor) else v.clone())
            for k, v in model.state_dict().items()
        }
    result = {
        "losses": losses,
        "weights": first,
        "int8": isinstance(layer, SwitchBackLinear),
        "dtypes": seen[0],
    }
    # As bytes: a queue would pass tensors as shared-memory handles that die with this process.
    return pickle.dumps(result)


def _single_process(mode: str) -> dict:
    model = _model(mode, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first = [], {}
    for step in range(STEPS):
        loss = _half_losses(model, *_batch(step), [0, 1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        first = first or {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": first}


@pytest.fixture(scope="module")
def single() -> dict:
    return _single_process(MODE)


def test_fsdp2_two_ranks_match_unsharded_int8(single):
    sharded = pickle.loads(spawn(_fsdp_worker, 2, False, MODE)[0])
    assert sharded["int8"]
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-4)
    for name, tensor in single["weights"].items():  # after the first step
        diff = (sharded["weights"][name] - tensor).norm() / tensor.norm().clamp_min(1e-12)
        assert diff < 1e-5, name
    assert single["losses"][-1] < single["losses"][0]


def test_fsdp2_bf16_mixed_precision_tracks_fp32(single):
    sharded = pickle.loads(spawn(_fsdp_worker, 2, True, MODE)[0])
    assert sharded["dtypes"] == (torch.bfloat16,) * 3  # input, gathered weight, output
    assert sharded["losses"] == pytest.approx(single["losses"], rel=0.02)
