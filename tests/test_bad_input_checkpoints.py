"""Bad-input rows for checkpoints, local and on S3, and the registry: damaged or foreign bytes.

One real run (the tiny model, 1 rank) commits checkpoints at steps 4 and 8; each row copies the
run's checkpoint root, damages the copy as a user's disk or bucket would, and runs the real
command line against it. Every row must exit 2 with one line naming the object (and the tensor)
and what to do, and leave every checkpoint and registry byte as it was. Rows a manifest settles
(another model, another global batch) must fail before the model is built, within the suite's
settled-before-work bound. `--resume latest` skipping a damaged checkpoint is not a refusal:
tests/test_checkpoint_integrity.py runs it.
"""

from __future__ import annotations

import os
import shutil
import struct
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.bad_input import TORCH_FIRST_S, Case, bigclip, check
from support.train_harness import demo_argv, train_and_weights
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from bigclip.checkpoint import CheckpointStore, catalog
from bigclip.checkpoint.finite import local_tensors
from bigclip.checkpoint.integrity import MemoryFile, zip_records
from bigclip.cli_args import parse_train_args
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.registry.registry import Registry
from bigclip.storage.safe_metadata import load_metadata
from bigclip.train.run_lock import RunLock

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

BUCKET = "bad-input-ckpt"
WORK_S = 120.0  # rows that build the model and start loading before the damage shows
# Those runs have started: their folder (config.yaml, the log naming the damage) stays. A registry
# keeps the folder of a checkpoint's leases once the run's lease is released.
STARTED = ("resumed",)
LEASED = (*STARTED, "registry/leases")
# Rows the manifest settles before the model is built (the test checks the run line never came).
# The suite's 5 s bound also needs a start without torch's import, which the CLI's bad-flag path
# works on; until then, on a busy 2-core box, start-up alone took 7-14 s.
MANIFEST_S = 30.0


@pytest.fixture(scope="module")
def run(demo_data, module_tmp) -> Path:
    """A checkpoint root with commits at steps 4 and 8."""
    tmp = module_tmp("bad-ckpt")
    root = tmp / "checkpoints"
    argv = demo_argv(demo_data, tmp, "--max-steps", "8", "--save-every-n-steps", "4", "--checkpoint-dir",
                     str(root), name="source")  # fmt: skip
    spawn(train_and_weights, 1, argv)
    return root


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket(BUCKET)
        yield server


def tensor_byte(folder: Path, prefix: str) -> tuple[Path, int]:
    """(file, offset) of a byte inside the stored bytes of the largest tensor under `prefix`."""
    path, start, nbytes = tensor_bytes(folder, prefix)
    return path, start + nbytes // 2


def tensor_bytes(folder: Path, prefix: str) -> tuple[Path, int, int]:
    """(file, offset, length) of the stored bytes of the largest tensor under `prefix`."""
    metadata = load_metadata((folder / ".metadata").read_bytes())
    key = max(
        (
            k
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(md, "chunks")
        ),
        key=lambda k: metadata.state_dict_metadata[k].size.numel(),
    )
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    path = folder / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        zipped = f.read(info.length)
    record = next(r for r in zip_records(MemoryFile(memoryview(zipped))) if r.is_storage)
    return path, info.offset + record.start, record.nbytes


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def flip_model(folder: Path) -> None:
    flip(*tensor_byte(folder, "model."))


def flip_optim(folder: Path) -> None:
    flip(*tensor_byte(folder, "optim."))


def nan_in_model(folder: Path) -> None:
    """Damage that decodes as a number the run could have made: an fp32 weight's bytes become NaN's."""
    path, start, nbytes = tensor_bytes(folder, "model.")
    data = bytearray(path.read_bytes())
    at = start + (nbytes // 8) * 4  # an element's first byte
    data[at : at + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))


def flip_metadata(folder: Path) -> None:
    flip(folder / ".metadata", (folder / ".metadata").stat().st_size // 2)


def flip_rank_record(folder: Path) -> None:
    record = folder / "__0_rank.bigclip"  # its DCP metadata (the record's last part), which resume reads
    flip(record, record.stat().st_size - 100)


def truncate_shard(folder: Path) -> None:
    shard = sorted(folder.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])


def remove_shard(folder: Path) -> None:
    sorted(folder.glob("*.distcp"))[0].unlink()


def garble_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text('{"format": "bigclip-checkpoint", "step": ')


