"""The planner's formulas against what the code really does: saved tensors of the real residual
block, recorded loss-memory measurements, a real S3 save's requests, and the CLI."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.s3_fault_proxy import FaultProxy  # tests/ is on sys.path (rootdir conftest)

from bigclip.checkpoint import CheckpointStore
from bigclip.checkpoint.catalog import read_manifest, step_folder
from bigclip.cli_args import parse_train_args
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import ConfigError
from bigclip.models.shape import TowerShape
from bigclip.models.transformer import ResidualAttentionBlock, block_linears
from bigclip.ops.int8.switchback import apply_int8
from bigclip.plan.checkpoint_cost import STEP_FOLDER_REQUESTS
from bigclip.plan.command import main
from bigclip.plan.memory import (
    activation_bytes,
    block_saved_per_token,
    loss_buffer_bytes,
    recomputed_flops,
    towers,
)
from bigclip.plan.planner import Hardware, build_plan, forward_flops, s3_requests
from bigclip.plan.spec import PlanSpec, from_train_config
from bigclip.storage.save_requests import PART_BYTES, upload_requests
from bigclip.storage.settings import storage_configured

ROOT = Path(__file__).resolve().parents[1]


class _OneBlock(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def blocks(self) -> list[torch.nn.Module]:
        return [self.block]

    def swappable_linears(self) -> list:
        return block_linears("block", self.block)


def saved_bytes_per_token(block: torch.nn.Module, x: torch.Tensor) -> float:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(saved.values()) / (x.shape[0] * x.shape[1])


@pytest.mark.parametrize(
    "int8, attention",
    [("none", False), ("switchback-global", True), ("switchback-memefficient", False),
     ("switchback-memefficient", True)],
)  # fmt: skip
def test_activation_formula_matches_saved_tensors_of_the_real_block(int8: str, attention: bool) -> None:
    width, heads, mlp, batch, seq = 64, 4, 256, 2, 17
    block = ResidualAttentionBlock(width, heads, mlp / width).to(torch.bfloat16)
    if int8 != "none":
        apply_int8(_OneBlock(block), int8, include_attention=attention)
    x = torch.randn(batch, seq, width, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes_per_token(block, x)
    spec = PlanSpec(
        model="tiny",
        gpus=1,
        batch_size=batch,
        linear_kind=int8,
        int8_attention=attention,
        linear_filter="all",
    )
    planned = block_saved_per_token(TowerShape(1, width, mlp, heads, seq), spec)
    # The plan counts LayerNorm statistics in fp32 (CUDA); CPU keeps them in bf16: 8 bytes/token.
    assert planned - measured == pytest.approx(8, abs=0.5)


def _recorded_loss_rows() -> list[dict]:
    return json.loads((ROOT / "benchmarks/results/loss_memory.json").read_text())["rows"]


@pytest.mark.parametrize("row", _recorded_loss_rows(), ids=lambda r: f"{r['method']}-{r['global']}")
def test_loss_buffers_match_recorded_measurements(row: dict) -> None:
    """benchmarks/loss_memory.py measured rank 0 of 16 (embed dim 1280, fp32) with live-tensor tracking."""
    spec = PlanSpec(
        model="ViT-bigG-14", gpus=16, batch_size=row["local"], loss_chunk_size=row["chunk"],
        loss_exchange=row["method"] if row["chunk"] else "ring", local_loss=True, gather_with_grad=True,
    )  # fmt: skip
    planned_mib = loss_buffer_bytes(spec) / 2**20
    assert planned_mib == pytest.approx(row["peak_MiB"], rel=0.10)


def test_forward_flops_of_bigg_and_patch_dropout() -> None:
    full = forward_flops(PlanSpec(model="ViT-bigG-14", gpus=1, batch_size=1))
    assert full == pytest.approx(1065e9, rel=0.005)  # DESIGN.md: image 967.5 + text 97.9 GFLOPs
    half = forward_flops(PlanSpec(model="ViT-bigG-14", gpus=1, batch_size=1, patch_dropout=0.5))
    assert 0.5 < half / full < 0.6  # the vision tower is ~90% of the work and sees 129 of 257 tokens


def test_forced_image_size_and_context_length_are_planned() -> None:
    """--force-image-size and --force-context-length change what the run builds: the plan follows them."""
    base = ["--model", "ViT-L-14", "--batch-size", "32"]
    plain = from_train_config(parse_train_args(base), gpus=8)
    forced = from_train_config(
        parse_train_args([*base, "--force-image-size", "336", "--force-context-length", "32"]), gpus=8
    )
    vision, text = forced.model_shape().towers["vision"], forced.model_shape().towers["text"]
    assert vision.tokens == (336 // 14) ** 2 + 1 and text.tokens == 32
    assert forward_flops(forced) > 2 * forward_flops(plain)  # 577 image tokens instead of 257
    assert (
        build_plan(forced, Hardware()).memory.activations > build_plan(plain, Hardware()).memory.activations
    )


@pytest.mark.slow
def test_s3_requests_per_save_match_a_real_save() -> None:
    """One rank saves through a counting proxy to a loopback S3; the request model must agree."""
    # Two objects (the store's io_threads), one of them larger than a part (PART_BYTES: 64 MiB).
    state = {
        "model": {"big": torch.randn(18_000_000), "small": torch.randn(1000), "mid": torch.randn(4_000_000)}
    }
    with LoopbackS3() as s3:
        s3.create_bucket("plan-bucket")
        with FaultProxy(upstream=s3.endpoint) as proxy, storage_configured(s3_endpoint=proxy.endpoint):
            store = CheckpointStore("s3://plan-bucket/ck", io_threads=2)
            proxy.requests.clear()
            store.save(state, step=7)
            observed = len(proxy.requests)
            manifest = read_manifest(store.location, step_folder(7))
            store.close()
    sizes = [record.size for name, record in manifest.objects.items() if name.endswith(".distcp")]
    assert len(sizes) == 2 and max(sizes) > PART_BYTES  # several parts for one object
    # Its shards and its record under its prefix; the listing, .metadata and the manifest from rank 0.
    record = next(r.size for name, r in manifest.objects.items() if name.endswith("rank.bigclip"))
    metadata = manifest.objects[".metadata"].size
    rank0 = STEP_FOLDER_REQUESTS + upload_requests(metadata, part_bytes=PART_BYTES)
    assert observed == s3_requests([*sizes, record], part_size=PART_BYTES) + rank0


def test_plan_cli_reports_and_refuses_bad_input(capsys: pytest.CaptureFixture) -> None:
    argv = ["--gpus", "1024", "--model", "ViT-bigG-14", "--batch-size", "160", "--grad-checkpointing"]
    assert main([*argv, "--loss-chunk-size", "1024"]) == 0
    out = capsys.readouterr().out
    for quantity in ("parameters", "activations", "loss buffers", "communication buffers", "peak per GPU",
                     "model FLOPs per step", "step time at 40% MFU", "S3 requests per save"):  # fmt: skip
        assert quantity in out
    assert main([*argv, "--loss-chunk-size", "1024", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["spec"]["engine"] == "fsdp"
    # OpenCLIP's default loss materialises global x global logits: 163,840^2 floats do not fit.
    assert main([*argv, "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["fits"]
    with pytest.raises(ConfigError, match="--mfu"):
        main([*argv, "--mfu", "1.5"])


def test_deepspeed_flags_select_the_zero_stage_and_offload() -> None:
    base = ["--model", "ViT-bigG-14", "--batch-size", "32", "--engine", "deepspeed"]
    cfg = parse_train_args([*base, "--deepspeed-config", str(ROOT / "ds_configs/zero3_offload.json")])
    spec = from_train_config(cfg, gpus=256)
    assert spec.engine == "zero3" and spec.zero.offload_optimizer and spec.zero.offload_param
    plan = build_plan(spec, Hardware())
    state = plan.memory.state
    assert state.parameters == state.optimizer == 0 and state.host_total > 0
    zero1 = from_train_config(
        parse_train_args([*base, "--deepspeed-config", str(ROOT / "ds_configs/zero1.json")]), gpus=256
    )
    # ZeRO-1 keeps the whole bf16 model and its gradients on every rank.
    whole = build_plan(zero1, Hardware()).memory.state
    assert whole.parameters >= 2 * 2_539_000_000 and whole.gradients == whole.parameters
    assert math.isclose(whole.optimizer, 12 * 2_539_570_000 / 256, rel_tol=0.01)


def test_selective_checkpointing_is_priced_between_none_and_full() -> None:
    """What `bigclip plan` tells a user choosing a checkpointing setting: memory falls and recomputed
    work rises from none to `ops` / every-2 to full, and full keeps one block input per block."""
    base = PlanSpec(model="ViT-bigG-14", gpus=1, batch_size=64)
    settings = {
        "none": base,
        "every-2": replace(base, grad_checkpointing=True, checkpoint_every=2),
        "ops": replace(base, grad_checkpointing=True, checkpoint_policy="ops"),
        "full": replace(base, grad_checkpointing=True),
    }
    memory = {k: activation_bytes(s) for k, s in settings.items()}
    work = {k: recomputed_flops(s) for k, s in settings.items()}
    assert (
        memory["none"] > memory["every-2"] > memory["full"]
        and memory["none"] > memory["ops"] > memory["full"]
    )
    assert work["none"] == 0 < work["ops"] < work["every-2"] < work["full"]
    plain = activation_bytes(replace(base, batch_size=1))
    full = activation_bytes(replace(base, batch_size=1, grad_checkpointing=True))
    tokens_times_layers = sum(t.tokens * t.layers * t.width * 2 for t in towers(base).values())  # bf16 inputs
    one_block = sum(t.tokens * block_saved_per_token(t, base) for t in towers(base).values())
    assert (
        full
        == plain
        - sum(t.tokens * t.layers * block_saved_per_token(t, base) for t in towers(base).values())
        + tokens_times_layers
        + one_block
    )


def _advice(argv: list[str], gpus: int, memory_gib: float = 80.0):
    from bigclip.plan.advice import advise

    plan = build_plan(
        from_train_config(parse_train_args(argv), gpus=gpus), Hardware(gpu_memory_gib=memory_gib)
    )
    assert not plan.fits
    return plan, advise(plan, build_plan)


BIGG_CKPT = ["--model", "ViT-bigG-14", "--grad-checkpointing"]


@pytest.mark.parametrize(
    ("argv", "gpus", "memory", "term", "first", "never"),
    [
        # OpenCLIP's loss at a global batch of 163,840: ~400 GiB of logits; more GPUs would grow them.
        ([*BIGG_CKPT, "--batch-size", "160"], 1024, 80, "loss buffers", "--loss-chunk-size 1024",
         ("--grad-checkpointing", "twice the GPUs")),
        (["--model", "ViT-bigG-14", "--batch-size", "512"], 1, 80, "activations", "--grad-checkpointing", ()),
        ([*BIGG_CKPT, "--batch-size", "1", "--loss-chunk-size", "64"], 1, 24, "model state", "twice the GPUs",
         ("--grad-checkpointing",)),
    ],
    ids=["loss", "activations", "model-state"],
)  # fmt: skip
def test_advice_follows_the_largest_term_and_each_remedy_is_replanned(argv, gpus, memory, term, first, never):
    plan, advice = _advice(argv, gpus, memory)
    assert advice.largest[0] == advice.term[0] == term
    m = plan.memory
    sizes = {"loss buffers": m.loss_buffers, "activations": m.activations + m.backward_workspace}
    assert advice.largest[1] == sizes.get(term, advice.largest[1])
    assert advice.remedies[0][0].startswith(first) and advice.remedies[0][2]  # the best one fits
    for flags, peak, fits in advice.remedies:
        assert not flags.startswith(never), flags
        other = parse_train_args([*argv, *flags.split(" (")[0].split()]) if flags.startswith("--") else None
        if other is not None:  # the peak said is the plan of the flags said
            replanned = build_plan(from_train_config(other, gpus=gpus), Hardware(gpu_memory_gib=memory))
            assert (replanned.memory.peak, replanned.fits) == (peak, fits)


def test_plan_prints_the_advice_the_run_time_and_gpu_hours(capsys: pytest.CaptureFixture) -> None:
    argv = ["--gpus", "1024", *BIGG_CKPT, "--batch-size", "160", "--train-num-samples", "100000000",
            "--epochs", "390"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    advice = out.split("does not fit: ")[1]
    assert advice.startswith("its largest term is the loss buffers") and "--loss-chunk-size 1024" in advice
    assert "--grad-checkpointing" not in advice and "GPUs" not in advice
    assert main([*argv, "--loss-chunk-size", "1024", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    steps = 390 * (100_000_000 // (160 * 1024))  # the loop's steps per epoch, every epoch
    assert plan["optimizer_steps"] == steps and not plan["steps_bounded"]
    assert plan["run_time_s"] == pytest.approx(steps * plan["step_time_s"])
    assert plan["gpu_hours"] == pytest.approx(plan["run_time_s"] * 1024 / 3600)
    assert main([*argv, "--loss-chunk-size", "1024"]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"^optimizer steps +{steps:,}$", text, re.M) and "does not fit" not in text
    assert f"{plan['gpu_hours']:,.0f} (1,024 GPUs)" in text
    # --max-steps ends it first; without --train-num-samples it is an upper bound; with neither, unknown.
    for extra, expected in ((["--max-steps", "1000"], 1000), (["--train-num-samples", "0", "--max-steps", "50"], 50),
                            (["--train-num-samples", "0"], None)):  # fmt: skip
        assert main([*argv, "--loss-chunk-size", "1024", *extra, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["optimizer_steps"] == expected
    assert main([*argv, "--loss-chunk-size", "1024", "--train-num-samples", "0"]) == 0
    assert "unknown: give --train-num-samples" in capsys.readouterr().out


def test_fsdp_units_of_several_blocks_are_priced_as_gathered_together() -> None:
    """FSDP2 gathers a unit's blocks at once: bigG's image blocks in units of four hold four times
    one block's bytes in each term that holds a unit (two in flight, bf16; its gradients, bf16 and
    fp32), the root's parameters (bf16) unchanged."""
    spec = PlanSpec(model="ViT-bigG-14", gpus=8, batch_size=32)
    one, four = (
        build_plan(replace(spec, fsdp_blocks_per_unit=n), Hardware()).memory.communication for n in (1, 4)
    )
    root = 2 * sum(p.numel for p in spec.model_shape().params if p.block == -1)
    assert four - root == 4 * (one - root)
