"""`bigclip models`: every registered family's model configs, their image sizes, parameter counts
and OpenCLIP tags.

Torch-free: sizes and counts come from each model's static shape (models/shape.py), which
tests/test_model_shape.py holds equal to the built model's parameters.
"""

from __future__ import annotations

from bigclip.errors import ConfigError
from bigclip.models.families import all_configs, family_of, model_shape
from bigclip.models.pretrained_tags import QUICKGELU, tags_for


def main(argv: list[str]) -> int:
    if argv and argv[0] not in ("-h", "--help"):
        raise ConfigError(f"bigclip models takes no options, got {' '.join(argv)}; run `bigclip models`")
    if argv:
        print(
            "usage: bigclip models    (lists the model configs with their image sizes, parameter counts and OpenCLIP tags)"
        )
        return 0
    names = all_configs()
    width = max(map(len, names)) + 2
    print(
        f"{'model':<{width}}{'image px':>9}{'params (M)':>12}{'image (M)':>12}{'text (M)':>12}  OpenCLIP tags"
    )
    for name in names:
        shape, is_image = model_shape(name), family_of(name).image_param
        total = sum(p.numel for p in shape.params)
        image = sum(p.numel for p in shape.params if is_image(p.name))  # the rest: text, scalars
        tags = ", ".join(tags_for(name) + [f"{t} (-quickgelu)" for t in tags_for(name + QUICKGELU)])
        print(
            f"{name:<{width}}{shape.image_size:>9}"
            + "".join(f"{n / 1e6:>12.2f}" for n in (total, image, total - image))
            + f"  {tags or '-'}"
        )
    return 0
