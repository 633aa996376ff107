"""Bad `bigclip train` flags: each fails with one line naming the flag and the fix, before any work.

Every row is a real `python -m bigclip train ...` in a folder that holds demo shards and an earlier
run (logs/exp), which must stay byte for byte as it was. Rows settled by the flags alone also run
without importing torch (test_a_bad_flag_fails_without_importing_torch) in well under a second;
rows that ask the machine (--device, the global batch, DeepSpeed) import torch but still fail
before a process group is formed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.bad_input import ROOT, TORCH_FIRST_S, Case, bigclip, check
from support.hf_cache import populate_cache
from support.hf_tokenizers import eos_folder
from support.openclip_ref import open_clip_config

from bigclip.demo.shapes_data import write_demo_data

DATA = "data/train/{00000..00001}.tar"
# Importing torch and DeepSpeed alone takes 4-6 s on a busy 2-core box; the check itself is instant.
DEEPSPEED_S = 10.0
BASE = ("--model", "tiny", "--train-data", DATA, "--logs", "logs", "--name", "fresh")
VAL = "data/val/{00000..00000}.tar"
EVAL = ("--model", "tiny", "--val-data", VAL, "--logs", "logs", "--name", "fresh")
# Refused once the process group and the run's checkpoint folder are up (torch imported, no model built).
SET_UP_S = 15.0


def train(name: str, *flags: str, says: tuple[str, ...], base: tuple[str, ...] = BASE, **kw) -> Case:
    return Case(name, bigclip("train", *base, *flags), says, **kw)


CASES = [
    train("openclip-model-of-timm-tower", "--model", "EVA02-L-14",
          says=("model 'EVA02-L-14' needs timm's eva02_large_patch14_clip_224 image tower", "bigclip models")),
    train("unknown-flag", "--bogus-flag", says=("unrecognized arguments: --bogus-flag", "bigclip train --help")),
    train("misspelt-flag", "--batch-sise", "8", says=("--batch-sise", "did you mean --batch-size?")),
    train("help-unknown-section", "--help", "dta", says=("--help dta: no such section", "did you mean data?",
                                                         "the sections are model, data")),
    train("lr-not-a-number", "--lr", "abc", says=("--lr", "invalid float value: 'abc'")),
    train("lr-nan", "--lr", "nan", says=("--lr nan", "finite number")),
    train("lr-inf", "--lr", "inf", says=("--lr inf", "finite number")),
    train("lr-zero", "--lr", "0", says=("--lr must be positive",)),
    train("lr-negative", "--lr", "-1e-3", says=("--lr must be positive",)),
    train("beta1-one", "--beta1", "1.0", says=("--beta1 1.0", "[0, 1)")),
    train("beta2-negative", "--beta2", "-0.1", says=("--beta2 -0.1", "[0, 1)")),
    train("eps-zero", "--eps", "0", says=("--eps 0.0", "eps > 0")),
    train("wd-negative", "--wd", "-0.1", says=("--wd", "must not be negative")),
    train("warmup-negative", "--warmup", "-5", says=("--warmup", "must not be negative")),
    train("no-epochs-no-steps", "--epochs", "0", says=("--epochs or --max-steps",)),
    train("accum-zero", "--accum-freq", "0", says=("--accum-freq must be at least 1",)),
    train("batch-zero", "--batch-size", "0", says=("--batch-size must be at least 1",)),
    train("workers-negative", "--workers", "-1", says=("--workers must be 0 or more",)),
    train("precision-unknown", "--precision", "fp8", says=("--precision", "invalid choice: 'fp8'")),
    train("engine-unknown", "--engine", "horovod", says=("--engine", "invalid choice: 'horovod'")),
    train("linear-filter-unknown", "--int8", "switchback-global", "--linear-filter", "volta",
          says=("--linear-filter", "invalid choice: 'volta'", "'hopper'")),
    train("deepspeed-without-config", "--engine", "deepspeed", says=("--engine deepspeed needs --deepspeed-config",)),
    train("fsdp-switch-vs-deepspeed", "--fsdp", "--engine", "deepspeed", "--deepspeed-config", "zero3",
          says=("--fsdp", "contradicts --engine deepspeed")),
    train("model-unknown", "--model", "ViT-Q-99", says=("unknown model 'ViT-Q-99'", "available:")),
    train("pretrained-tag-unknown", "--pretrained", "no_such_tag", says=("no_such_tag",)),
    train("tag-with-hashing-tokenizer", "--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k", "--tokenizer",
          "hashing", says=("--pretrained laion2b_s34b_b79k", "--tokenizer open_clip", "--allow-tokenizer-change")),
    train("resume-latest-overwrite", "--resume", "latest", "--overwrite-run",
          says=("--resume latest and --overwrite-run contradict", "give one of them")),
    train("resume-path-overwrite", "--resume", "logs/exp/checkpoints/step_00000002", "--overwrite-run",
          says=("--overwrite-run contradict", "give one of them")),
    train("delete-previous-keep-last", "--delete-previous-checkpoint", "--keep-last", "3",
          says=("--delete-previous-checkpoint", "--keep-last 3", "give one of them")),
    train("save-frequency-negative", "--save-frequency", "-1", says=("must not be negative",)),
    train("keep-last-negative", "--keep-last", "-2", says=("must not be negative",)),
    train("save-minutes-negative", "--save-every-n-minutes", "-5", says=("--save-every-n-minutes -5.0", "0 for no")),
    train("save-minutes-nan", "--save-every-n-minutes", "nan", says=("--save-every-n-minutes nan", "finite number")),
    train("dist-timeout-zero", "--dist-timeout", "0", says=("--dist-timeout must be at least 1",)),
    train("fsdp-units-zero", "--fsdp-blocks-per-unit", "0", says=("--fsdp-blocks-per-unit must be at least 1",)),
    train("dist-url-tcp", "--dist-url", "tcp://10.0.0.1:23456", says=("--dist-url", "MASTER_ADDR and MASTER_PORT")),
    train("logs-on-s3", "--logs", "s3://bucket/logs", says=("--logs s3://bucket/logs", "--remote-sync")),
    train("report-to-unknown", "--report-to", "mlflow", says=("--report-to 'mlflow'", "tensorboard, wandb")),
    train("log-every-zero", "--log-every-n-steps", "0", says=("--log-every-n-steps", "at least 1")),
    train("remote-sync-frequency-zero", "--remote-sync-frequency", "0", says=("--remote-sync-frequency",)),
    train("image-size-not-square", "--force-image-size", "224", "112", says=("--force-image-size", "square")),
    train("image-size-below-patch", "--force-image-size", "4", says=("--force-image-size 4", "patch size")),
    train("patch-dropout-one", "--force-patch-dropout", "1.0", says=("--force-patch-dropout", "[0, 1)")),
    train("context-length-negative", "--force-context-length", "-1", says=("--force-context-length",)),
    train("context-length-huge", "--force-context-length", "100000",
          says=("--force-context-length 100000: give 1 to 8192 tokens", "37.3 GiB for the mask alone")),
    train("ckpt-every-without-ckpt", "--grad-checkpointing-every", "2", says=("add it",)),
    train("compile-mode-without-compile", "--torchcompile-mode", "max-autotune", says=("need --torchcompile",)),
    train("int8-attention-alone", "--int8-attention", says=("--int8-attention needs a SwitchBack --linear-kind", "--int8 switchback-global")),
    train("unlocked-groups-without-lock", "--lock-image-unlocked-groups", "2", says=("add --lock-image",)),
    train("freeze-ln-without-lock", "--lock-text-freeze-layer-norm", says=("only with --lock-text",)),
    train("opt-kwargs-own-flag", "--opt-kwargs", "lr=1.0", says=("--opt-kwargs lr", "--lr")),
    train("opt-kwargs-wrong-type", "--opt-kwargs", "amsgrad=maybe",
          says=("--opt-kwargs amsgrad='maybe'", "takes a bool there", "amsgrad=False"), max_s=SET_UP_S),
    train("max-steps-negative", "--max-steps", "-1", says=("--epochs and --max-steps must not be negative",)),
    train("seed-negative", "--seed", "-1", says=("--seed must be between 0 and", "got -1")),
    train("seed-past-numpy", "--seed", str(2**40), says=("--seed must be between 0 and",)),
    train("name-outside-logs", "--name", "..", says=("--name '..'", "inside --logs")),
    train("name-absolute", "--name", "/tmp/run", says=("--name '/tmp/run'", "not an absolute path")),
    train("batch-keys-folder-missing", "--batch-keys-file", "nope/keys",
          says=("--batch-keys-file nope/keys", "the folder nope does not exist")),
    train("opt-kwargs-no-equals", "--opt-kwargs", "amsgrad", says=("KEY=VALUE", "'amsgrad'")),
    train("cooldown-without-epochs", "--lr-scheduler", "const-cooldown", says=("--epochs-cooldown N",)),
    train("openclip-horovod", "--horovod", says=("--horovod is an OpenCLIP option bigclip does not take",)),
    train("openclip-csv-dataset", "--dataset-type", "csv", says=("--dataset-type csv", "webdataset")),
    train("bnb-linear-unknown", "--use-bnb-linear", "Linear8bitLt", says=("--use-bnb-linear", "use one of")),
    train("loss-chunk-negative", "--loss-chunk-size", "-1", says=("--loss-chunk-size",)),
    train("val-frequency-negative", "--val-frequency", "-1", says=("--val-frequency",)),
    train("step-timeout-nan", "--step-timeout", "nan", says=("--step-timeout nan", "finite number")),
    train("image-mean-nan", "--image-mean", "0.5", "nan", "0.5", says=("--image-mean", "finite number")),
    train("config-missing", "--config", "missing.yaml", says=("--config missing.yaml: file not found",)),
    train("config-not-a-mapping", "--config", "list.yaml", says=("--config list.yaml", "mapping")),
    train("config-unknown-option", "--config", "unknown.yaml", says=("unknown option 'learning_rate'",)),
    # YAML values meet the flags' checks: `"no"` is not false, 1.5 not a number of epochs, text not a rate.
    train("config-bool-as-text", "--config", "bool_text.yaml",
          says=("--config bool_text.yaml: grad_checkpointing: 'no' is not true or false", "grad_checkpointing: false")),
    train("config-int-as-float", "--config", "float_epochs.yaml",
          says=("--config float_epochs.yaml: epochs: 1.5 is not a whole number", "epochs: 32")),
    train("config-wrong-type", "--config", "list_lr.yaml", says=("lr: [1, 2] is not a number", "(the value --lr takes)")),
    train("config-invalid-choice", "--config", "choice.yaml", says=("precision: invalid choice 'fp8'", "amp_bf16")),
    train("config-section-value-wrong-type", "--config", "section.yaml",
          says=("batch_size: 'x' is not a whole number",)),
    train("remote-sync-is-logs", "--remote-sync", "logs", "--remote-sync-protocol", "fsspec",
          says=("--remote-sync logs is inside --logs logs", "delete the checkpoints it backs up", "other storage")),
    train("remote-sync-inside-logs", "--remote-sync", "file://logs/backup", "--remote-sync-protocol", "fsspec",
          says=("--remote-sync file://logs/backup is inside --logs logs", "outside --logs")),
    train("no-train-data", says=("--train-data is empty", "/data/{00000..00099}.tar", "--val-data"),
          base=("--logs", "logs")),
    # Without --train-data a run evaluates (OpenCLIP's way): it needs weights and an evaluation that runs.
    train("eval-only-no-weights", says=("no --train-data", "no weights to evaluate", "--pretrained", "--resume"),
          base=EVAL),
    train("eval-only-frequency-zero", "--pretrained", "w.safetensors", "--val-frequency", "0",
          says=("--val-frequency 0", "--val-data would never be evaluated"), base=EVAL),
    train("empty-train-data", "--train-data", "", says=("--train-data is empty",)),
    train("int-flag-float", "--epochs", "1.5", says=("--epochs", "invalid int value: '1.5'")),
    train("missing-value", "--lr", says=("--lr", "expected one argument")),
    train("device-unknown", "--device", "gpu0", says=("--device 'gpu0'", "cpu, cuda or cuda:N")),
    train("device-mps", "--device", "mps", says=("--device 'mps'", "cpu, cuda or cuda:N")),
    train("fewer-samples-than-a-step", "--train-num-samples", "100", "--batch-size", "64", "--accum-freq", "2",
          says=("--train-num-samples 100", "64 x --accum-freq 2 x 1 rank(s) = 128", "lower --batch-size")),
    train("fewer-samples-than-a-world-step", "--train-num-samples", "100", "--batch-size", "32",
          env={"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_PORT": "29500"},
          says=("--train-num-samples 100", "x 4 rank(s) = 128")),
    # Launcher variables set by hand: one line before torch, not torch.distributed's traceback.
    train("world-size-not-a-number", env={"RANK": "0", "WORLD_SIZE": "two"},
          says=("WORLD_SIZE='two' is not a whole number", "unset them to train as one process")),
    train("rank-not-below-world-size", env={"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "29500"},
          says=("RANK=2 WORLD_SIZE=2", "ranks 0 to WORLD_SIZE - 1", "torchrun")),
    train("rank-variables-without-a-launcher", env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": None},
          says=("RANK=0 and WORLD_SIZE=2 are set but MASTER_PORT is not", "-m bigclip.train -- FLAGS")),
    train("slurm-rank-not-a-number", env={"SLURM_PROCID": "x", "SLURM_NTASKS": "4", "RANK": None},
          says=("SLURM_PROCID='x' is not a whole number",)),
    # DeepSpeed's config and accelerator: torch and DeepSpeed are imported (DEEPSPEED_S), no process
    # group is formed.
    train("deepspeed-config-missing", "--engine", "deepspeed", "--deepspeed-config", "nope.json",
          says=("--deepspeed-config nope.json: file not found", "zero3"), max_s=DEEPSPEED_S),
    train("deepspeed-batch-contradiction", "--engine", "deepspeed", "--deepspeed-config", "ds_batch.json",
          "--batch-size", "8", says=('"train_micro_batch_size_per_gpu": 4 contradicts --batch-size (8)',),
          max_s=DEEPSPEED_S),
    # The model's tokenizer, built as the run sets up (torch imported, nothing written yet).
    train("model-tokenizer-not-cached", "--model", "ViT-L-14-CLIPA", env={"HF_HOME": "hf", "HF_HUB_OFFLINE": "1"},
          says=("model ViT-L-14-CLIPA reads Hugging Face's bert-base-uncased tokenizer", "transformers could not load it",
                "Hugging Face cache (--cache-dir)"), max_s=SET_UP_S),
    train("eos-pooling-with-hashing", "--model", "ViT-H-14-worldwide", "--tokenizer", "hashing",
          says=("--tokenizer hashing", "pool_type 'eos'", "use --tokenizer open_clip"), max_s=SET_UP_S),
]  # fmt: skip

EVAL_COMMAND = [  # `bigclip eval`: the evaluation-only run by name
    Case("eval-nothing-given", bigclip("eval", "--logs", "logs", "--name", "fresh"),
         ("nothing to evaluate on", "--val-data", "--imagenet-val", "the weights: --pretrained or --resume")),
    Case("eval-no-data", bigclip("eval", "--model", "tiny", "--pretrained", "w.safetensors", "--logs", "logs"),
         ("nothing to evaluate on", "--val-data SHARDS", "--imagenet-val DIR")),
    Case("eval-no-weights", bigclip("eval", *EVAL), ("no weights to evaluate", "--pretrained", "--resume")),
    Case("eval-with-train-data", bigclip("eval", *BASE, "--val-data", VAL, "--pretrained", "w.safetensors"),
         ("--train-data", "bigclip eval only evaluates weights", "bigclip train")),
    Case("eval-resume-latest-finds-none", bigclip("eval", *EVAL, "--resume", "latest"),
         ("--resume latest", "holds no committed checkpoint", "--resume PATH", "--pretrained"), max_s=SET_UP_S),
]  # fmt: skip


@pytest.mark.parametrize("case", EVAL_COMMAND, ids=[c.name for c in EVAL_COMMAND])
def test_bad_eval_command(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])
    assert not (home / "logs" / "fresh").exists()


NO_GPU = [
    train("device-cuda-without-gpu", "--device", "cuda", says=("--device cuda", "no GPU", "leave --device out"),
          max_s=TORCH_FIRST_S),
    train("device-cuda-index-without-gpu", "--device", "cuda:3", says=("--device cuda:3", "no GPU"),
          max_s=TORCH_FIRST_S),
]  # fmt: skip


@pytest.fixture(scope="module")
def home(module_tmp) -> Path:
    """Shards, an earlier run's folder (what must survive), and a few config files."""
    home = module_tmp("flags")
    write_demo_data(
        str(home / "data"), samples=16, shards=2, val_samples=4, classify_samples=0, image_size=16
    )
    run = home / "logs" / "exp"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {model: tiny}\n")
    (run / "checkpoints" / "step_00000002" / "manifest.json").write_text(json.dumps({"step": 2}))
    (home / "list.yaml").write_text("- lr: 1\n")
    (home / "unknown.yaml").write_text("learning_rate: 1\n")
    (home / "bool_text.yaml").write_text('grad_checkpointing: "no"\n')
    (home / "float_epochs.yaml").write_text("epochs: 1.5\n")
    (home / "list_lr.yaml").write_text("lr: [1, 2]\n")
    (home / "choice.yaml").write_text("precision: fp8\n")
    (home / "section.yaml").write_text("data: {batch_size: x}\n")
    (home / "ds_batch.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    return home


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_flag(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])
    assert not (home / "logs" / "fresh").exists()  # refused before the run folder is made


