"""Objects named "module:attribute" ("module:a.b" for a nested one), imported when first used: how
bigclip's tables name what they register (commands, engines, model families' builders, storage
schemes' openers), so registering one imports nothing and a run loads only what it uses.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_named(reference: str, *, default: str = "") -> Any:
    """The object `reference` names; `default`: the attribute when the reference names a module only."""
    module, _, dotted = reference.partition(":")
    found = importlib.import_module(module)
    for part in (dotted or default).split("."):
        found = getattr(found, part)
    return found
