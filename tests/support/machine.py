"""What this machine offers the code under test, asked of the machine, never assumed.

CPU models differ between the machines the suite runs on: an AMD EPYC without AVX512-FP16 has no
oneDNN fp16, so DeepSpeed's CPU accelerator refuses `--precision amp` there, while Intel CPUs with
AVX512-FP16/AMX accept it. A test whose outcome depends on such a feature asks here what to expect.

Setting WITHHOLD_FP16_ENV=1 makes every process that imports this module report fp16 as
unsupported (spawned ranks import their test module, which imports this), so a machine that has
fp16 also runs the suite as a machine without it would: tests/test_precision_matrix.py and
tests/test_flag_matrix.py each run their fp16 rows that way too.
"""

from __future__ import annotations

import os

WITHHOLD_FP16_ENV = "BIGCLIP_TEST_WITHHOLD_CPU_FP16"
ZERO_FP16_REFUSAL = "--precision amp_bf16"  # what bigclip's refusal tells the user to use instead


def _withhold_fp16() -> None:
    if os.environ.get(WITHHOLD_FP16_ENV) == "1":
        # The accelerator's answer, which bigclip asks (deepspeed/accelerator/cpu_accelerator.py
        # reads oneDNN's): patching torch.ops.mkldnn instead breaks code that walks its ops.
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        CPU_Accelerator.is_fp16_supported = lambda self: False


_withhold_fp16()


def zero_accepts_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator, which the ZeRO tests run on, trains fp16 here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def expected_refusal(engine: str, precision: str) -> str | None:
    """The fragment bigclip's refusal holds where this machine cannot train `precision` on
    `engine` ("fsdp", "zero1"...), else None (it must train)."""
    if engine != "fsdp" and precision == "amp" and not zero_accepts_fp16():
        return ZERO_FP16_REFUSAL
    return None
