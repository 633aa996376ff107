"""`bigclip models`: the bundled model configs, their image sizes, parameter counts and OpenCLIP tags.

Its options (none) are checked before the model code, and with it torch, is imported: a stray
option fails in a fraction of a second. The counts come from each model built on the meta device.
"""

from __future__ import annotations

from bigclip.errors import ConfigError
from bigclip.models.named_configs import get_model_config, list_models
from bigclip.models.pretrained_tags import QUICKGELU, tags_for


def main(argv: list[str]) -> int:
    if argv and argv[0] not in ("-h", "--help"):
        raise ConfigError(f"bigclip models takes no options, got {' '.join(argv)}; run `bigclip models`")
    if argv:
        print(
            "usage: bigclip models    (lists the model configs with their image sizes, parameter counts and OpenCLIP tags)"
        )
        return 0
    from bigclip.models.factory import count_parameters, create_model  # torch: only to count

    names = list_models()
    width = max(map(len, names)) + 2
    print(
        f"{'model':<{width}}{'image px':>9}{'params (M)':>12}{'image (M)':>12}{'text (M)':>12}  OpenCLIP tags"
    )
    for name in names:
        counts = count_parameters(create_model(name, device="meta"))
        tags = ", ".join(tags_for(name) + [f"{t} (-quickgelu)" for t in tags_for(name + QUICKGELU)])
        print(
            f"{name:<{width}}{get_model_config(name).vision_cfg.image_size:>9}"
            + "".join(f"{counts[k] / 1e6:>12.2f}" for k in ("total", "image", "text"))
            + f"  {tags or '-'}"
        )
    return 0