def shard_of_another_save(folder: Path) -> None:
    """Step 4's first shard, intact, in step 8's folder (a sync that compared sizes only): its own
    zip CRC-32s pass, the size matches the manifest; only the writer's record of step 8 tells."""
    shard = sorted(folder.glob("*.distcp"))[0]
    older = folder.parent / "step_00000004" / shard.name
    assert older.stat().st_size == shard.stat().st_size and older.read_bytes() != shard.read_bytes()
    shutil.copyfile(older, shard)


def null_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text("null\n")  # valid JSON, no manifest


def manifest_as_folder(folder: Path) -> None:
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").mkdir()


def uncommit(folder: Path) -> None:
    (folder / "manifest.json").unlink()


DAMAGES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "flipped byte in a model tensor": (flip_model, ("__0_", "is damaged: model.", "CRC-32", "re-copy")),
    "flipped byte in an optimizer moment": (flip_optim, ("__0_", "is damaged: optim.", "CRC-32", "re-copy")),
    # Not "the run diverged": the bytes are not the ones written.
    "bytes that decode as NaN": (nan_in_model, ("__0_", "is damaged: model.", "CRC-32", "re-copy")),
    "flipped byte in .metadata": (flip_metadata, (".metadata is damaged", "SHA-256", "re-copy")),
    "flipped byte in a rank record": (
        flip_rank_record,
        ("__0_rank.bigclip", "differs from what its writer", "SHA-256"),
    ),
    "truncated shard": (truncate_shard, ("is damaged", "bytes, manifest says")),
    "shard of another save": (
        shard_of_another_save,
        ("__0_", "is damaged: ", "a file of another checkpoint"),
    ),
    "missing shard": (remove_shard, ("is damaged", ".distcp: missing")),
    "garbled manifest": (garble_manifest, ("manifest.json is damaged", "not a bigclip checkpoint manifest")),
    "manifest of JSON null": (null_manifest, ("manifest.json is damaged", "manifest (not a JSON object)")),
    "interrupted save (no manifest)": (uncommit, ("is not a committed checkpoint", "Committed ones")),
}


def copy_run(
    run: Path, tmp_path: Path, damage: Callable[[Path], None], *, steps: tuple[int, ...] = (8,)
) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(run, root)
    for step in steps:
        damage(root / f"step_{step:08d}")
    return root


def upload(s3: LoopbackS3, root: Path) -> str:
    prefix = f"runs/{uuid.uuid4().hex[:8]}/checkpoints"
    client = s3.client()
    for path in root.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(root)}")
    return f"s3://{BUCKET}/{prefix}"


def train(demo_data, tmp_path: Path, *extra: str, name: str = "resumed") -> tuple[str, ...]:
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "12", "--save-every-n-steps", "4", *extra, name=name)
    return bigclip("train", *argv)


@pytest.mark.parametrize(
    "where", ["local", pytest.param("s3", marks=pytest.mark.slow)]
)  # s3: the same reader
# A resume reads rank records, never DCP's global .metadata (every rank's chunks): the readers
# of that file (consolidate, --pretrained) refuse its damage below.
@pytest.mark.parametrize("damage", [d for d in DAMAGES if d != "flipped byte in .metadata"])
def test_resume_from_a_damaged_checkpoint_is_refused(demo_data, run, s3, tmp_path, where, damage):
    """--resume PATH never falls back: the damage is named, with what to do, and nothing changes."""
    if where == "s3" and damage == "interrupted save (no manifest)":
        pytest.skip("the same lookup as locally; the S3 listing is covered by the other rows")
    hurt, says = DAMAGES[damage]
    root = copy_run(run, tmp_path, hurt)
    uri = str(root) if where == "local" else upload(s3, root)
    target = f"{uri}/step_00000008"
    ckpt = tmp_path / "new-checkpoints"
    case = Case(f"{damage} ({where})", train(demo_data, tmp_path, "--resume", target, "--checkpoint-dir",
                str(ckpt) if where == "local" else f"{uri}-new"), says, max_s=WORK_S, leaves=STARTED, env=s3.env)  # fmt: skip
    check(case, cwd=tmp_path, protect=[root])  # (the new run's own folder may be created)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_resume_latest_with_every_checkpoint_damaged_is_refused(demo_data, run, s3, tmp_path, where):
    root = copy_run(run, tmp_path, flip_model, steps=(4, 8))
    uri = str(root) if where == "local" else upload(s3, root)
    case = Case(f"every checkpoint damaged ({where})",
                train(demo_data, tmp_path, "--resume", "latest", "--checkpoint-dir", uri),
                ("step_00000004/__0_", "is damaged: model.", "CRC-32"), max_s=WORK_S, leaves=STARTED, env=s3.env)  # fmt: skip
    check(case, cwd=tmp_path, protect=[root])


