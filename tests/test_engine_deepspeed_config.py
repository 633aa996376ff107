"""DeepSpeed configs: bigclip's flags are the source of truth, misplaced keys are refused, and
all of it happens before a model is built. No processes are spawned here."""

from __future__ import annotations

import itertools
import json
import math
import sys

import pytest
import torch
from support.engine_harness import tiny_config
from test_engine_deepspeed import DS_CONFIGS, STAGES

from bigclip.cli_args import parse_train_args
from bigclip.distributed import Runtime
from bigclip.engines import build_engine
from bigclip.engines.deepspeed_config import DS_INSTALL, load_ds_config, resolve_ds_config
from bigclip.engines.deepspeed_layout import flat_boxes
from bigclip.engines.optimizer import read_moments, write_moments
from bigclip.errors import ConfigError

WIDTH = 64  # the tiny model's width


def resolve(raw: dict, *, world: int = 2, **flags: object) -> dict:
    return resolve_ds_config(raw, tiny_config(**flags), world_size=world, model_width=WIDTH).config


def with_zero(**extra: object) -> dict:
    return {"zero_optimization": {"stage": 2}, **extra}


@pytest.mark.parametrize("name", STAGES)
def test_shipped_configs_fill_auto_from_flags(name):
    raw = load_ds_config(str(DS_CONFIGS / f"{name}.json"))
    flags = {"data.batch_size": 16, "optim.accum_freq": 4, "optim.grad_clip_norm": 1.0}
    out = resolve(raw, world=8, **flags, **{"engine.precision": "amp_bf16"})
    assert out["train_micro_batch_size_per_gpu"] == 16
    assert out["gradient_accumulation_steps"] == 1  # bigclip accumulates itself
    assert out["train_batch_size"] == 16 * 8
    assert out["gradient_clipping"] == 1.0
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    assert out["zero_optimization"]["reduce_bucket_size"] == WIDTH * WIDTH
    assert "auto" not in json.dumps(out)


def test_precision_sections_follow_the_flag():
    fp16 = resolve(with_zero(), **{"engine.precision": "amp"})
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    pure = resolve(with_zero(), **{"engine.precision": "pure_bf16"})["bf16"]
    assert pure["enabled"] and pure["bf16_master_weights_and_grads"] and pure["bf16_optimizer_states"]
    fp32 = resolve(with_zero())
    assert not fp32["bf16"]["enabled"] and not fp32["fp16"]["enabled"]


@pytest.mark.parametrize(
    ("raw", "flags", "named"),
    [
        (with_zero(train_micro_batch_size_per_gpu=32), {"data.batch_size": 64}, ["32", "--batch-size (64)"]),
        (with_zero(gradient_accumulation_steps=2), {"optim.accum_freq": 4}, ["2", "--accum-freq (4)"]),
        (with_zero(train_batch_size=100), {"data.batch_size": 8}, ["100", "16"]),
        (with_zero(gradient_clipping=1.0), {}, ["1.0", "--grad-clip-norm (0.0)"]),
        (with_zero(bf16={"enabled": True}), {}, ["bf16.enabled", "true", "--precision fp32"]),
        (with_zero(fp16={"enabled": False}), {"engine.precision": "amp"}, ["false", "--precision amp"]),
        (
            with_zero(optimizer={"type": "AdamW", "params": {"lr": 0.1}}),
            {"optim.lr": 0.001},
            ["0.1", "--lr (0.001)"],
        ),
    ],
)
def test_a_value_contradicting_a_flag_names_both(raw, flags, named):
    with pytest.raises(ConfigError) as error:
        resolve(raw, **flags)
    for text in named:
        assert text in str(error.value)


@pytest.mark.parametrize(
    ("raw", "hint"),
    [
        (with_zero(stage3_prefetch_bucket_size=1000), 'into "zero_optimization"'),
        (with_zero(loss_scale_window=100), 'into "fp16"'),
        (with_zero(zero_optimisation={"stage": 3}), "unknown top-level key"),
        ({"zero_optimization": {"stage": 3, "device": "cpu"}}, "offload_optimizer"),
        (with_zero(scheduler={"type": "WarmupLR"}), "--lr-scheduler"),
        ({"zero_optimization": {"stage": 0}}, "--engine fsdp"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, '"cpu"'),
        (with_zero(managed_gradient_accumulation=False), "accumulation"),
        ({"zero_optimization": {"stage": 2, "overlap_comm": "sometimes"}}, "overlap_comm"),
        (with_zero(fp16={"enabled": "auto", "loss_scale_windw": 10}), "loss_scale_windw"),
    ],
)
def test_misplaced_or_unsupported_keys_are_refused(raw, hint):
    with pytest.raises(ConfigError) as error:
        resolve(raw)
    assert hint in str(error.value)