# OpenCLIP's own configs whose towers bigclip does not build, as `--model hf-hub:` repositories in an
# offline Hugging Face cache: each refused by its tower before any work (a ResNet's config failed
# deep in the model's build, with a TypeError's traceback).
OTHER_TOWERS = {
    "RN50": "a ResNet image tower (OpenCLIP's ModifiedResNet)",
    "convnext_base": "timm's convnext_base image tower",
    "xlm-roberta-base-ViT-B-32": "Hugging Face's xlm-roberta-base text tower",
    "coca_ViT-B-32": "CoCa's captioning decoder",
}
HUB_ENV = {"HF_HOME": "hf", "HF_HUB_OFFLINE": "1"}  # relative: the case's working directory
HUB_MODELS = [
    train(f"hub-{name}", "--model", f"hf-hub:openclip/{name}", "--batch-size", "4", env=HUB_ENV,
          says=(f"model 'hf-hub:openclip/{name}' needs {tower}", "bigclip models", "docs/extending.md"))
    for name, tower in OTHER_TOWERS.items()
]  # fmt: skip
# OpenCLIP options of its own towers with values bigclip does not build (tiny's config, one key changed).
ODD_OPTIONS = {
    "vision-pool-none": ("vision_cfg", {"pool_type": "none"}, ("vision_cfg.pool_type 'none' is not one bigclip builds",
                                                               "use one of tok, avg")),
    "text-pool-mean": ("text_cfg", {"pool_type": "mean"}, ("text_cfg.pool_type 'mean'", "argmax, last, first, eos")),
    "tokenizer-language": ("text_cfg", {"hf_tokenizer_name": "x/y", "tokenizer_kwargs": {"language": "en"}},
                           ("text_cfg.tokenizer_kwargs 'language' is not applied by bigclip", "clean, strip_sep_token")),
}  # fmt: skip
# Settled once the tokenizer is loaded (transformers imported): XLM-R's layout ends texts with id 2,
# and the tower would pool at 3, which it never writes.
TOKENIZER_OPTIONS = {
    "eos-id-not-written": ("text_cfg", {"hf_tokenizer_name": "openclip/xlm-layout", "pool_type": "eos", "eos_id": 3},
                           ("tokenizer openclip/xlm-layout does not write id 3", "text_cfg pool_type 'eos', eos_id 3",
                            "ends texts with id 2", "another tokenizer")),
}  # fmt: skip
HUB_MODELS += [
    train(f"hub-{name}", "--model", f"hf-hub:openclip/{name}", "--batch-size", "4", env=HUB_ENV, says=says,
          max_s=SET_UP_S if name in TOKENIZER_OPTIONS else Case.max_s)
    for name, (_, _, says) in (ODD_OPTIONS | TOKENIZER_OPTIONS).items()
]  # fmt: skip