def test_a_checkpoint_with_nan_weights_is_refused_naming_the_tensor(demo_data, run, tmp_path, monkeypatch):
    """Intact bytes, non-finite values (as an older writer, which did not check, could save)."""
    root = copy_run(run, tmp_path, lambda folder: None)
    dcp_to_torch_save(root / "step_00000008", tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    name, tensor = next(
        (k, t) for k, t in local_tensors(state) if k.startswith("model.") and t.is_floating_point()
    )
    tensor.view(-1)[0] = float("nan")
    monkeypatch.setattr("bigclip.checkpoint.store.first_non_finite", lambda plain: None)  # the older writer
    store = CheckpointStore(str(root))
    store.save(state, step=9, meta=catalog.read_manifest(store.location, "step_00000008").meta)
    store.close()
    case = Case("NaN in a saved tensor", train(demo_data, tmp_path, "--resume", str(root / "step_00000009"),
                "--checkpoint-dir", str(tmp_path / "new")), (name, "NaN or inf", "older checkpoint"),
                max_s=WORK_S, leaves=STARTED)  # fmt: skip
    check(case, cwd=tmp_path, protect=[root])


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize(
    "flags, says",
    [
        (("--model", "ViT-B-32"), ("checkpoint is of model tiny", "--model tiny")),
        (("--batch-size", "16"), ("global batch 32, this run has 16", "--allow-batch-size-change")),
        (
            ("--force-image-size", "32"),
            ("trained at image size 64, this run builds tiny at 32", "resume with no --force-image-size"),
        ),  # fmt: skip
        (("--siglip",), ("trained with --loss clip, this run has --loss siglip", "resume with --loss clip")),
    ],
    ids=["another model", "another global batch", "another image size", "another loss"],
)
def test_what_the_manifest_settles_fails_before_the_model_is_built(
    demo_data, run, s3, tmp_path, where, flags, says
):
    uri = str(run) if where == "local" else upload(s3, run)
    case = Case(f"{flags[0]} ({where})", train(demo_data, tmp_path, "--resume", f"{uri}/step_00000008",
                "--checkpoint-dir", str(tmp_path / "new"), *flags), says, max_s=MANIFEST_S, env=s3.env)  # fmt: skip
    out = check(case, cwd=tmp_path, protect=[run])
    assert "engine fsdp, model" not in out.stdout + out.stderr  # the "run NAME: ... model" line comes later


def test_resuming_an_older_checkpoint_over_newer_ones_is_refused(demo_data, run, tmp_path):
    """--resume step 4 into the folder that holds step 8: the run's saves would overwrite step 8
    (and retention count it): refused before the model is built, nothing touched."""
    root = copy_run(run, tmp_path, lambda folder: None)
    case = Case("older checkpoint over newer ones", train(demo_data, tmp_path, "--resume", str(root / "step_00000004"),
                "--checkpoint-dir", str(root)), ("(step 4)", "holds 1 newer committed checkpoint(s) (step_00000008)",
                "move them elsewhere first"), max_s=MANIFEST_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[root])


RESUME_PATHS = {  # a path a user may give for a checkpoint: what it is, and what the line says
    "a run folder": ("job", ("is a run folder", "job/checkpoints (its newest commit, step_00000008)")),
    "a file inside a checkpoint": (
        "job/checkpoints/step_00000008/manifest.json",
        ("is a file inside the checkpoint", "step_00000008: give that folder"),
    ),
    "a missing step": (
        "job/checkpoints/step_00000099",
        ("nothing is there", "Committed ones under", "step_00000008', "),
    ),  # fmt: skip
}


@pytest.mark.parametrize("what", list(RESUME_PATHS))
def test_a_resume_path_that_is_no_checkpoint_says_what_to_give(demo_data, run, tmp_path, what):
    """Not "no manifest.json" about a manifest, nor the new run's (empty) checkpoints folder."""
    shutil.copytree(run, tmp_path / "job" / "checkpoints")
    target, says = RESUME_PATHS[what]
    case = Case(f"--resume {what}", train(demo_data, tmp_path, "--resume", str(tmp_path / target)), says,
                max_s=MANIFEST_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[tmp_path / "job"])


def test_a_renamed_checkpoint_folder_is_refused(run, tmp_path):
    """step_00000004 renamed step_00000012: `--resume latest` orders by the name, so it would resume
    at step 4 and overwrite step 8; its manifest's step disagrees, and that is damage."""
    root = copy_run(run, tmp_path, lambda folder: None)
    (root / "step_00000004").rename(root / "step_00000012")
    case = Case("renamed folder", bigclip("checkpoints", "verify", str(root / "step_00000012")),
                ("holds step 4, not the step its folder is named for (12)", "step_00000004"), max_s=WORK_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[root])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_missing_openclip_checkpoint_is_not_found_and_leaves_no_folder(demo_data, s3, tmp_path, where):
    """--resume epoch_N.pt is read after the model is built: that it is missing is settled before."""
    uri = str(tmp_path / "gone" / "epoch_28.pt") if where == "local" else f"s3://{BUCKET}/gone/epoch_3.pt"
    case = Case(f"missing OpenCLIP checkpoint ({where})", train(demo_data, tmp_path, "--resume", uri),
                (f"--resume {uri}: not found", "--resume latest"), max_s=MANIFEST_S, env=s3.env)  # fmt: skip
    check(case, cwd=tmp_path)  # and no run folder: nothing is left in tmp_path


def second_start_while_running(rank: int, world: int, argv: list[str], case: Case, cwd: str) -> str:
    """Worker: set a run up (it now holds its folder), start another with the same name, then end.
    (The lock file is not digested: a process that opens and closes it drops its own POSIX lock.)"""
    from bigclip.train.trainer import close_run, setup

    run = setup(parse_train_args(argv))
    try:
        line = check(case, cwd=Path(cwd), protect=[run.run_dir / "config.yaml"]).last_line
    finally:
        close_run(run, strict=False)
    assert f" pid {os.getpid()} " in line, line  # the run in the way is named
    return line


def test_a_second_run_with_the_same_name_is_refused_while_the_first_runs(demo_data, tmp_path):
    """Before, both exited 0, the second overwriting the first's committed checkpoints. The folder's
    lock names the run in the way; once it ended, the folder is free again (--resume latest)."""
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "4", name="busy")
    case = Case("same --name while running", bigclip("train", *argv),
                ("run folder", "is in use by another run (host", "another --name"), max_s=MANIFEST_S)  # fmt: skip
    spawn(second_start_while_running, 1, argv, case, str(tmp_path))
    lock = RunLock(tmp_path / "busy")
    lock.take()  # the first run ended: its lock went with it
    lock.release()


