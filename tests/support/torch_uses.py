"""Every torch name a source tree uses, read from its syntax tree (no import).

A use is a dotted name rooted at an import of torch: `dist.all_reduce` after
`import torch.distributed as dist` is `torch.distributed.all_reduce`; `fully_shard(...)` after
`from torch.distributed.fsdp import fully_shard` is `torch.distributed.fsdp.fully_shard`. Keyword
arguments of calls to such names count too, as `NAME(keyword=)`: a keyword is as much an API as
a function (`P2POp(group_peer=)` is newer than `P2POp`). `getattr(torch_alias, "literal")` counts
as the attribute it names. Attributes of objects torch returns (`tensor.view`) are not followed.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path


def torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch module or object it is bound to, from the file's imports."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    # `import torch.distributed` binds `torch`; `import torch.distributed as d` binds d
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "torch"
        ):
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`a.b.c` as a torch name when `a` is a torch alias, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _getattr_use(node: ast.Call, aliases: dict[str, str]) -> str | None:
    is_getattr = isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
    if not (is_getattr and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
        return None
    base = dotted(node.args[0], aliases)
    return f"{base}.{node.args[1].value}" if base and isinstance(node.args[1].value, str) else None


def file_uses(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = torch_aliases(tree)
    uses = set(aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := dotted(node, aliases)):
            uses.add(name)
        elif isinstance(node, ast.Call):
            if name := _getattr_use(node, aliases):
                uses.add(name)
            if name := dotted(node.func, aliases):
                uses.update(f"{name}({k.arg}=)" for k in node.keywords if k.arg)
    return uses


def torch_uses(*roots: Path) -> dict[str, list[str]]:
    """Torch name -> the files (relative to their root's parent) that use it."""
    found: dict[str, list[str]] = defaultdict(list)
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for name in file_uses(path):
                found[name].append(str(path.relative_to(root.parent)))
    return dict(found)
