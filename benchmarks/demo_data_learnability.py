"""Is `make-demo-data` output learnable by the tiny CLIP in minutes on CPU? Retrieval vs chance.

  PYTHONPATH=$PWD python benchmarks/demo_data_learnability.py [--minutes 3] [--samples 20000]

One process, the real data pipeline (bigclip.data), the tiny model and OpenCLIP's ClipLoss,
AdamW; then zero-shot retrieval top-1 on the held-out set (distinct captions, chance = 1/N)
in both directions, before and after training. A check on the data, not the lead's demo.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.config import DataConfig  # noqa: E402
from bigclip.data.device import image_normalizer  # noqa: E402
from bigclip.data.eval import load_eval_set  # noqa: E402
from bigclip.data.loader import build_train_loader  # noqa: E402
from bigclip.data.tokenizer import build_tokenizer  # noqa: E402
from bigclip.demo.shapes_data import write_demo_data  # noqa: E402
from bigclip.models.factory import create_model  # noqa: E402
from bigclip.ops.loss.contrastive import ClipLoss  # noqa: E402


@torch.no_grad()
def retrieval_top1(model, images: torch.Tensor, texts: torch.Tensor) -> tuple[float, float]:
    image_features = model.encode_image(images, normalize=True)
    text_features = model.encode_text(texts, normalize=True)
    similarity = image_features @ text_features.T
    target = torch.arange(len(images))
    image_to_text = (similarity.argmax(1) == target).float().mean().item()
    text_to_image = (similarity.argmax(0) == target).float().mean().item()
    return image_to_text, text_to_image


def train(model, cfg: DataConfig, tokenizer, *, minutes: float, lr: float) -> tuple[int, int, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    loss_fn, steps, epoch, deadline = ClipLoss(), 0, 0, time.monotonic() + minutes * 60
    loss = torch.tensor(0.0)
    while time.monotonic() < deadline:
        loader = build_train_loader(
            cfg, rank=0, world_size=1, seed=0, epoch=epoch, image_size=model.image_size, tokenizer=tokenizer
        )
        for batch in loader:
            out = model(batch.images, batch.texts)
            loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if time.monotonic() > deadline:
                loader.close()
                break
        epoch += 1
    return steps, epoch, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--val-samples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = create_model("tiny", device="cpu")
    tokenizer = build_tokenizer("open_clip", context_length=model.context_length, vocab_size=49408)
    with tempfile.TemporaryDirectory() as tmp:
        demo = write_demo_data(tmp, samples=args.samples, shards=8, val_samples=args.val_samples)
        held_out = load_eval_set(demo.val_pattern, image_size=model.image_size, tokenizer=tokenizer)
        held_out_images = image_normalizer(DataConfig())(held_out.images)  # uint8 -> normalised
        before = retrieval_top1(model.eval(), held_out_images, held_out.texts)
        cfg = DataConfig(train_data=demo.train_pattern, batch_size=args.batch_size, workers=1)
        steps, epochs, loss = train(model.train(), cfg, tokenizer, minutes=args.minutes, lr=args.lr)
        after = retrieval_top1(model.eval(), held_out_images, held_out.texts)
    chance = 1 / args.val_samples
    rows = [
        {"when": "before", "steps": 0, "i2t_top1": before[0], "t2i_top1": before[1], "chance": chance},
        {"when": "after", "steps": steps, "i2t_top1": after[0], "t2i_top1": after[1], "chance": chance},
    ]
    print_table(rows)
    write_results("demo_data_learnability", rows, epochs=epochs, final_loss=loss, **vars(args))


if __name__ == "__main__":
    main()
