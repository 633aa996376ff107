"""The planner's per-rank parameter, gradient and optimizer bytes against the real engines, run as
rank 0 of 256 and 1024 (and of one) under torch's fake process group (each dry run in a fresh process)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bigclip.cli_args import parse_train_args
from bigclip.errors import ConfigError
from bigclip.plan.dryrun import run_dry_run, split_gpus
from bigclip.plan.planner import Hardware, build_plan
from bigclip.plan.spec import from_train_config

ROOT = Path(__file__).resolve().parents[1]
ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs/zero3.json")]
RECIPE_ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs/zero3_vit_bigg.json")]
BIGG = ["--model", "ViT-bigG-14", "--batch-size", "2"]
CASES = {
    "fsdp-bigG-256": ["--gpus", "256", *BIGG],
    "fsdp-bigG-1024": ["--gpus", "1024", *BIGG],
    "zero3-bigG-256": ["--gpus", "256", *BIGG, *RECIPE_ZERO3],
    "zero3-bigG-1024": ["--gpus", "1024", *BIGG, *RECIPE_ZERO3],
    # Other dtypes and options: bf16 parameters and moments; fp32 ZeRO-3; checkpointing, dropout.
    "fsdp-B32-pure_bf16-256": ["--gpus", "256", "--model", "ViT-B-32", "--precision", "pure_bf16",
                               "--grad-checkpointing", "--force-patch-dropout", "0.5"],
    "zero3-B32-fp32-256": ["--gpus", "256", "--model", "ViT-B-32", "--precision", "fp32", *ZERO3],
    # One GPU: no FSDP2, bf16 parameters beside fp32 masters (engines/master_weights.py).
    "fsdp-B32-1": ["--gpus", "1", "--model", "ViT-B-32"],
}  # fmt: skip


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, dict]:
    """All dry runs, two at a time (each is one single-threaded process)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_dry_run, argv) for name, argv in CASES.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("quantity", ["parameters", "gradients", "optimizer"])
def test_plan_matches_dry_run_within_one_percent(dry_runs: dict, case: str, quantity: str) -> None:
    gpus, train_argv = split_gpus(CASES[case])
    spec = from_train_config(parse_train_args(train_argv), gpus=gpus)
    state = build_plan(spec, Hardware()).memory.state
    measured = dry_runs[case][quantity]
    assert measured > 0
    assert getattr(state, quantity) == pytest.approx(measured, rel=0.01)


@pytest.mark.slow
def test_rank_share_shrinks_with_the_world(dry_runs: dict) -> None:
    """At 4x the ranks each rank holds ~1/4: exactly for ZeRO-3's flat partitions; FSDP2's rank 0
    holds ceil(rows / N) rows of every parameter, 14% over 1/N for ViT-bigG-14 at 1024 ranks."""
    ratio = {}
    for engine in ("fsdp", "zero3"):
        small, large = dry_runs[f"{engine}-bigG-256"], dry_runs[f"{engine}-bigG-1024"]
        ratio[engine] = small["parameters"] / large["parameters"]
    assert ratio["zero3"] == pytest.approx(4.0, rel=0.001)
    assert 3.5 < ratio["fsdp"] < 3.7


@pytest.mark.slow
def test_dry_run_refuses_engines_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="--gpus"):
        split_gpus(["--model", "tiny"])
    with pytest.raises(RuntimeError, match="holds the whole model"):
        run_dry_run(["--gpus", "8", "--model", "tiny", "--engine", "deepspeed", "--deepspeed-config",
                     str(ROOT / "ds_configs/zero1.json")])  # fmt: skip