def test_resume_from_a_missing_bucket_says_so(demo_data, run, s3, tmp_path):
    case = Case("wrong bucket", train(demo_data, tmp_path, "--resume", "s3://no-such-bucket-here/x/step_00000008",
                "--checkpoint-dir", str(tmp_path / "new")), ("no-such-bucket-here",), max_s=MANIFEST_S, env=s3.env)  # fmt: skip
    check(case, cwd=tmp_path, protect=[run])


@pytest.fixture(scope="module")
def registry(run, module_tmp) -> Registry:
    registry = Registry(str(module_tmp("registry") / "reg"))
    registry.publish(str(run / "step_00000008"), "tiny-v1")
    return registry


def damaged_registry(registry: Registry, tmp_path: Path, what: str) -> Path:
    """A copy of the registry whose blob for `what` (a tensor prefix, or '.metadata') is damaged."""
    copy = tmp_path / "registry"
    shutil.copytree(registry.location.root, copy)
    published = registry.get("tiny-v1")
    blob = lambda name: copy / "blobs" / published.objects[name].sha256[:2] / published.objects[name].sha256  # noqa: E731
    if what == ".metadata":
        flip_metadata_blob = blob(".metadata")
        flip(flip_metadata_blob, flip_metadata_blob.stat().st_size // 2)
        return copy
    if what == "another save":  # the blob's bytes replaced by step 4's intact shard of that name
        shard = min(name for name in published.objects if name.endswith(".distcp"))
        shutil.copyfile(Path(published.source) / ".." / "step_00000004" / shard, blob(shard))
        return copy
    folder = tmp_path / "view"  # the blobs under their checkpoint names, to find the byte
    folder.mkdir()
    for name in published.objects:
        (folder / name).symlink_to(blob(name))
    path, offset = tensor_byte(folder, what)
    flip(path.resolve(), offset)
    return copy


@pytest.mark.parametrize(
    "name, says",
    [("tiny-v1", ("tiny-v1 is already published", "never changes", "new name (e.g. tiny-v1-v2)")),
     ("Tiny-V1", ("Tiny-V1 differs from tiny-v1", "only in letter case", "publish under another name"))],
    ids=["name-taken", "name-differs-only-in-case"],
)  # fmt: skip
def test_publishing_under_a_taken_name_is_refused(registry, run, tmp_path, name, says):
    root = Path(registry.location.root)
    # publish imports DCP (torch) to read checkpoints, then checks the name before reading the source
    case = Case(f"publish as {name}", bigclip("publish", str(run / "step_00000004"), name, "--registry", str(root),
                "--no-progress"), says, max_s=TORCH_FIRST_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[root])


REGISTRY_ROWS = {
    "model tensor blob": ("model.", ("is damaged: model.", "CRC-32")),
    "optimizer blob": ("optim.", ("is damaged: optim.", "CRC-32")),
    ".metadata blob": (".metadata", (".metadata) is damaged", "SHA-256")),
    "shard blob of another save": ("another save", ("__0_", "is damaged: ", "a file of another checkpoint")),
}


@pytest.mark.parametrize("row", list(REGISTRY_ROWS))
def test_consolidating_a_damaged_registry_blob_is_refused(registry, tmp_path, row):
    what, says = REGISTRY_ROWS[row]
    copy = damaged_registry(registry, tmp_path, what)
    out = tmp_path / "out.safetensors"
    case = Case(f"consolidate registry, {row}", bigclip("consolidate", "registry:tiny-v1", str(out), "--registry",
                str(copy), "--with-optimizer", "--no-progress"), says, max_s=WORK_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[copy])
    assert not out.exists()


@pytest.mark.parametrize("row", ["model tensor blob", ".metadata blob"])
def test_pretrained_from_a_damaged_registry_blob_is_refused(demo_data, registry, tmp_path, row):
    what, says = REGISTRY_ROWS[row]
    copy = damaged_registry(registry, tmp_path, what)
    case = Case(f"--pretrained registry, {row}", train(demo_data, tmp_path, "--pretrained", "registry:tiny-v1",
                "--registry", str(copy), "--checkpoint-dir", str(tmp_path / "new")), says, max_s=WORK_S, leaves=LEASED)  # fmt: skip
    check(case, cwd=tmp_path, protect=[copy])


@pytest.mark.parametrize(
    "damage",
    [
        "flipped byte in a model tensor",
        "flipped byte in .metadata",
        "truncated shard",
        "shard of another save",
    ],
)
def test_pretrained_and_consolidate_from_a_damaged_checkpoint_are_refused(demo_data, run, tmp_path, damage):
    hurt, says = DAMAGES[damage]
    root = copy_run(run, tmp_path, hurt)
    out = tmp_path / "out.safetensors"
    consolidate = Case(f"consolidate, {damage}", bigclip("consolidate", str(root / "step_00000008"), str(out),
                       "--no-progress"), says, max_s=WORK_S)  # fmt: skip
    check(consolidate, cwd=tmp_path, protect=[root])
    assert not out.exists()
    pretrained = Case(f"--pretrained, {damage}", train(demo_data, tmp_path, "--pretrained", str(root / "step_00000008"),
                      "--checkpoint-dir", str(tmp_path / "new")), says, max_s=WORK_S, leaves=STARTED)  # fmt: skip
    check(pretrained, cwd=tmp_path, protect=[root])


@pytest.mark.parametrize("part", ["manifest.json", "__0_0.distcp", "__0_rank.bigclip"])
def test_a_file_inside_a_checkpoint_is_refused_as_weights(run, tmp_path, part):
    """consolidate (and --pretrained, the same opening) given one file of a checkpoint: its folder
    is named, instead of torch.load's failure on a file that is no weights file."""
    step = run / "step_00000008"
    case = Case(f"consolidate {part}", bigclip("consolidate", str(step / part), "out.safetensors", "--no-progress"),
                (f"{step / part} is a file inside a bigclip checkpoint", f"give its folder {step}"), max_s=WORK_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[run])


def test_a_manifest_that_is_a_folder_is_refused(run, tmp_path):
    root = copy_run(run, tmp_path, manifest_as_folder)
    step = root / "step_00000008"
    says = ("manifest.json is damaged", "its manifest.json is a folder, not a manifest")
    for name, args in [("consolidate", ("consolidate", str(step), "out.safetensors", "--no-progress")),
                       ("verify", ("checkpoints", "verify", str(step)))]:  # fmt: skip
        check(
            Case(f"{name}, manifest.json a folder", bigclip(*args), says, max_s=WORK_S),
            cwd=tmp_path,
            protect=[root],
        )


def test_the_damage_helpers_hit_tensor_bytes(run):
    """The rows above damage what they say: the byte chosen lies inside a tensor's stored bytes."""
    path, offset = tensor_byte(run / "step_00000008", "model.")
    assert path.suffix == ".distcp" and 0 < offset < path.stat().st_size


@pytest.fixture(scope="module")
def consolidated(run, module_tmp) -> Path:
    """The step-8 weights as a consolidated safetensors file, with its checksum manifest beside it."""
    from bigclip.weights.consolidate import consolidate

    out = module_tmp("consolidated") / "tiny.safetensors"
    consolidate(str(run / "step_00000008"), str(out), progress=False)
    return out


@pytest.fixture(scope="module")
def st_registry(consolidated, module_tmp) -> Registry:
    registry = Registry(str(module_tmp("st-registry") / "reg"))
    assert registry.publish(str(consolidated), "tiny-st").kind == "safetensors"
    return registry


def damaged_st_registry(registry: Registry, tmp_path: Path, hurt: Callable[[Path], None]) -> Path:
    """A copy of the registry whose safetensors blob is damaged by `hurt`."""
    copy = tmp_path / "registry"
    shutil.copytree(registry.location.root, copy)
    sha = registry.get("tiny-st").objects["tiny.safetensors"].sha256
    hurt(copy / "blobs" / sha[:2] / sha)
    return copy


def flip_last_tensor(path: Path) -> None:
    """A byte in the middle of the file's data: ranged reads of any one tensor would not see the
    header change, only the file's SHA-256 does."""
    flip(path, path.stat().st_size - 20)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


ST_ROWS = {
    "flipped byte": (
        flip_last_tensor,
        ("registry:tiny-st tiny.safetensors", "is damaged", "SHA-256", "checkpoints verify tiny-st"),
    ),  # fmt: skip
    "truncated": (truncate, ("registry:tiny-st is damaged", "manifest says", "checkpoints verify tiny-st")),
}


@pytest.mark.parametrize("row", list(ST_ROWS))
def test_a_damaged_safetensors_blob_is_refused_by_pretrained_and_consolidate(
    demo_data, st_registry, tmp_path, row
):
    hurt, says = ST_ROWS[row]
    copy = damaged_st_registry(st_registry, tmp_path, hurt)
    out = tmp_path / "out.safetensors"
    consolidate = Case(f"consolidate registry safetensors, {row}", bigclip("consolidate", "registry:tiny-st",
                       str(out), "--registry", str(copy), "--no-progress"), says, max_s=WORK_S)  # fmt: skip
    check(consolidate, cwd=tmp_path, protect=[copy])
    assert not list(tmp_path.glob("out*"))  # no file, no manifest
    pretrained = Case(f"--pretrained registry safetensors, {row}", train(demo_data, tmp_path, "--pretrained",
                      "registry:tiny-st", "--registry", str(copy), "--checkpoint-dir", str(tmp_path / "new")),
                      says, max_s=WORK_S, leaves=LEASED)  # fmt: skip
    check(pretrained, cwd=tmp_path, protect=[copy])
    assert not (tmp_path / "new").exists() or not list((tmp_path / "new").rglob("manifest.json"))


def test_a_damaged_consolidated_file_is_refused_by_pretrained(demo_data, consolidated, tmp_path):
    """A local file with the checksum manifest `bigclip consolidate` wrote beside it is checked too."""
    folder = tmp_path / "weights"
    shutil.copytree(consolidated.parent, folder)
    flip_last_tensor(folder / consolidated.name)
    case = Case("--pretrained consolidated file, flipped byte", train(demo_data, tmp_path, "--pretrained",
                str(folder / consolidated.name), "--checkpoint-dir", str(tmp_path / "new")),
                (f"{folder / consolidated.name} is damaged", "SHA-256", "bigclip consolidate"), max_s=WORK_S, leaves=STARTED)  # fmt: skip
    check(case, cwd=tmp_path, protect=[folder])