@pytest.fixture(scope="module")
def hub_home(home: Path, module_tmp) -> Path:
    tiny = json.loads((ROOT / "bigclip" / "models" / "configs" / "tiny.json").read_text())
    configs = {name: open_clip_config(name) for name in OTHER_TOWERS}
    odd = ODD_OPTIONS | TOKENIZER_OPTIONS
    configs |= {name: tiny | {tower: tiny[tower] | keys} for name, (tower, keys, _) in odd.items()}
    for name, model_cfg in configs.items():
        folder = module_tmp(name)
        (folder / "open_clip_config.json").write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}})
        )
        populate_cache(home / "hf" / "hub", f"openclip/{name}", folder)
    populate_cache(home / "hf" / "hub", "openclip/xlm-layout", eos_folder(module_tmp("xlm-layout")))
    return home


@pytest.mark.parametrize("case", HUB_MODELS, ids=[c.name for c in HUB_MODELS])
def test_a_model_bigclip_does_not_build_is_refused_by_its_tower_or_option(case: Case, hub_home: Path) -> None:
    check(case, cwd=hub_home, protect=[hub_home])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --device cuda is valid here")
@pytest.mark.parametrize("case", NO_GPU, ids=[c.name for c in NO_GPU])
def test_cuda_device_on_a_machine_without_one(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])


