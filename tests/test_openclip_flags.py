"""Every option of OpenCLIP's trainer parser is accepted with its meaning or refused saying why.

Two references: the released parser, walked live (`open_clip_train.params` of the installed
open_clip_torch 3.3.0; missing, the tests skip locally and fail under CI), and OpenCLIP main's,
kept as test data (tests/data/openclip_main_params.json names the commit; see
support/openclip_main.py to regenerate it). A new OpenCLIP option fails here until it is handled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from support.openclip_main import main_options
from support.openclip_ref import open_clip_train_parser

from bigclip.cli_args import build_parser, parse_train_args
from bigclip.cli_help import openclip_help
from bigclip.config import TrainConfig, section_of
from bigclip.errors import ConfigError
from bigclip.openclip_flags import IGNORED, REFUSED, REFUSED_VALUES, ignored_warning

# Declared by work merged separately (issue 12 part B; the data-path and checkpoint branches).
PENDING = {
    "--image-mean": "data", "--image-std": "data", "--image-interpolation": "data",
    "--image-resize-mode": "data", "--aug-cfg": "data", "--train-data-upsampling-factors": "data",
    "--save-most-recent": "checkpoint",
}  # fmt: skip

# Sample values (and the options they need) where the type alone does not give a valid one.
SAMPLES: dict[str, list[str]] = {
    "--train-data": ["/data/{00000..00009}.tar"], "--val-data": ["/data/val-{0..1}.tar"],
    "--model": ["ViT-B-16"], "--pretrained": ["/weights/open_clip_pytorch_model.bin"],
    "--resume": ["latest"], "--logs": ["/tmp/bigclip-logs"], "--name": ["run7"], "--cache-dir": ["/tmp/c"],
    "--device": ["cpu"], "--dist-backend": ["gloo"], "--dist-url": ["env://"], "--wandb-notes": ["note"],
    "--wandb-project-name": ["proj"], "--remote-sync": ["s3://bucket/runs"], "--opt": ["adamw"],
    "--use-bnb-linear": ["SwitchBackLinearGlobal"], "--loss-dist-impl": ["gather"],
    "--force-image-size": ["96", "96"], "--force-context-length": ["40"], "--force-patch-dropout": ["0.5"],
    "--report-to": ["wandb,tensorboard"], "--imagenet-val": ["/data/imagenet/val"],
    "--imagenet-v2": ["/data/imagenetv2"], "--image-mean": ["0.5", "0.5", "0.5"],
    "--image-std": ["0.5", "0.5", "0.5"], "--aug-cfg": ["scale=(0.5, 1.0)"],
    "--train-data-upsampling-factors": ["1::2", "--dataset-resampled", "--train-data", "/a/{0..1}.tar::/b/0.tar"],
    "--lock-image-unlocked-groups": ["3", "--lock-image"], "--lock-text-unlocked-layers": ["2", "--lock-text"],
    # OpenCLIP main's
    "--image-key": ["webp"], "--text-key": ["caption.txt;txt"], "--opt-kwargs": ["amsgrad=True", "foreach=None"],
    "--torchcompile-mode": ["max-autotune", "--torchcompile"], "--torchcompile-backend": ["eager", "--torchcompile"],
    "--log-metric-every-n-steps": ["5"], "--val-retrieval-chunk-size": ["1024"],
}  # fmt: skip

# OpenCLIP options whose bigclip field has another name or value: flag -> (field, value meant).
MEANS: dict[str, tuple[str, Any]] = {
    "--opt": ("optimizer", "adamw"),
    "--use-bnb-linear": ("linear_kind", "switchback-global"),
    "--loss-dist-impl": ("loss_exchange", "allgather"),
    "--siglip": ("loss", "siglip"),
    "--no-set-device-rank": ("set_device_rank", False),
    "--force-image-size": ("force_image_size", [96, 96]),
    "--report-to": ("report_to", "wandb,tensorboard"),
    "--opt-kwargs": ("opt_kwargs", {"amsgrad": True, "foreach": None}),
    "--fsdp": ("engine", "fsdp"),  # FSDP2 instead of DDP: bigclip's default engine
    "--fsdp-no-reshard-after-forward": ("reshard_after_forward", False),
}
# Values bigclip spells differently: (flag, OpenCLIP value) -> bigclip value.
VALUE_MEANS = {("--precision", "amp_bfloat16"): "amp_bf16", ("--dataset-type", "auto"): "webdataset"}
NEEDS = {
    ("--lr-scheduler", "const-cooldown"): ["--epochs-cooldown", "2"],
    ("--lock-text-freeze-layer-norm", None): ["--lock-text"],  # a modifier: alone it is refused
}


def openclip_options() -> list[argparse.Action]:
    parser = open_clip_train_parser()
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


MAIN_COMMIT, MAIN_OPTIONS = main_options()


def command_lines(action: argparse.Action) -> list[tuple[list[str], str | None]]:
    """(argv, the value given or None) for each way to use the option worth checking."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [([flag, *NEEDS.get((flag, None), [])], None)]
    if action.choices:
        return [([flag, v, *NEEDS.get((flag, v), [])], v) for v in action.choices]
    if flag == "--lr-scheduler":  # free text in OpenCLIP, documented values
        return [([flag, v, *NEEDS.get((flag, v), [])], v) for v in ("cosine", "const", "const-cooldown")]
    sample = SAMPLES.get(flag) or [{int: "3", float: "0.5"}.get(action.type, "x")]
    return [([flag, *sample], sample[0])]


