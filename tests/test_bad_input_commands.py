"""Bad options of the other commands (the command name, plan, models, doctor, consolidate, publish,
checkpoints, index-shards): one line naming the option and the fix; nothing written. And a reader
that closed the pipe (`bigclip models | head`) ends a command quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.bad_input import ROOT, SETTLED_BEFORE_WORK_S, TORCH_FIRST_S, Case, bigclip, check
from support.no_torch import refusals_without_torch

PLAN = ("--gpus", "8")
# doctor's checks of a location load torch (storage): 3-5 s on an idle 2-core box, 10 s at a load of 8
# (TORCH_FIRST_S). The other commands parse and check their options before importing torch
# (tests/test_cli_no_torch.py).


def late(name: str, *args: str, says: tuple[str, ...], **kw) -> Case:
    """A row of a command that imports torch before its check."""
    return Case(name, bigclip(*args), says, max_s=TORCH_FIRST_S, **kw)


def row(name: str, *args: str, says: tuple[str, ...], **kw) -> Case:
    return Case(name, bigclip(*args), says, **kw)


CASES = [
    Case("unknown-command", bigclip("trian"), ("unknown command 'trian'", "did you mean train?")),
    Case("unknown-command-far", bigclip("frobnicate"), ("unknown command 'frobnicate'", "listed above")),
    row("plan-gpus-missing", "plan", "--model", "tiny", says=("required: --gpus",)),
    row("plan-gpus-zero", "plan", "--gpus", "0", says=("--gpus", "must be at least 1")),
    row("plan-model-unknown", "plan", *PLAN, "--model", "ViT-Q-99", says=("unknown model 'ViT-Q-99'",)),
    row("plan-lr-nan", "plan", *PLAN, "--lr", "nan", says=("--lr nan", "finite number")),
    row("plan-batch-zero", "plan", *PLAN, "--batch-size", "0", says=("--batch-size", "at least 1")),
    row("plan-unknown-flag", "plan", *PLAN, "--bogus", says=("unrecognized arguments: --bogus",)),
    row("plan-mfu-above-one", "plan", *PLAN, "--mfu", "1.5", says=("--mfu 1.5", "from 0.01 to 1", "0.4 for 40%")),
    row("plan-mfu-vanishing", "plan", *PLAN, "--mfu", "1e-300", says=("--mfu 1e-300", "from 0.01 to 1")),
    row("plan-peak-zero", "plan", *PLAN, "--peak-tflops", "0", says=("--peak-tflops 0", "positive number")),
    row("plan-memory-nan", "plan", *PLAN, "--gpu-memory-gib", "nan", says=("--gpu-memory-gib nan", "positive")),
    row("models-with-options", "models", "--bogus", says=("bigclip models takes no options",)),
    Case("doctor-location-missing", bigclip("doctor"), ("required: location", "bigclip doctor --help")),
    Case("doctor-size-negative", bigclip("doctor", "ckpt", "--size-mb", "-1"), ("--size-mb", "got -1")),
    Case("doctor-timeout-zero", bigclip("doctor", "ckpt", "--timeout-s", "0"), ("--timeout-s positive",)),
    late("doctor-file-in-the-way", "doctor", "notes.txt", "--size-mb", "0",  # its checks load torch
         says=("notes.txt: folder", "a file, not a folder", "give a folder"), code=1),
    row("consolidate-args-missing", "consolidate", says=("required: src",)),
    row("consolidate-unknown-flag", "consolidate", "nope", "out.safetensors", "--bogus",
        says=("unrecognized arguments: --bogus",)),
    row("consolidate-source-missing", "consolidate", "nope", "out.safetensors",
        says=("nope does not exist", "neither a weights file", "manifest.json")),
    row("consolidate-out-and-open-clip-dir", "consolidate", "notes.txt", "out.safetensors", "--open-clip-dir", "d",
        says=("give OUT, --open-clip-dir DIR or --transformers-dir DIR (one of them)",)),
    row("consolidate-two-export-folders", "consolidate", "notes.txt", "--open-clip-dir", "d", "--transformers-dir", "e",
        says=("give OUT, --open-clip-dir DIR or --transformers-dir DIR (one of them)",)),
    row("consolidate-transformers-with-optimizer", "consolidate", "notes.txt", "--transformers-dir", "d",
        "--with-optimizer", says=("--transformers-dir writes the model's weights, without optimizer state",)),
    late("consolidate-transformers-siglip", "consolidate", "siglip.pt", "--transformers-dir", "hf", "--model", "tiny",
         says=("learned logit bias (a SigLIP model)", "CLIPModel has no place", "--open-clip-dir")),
    row("consolidate-dtype-unknown", "consolidate", "notes.txt", "o.safetensors", "--dtype", "fp8",
        says=("--dtype", "invalid choice: 'fp8'")),
    row("consolidate-piece-size-unreadable", "consolidate", "notes.txt", "o.safetensors", "--piece-size", "1.2.3",
        says=("--piece-size", "cannot read size '1.2.3'", "5GB")),
    row("consolidate-shard-size-zero", "consolidate", "notes.txt", "o.safetensors", "--max-shard-size", "0",
        says=("--max-shard-size '0'", "positive size")),
    row("consolidate-read-ahead-zero", "consolidate", "notes.txt", "o.safetensors", "--read-ahead", "0",
        says=("--read-ahead 0", "at least 1")),
    row("consolidate-out-is-a-file", "consolidate", "siglip.pt", "notes.txt",
        says=("OUT notes.txt: notes.txt is a file", "give another path")),
    row("consolidate-out-inside-a-file", "consolidate", "siglip.pt", "notes.txt/w.safetensors",
        says=("OUT notes.txt/w.safetensors: notes.txt is a file", "give another path")),
    row("consolidate-export-folder-is-a-file", "consolidate", "siglip.pt", "--open-clip-dir", "notes.txt",
        says=("--open-clip-dir notes.txt: notes.txt is a file", "give another path")),
    late("consolidate-source-not-weights", "consolidate", "junk.pt", "o.safetensors",
         says=("junk.pt: not a weights file torch can read safely (", "TorchScript archives"), code=2),
    row("consolidate-registry-missing", "consolidate", "registry:tiny-v1", "o.safetensors",
        says=("registry:tiny-v1: no registry given", "BIGCLIP_REGISTRY"), env={"BIGCLIP_REGISTRY": ""}),
    row("publish-args-missing", "publish", says=("required: src, name",)),
    row("publish-no-registry", "publish", "notes.txt", "v1", says=("no registry given", "BIGCLIP_REGISTRY"),
        env={"BIGCLIP_REGISTRY": ""}),
    row("publish-source-missing", "publish", "nope", "v1", "--registry", "reg",
        says=("nope: no such file or folder", "s3://")),
    row("publish-name-invalid", "publish", "siglip.pt", "tiny v1!", "--registry", "reg",
        says=("invalid checkpoint name 'tiny v1!'", "e.g. vit-h-14-laion2b-v1")),
    row("checkpoints-registry-is-a-file", "checkpoints", "list", "--registry", "notes.txt",
        says=("registry notes.txt is a file, not a registry folder", "s3:// prefix")),
    row("publish-registry-is-a-file", "publish", "siglip.pt", "v1", "--registry", "notes.txt",
        says=("registry notes.txt is a file, not a registry folder",)),
    row("checkpoints-registry-missing", "checkpoints", "list", "--registry", "regsitry",
        says=("registry regsitry: no such folder", "check --registry")),
    row("checkpoints-command-missing", "checkpoints", says=("required: command",)),
    row("checkpoints-command-unknown", "checkpoints", "frob", says=("invalid choice: 'frob'", "'list'")),
    row("checkpoints-no-registry", "checkpoints", "list", says=("no registry given", "BIGCLIP_REGISTRY"),
        env={"BIGCLIP_REGISTRY": ""}),
    row("checkpoints-unknown-flag", "checkpoints", "list", "--bogus", says=("unrecognized arguments: --bogus",)),
    row("index-shards-pattern-missing", "index-shards", says=("required: pattern",)),
    row("index-shards-no-shard", "index-shards", "nope/{00000..00003}.tar",
        says=("matches no shard", "Check the path, the brace range")),
    row("index-shards-unbalanced-brace", "index-shards", "nope/{00000..00003.tar",
        says=("'nope/{00000..00003.tar': unbalanced braces", "close each range")),
    row("index-shards-pattern-expanded-by-the-shell", "index-shards", "nope/00000.tar", "nope/00001.tar",
        "nope/00002.tar", says=("unrecognized arguments: nope/00001.tar", "did the shell expand", "Quote it")),
    row("checkpoints-verify-missing-folder", "checkpoints", "verify", "./nope",
        says=("./nope: no such folder", "LOGS/RUN/checkpoints/step_N", "--registry")),
    row("checkpoints-verify-not-a-checkpoint", "checkpoints", "verify", ".",
        says=(". holds no committed bigclip checkpoint", "give a checkpoint folder")),
    row("checkpoints-verify-name-without-registry", "checkpoints", "verify", "tiny-v1",
        says=("no registry given", "BIGCLIP_REGISTRY", "give its path (e.g. ./tiny-v1)"), env={"BIGCLIP_REGISTRY": ""}),
    row("index-shards-threads-zero", "index-shards", "nope/0.tar", "--threads", "0",
        says=("--threads 0", "at least 1")),
]  # fmt: skip


@pytest.fixture(scope="module")
def home(module_tmp) -> Path:
    import torch

    home = module_tmp("commands")
    (home / "notes.txt").write_text("not a folder\n")
    # A SigLIP model's weights (a learned logit bias), which transformers' CLIPModel cannot hold.
    torch.save({"logit_scale": torch.zeros(()), "logit_bias": torch.zeros(())}, home / "siglip.pt")
    (home / "junk.pt").write_bytes(bytes(range(256)) * 4)  # no zip, no pickle: torch.load fails its own way
    return home


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_command_option(case: Case, home: Path) -> None:
    out = check(case, cwd=home, protect=[home])
    assert sorted(p.name for p in home.iterdir()) == ["junk.pt", "notes.txt", "siglip.pt"]
    assert "weights_only" not in out.stderr  # torch's advice to unpickle an untrusted file is not passed on


def test_flag_settled_refusals_import_no_torch(home: Path) -> None:
    """Every row above that flags settle is refused without importing torch (which alone costs seconds)."""
    rows = [c for c in CASES if c.max_s <= SETTLED_BEFORE_WORK_S]
    result = refusals_without_torch(rows, cwd=home)
    assert result["torch"] is False, f"torch was imported by row {list(result['codes'])[-1]}"
    assert result["codes"] == {c.name: c.code for c in rows}


@pytest.mark.parametrize(
    "args",
    [("--help",), ("--version",), ("models",), ("train", "--help"), ("train", "--help-openclip"), ("plan", "--help"),
     ("consolidate", "--help"), ("checkpoints", "--help"), ("doctor", "--help"), ("index-shards", "--help")],
    ids=" ".join,
)  # fmt: skip
def test_a_reader_that_closed_the_pipe_ends_the_command_quietly(args: tuple[str, ...], home: Path) -> None:
    """`bigclip models | head`: when the reader has gone, the command stops as `yes | head` does
    (exit 141, SIGPIPE's), with no traceback and nothing written. (argparse's own help screens
    ignore the failed write and exit 0, as silently.)"""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        done = subprocess.run([sys.executable, *bigclip(*args)], stdout=write, stderr=subprocess.PIPE, text=True,
                              cwd=home, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)  # fmt: skip
    finally:
        os.close(write)
    argparse_help = args[0] not in ("train", "models") and args[1:] == ("--help",)
    assert (done.returncode, done.stderr) == (0 if argparse_help else 141, "")
    assert sorted(p.name for p in home.iterdir()) == ["junk.pt", "notes.txt", "siglip.pt"]
