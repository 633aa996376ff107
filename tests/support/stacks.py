"""The second stack CI tests, and which tests run on it.

`make test` runs the whole suite on the main stack (.venv: torch 2.13.0 and the newest release of
every other dependency), then LOW_STACK_TESTS on the low stack (.venv-low, `make test-low`):
torch 2.11.0 with the Triton it pins (3.6.0), the GPU machines' stack, and every other direct
dependency at the lower bound pyproject.toml declares. So the lowest versions bigclip promises
are the ones a test ran on, and pyproject.toml's bounds are exactly what .venv-low installed
(tests/test_low_stack.py checks that there).

The subset: every test of the code that differs between torch releases (engines, training loop,
loss, int8 kernels, data on the device, checkpoints) and every test that touches a dependency
installed at its lower bound (S3: boto3, moto, s3torchconnector; the tokenizer: ftfy, regex;
DeepSpeed; bitsandbytes; webdataset; tensorboard; wandb; transformers). The rest (layout, Slurm,
planning, CLI wording, OpenCLIP's reference environment) does not depend on those versions.

    python tests/support/stacks.py constraints   # name==lower-bound lines for pip -c
    python tests/support/stacks.py tests         # the subset's files, one a line

Runs with the standard library only (the Makefile calls it before any venv exists).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 has tomli through pip's vendored copy or pytest
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LOW_STACK_ENV = "BIGCLIP_STACK"  # set to "low" by `make test-low`

LOW_STACK_TESTS = (
    # engines and training loop
    "tests/test_engine_fsdp.py",
    # not its compiled runs (a minute): compile on this stack is test_flag_matrix's compiled rows
    # (FSDP2) and test_fast_compile's steps (both engines)
    "tests/test_engine_deepspeed.py::test_every_zero_stage_matches_unsharded_reference_and_fsdp",
    "tests/test_engine_deepspeed.py::test_accumulation_patch_dropout_and_grad_checkpointing_under_both_engines",
    "tests/test_engine_deepspeed.py::test_mixed_precision_under_both_engines",
    "tests/test_engine_deepspeed_checkpoint.py",
    "tests/test_engine_deepspeed_config.py",
    # the loop; SwitchBack's training on this stack is test_switchback's (each kind against fp32)
    "tests/test_train.py::test_two_ranks_learn_and_log",
    "tests/test_resume.py",
    "tests/test_optimizer.py",
    "tests/test_precision_matrix.py",  # issue 22: precision x checkpointing x engine
    "tests/test_flag_matrix.py",  # issue 22: every documented GPU flag combination
    # loss
    "tests/test_contrastive.py",
    "tests/test_contrastive_dist.py",
    "tests/test_torch_compat.py",
    # int8: SwitchBack's kernels under the Triton interpreter, its layers on both engines
    "tests/test_switchback.py",
    "tests/test_switchback_kernels.py",
    "tests/test_switchback_fsdp.py",
    "tests/test_switchback_zero3.py",
    "tests/test_switchback_interpreted.py",  # every GPU tile, bit-exact, under Triton 3.6's interpreter
    "tests/test_switchback_diagnose.py",
    # fp8: torchao's float8 training at its lower bound (0.17.0, torch 2.11's release)
    "tests/test_fp8.py",
    # fast by construction: graph breaks, host syncs and dtypes differ between torch releases
    "tests/test_fast_compile.py",
    "tests/test_fast_sync.py",
    "tests/test_fast_dtypes.py",
    # data on the device; webdataset's key rule; the tokenizer (ftfy, regex)
    "tests/test_data_fast_transform.py",
    "tests/test_data_pipeline.py",
    "tests/test_data_common.py",
    "tests/test_tokenizer_openclip.py",
    # --pretrained TAG / hf-hub: through huggingface_hub at its lower bound (not the slow ViT-B-32 run:
    # the same library calls on a 151 M-parameter model)
    "tests/test_pretrained_hub.py::test_hf_hub_model_loads_its_config_preprocessing_and_weights_offline",
    "tests/test_pretrained_hub.py::test_an_uncached_hf_hub_model_fails_offline_saying_how_to_get_it",
    "tests/test_pretrained_hub.py::test_tag_files_are_found_as_openclip_finds_them",
    # transformers at its lower bound loads `consolidate --transformers-dir`'s folder (dev extra) and
    # the Hugging Face tokenizers model configs name
    "tests/test_transformers_export.py",
    "tests/test_hf_tokenizer.py::test_ids_are_openclips_hf_tokenizers",  # not its training runs: the
    "tests/test_hf_tokenizer.py::test_a_tokenizer_with_more_ids_than_the_text_tower_is_refused",  # same calls
    # checkpoints, local and S3 (boto3, moto, s3torchconnector)
    "tests/test_checkpoint_store.py",
    "tests/test_checkpoint_async.py",
    "tests/test_checkpoint_reshard.py",
    "tests/test_checkpoint_faults.py",
    "tests/test_s3_exclusive.py",
    "tests/test_data_s3.py",
    "tests/test_sync.py",
    # packaging and the declared ranges themselves
    "tests/test_low_stack.py",
    "tests/test_import_hygiene.py",
)

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def core_names() -> list[str]:
    """The distributions `pip install bigclip` installs (no extra)."""
    return [canonical(_REQUIREMENT.match(r).group(1)) for r in _project()["dependencies"]]


def lower_bounds() -> dict[str, str]:
    """{distribution name: declared lower bound} over the core and every optional dependency."""
    project = _project()
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    bounds: dict[str, str] = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match is None:
            if not requirement.startswith(project["name"]):  # bigclip[s3,...] names its own extras
                raise ValueError(f"pyproject.toml: {requirement!r} has no `>=` lower bound")
            continue
        bounds[canonical(match.group(1))] = match.group(3)
    return bounds


def canonical(name: str) -> str:
    """PEP 503's normalized name: what pip and importlib.metadata agree on."""
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints() -> str:
    """A pip constraints file pinning each direct dependency to its lower bound."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(lower_bounds().items()))


def existing_tests() -> list[str]:
    """LOW_STACK_TESTS (files, or pytest node ids FILE::TEST); a missing file is an error (a renamed
    test must not drop out silently, and pytest itself fails on a node id it cannot find)."""
    missing = [path for path in LOW_STACK_TESTS if not (ROOT / path.split("::")[0]).is_file()]
    if missing:
        raise FileNotFoundError(f"tests/support/stacks.py names tests that do not exist: {missing}")
    return list(LOW_STACK_TESTS)


def main(argv: list[str]) -> int:
    if argv == ["constraints"]:
        sys.stdout.write(constraints())
    elif argv == ["tests"]:
        print("\n".join(existing_tests()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
