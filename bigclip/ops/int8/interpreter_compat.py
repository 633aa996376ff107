"""One fix to Triton's CPU interpreter (TRITON_INTERPRET=1), so SwitchBack's kernels run there
on Triton 3.6 (the GPU machines' Triton) as on newer releases.

Cause: the interpreter holds a scalar as a one-element 1-D numpy array, and Triton <= 3.6 turns
it into a Python int with `int(array)` (its patched `tl.tensor.__index__`). NumPy deprecated that
conversion in 1.25 and refuses it since 2.4 ("only 0-dimensional arrays can be converted to
Python scalars"), so every `range()` over a runtime value in a kernel fails: the GEMM's K loop,
`for k in range(0, tl.cdiv(K, BLOCK_K))`. Compiled kernels never run this code. Upstream fixed it
with `int(self.handle.data.squeeze())` (triton-lang/triton#9171, #9172, after 3.6).

No other loop form avoids it without changing what the GPU compiles (`tl.range` is the same
Python `range` in the interpreter; a constexpr trip count specialises the kernel on K), so the
kernel stays as it is and this applies upstream's line to an interpreter that lacks it.
"""

from __future__ import annotations

import inspect
from typing import Any

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


def install() -> bool:
    """Apply upstream's fix if this interpreter needs it (idempotent); True if it was applied."""
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
