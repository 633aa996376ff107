"""OpenCLIP main's options that bigclip implements, each doing what OpenCLIP means by it:
--opt-kwargs, --torchcompile-mode/--torchcompile-backend, --log-metric-every-n-steps,
--val-retrieval-chunk-size/--val-retrieval-precision, --fsdp/--fsdp-no-reshard-after-forward.
(--image-key/--text-key: test_data_keys.py; that every option parses: test_openclip_flags.py.)"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.train_harness import demo_argv, train_worker

from bigclip.cli_args import parse_train_args
from bigclip.distributed import spawn
from bigclip.engines.optimizer import check_opt_kwargs, make_optimizer, param_groups
from bigclip.errors import ConfigError
from bigclip.train.evaluate import retrieval_metrics

RECORDER = "bigclip_test_recorder"


def test_opt_kwargs_reach_the_optimizer():
    cfg = parse_train_args(["--opt-kwargs", "amsgrad=True", "maximize=False"])
    model = torch.nn.Linear(4, 4)
    optimizer = make_optimizer(param_groups(model, weight_decay=0.1), cfg.optim)
    assert optimizer.defaults["amsgrad"] is True and optimizer.defaults["lr"] == cfg.optim.lr
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert "max_exp_avg_sq" in optimizer.state[model.weight]  # AMSGrad's extra moment: it is in effect


def test_opt_kwargs_that_have_flags_or_that_the_optimizer_lacks_are_refused():
    with pytest.raises(ConfigError, match="--opt-kwargs lr: set these with their own flags"):
        parse_train_args(["--opt-kwargs", "lr=0.1"])
    cfg = parse_train_args(["--opt-kwargs", "momentum=0.9"])
    with pytest.raises(ConfigError, match="--opt-kwargs .*momentum.*adamw does not take it"):
        make_optimizer(param_groups(torch.nn.Linear(2, 2), weight_decay=0.1), cfg.optim)


def test_opt_kwargs_of_the_wrong_type_are_refused_before_the_model_is_built():
    """Checked against the constructor's defaults: a bool keyword takes a bool, a number a number;
    a keyword defaulting to None (foreach, fused) takes what the constructor takes."""
    check_opt_kwargs(parse_train_args(["--opt-kwargs", "foreach=True", "fused=False", "amsgrad=True"]).optim)
    for bad, says in [("amsgrad=maybe", "takes a bool there"), ("maximize=1", "takes a bool there"),
                      ("weight_decay_xyz=1", None), ("capturable=None", "takes a bool there")]:  # fmt: skip
        cfg = parse_train_args(["--opt-kwargs", bad]).optim
        if says is None:
            check_opt_kwargs(cfg)  # an unknown keyword: the constructor names it (above)
            continue
        with pytest.raises(ConfigError, match=f"--opt-kwargs {bad.split('=')[0]}=.*{says}"):
            check_opt_kwargs(cfg)


def test_opt_kwargs_with_a_deepspeed_optimizer_section_say_where_they_go():
    from bigclip.engines.deepspeed_config import resolve_ds_config

    cfg = parse_train_args(["--opt-kwargs", "amsgrad=True"])
    raw = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}  # fmt: skip
    with pytest.raises(ConfigError, match='put them in the section\'s "params"'):
        resolve_ds_config(raw, cfg, world_size=1, model_width=64)


def test_fsdp_switches_agree_with_the_engine_flags_or_are_refused():
    cfg = parse_train_args(["--fsdp", "--fsdp-no-reshard-after-forward"])
    assert (cfg.engine.engine, cfg.engine.reshard_after_forward) == ("fsdp", False)
    with pytest.raises(ConfigError, match="--fsdp means --engine fsdp, which contradicts --engine deepspeed"):
        parse_train_args(["--fsdp", "--engine", "deepspeed", "--deepspeed-config", "ds_configs/zero2.json"])


def test_torchcompile_mode_and_backend_need_torchcompile_and_valid_names():
    from bigclip.engines.compile import compile_blocks

    with pytest.raises(ConfigError, match="need --torchcompile"):
        parse_train_args(["--torchcompile-mode", "max-autotune"])
    for flags, message in ((["--torchcompile-mode", "fastest"], "Unrecognized mode"),
                           (["--torchcompile-backend", "nope"], "Invalid backend")):  # fmt: skip
        cfg = parse_train_args(["--torchcompile", *flags])
        with pytest.raises(ConfigError, match=f"{flags[0]} {flags[1]}: .*{message}"):
            compile_blocks([torch.nn.Linear(2, 2)], cfg.model)


def compiled_training(rank: int, world: int, argv: list[str], record: str) -> dict:
    """Worker: register a torch.compile backend that records how it was called, then train."""
    from torch._dynamo import register_backend

    from bigclip.train.trainer import train

    @register_backend(name=RECORDER)
    def recorder(gm, example_inputs, **kwargs):  # noqa: ANN001, ANN003
        with open(record, "a") as f:
            f.write(json.dumps(kwargs) + "\n")
        return gm.forward

    return train(parse_train_args(argv))


@pytest.mark.slow
def test_torchcompile_mode_and_backend_reach_torch_compile_in_training(demo_data, tmp_path):
    record = tmp_path / "compiled.jsonl"
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "2", "--val-frequency", "0", "--torchcompile",
                     "--torchcompile-backend", RECORDER, "--torchcompile-mode", "max-autotune")  # fmt: skip
    summary = spawn(compiled_training, 1, argv, str(record))[0]
    assert summary["step"] == 2
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls and all(c == {"mode": "max-autotune"} for c in calls)  # every block's graph, with the mode


@pytest.mark.slow
def test_scalars_every_metric_step_and_the_log_line_every_log_step(demo_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = demo_argv(demo_data, tmp_path, "--max-steps", "7", "--val-frequency", "0",
                     "--log-every-n-steps", "3", "--log-metric-every-n-steps", "2")  # fmt: skip
    summary = spawn(train_worker, 1, argv)[0]
    events = EventAccumulator(str(Path(summary["run_dir"]) / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [
        2,
        3,
        4,
        6,
        7,
    ]  # as OpenCLIP main: both, and the last
    log = (Path(summary["run_dir"]) / "out.log").read_text()
    done = [int(n) for n in re.findall(r"Train Epoch: 0 \[\s*(\d+)/", log)]
    assert done == [3 * 32, 6 * 32, 7 * 32]  # samples done at steps 3, 6 and the last


@pytest.mark.slow
def test_every_epochs_last_step_is_logged(demo_data, tmp_path):
    """As OpenCLIP's log: an epoch's last batch prints its line (and writes its scalars), whatever
    --log-every-n-steps is: 2 epochs of 8 steps print lines at steps 8 and 16 only (scalars every 4)."""
    argv = demo_argv(demo_data, tmp_path, "--epochs", "2", "--train-num-samples", "256", "--val-frequency", "0",
                     "--log-every-n-steps", "100", "--log-metric-every-n-steps", "4")  # fmt: skip
    summary = spawn(train_worker, 1, argv)[0]
    log = (Path(summary["run_dir"]) / "out.log").read_text()
    assert re.findall(r"Train Epoch: (\d) \[\s*(\d+)/(\d+)", log) == [
        ("0", "256", "256"),
        ("1", "256", "256"),
    ]


@pytest.mark.slow
@pytest.mark.dist
def test_an_epoch_that_ends_early_logs_its_last_step(demo_data, tmp_path):
    """OpenCLIP logs an epoch's last batch. Here 3 shards of 384 without sizes.json go to 2 ranks
    by whole shards (768 and 384 samples): the epoch planned 18 steps ends at 12, where rank 1
    runs out, and that step is logged (the run's summary carries its loss), though it is no
    multiple of --log-every-n-steps."""
    data = tmp_path / "data"
    data.mkdir()
    for n in range(3):
        shutil.copy(Path(demo_data.train_pattern).parent / f"{n:05d}.tar", data)
    argv = demo_argv(demo_data, tmp_path, "--train-data", str(data / "{00000..00002}.tar"), "--train-num-samples",
                     "1152", "--val-frequency", "0", "--log-every-n-steps", "100")  # fmt: skip
    summary = spawn(train_worker, 2, argv)[0]
    assert summary["step"] == 12 and summary["loss"] is not None, summary
    log = (Path(summary["run_dir"]) / "out.log").read_text()
    assert re.findall(r"Train Epoch: 0 \[\s*(\d+)/\s*(\d+)", log) == [("768", "1152")], log[-3000:]


def test_chunked_retrieval_scores_equal_the_whole_matrix():
    torch.manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(50, 8), dim=1)
    text = torch.nn.functional.normalize(image + 0.8 * torch.randn(50, 8), dim=1)
    text[7] = text[3]  # a tie: the lower index ranks first (argmax's order), chunked or not
    whole = retrieval_metrics(image, text, logit_scale=10.0, batch_size=16, chunk_size=0)
    assert 0 < whole["image_to_text_R@1"] < whole["image_to_text_R@5"] < 1
    for chunk in (1, 7, 50, 4096):
        assert retrieval_metrics(image, text, logit_scale=10.0, batch_size=16, chunk_size=chunk) == whole
    half = retrieval_metrics(image.bfloat16(), text.bfloat16(), logit_scale=10.0, batch_size=16, chunk_size=7,
                             fp32=False)  # 'model' precision  # fmt: skip
    assert half["num_samples"] == 50
    cfg = parse_train_args(["--val-retrieval-chunk-size", "0", "--val-retrieval-precision", "model"])
    assert (cfg.data.val_retrieval_chunk_size, cfg.data.val_retrieval_precision) == (0, "model")
