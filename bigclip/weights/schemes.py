"""URI schemes that --pretrained and the registry both read, in a module that imports nothing.

`registry:NAME` names a published checkpoint: `weights/sources.py` opens it (importing the
registry only then), and `registry/published.py` parses it. The name lives here, below both,
so neither has to import the other for it (the two once formed an import circle).
"""

REGISTRY_SCHEME = "registry:"