def cases() -> list[tuple[str, list[str], str | None]]:
    try:
        options = openclip_options()
    except BaseException:  # reported by the test itself, which fails on CI
        return [("reference", [], None)]
    return [(a.option_strings[0], argv, v) for a in options for argv, v in command_lines(a)]


def main_cases() -> list[tuple[str, list[str], str | None]]:
    return [(a.option_strings[0], argv, v) for a in MAIN_OPTIONS for argv, v in command_lines(a)]


def test_openclip_has_the_options_this_test_was_written_for():
    flags = {a.option_strings[0] for a in openclip_options()}
    assert len(flags) >= 90 and {"--dataset-type", "--horovod", "--precision"} <= flags
    main = {s for a in MAIN_OPTIONS for s in a.option_strings}
    assert len(MAIN_COMMIT) == 40 and len(MAIN_OPTIONS) >= 140 and {"--fsdp", "--use-naflex"} <= main
    assert set(REFUSED) | set(IGNORED) <= flags | main and set(PENDING) <= flags  # none that nobody has
    assert not set(REFUSED) & set(IGNORED)


@pytest.mark.parametrize(("flag", "argv", "value"), cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_openclip_option_is_accepted_or_refused_saying_why(flag, argv, value):
    if flag == "reference":
        openclip_options()  # skips (or fails on CI) naming the missing package
    accepted_or_refused(flag, argv, value)


@pytest.mark.parametrize(
    ("flag", "argv", "value"), main_cases(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_every_option_of_openclip_main_is_accepted_or_refused_saying_why(flag, argv, value):
    accepted_or_refused(flag, argv, value)


def test_every_spelling_of_openclip_mains_options_is_declared():
    """Second spellings too (e.g. --visual-layer-decay for --image-layer-decay): none is unknown to argparse."""
    declared = set(build_parser()._option_string_actions)
    missing = [s for a in MAIN_OPTIONS for s in a.option_strings if s not in declared and s not in PENDING]
    assert not missing, missing


def test_defaults_that_matter_are_openclip_mains():
    """bigclip's precision default is main's amp_bf16 (3.3.0's is amp); image and caption keys are main's."""
    defaults = {a.dest: a.default for a in MAIN_OPTIONS}
    cfg = TrainConfig()
    assert cfg.engine.precision == defaults["precision"] == "amp_bf16"
    assert (cfg.data.image_key, cfg.data.text_key) == (defaults["image_key"], defaults["text_key"])
    assert cfg.log.log_metric_every_n_steps == defaults["log_metric_every_n_steps"]
    assert cfg.data.val_retrieval_chunk_size == defaults["val_retrieval_chunk_size"]


def accepted_or_refused(flag: str, argv: list[str], value: str | None) -> None:
    if flag in IGNORED:  # taken with its value and ignored: the config is the default one
        assert parse_train_args(argv).to_dict() == parse_train_args([]).to_dict()
        return
    if flag in REFUSED or value in REFUSED_VALUES.get(flag.removeprefix("--").replace("-", "_"), {}):
        with pytest.raises(ConfigError) as refused:
            parse_train_args(argv)
        assert flag in str(refused.value) and len(str(refused.value)) > len(flag) + 40
        return
    if flag in PENDING and not any(flag in a.option_strings for a in build_parser()._actions):
        pytest.xfail(f"{flag} is declared by the {PENDING[flag]} branch, merged separately")
    cfg = parse_train_args(argv)
    if flag in PENDING:
        return  # its meaning is tested where it is built
    check_meaning(cfg, flag, argv, value)


def check_meaning(cfg: TrainConfig, flag: str, argv: list[str], value: str | None) -> None:
    """The option set the bigclip field of the same meaning to the value given."""
    field, expected = MEANS.get(flag, (flag.removeprefix("--").replace("-", "_"), None))
    got = getattr(getattr(cfg, section_of(field)), field)
    if expected is None:
        if value is None:
            expected = True
        else:
            expected = VALUE_MEANS.get((flag, value), value)
            expected = type(got)(expected) if not isinstance(got, list) else expected
    assert got == expected, f"{' '.join(argv)} set {field}={got!r}, expected {expected!r}"


def test_refused_flags_are_declared_once_and_listed_by_help_openclip():
    text = openclip_help()
    declared = build_parser()._option_string_actions
    for flag in [*REFUSED, *IGNORED]:
        assert flag in text and flag in declared
    fields = {f for s in TrainConfig().sections().values() for f in vars(s)}
    assert not {f.removeprefix("--").replace("-", "_") for f in [*REFUSED, *IGNORED]} & fields


IGNORED_RUN = ["--ddp-static-graph", "--use-bn-sync", "--momentum", "0.9", "--csv-separator", ",",
               "--coca-caption-loss-weight", "2.0", "--ddp-static-graph", "--lock-image", "--lock-image-freeze-bn-stats"]  # fmt: skip


def test_flags_that_do_not_apply_warn_once_each_on_rank_0_and_change_nothing(tmp_path):
    """A command line with OpenCLIP's DDP and BatchNorm flags (one given twice) trains as without
    them; each is named once on stderr, with why, and only by rank 0 of a launch."""
    (tmp_path / "run.yaml").write_text("use_bn_sync: true\ntorchscript: true\n")
    code = (
        "import sys; from bigclip.cli_args import parse_train_args as p; import json;"
        "print(json.dumps(p(sys.argv[1:]).to_dict()))"
    )  # fmt: skip
    argv = [
        sys.executable,
        "-c",
        code,
        "--config",
        str(tmp_path / "run.yaml"),
        "--model",
        "tiny",
        *IGNORED_RUN,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
    rank0 = subprocess.run(argv, capture_output=True, text=True, check=True, env=env, timeout=60)
    lines = rank0.stderr.splitlines()
    named = [
        "--ddp-static-graph",
        "--use-bn-sync",
        "--momentum",
        "--csv-separator",
        "--coca-caption-loss-weight",
        "--lock-image-freeze-bn-stats",
        "--torchscript",
    ]  # the flags, then the file (read after them)
    assert lines == [f"bigclip: warning: {ignored_warning(flag)}" for flag in named], lines
    expected = parse_train_args(["--model", "tiny", "--lock-image"]).to_dict()
    assert json.loads(rank0.stdout) == expected  # nothing of them reached the run's config
    rank1 = subprocess.run(
        argv, capture_output=True, text=True, check=True, env={**env, "RANK": "1"}, timeout=60
    )
    assert rank1.stderr == "" and json.loads(rank1.stdout) == expected


def test_openclips_distributed_guide_command_parses():
    """The torchrun command from OpenCLIP's README, pasted as it is."""
    cfg = parse_train_args([
        "--train-data", "/data/cc12m/cc12m-train-{0000..2175}.tar", "--train-num-samples", "10968539",
        "--dataset-type", "webdataset", "--batch-size", "320", "--precision", "amp", "--workers", "4",
        "--report-to", "tensorboard", "--local-loss", "--gather-with-grad", "--model", "ViT-B-32",
    ])  # fmt: skip
    assert (cfg.data.dataset_type, cfg.engine.precision, cfg.data.batch_size) == ("webdataset", "amp", 320)


@pytest.mark.slow
def test_a_refused_flag_exits_2_before_anything_is_built(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bigclip.cli", "train", "--logs", str(tmp_path), "--horovod"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--horovod" in proc.stderr and "FSDP2" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # no run folder was made


def test_refused_options_in_a_yaml_file_say_why(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("horovod: true\n")
    with pytest.raises(ConfigError, match="--horovod.*FSDP2"):
        parse_train_args(["--config", str(path)])
    path.write_text("precision: bf16\n")
    with pytest.raises(ConfigError, match="--precision bf16.*amp_bf16"):
        parse_train_args(["--config", str(path)])


def test_cache_dir_is_where_pretrained_downloads_go(tmp_path):
    """--cache-dir: OpenCLIP's download cache, here for --pretrained http(s)/s3 .pt/.bin files."""
    import functools
    import http.server
    import threading

    import torch

    from bigclip.weights.sources import open_weights

    served = tmp_path / "served"
    served.mkdir()
    torch.save({"state_dict": {"module.logit_scale": torch.ones(())}}, served / "w.pt")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cache = parse_train_args(["--cache-dir", str(tmp_path / "cache")]).model.cache_dir
        source = open_weights(f"http://127.0.0.1:{server.server_port}/w.pt", cache=cache)
    finally:
        server.shutdown()
    assert [t.name for t in source.reader.tensors()] == ["logit_scale"]
    assert [p.name.endswith("-w.pt") for p in (tmp_path / "cache" / "downloads").iterdir()] == [True]


def test_log_local_and_debug_choose_who_logs_and_how_much(tmp_path):
    import logging

    from bigclip.train.metrics import log_file_name, setup_logging

    assert log_file_name(rank=0, local_rank=0, log_local=False) == "out.log"
    assert log_file_name(rank=8, local_rank=0, log_local=False) is None  # global master only
    assert log_file_name(rank=8, local_rank=0, log_local=True) == "out-8.log"  # each node's master
    assert log_file_name(rank=9, local_rank=1, log_local=True) is None
    node_master = setup_logging(
        rank=8, local_rank=0, log_local=True, debug=True, log_file=tmp_path / "out-8.log"
    )
    assert node_master.level == logging.DEBUG
    node_master.debug("hello from rank 8")
    assert "hello from rank 8" in (tmp_path / "out-8.log").read_text()
    assert setup_logging(rank=9, local_rank=1, log_local=True).level == logging.WARNING


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--use-bnb-linear", "SwitchBackLinearGlobal"], {},
         "linear kind switchback-global: SwitchBack int8 (global quantisation); int8 matmuls on the PyTorch "
         "path (torch._int_mm): Triton runs on CUDA tensors, and this run computes on the CPU; all 8 MLP linears "
         "(attention stays 16-bit) converted (every linear: a CPU runs the kinds for their numerics, not speed)"),
        (["--int8", "switchback-vectorwise", "--int8-attention", "--device", "cuda", "--linear-filter", "all"],
         {"BIGCLIP_SWITCHBACK_BACKEND": "torch"},
         "linear kind switchback-vectorwise: SwitchBack int8 (vectorwise quantisation); int8 matmuls on the "
         "PyTorch path (torch._int_mm): BIGCLIP_SWITCHBACK_BACKEND=torch; all 16 MLP and attention linears "
         "converted (every linear: --linear-filter all)"),
        (["--linear-kind", "fp8-rowwise"], {},
         "linear kind fp8-rowwise: torchao float8 (rowwise scales); emulated on the CPU (torchao's casts, "
         "high-precision matmuls); all 16 MLP and attention linears converted (every linear: a CPU runs the "
         "kinds for their numerics, not speed)"),
    ],
    ids=["use-bnb-linear", "forced-torch-path", "fp8"],
)  # fmt: skip
def test_the_linear_kind_and_its_path_are_logged_once(monkeypatch, argv, env, expected):
    """OpenCLIP's --use-bnb-linear (and --int8, --linear-kind) say at start which kind runs where."""
    import logging

    from bigclip.models import from_config

    if expected.startswith("linear kind fp8"):
        pytest.importorskip("torchao", reason="--linear-kind fp8-* needs torchao (bigclip[fp8])")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(from_config, "_said", set())
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("bigclip.models")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        cfg = parse_train_args(["--model", "tiny", *argv])
        for _ in range(2):  # ZeRO-3 builds the model again on the device: still one line
            from_config.build_model(cfg)
    finally:
        logger.removeHandler(handler)
    assert records == [expected]


def test_the_triton_path_is_named_with_its_version(monkeypatch):
    triton = pytest.importorskip("triton", reason="SwitchBack's Triton kernels need triton (bigclip[int8])")
    from bigclip.ops.int8.custom_ops import describe_path

    monkeypatch.setenv("BIGCLIP_SWITCHBACK_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert describe_path("cpu") == (
        f"bigclip's Triton kernels (triton {triton.__version__}) under Triton's CPU interpreter (TRITON_INTERPRET=1)"
    )
