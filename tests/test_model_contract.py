"""The model contract is all an engine, a linear kind, the planner and consolidation need: a dual
encoder that is not CLIP (tests/support/dual_encoder.py), implementing the contract and nothing
more, trains on FSDP2 and ZeRO-3 over two gloo ranks to the same losses, takes the fp8 and int8
linear kinds, is priced by the planner from its family's static shape (parameters per rank as the
engines hold them, FLOPs as torch counts them, a block's activations as autograd saves them) and
consolidates from both engines' checkpoints."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.dual_encoder import (
    CONTEXT,
    FAMILY,
    IMAGE_SIZE,
    NAME,
    WIDTH,
    DualEncoder,
    MLPBlock,
    dual_encoder_shape,
)
from support.engine_harness import global_batch, run_steps, tiny_config
from test_plan import saved_bytes_per_token
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bigclip.checkpoint import CheckpointStore
from bigclip.cli_args import parse_train_args
from bigclip.distributed import Runtime, spawn
from bigclip.engines import build_engine
from bigclip.errors import ConfigError
from bigclip.models import families, listing
from bigclip.models.contract import TrainableModel, param_shapes
from bigclip.models.from_config import build_model, model_factory, synthetic_batch
from bigclip.models.run_options import image_size
from bigclip.models.shape import ModelOptions
from bigclip.plan.memory import block_saved_per_token
from bigclip.plan.planner import Hardware, build_plan
from bigclip.plan.spec import PlanSpec
from bigclip.train.trainer import build_tokenizer
from bigclip.weights import named, pretrained
from bigclip.weights.consolidate import consolidate
from bigclip.weights.open_clip_export import model_config

os.environ["DS_ACCELERATOR"] = "cpu"
DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
BATCH = 8


def engine_config(engine: str, **overrides: object):  # noqa: ANN201
    if engine != "fsdp":
        overrides |= {
            "engine.engine": "deepspeed",
            "engine.deepspeed_config": str(DS_CONFIGS / f"{engine}.json"),
        }
    return tiny_config(**overrides)


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds: FSDP2's local shards, ZeRO-3's partitions."""
    total = 0
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def train(rank: int, world: int, engine: str, linear_kind: str = "none", save_to: str = "") -> dict:
    """Worker: `--model dual-encoder-tiny` built as the training command builds a model (its family's
    builder, then --linear-kind's swap) through the real engine, 4 optimizer steps; with `save_to`, a
    checkpoint of them through CheckpointStore. Rank 0 returns losses, full weights, held bytes."""
    families.register_family(FAMILY)  # a spawned process starts with the built-in families only
    cfg = engine_config(engine, **{"model.model": NAME, "model.linear_kind": linear_kind})
    runtime = Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    built = build_engine(cfg, runtime)
    model = build_model(cfg)
    assert isinstance(model, DualEncoder)
    built.build(model, rebuild=model_factory(cfg))
    losses = run_steps(built, cfg, range(4), BATCH)
    if save_to:
        store = CheckpointStore(save_to)
        store.save({**built.checkpoint_state(), "train": {"step": 4}}, step=4, meta={"model": NAME})
        store.close()
    out = {"losses": losses, "weights": built.full_state_dict(), "held": local_parameter_bytes(built.module)}
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def trained(module_tmp) -> tuple[Path, dict[str, dict]]:
    root = module_tmp("dual_encoder")
    return root, {
        engine: spawn(train, 2, engine, "none", str(root / engine))[0] for engine in ("fsdp", "zero3")
    }


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dual encoder's family, registered for this test only."""
    monkeypatch.setattr(families, "FAMILIES", list(families.FAMILIES))
    families.register_family(FAMILY)


def test_the_dual_encoder_implements_the_contract():
    assert isinstance(DualEncoder(device="meta"), TrainableModel)


@pytest.mark.dist
def test_a_model_that_is_not_clip_trains_the_same_on_fsdp2_and_zero3(trained):
    fsdp, zero3 = trained[1]["fsdp"]["losses"], trained[1]["zero3"]["losses"]
    assert all(math.isfinite(x) for x in fsdp) and len(set(fsdp)) == len(fsdp), fsdp  # it trained
    assert zero3 == pytest.approx(fsdp, rel=1e-4)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["fp8-tensorwise", "switchback-global"])