PROBE = """
import json, sys
from bigclip.errors import BigclipError
from bigclip.cli_args import parse_train_args
from bigclip.train.preflight import check_flags
refused = {}
for argv in json.loads(sys.argv[1]):
    try:
        check_flags(parse_train_args(argv))
    except BigclipError as e:
        refused[" ".join(argv)] = str(e)
print(json.dumps({"torch": "torch" in sys.modules, "refused": refused}))
"""


def test_a_bad_flag_fails_without_importing_torch() -> None:
    """Parsing and checking every flag-settled row's argv loads no torch (that alone costs seconds)."""
    rows = [c for c in CASES if c.argv[2] == "train" and not c.env][: CASES.index(_first_machine_row())]
    argvs = [list(c.argv[3:]) for c in rows]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=ROOT / "tests", env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["torch"] is False
    config_rows = {c.name for c in rows if "--config" in c.argv}  # their files are in the home folder
    assert len(result["refused"]) >= len(argvs) - len(config_rows)


def _first_machine_row() -> Case:
    return next(c for c in CASES if c.name == "deepspeed-config-missing")


@pytest.mark.parametrize(
    "env",
    [{}, {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, {"SLURM_PROCID": "5", "SLURM_NTASKS": "16"},
     {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "64"}],
)  # fmt: skip
def test_the_torch_free_world_size_reads_the_launcher_as_the_process_group_does(env, monkeypatch) -> None:
    from bigclip.distributed import launch_env
    from bigclip.train.preflight import launch_world_size

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch_world_size() == launch_env()[1]


@pytest.mark.dist
def test_a_flag_refused_under_torchrun_is_what_its_summary_names(home: Path) -> None:
    """torchrun prints its own failure summary last: the rank's line must be in it (error file)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--nproc-per-node", "2", "-m", "bigclip.train", "--", *BASE, "--lr", "nan"]
    done = subprocess.run(argv, cwd=home, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode != 0
    summary = done.stderr[done.stderr.rindex("Root Cause") :]
    assert "traceback : bigclip: error: --lr nan: give a finite number" in summary, done.stderr[-3000:]
    # the root cause is the rank's own line; a rank torchrun stopped once the first failed (a slow
    # box) is listed above it without an error file
    assert "To enable traceback" not in summary, done.stderr[-3000:]
