"""`bigclip models`: the bundled model configs with their parameter counts.

Its options (none) are checked before the model code, and with it torch, is imported: a stray
option fails in a fraction of a second. The counts come from each model built on the meta device.
"""

from __future__ import annotations

from bigclip.errors import ConfigError
from bigclip.models.named_configs import list_models


def main(argv: list[str]) -> int:
    if argv and argv[0] not in ("-h", "--help"):
        raise ConfigError(f"bigclip models takes no options, got {' '.join(argv)}; run `bigclip models`")
    if argv:
        print("usage: bigclip models    (lists the model configs with their parameter counts)")
        return 0
    from bigclip.models.factory import count_parameters, create_model  # torch: only to count

    print(f"{'model':<14}{'params (M)':>12}{'image (M)':>12}{'text (M)':>12}")
    for name in list_models():
        counts = count_parameters(create_model(name, device="meta"))
        print(f"{name:<14}" + "".join(f"{counts[k] / 1e6:>12.2f}" for k in ("total", "image", "text")))
    return 0
