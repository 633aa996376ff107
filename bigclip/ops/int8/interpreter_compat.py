"""Two fixes to Triton's CPU interpreter (TRITON_INTERPRET=1), so SwitchBack's kernels run there
on Triton 3.6 (the GPU machines' Triton) as on newer releases, with the GPU's rounding.

1. Scalars as loop bounds. The interpreter holds a scalar as a one-element 1-D numpy array, and
Triton <= 3.6 turns it into a Python int with `int(array)` (its patched `tl.tensor.__index__`).
NumPy deprecated that conversion in 1.25 and refuses it since 2.4 ("only 0-dimensional arrays
can be converted to Python scalars"), so every `range()` over a runtime value fails: the GEMM's
K loop, `for k in range(0, tl.cdiv(K, BLOCK_K))`. Upstream fixed it with
`int(self.handle.data.squeeze())` (triton-lang/triton#9171, #9172, after 3.6). No other loop form
avoids it without changing what the GPU compiles (`tl.range` is the same Python `range` in the
interpreter; a constexpr trip count specialises the kernel on K), so the kernel stays as it is
and this applies upstream's line where the interpreter lacks it.

2. fp32 -> bf16. The interpreter truncates (numpy has no bf16; up to 3.9 at least), while a GPU
rounds to nearest even (`cvt.rn.bf16.f32`, what `.to(tl.bfloat16)` compiles to) and so does
PyTorch. With this, the kernels' bf16 outputs can be compared bit for bit on CPU too.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

_OLD_INDEX = "int(self.handle.data))"  # the line upstream replaced
_FIXED_MARK = "_bigclip_index_fix"


def _index(tensor: Any) -> int:
    return int(tensor.handle.data.squeeze())


def needs_fix() -> bool:
    """Whether the installed interpreter still converts scalars with `int(array)`."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, _FIXED_MARK, False):
        return False
    try:
        return _OLD_INDEX in inspect.getsource(patch)
    except (OSError, TypeError):  # no source to read: leave the interpreter alone
        return False


def bf16_round_to_nearest_even(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), rounding to nearest even; NaN becomes 0x7FC0."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(x), np.uint32(0x7FC0), rounded).astype(np.uint16)


def install() -> None:
    """Apply both fixes to this process's interpreter (idempotent)."""
    _install_index_fix()
    _install_bf16_rounding()


def _install_bf16_rounding() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, _FIXED_MARK, False):
        return

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(bf16_round_to_nearest_even(src.data), tl.bfloat16)
        return original(self, src, dst_type)

    setattr(cast_impl, _FIXED_MARK, True)
    builder.cast_impl = cast_impl


def _install_index_fix() -> bool:
    """Upstream's `__index__` fix, if this interpreter needs it; True if it was applied."""
    if not needs_fix():
        return False
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: type, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored with the rest after each launch

    setattr(patch_lang_tensor, _FIXED_MARK, True)
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
