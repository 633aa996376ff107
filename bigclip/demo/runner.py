"""`bigclip demo`: the whole stack end to end on one CPU box, in a few minutes.

1. Write captioned synthetic images as webdataset shards (plus a held-out set).
2. Start a loopback S3 endpoint (moto, 127.0.0.1) and a bucket for checkpoints.
3. Train the tiny CLIP with torchrun on 2 CPU ranks (FSDP2), checkpointing straight to S3.
4. Preempt it with SIGUSR1, as SLURM does before a time limit: it checkpoints and exits 85.
5. Requeue it on 1 rank (same global batch): it resumes from the latest S3 checkpoint at the
   exact step, and trains to the end.
6. Report the loss before and after the resume, zero-shot retrieval on the held-out set and
   zero-shot classification of new images by the shape drawn (`--imagenet-val`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from bigclip.cli_args import ArgumentParser
from bigclip.demo.data import SHAPES, DemoData, write_demo_data

BUCKET = "bigclip-demo"
LOSS = re.compile(r"Contrastive_loss: ([0-9.]+)")
SAVED = re.compile(r"checkpoint step (\d+) -> \S+ \((?:committed|async)")
RESUMED = re.compile(r"resumed \S+ at step (\d+)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="bigclip demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo", help="Folder for data and logs.")
    p.add_argument("--samples", type=int, default=20000, help="Training samples to generate.")
    p.add_argument("--steps", type=int, default=600, help="Total optimizer steps (global batch 64).")
    p.add_argument(
        "--preempt-after", type=int, default=400, help="Send SIGUSR1 after the checkpoint at this step."
    )
    return p.parse_args(argv)


def demo_data(out: Path, samples: int) -> DemoData:
    """Generate once; a rerun of the demo reuses the shards."""
    marker = out / "data" / "demo_data.json"
    if marker.exists():
        saved = DemoData(**json.loads(marker.read_text()))
        if saved.train_samples == samples and saved.classify_pattern:
            return saved
    print(f"[demo] writing {samples} captioned images as webdataset shards under {marker.parent}")
    made = write_demo_data(str(marker.parent), samples=samples, shards=8, val_samples=300, seed=0)
    marker.write_text(json.dumps(vars(made)))
    return made


def recipe_argv(data: DemoData, steps: int, batch_size: int) -> list[str]:
    """What the demo trains and evaluates (the tiny CLIP, its data, optimiser, loss, zero-shot set)."""
    return [
        "--model", "tiny", "--train-data", data.train_pattern, "--precision", "fp32", "--batch-size",
        str(batch_size), "--workers", "1", "--epochs", "100", "--max-steps", str(steps), "--lr", "2e-3",
        "--warmup", "50", "--wd", "0.1", "--local-loss", "--gather-with-grad", "--loss-chunk-size", "32",
        "--imagenet-val", data.classify_pattern, "--zeroshot-frequency", "1",
    ]  # fmt: skip


def train_argv(data: DemoData, out: Path, steps: int, batch_size: int) -> list[str]:
    """The recipe, with held-out retrieval, logs, and checkpoints streamed to the loopback S3."""
    return [
        *recipe_argv(data, steps, batch_size), "--val-data", data.val_pattern,
        "--log-every-n-steps", "25", "--logs", str(out / "logs"), "--name", "demo",
        "--checkpoint-dir", f"s3://{BUCKET}/demo/checkpoints", "--save-every-n-steps", "100",
        "--save-frequency", "0", "--async-save", "--resume", "latest",
        "--remote-sync", f"s3://{BUCKET}/demo/logs", "--remote-sync-frequency", "30",
    ]  # fmt: skip


def run_phase(cmd: list[str], *, preempt_after: int | None) -> tuple[int, list[str]]:
    """Run a training command, echo its rank-0 lines, optionally SIGUSR1 it after a checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    signalled = False
    for line in proc.stdout:
        lines.append(line)
        if " | INFO | " in line or "Error" in line:
            print("   ", line.rstrip().split(" | INFO | ")[-1])
        saved = SAVED.search(line)
        if preempt_after is not None and saved and int(saved.group(1)) >= preempt_after and not signalled:
            print(
                f"[demo] SIGUSR1 -> torchrun (as SLURM's --signal=USR1@SECONDS would) after step {saved.group(1)}"
            )
            proc.send_signal(signal.SIGUSR1)
            signalled = True
    return proc.wait(), lines


def losses(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := LOSS.search(line))]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    data = demo_data(out, args.samples)
    from bigclip.demo.loopback_s3 import LoopbackS3  # torch (and moto): after the options are checked

    with LoopbackS3() as s3:
        s3.create_bucket(BUCKET)
        print(f"[demo] loopback S3 at {s3.endpoint}, bucket s3://{BUCKET}")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "-m", "bigclip.train", "--"]  # fmt: skip
        print("[demo] phase 1: torchrun, 2 CPU ranks x batch 32, FSDP2, checkpoints streamed to S3")
        code1, lines1 = run_phase(
            launcher + train_argv(data, out, args.steps, 32), preempt_after=args.preempt_after
        )
        print(f"[demo] phase 1 ended (ranks exit 85 = requeue me; torchrun reports {code1})")
        print("[demo] phase 2: requeued on 1 rank x batch 64 (same global batch), --resume latest from S3")
        code2, lines2 = run_phase([sys.executable, "-m", "bigclip.train", *train_argv(data, out, args.steps, 64)],
                                  preempt_after=None)  # fmt: skip
        from bigclip.checkpoint import CheckpointStore  # torch: after the options are checked

        committed = CheckpointStore(f"s3://{BUCKET}/demo/checkpoints").committed()
    if code2 != 0:
        print("[demo] phase 2 failed; see the output above", file=sys.stderr)
        return 1
    report(out, lines1, lines2, committed)
    return 0


def report(out: Path, lines1: list[str], lines2: list[str], committed: list[tuple[int, str]]) -> None:
    resumed = next((int(m.group(1)) for line in lines2 if (m := RESUMED.search(line))), None)
    l1, l2 = losses(lines1), losses(lines2)
    results = [json.loads(x) for x in (out / "logs" / "demo" / "results.jsonl").read_text().splitlines()]
    final = results[-1]
    print("\n================ bigclip demo ================")
    print(f"loss (2 ranks):        {l1[0]:.3f} -> {l1[-1]:.3f}   (chance level log(64) = 4.159)")
    print(f"resumed on 1 rank at:  step {resumed}, from the latest committed S3 checkpoint")
    print(f"loss (1 rank):         {l2[0]:.3f} -> {l2[-1]:.3f}")
    print(f"checkpoints on S3:     steps {[s for s, _ in committed]}")
    chance = final["chance"]
    print(f"held-out retrieval top-1 over {final['num_samples']} pairs (chance {100 * chance:.2f}%):")
    print(
        f"   image -> text: {100 * final['image_to_text_R@1']:.1f}%   text -> image: {100 * final['text_to_image_R@1']:.1f}%"
    )
    top1 = final.get("imagenet-zeroshot-val-top1")
    if top1 is not None:
        print(
            f"zero-shot classification of new images by shape ({len(SHAPES)} classes, chance "
            f"{100 / len(SHAPES):.0f}%): top-1 {100 * top1:.1f}%"
        )
    print(f"TensorBoard:           tensorboard --logdir {out / 'logs' / 'demo' / 'tensorboard'}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