def test_a_model_that_is_not_clip_takes_the_linear_kinds(kind):
    if kind.startswith("fp8"):
        pytest.importorskip("torchao")
    plain, swapped = spawn(train, 1, "fsdp")[0]["losses"], spawn(train, 1, "fsdp", kind)[0]["losses"]
    assert all(math.isfinite(x) for x in swapped) and swapped != plain
    assert swapped == pytest.approx(plain, rel=0.05)


def test_the_planner_prices_a_model_that_is_not_clip_from_its_shape(registered):
    """Its family's shape lists the module's parameters; the planner's FLOPs are torch's count of
    its forward and a block's activations what autograd saves (LayerNorm statistics: fp32 on
    GPUs, the plan's assumption; bf16 on the CPU, 4 bytes per token less)."""
    spec = PlanSpec(model=NAME, gpus=2, batch_size=4)
    shape = spec.model_shape()
    assert shape.params == param_shapes(DualEncoder(device="meta"))
    plan = build_plan(spec, Hardware())
    images, texts = global_batch(0, 1)
    with FlopCounterMode(display=False) as counted, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        DualEncoder(device="cpu")(images, texts)
    assert plan.forward_flops_per_sample == counted.get_total_flops() > 0
    block = MLPBlock(WIDTH, "cpu").to(torch.bfloat16)
    x = torch.randn(2, 17, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    assert block_saved_per_token(shape.towers["image"], spec) - saved_bytes_per_token(block, x) == 4
    assert plan.memory.activations > 0 and plan.checkpoint_total_bytes == 12 * shape.numel
    images, texts = synthetic_batch(parse_train_args(["--model", NAME, "--batch-size", "3"]))  # the dry run's
    assert images.shape == (3, 3, shape.image_size, shape.image_size) and texts.shape == (3, CONTEXT)
    with pytest.raises(ConfigError, match="no OpenCLIP config"):
        model_config(NAME, {}, {p.name: p.shape for p in shape.params})


def test_a_family_without_named_weights_starts_from_its_own_init(registered, tmp_path):
    """No `named_weights` module: nothing is named (no tags, no model bringing its own weights),
    so a run without --pretrained reads no weights; CLIP's module is OpenCLIP's names."""
    toy = parse_train_args(["--model", NAME])
    assert pretrained.named_weights(toy) is None and not FAMILY.has_own_weights(NAME)
    assert not pretrained.applies(toy, CheckpointStore(str(tmp_path)))
    assert pretrained.named_weights(parse_train_args(["--model", "tiny"])) is named


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_a_model_that_is_not_clip_is_planned_and_consolidated(trained, registered, engine, tmp_path):
    """Rank 0's parameters as the engine holds them are the plan's; the checkpoint consolidates to
    the engine's own full weights, bit for bit."""
    root, runs = trained
    spec = PlanSpec(model=NAME, gpus=2, batch_size=BATCH // 2, engine=engine, precision="fp32")
    assert build_plan(spec, Hardware()).memory.state.parameters == runs[engine]["held"]
    consolidate(str(root / engine), str(tmp_path / "dual.safetensors"))
    state = load_file(tmp_path / "dual.safetensors")
    assert state.keys() == runs[engine]["weights"].keys()
    assert all(torch.equal(state[k], v) for k, v in runs[engine]["weights"].items())


def test_the_command_line_reaches_a_model_that_is_not_clip_through_its_family(registered, capsys):
    """`--model` is checked, listed and tokenized through the family the name belongs to."""
    cfg = parse_train_args(["--model", NAME, "--train-data", "shards"])
    assert build_tokenizer(cfg)(["a photo"]).shape == (1, CONTEXT)
    assert image_size(cfg) == IMAGE_SIZE
    with pytest.raises(ConfigError, match="takes no --grad-checkpointing"):
        parse_train_args(["--model", NAME, "--train-data", "shards", "--grad-checkpointing"])
    listing.main([])
    shape, image = dual_encoder_shape(NAME, ModelOptions()), ("patch_embed.", "image_blocks.")
    image_m = sum(p.numel for p in shape.params if p.name.startswith(image)) / 1e6
    rows = [line.split()[:4] for line in capsys.readouterr().out.splitlines() if NAME in line]
    assert rows == [[NAME, str(IMAGE_SIZE), f"{shape.numel / 1e6:.2f}", f"{image_m:.2f}"]]
    assert image_m > 0
