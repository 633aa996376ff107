"""Image transforms (OpenCLIP's defaults without torchvision) and the tokenizers."""

import pickle
import random

import numpy as np
import pytest
import torch
from PIL import Image

from bigclip.data.tokenizer import HashingTokenizer, build_tokenizer
from bigclip.data.transforms import (
    center_crop_box,
    eval_transform,
    random_resized_crop_box,
    shortest_side_size,
    train_transform,
)
from bigclip.demo.shapes_data import all_attributes
from bigclip.errors import ConfigError


def gradient_image(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    rgb = np.concatenate([np.broadcast_to(x, (height, width, 1)), np.broadcast_to(y, (height, width, 1))], -1)
    rgb = np.concatenate([rgb, np.full((height, width, 1), 77, np.float32)], -1)
    return Image.fromarray(rgb.astype(np.uint8))


def test_constant_image_stays_constant_uint8():
    colour = (200, 100, 50)
    for transform in (train_transform(16), train_transform(16, fast=False), eval_transform(16)):
        out = transform(Image.new("RGB", (40, 30), colour))
        assert out.shape == (16, 16, 3) and out.dtype == np.uint8
        assert (out == np.array(colour, np.uint8)).all()


def test_eval_center_crops_the_middle_of_a_wide_image():
    image = gradient_image(64, 32)  # already 32 on the short side: no resize, crop columns 16..47
    np.testing.assert_array_equal(eval_transform(32)(image), np.asarray(image.crop((16, 0, 48, 32))))


def test_eval_resizes_shortest_side_like_torchvision():
    assert shortest_side_size(100, 50, 32) == (64, 32)
    assert shortest_side_size(50, 99, 32) == (32, 63)  # long side truncated, as torchvision's int()
    assert center_crop_box(64, 32, 32) == (0, 16, 32, 32)
    image = gradient_image(100, 50)
    reference = image.resize((64, 32), Image.Resampling.BICUBIC).crop((16, 0, 48, 32))
    np.testing.assert_array_equal(eval_transform(32)(image), np.asarray(reference))


def test_eval_resize_modes_longest_pads_and_squash_stretches():
    image = gradient_image(100, 50)
    longest = eval_transform(32, resize_mode="longest")(image)  # 32 x 16, padded 8 rows above and below
    resized = np.asarray(image.resize((32, 16), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(longest[8:24], resized)
    assert (longest[:8] == 0).all() and (longest[24:] == 0).all()
    squash = eval_transform(32, resize_mode="squash", interpolation="bilinear")(image)
    np.testing.assert_array_equal(squash, np.asarray(image.resize((32, 32), Image.Resampling.BILINEAR)))


def test_random_resized_crop_keeps_scale_and_ratio():
    rng = random.Random(0)
    for _ in range(200):
        top, left, h, w = random_resized_crop_box(120, 90, rng)
        assert 0 <= top <= 90 - h and 0 <= left <= 120 - w
        assert 0.88 <= h * w / (120 * 90) <= 1.0  # scale (0.9, 1.0), up to pixel rounding
        assert 3 / 4 - 0.03 <= w / h <= 4 / 3 + 0.03


def test_random_resized_crop_falls_back_to_a_centred_crop():
    # No 90%-area crop of a 1000x10 image has an aspect ratio within [3/4, 4/3].
    assert random_resized_crop_box(1000, 10, random.Random(0)) == (0, (1000 - 13) // 2, 10, 13)


def test_exact_train_transform_is_the_sampled_crop_resized_bicubically():
    image = gradient_image(80, 60)
    out = train_transform(24, fast=False)(image, random.Random(3))
    top, left, h, w = random_resized_crop_box(80, 60, random.Random(3))
    reference = image.crop((left, top, left + w, top + h)).resize((24, 24), Image.Resampling.BICUBIC)
    np.testing.assert_array_equal(out, np.asarray(reference))
    assert not np.array_equal(out, train_transform(24, fast=False)(image, random.Random(4)))  # random crops


def test_palette_and_alpha_images_become_rgb():
    palette = Image.new("P", (20, 20), 3)
    rgba = Image.new("RGBA", (20, 20), (10, 20, 30, 0))
    for image in (palette, rgba, Image.new("L", (20, 20), 9)):
        for transform in (eval_transform(8), train_transform(8), train_transform(8, fast=False)):
            assert transform(image.copy(), random.Random(0)).shape == (8, 8, 3)


def tok(context_length: int = 16, vocab_size: int = 49408) -> HashingTokenizer:
    return HashingTokenizer(context_length=context_length, vocab_size=vocab_size)


def test_tokenizer_layout_matches_openclip_conventions():
    ids = tok()(["a red circle", "A  Red\tcircle!"])
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    assert ids[0, 0] == 49406 and ids[0, 4] == 49407 and (ids[0, 5:] == 0).all()
    assert ids[0, :4].tolist() == ids[1, :4].tolist()  # case and whitespace do not matter
    assert ids[1, 5] == 49407  # "!" is its own token
    assert ids.argmax(-1).tolist() == [4, 5]  # the model pools at the end-of-text token


def test_tokenizer_truncates_keeping_end_token_last():
    ids = tok(context_length=8)(" ".join(f"word{i}" for i in range(30)))
    assert ids.shape == (1, 8) and ids[0, -1] == 49407 and ids[0].argmax() == 7


def test_word_ids_stay_below_the_special_tokens():
    small = tok(vocab_size=50)
    words = [f"w{i}" for i in range(500)]
    ids = [small.word_id(w) for w in words]
    assert min(ids) >= 1 and max(ids) <= 47 and len(set(ids)) == 47  # every word id used, none special


def test_tokenizer_ids_are_stable_and_demo_vocabulary_has_no_collisions():
    a, b = tok(), pickle.loads(pickle.dumps(tok()))
    assert a.encode("a small blue square") == b.encode("a small blue square")
    assert a.collisions(x.caption() for x in all_attributes()) == {}
    assert len({tuple(a.encode(x.caption())) for x in all_attributes()}) == len(all_attributes())


def test_build_tokenizer_errors_are_clear():
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        build_tokenizer("bpe", context_length=16, vocab_size=100)
    with pytest.raises(ConfigError, match="context_length"):
        build_tokenizer("hashing", context_length=1, vocab_size=100)
    with pytest.raises(ConfigError, match="vocab_size is 1000"):
        build_tokenizer("open_clip", context_length=16, vocab_size=1000)


def test_default_tokenizer_is_openclips_bpe_and_hashing_is_opt_in():
    """The issue's case: the default gave 26159 for "a", OpenCLIP's tokenizer gives 320."""
    from bigclip.cli_args import parse_train_args

    default = parse_train_args([]).data.tokenizer
    assert default == "open_clip"
    ids = build_tokenizer(default, context_length=32, vocab_size=49408)(["a red circle"])
    assert ids[0, :5].tolist() == [49406, 320, 736, 7117, 49407]
    assert parse_train_args(["--tokenizer", "hashing"]).data.tokenizer == "hashing"
    with pytest.raises(ConfigError, match="now named 'hashing'"):
        parse_train_args(["--tokenizer", "simple"])