def test_optimizer_section_is_filled_from_flags_and_8bit_needs_none():
    raw = with_zero(optimizer={"type": "AdamW", "params": "auto"})
    params = resolve(raw, **{"optim.lr": 0.002, "optim.wd": 0.05})["optimizer"]["params"]
    assert params == {"lr": 0.002, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05}
    with pytest.raises(ConfigError, match="remove"):
        resolve(raw, **{"optim.optimizer": "adamw8bit"})
    assert resolve(with_zero(), **{"optim.optimizer": "adamw8bit"})["zero_allow_untested_optimizer"]


def test_torchcompile_turns_off_zero3s_linear_replacement():
    """ZeRO-3's memory_efficient_linear trains compiled blocks wrong on torch 2.11 (zero block
    gradients, see test_torchcompile_under_both_engines): off under --torchcompile, on otherwise."""
    zero3 = {"zero_optimization": {"stage": 3}}
    compiled = {"model.torchcompile": True}
    assert resolve(zero3, **compiled)["zero_optimization"]["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in resolve(zero3)["zero_optimization"]  # DeepSpeed's default
    explicit = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
    with pytest.raises(ConfigError, match="memory_efficient_linear.*--torchcompile"):
        resolve(explicit, **compiled)


def test_bad_config_fails_when_the_engine_is_made_before_any_model(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(with_zero(train_micro_batch_size_per_gpu=3)))
    cfg = tiny_config(**{"engine.engine": "deepspeed", "engine.deepspeed_config": str(path)})
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="--batch-size"):
        build_engine(cfg, runtime)
    cfg.engine.deepspeed_config = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="not found"):
        build_engine(cfg, runtime)


def test_engine_without_deepspeed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` raise ImportError
    cfg = tiny_config(
        **{"engine.engine": "deepspeed", "engine.deepspeed_config": str(DS_CONFIGS / "zero2.json")}
    )
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as error:
        build_engine(cfg, runtime)
    assert DS_INSTALL in str(error.value)


def test_the_launchers_local_rank_flag_is_accepted():
    cfg = parse_train_args(["--local_rank=3", "--engine", "deepspeed", "--deepspeed-config", "x.json"])
    assert cfg.engine.local_rank == 3


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 5)])
def test_flat_boxes_tile_a_row_major_range_in_order(shape):
    numel = math.prod(shape)
    for start, end in itertools.combinations(range(0, numel + 1, max(1, numel // 13)), 2):
        seen = torch.zeros(shape, dtype=torch.long)
        order = torch.arange(numel).view(shape)
        flat = []
        for offsets, sizes in flat_boxes(shape, start, end):
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            seen[box] += 1
            flat += order[box].reshape(-1).tolist()
        assert flat == list(range(start, end))  # contiguous, in row-major order
        assert seen.sum() == end - start and seen.max() <= 1
        assert len(flat_boxes(shape, start, end)) <= 2 * len(shape) - 1


def test_8bit_moments_survive_dequantise_and_requantise_within_one_rounding():
    """8-bit checkpoints store fp32 moments: loading re-quantises them, which moves them by no
    more than one 8-bit rounding (not bit-exact: the signed code book ends at -0.993, so a block
    whose extreme is negative gets a new absmax)."""
    bnb = pytest.importorskip("bitsandbytes")
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = bnb.optim.AdamW8bit([param], lr=1e-3)
    for _ in range(3):
        param.grad = torch.randn(5000)
        optimizer.step()
    state = optimizer.state[param]
    before = {k: v.clone() for k, v in read_moments(state).items()}
    assert before["exp_avg"].abs().max() > 0 and before["exp_avg_sq"].min() >= 0
    write_moments(state, read_moments(state))
    for key, value in read_moments(state).items():
        assert (value - before[key]).norm() / before[key].norm() < 1e-2, key


class _Accelerator:
    """DeepSpeed's accelerator answer, fixed: whether the CPU accelerator reports fp16 depends on
    the host's CPU (oneDNN fp16 support), so the refusal is tested on both answers."""

    def __init__(self, fp16: bool) -> None:
        self.fp16 = fp16

    def is_fp16_supported(self) -> bool:
        return self.fp16

    def device_name(self) -> str:
        return "cpu"


@pytest.mark.parametrize("fp16_supported", [False, True])
def test_fp16_is_refused_up_front_where_the_accelerator_lacks_it(fp16_supported):
    from bigclip.engines.deepspeed import check_supported

    cfg = tiny_config(
        **{"engine.engine": "deepspeed", "engine.deepspeed_config": str(DS_CONFIGS / "zero2.json"),
           "engine.precision": "amp"}
    )  # fmt: skip
    if fp16_supported:
        check_supported(cfg, accelerator=_Accelerator(True))
        return
    with pytest.raises(ConfigError, match="--precision amp_bf16"):
        check_supported(cfg, accelerator=_Accelerator(False))
