"""What the loop reports every `--log-every-n-steps`: OpenCLIP's log line (with the loader's
capacity, model TFLOP/s per GPU, MFU and the ETA appended) and the scalars, every
`--log-metric-every-n-steps`: OpenCLIP's `train/` names and values, then bigclip's own.

Values are tensors until a log step: reading a device tensor (`.item()`) waits for the GPU, so
this runs only on log steps. The loss logged is the global one (averaged over ranks) and the
loader capacity the slowest rank's, so every rank logs the same numbers on the same steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bigclip.distributed import cpu_group
from bigclip.train import throughput
from bigclip.train.metrics import LOSS_NAME, Average, StepTimer, get_logger, peak_memory_gb, train_log_line
from bigclip.train.step import StepOutput, verify_inputs

if TYPE_CHECKING:
    from bigclip.train.run import Run


def log_step(
    run: Run, out: StepOutput, timer: StepTimer, loss_avg: Average, lr: float, steps_per_epoch: int,
    capacity: float, console: bool = True,
) -> None:  # fmt: skip
    """Scalars to the metric sinks; with `console`, OpenCLIP's log line too. Collective (every rank
    calls it on the same steps): the loss written is the global batch's."""
    state = run.progress.state
    verify_inputs(run.loss_fn, step=state.step)  # before anything is logged as a finite loss
    loss = out.loss.clone()
    # The slowest rank's data-loader capacity (samples/s its workers could deliver) sets the pace.
    capacity_t = torch.tensor([capacity], dtype=torch.float64)
    if run.runtime.world_size > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the global loss; every rank logs on the same steps
        dist.all_reduce(capacity_t, op=dist.ReduceOp.MIN, group=cpu_group())
    capacity = float(capacity_t)
    loss_value = run.progress.last_loss = loss.item()
    loss_avg.add(loss_value)
    scale = out.logit_scale.item()
    samples_per_s = run.global_batch / max(timer.batch.avg, 1e-9)
    pace = throughput.measure(
        flops_per_sample=throughput.train_flops_per_sample(run.cfg), samples_per_s=samples_per_s,
        world_size=run.runtime.world_size, peak_tflops=throughput.device_peak_tflops(run.runtime.device),
        steps_left=run.progress.total_steps - state.step, step_s=timer.batch.avg,
    )  # fmt: skip
    if console:
        get_logger().info(
            train_log_line(epoch=state.epoch, samples_done=state.epoch_step * run.global_batch,
                           samples_per_epoch=steps_per_epoch * run.global_batch, timer=timer,
                           global_batch=run.global_batch, world_size=run.runtime.world_size, lr=lr,
                           logit_scale=scale, loss=loss_value, loss_avg=loss_avg.avg)
            + f" Loader capacity: {capacity:#g}/s/gpu"  # Data (t) above is the wait for data
            + throughput.log_fields(pace)
        )  # fmt: skip
    openclip = {  # open_clip_train/train.py's names: dashboards built on OpenCLIP runs read these
        "train/data_time": timer.data.avg,
        "train/batch_time": timer.batch.avg,
        "train/samples_per_second": samples_per_s,
        "train/samples_per_second_per_gpu": samples_per_s / run.runtime.world_size,
        "train/scale": scale,  # the logit scale, exponentiated
        "train/lr": lr,
        f"train/{LOSS_NAME}": loss_value,  # each loss term by name (bigclip has one)...
        "train/loss": loss_value,  # ...and their sum
    }
    own = {
        "train/grad_norm": out.stats.grad_norm.item(),
        "train/data_capacity_per_gpu": capacity,  # < samples_per_second_per_gpu: data-bound
        "train/peak_memory_gb": peak_memory_gb(run.runtime.device),
    }
    run.scalars.scalars(openclip | own | throughput.scalars(pace), step=state.step)
    timer.reset()
