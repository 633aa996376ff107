"""URI schemes that --pretrained and the registry both read, in a module that imports no bigclip
module and no torch (`bigclip publish`/`checkpoints`/`consolidate` check their options with it).

`registry:NAME` names a published checkpoint: `weights/sources.py` opens it (importing the
registry only then), and `registry/published.py` parses it. The name lives here, below both,
so neither has to import the other for it (each importing the other would be an import circle).
"""

import os

REGISTRY_SCHEME = "registry:"


def registry_uri(explicit: str = "") -> str:
    """The registry `registry:NAME` refers to: --registry, else $BIGCLIP_REGISTRY."""
    return explicit or os.environ.get("BIGCLIP_REGISTRY", "")
