"""Decoding a raw webdataset sample into (image, caption), or the reason it is skipped.

Samples come from the open internet and are untrusted: any failure to decode is a skip
with a reason, counted by the caller, never an exception. Which tar members hold the image and
the caption is OpenCLIP's --image-key / --text-key (`SampleKeys`): by default the first of
jpg/png/jpeg/webp present, and txt (UTF-8).

Training opens images lazily (`load=False`: the header only), so that the transform can
decode a JPEG at reduced size (transforms.py); damage found then is a BAD_IMAGE skip too
(the worker catches it). Evaluation loads at once, so that every rank agrees on what is corrupt.

16-bit grayscale images (PNG's mode "I;16", or "I" in older Pillow) are scaled to 8 bits here:
PIL's own `convert("RGB")` clips them, turning every such image white. An empty caption is a
skip (EMPTY_TEXT), not a sample: every empty caption tokenizes to the same text, so a batch holding
two of them asks the loss to tell identical texts apart (OpenCLIP trains on them). A sample a
shard holds two members of the same name for (`KEY.jpg` twice) is skipped as DUPLICATE: which of
them goes with the caption is unknown (webdataset itself refuses such a shard: "duplicate file
name in tar file").
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from bigclip.data.tar_samples import RawSample

IMAGE_EXTENSIONS = ("jpg", "png", "jpeg", "webp")  # OpenCLIP's --image-key default, in its order
TEXT_EXTENSIONS = ("txt",)

# Why a sample was skipped (keys of the skip counters reported to the training loop).
NO_IMAGE = "no_image"  # no file with an image extension (unknown or missing)
NO_TEXT = "no_text"
BAD_IMAGE = "bad_image"  # image bytes PIL cannot decode
BAD_TEXT = "bad_text"  # caption that is not UTF-8
EMPTY_TEXT = "empty_text"  # a caption of nothing but white space
DUPLICATE = "duplicate_member"  # the shard holds a member of this sample twice (tar_samples.py)
WIDE_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit (or 32-bit integer) grayscale


@dataclass(frozen=True)
class SampleKeys:
    """The member suffixes (what follows the sample key, e.g. 'jpg' or 'caption.txt') read as the
    image and as the caption: the first one present wins."""

    image: tuple[str, ...] = IMAGE_EXTENSIONS
    text: tuple[str, ...] = TEXT_EXTENSIONS

    @classmethod
    def parse(cls, *, image_key: str, text_key: str) -> SampleKeys:
        """OpenCLIP's spelling: ';'-separated alternatives, e.g. --image-key 'jpg;png'."""
        return cls(image=_alternatives(image_key), text=_alternatives(text_key))


def _alternatives(value: str) -> tuple[str, ...]:
    # Lower case, as the reader files members (tar_samples.py): --image-key JPG reads KEY.JPG.
    return tuple(part.strip().lstrip(".").lower() for part in value.split(";") if part.strip())


DEFAULT_KEYS = SampleKeys()  # OpenCLIP's defaults: jpg;png;jpeg;webp and txt


@dataclass
class Decoded:
    key: str
    image: Image.Image
    caption: str


def _first(files: dict[str, bytes], extensions: tuple[str, ...]) -> bytes | None:
    return next((files[ext] for ext in extensions if ext in files), None)


def decode_image(data: bytes, *, load: bool = True) -> Image.Image | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EXIF / decompression-bomb warnings: we decide below
            image = Image.open(io.BytesIO(data))
            if image.mode in WIDE_GRAY:
                return _eight_bit(image)
            if load:
                image.load()  # decoding is lazy; force it so damage is found here
        return image
    except Exception:  # PIL raises many types (OSError, ValueError, SyntaxError, DecompressionBombError...)
        return None


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image as 8-bit 'L', scaled (0..65535 -> 0..255), not clipped."""
    pixels = np.asarray(image).astype(np.int64).clip(0)
    top = int(pixels.max()) if pixels.size else 0
    if top > 0xFFFF:  # a 32-bit image: its own range, scaled down
        pixels = pixels * 0xFFFF // top
    return Image.fromarray((pixels >> 8).astype(np.uint8), mode="L")


def decode_sample(raw: RawSample, *, load: bool = True, keys: SampleKeys = DEFAULT_KEYS) -> Decoded | str:
    """A `Decoded` sample (its image only opened unless `load`), or the reason it was skipped (above)."""
    if raw.duplicate:
        return DUPLICATE
    image_bytes = _first(raw.files, keys.image)
    if image_bytes is None:
        return NO_IMAGE
    text_bytes = _first(raw.files, keys.text)
    if text_bytes is None:
        return NO_TEXT
    try:
        caption = text_bytes.decode("utf-8").strip()
    except UnicodeDecodeError:
        return BAD_TEXT
    if not caption:
        return EMPTY_TEXT
    image = decode_image(image_bytes, load=load)
    if image is None:
        return BAD_IMAGE
    return Decoded(key=raw.key, image=image, caption=caption)
