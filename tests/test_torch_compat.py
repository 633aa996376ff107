"""bigclip runs on every torch and Python that pyproject.toml declares.

Only one torch is installed here, so the declared minimum is checked against a table of the
first release of every torch name bigclip (and its benchmarks, which run on the GPU machines'
older torch) uses: tests/support/torch_versions.py, each entry with the evidence from torch's
sources. The names come from the code's syntax tree, so a new use of a newer API fails here
until it is looked up and either guarded or the minimum raised. The one guarded pair, the
collectives renamed in torch 2.13, is run for real on both of its names.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.torch_uses import torch_uses
from support.torch_versions import GUARDED, IN_TORCH_2_0, SINCE, first_release
from test_contrastive import assert_matches, make_inputs, reference, run_loss

from bigclip.distributed import spawn
from bigclip.ops.loss import collectives
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss, ClipLoss

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def declared(requirement_prefix: str) -> tuple[int, ...]:
    """The lower bound pyproject.toml declares for `torch`."""
    spec = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith(requirement_prefix))
    return _release(spec.split(">=", 1)[1])


def used_names() -> dict[str, list[str]]:
    return torch_uses(ROOT / "bigclip", ROOT / "benchmarks")


def test_every_torch_name_used_is_in_the_declared_minimum():
    minimum = declared("torch>=")
    unknown, too_new = [], []
    for name, files in sorted(used_names().items()):
        release = first_release(name)
        if release is None:
            unknown.append(f"{name}  ({files[0]})")
        elif _release(release) > minimum:
            too_new.append(f"{name} needs torch {release}  ({files[0]})")
    assert not unknown, (
        "torch names with no entry in tests/support/torch_versions.py; look up the first release "
        "that has each and add it with the evidence:\n  " + "\n  ".join(unknown)
    )
    assert not too_new, (
        f"newer than the declared minimum torch {'.'.join(map(str, minimum))}: guard them "
        "(see bigclip/ops/loss/collectives.py) or raise the bound in pyproject.toml:\n  "
        + "\n  ".join(too_new)
    )


def test_guarded_names_are_used_only_through_their_fallback():
    leaked = {name: files for name, files in used_names().items() if name in GUARDED}
    assert not leaked, f"call these through bigclip.ops.loss.collectives, not directly: {leaked}"
    for new, old in (collectives.ALL_GATHER_NAMES, collectives.REDUCE_SCATTER_NAMES):
        assert f"torch.distributed.{new}" in GUARDED
        assert first_release(f"torch.distributed.{old}") is not None  # the fallback is in the minimum


def test_table_lists_no_name_the_code_no_longer_uses():
    stale = (IN_TORCH_2_0 | SINCE.keys()) - used_names().keys()
    stale -= {
        f"torch.distributed.{old}"
        for _, old in (collectives.ALL_GATHER_NAMES, collectives.REDUCE_SCATTER_NAMES)
    }
    assert not stale, f"remove from tests/support/torch_versions.py (no longer used): {sorted(stale)}"


def _resolve(name: str) -> object:
    """The object a dotted torch name denotes in the installed torch (ImportError/AttributeError if none)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_every_used_name_exists_in_the_installed_torch():
    """The table's other side: nothing bigclip uses was removed from (or misspelt for) this torch."""
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import
        for name in sorted(used_names()):
            function, _, keyword = name.partition("(")
            try:
                obj = _resolve(function)
            except (ImportError, AttributeError) as e:
                missing.append(f"{name}: {e}")
                continue
            if keyword and not _accepts(obj, keyword.rstrip("=)")):
                missing.append(f"{name}: no such keyword")
    assert not missing, "\n".join(missing)


def _accepts(obj: object, keyword: str) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return True  # a C function without a Python signature: not checkable here
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_declared_bounds_are_consistent():
    python = _release(PYPROJECT["project"]["requires-python"])
    assert python >= (3, 10), "torch >= 2.9 supports Python 3.10 and later only"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + "".join(map(str, python))
    assert torch.__version__ and _release(torch.__version__) >= declared("torch>=")


@pytest.mark.parametrize("root", ["bigclip", "benchmarks"])
def test_code_parses_as_the_oldest_declared_python(root):
    oldest = _release(PYPROJECT["project"]["requires-python"])
    for path in sorted((ROOT / root).rglob("*.py")):
        ast.parse(path.read_text(), filename=str(path), feature_version=oldest)


# -- the collectives renamed in torch 2.13 -------------------------------------------------


def test_pick_prefers_the_new_name_and_falls_back_to_the_old():
    new, old = object(), object()
    assert collectives.pick(("a", "b"), types.SimpleNamespace(a=new, b=old)) is new
    assert collectives.pick(("a", "b"), types.SimpleNamespace(b=old)) is old
    with pytest.raises(AttributeError, match="torch >= 2.9"):
        collectives.pick(("a", "b"), types.SimpleNamespace())


def old_names_worker(rank: int, world: int) -> list[dict]:
    """The loss on this rank with torch < 2.13's names only (the new ones removed from dist)."""
    for new, _ in (collectives.ALL_GATHER_NAMES, collectives.REDUCE_SCATTER_NAMES):
        if hasattr(dist, new):
            delattr(dist, new)
    assert collectives.pick(collectives.ALL_GATHER_NAMES) is dist.all_gather_into_tensor
    inputs = make_inputs(world * 6, seed=3)
    image, text = inputs.rows(rank, world)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch >= 2.13 deprecates the old names
        for loss_fn in (
            ChunkedContrastiveLoss(kind="clip", chunk_size=4, exchange="allgather"),
            ClipLoss(local_loss=True, gather_with_grad=True),
        ):
            got = run_loss(loss_fn, image, text, inputs)
            results.append({**vars(got), "image": got.image.numpy(), "text": got.text.numpy()})
    return results


@pytest.mark.dist
def test_losses_are_exact_through_the_pre_2_13_collective_names():
    world = 2
    per_rank = spawn(old_names_worker, world)
    want = reference(make_inputs(world * 6, seed=3), world, "clip")
    for rank, results in enumerate(per_rank):
        for got in results:
            got = type(want[rank])(**{**got, "image": torch.from_numpy(got["image"]),
                                      "text": torch.from_numpy(got["text"])})  # fmt: skip
            assert_matches(got, want[rank])
