"""What to change when a plan does not fit: remedies for its largest term first, each priced.

The peak is the larger of two phases (memory.py): the end of forward, or the optimizer step. Its
terms there, largest first, decide what is advised; a term's remedies are the changes that shrink
it, and each is priced by planning the run again with it, never guessed: a remedy is advised only
when it lowers the peak, with the peak it gives and whether that fits. So a run whose loss buffers
dominate (an unchunked loss at a large global batch) is told --loss-chunk-size, not more GPUs
(which grow those buffers), and --grad-checkpointing is never advised to a run that has it.
  loss buffers       --loss-chunk-size 1024 (exact, per-rank memory flat in the world size),
                     --loss-exchange ring, --local-loss
  activations        --grad-checkpointing, --grad-checkpointing-every 1, --grad-checkpointing-policy
                     full, then half the --batch-size with twice the --accum-freq (same global batch)
  model state        twice the GPUs (FSDP2 and ZeRO-3 shard it over them), --optimizer adamw8bit
  communication      --reshard-after-forward (FSDP2 frees gathered parameters after forward),
                     --fsdp-blocks-per-unit 1 (one block gathered at a time)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from bigclip.plan.engine_plan import engine_plan
from bigclip.plan.options import Hardware
from bigclip.plan.spec import PlanSpec

GiB = 2**30
Remedy = tuple[str, Callable[[PlanSpec], PlanSpec | None]]  # (the flags, the spec they give, or None)
# The flags may name the spec's own values: {batch} is half its --batch-size, {accum} twice its --accum-freq.


@dataclass(frozen=True)
class Advice:
    largest: tuple[str, int]  # the largest term of the peak phase, and its bytes per GPU
    term: tuple[str, int]  # the term the remedies shrink: the largest one that any remedy lowers
    remedies: list[tuple[str, int, bool]]  # (flags, the peak with them, whether that fits), best first

    def text(self) -> str:
        """One line: the largest term, then each remedy with the peak it gives."""
        (name, size), (term, term_size) = self.largest, self.term
        head = f"its largest term is the {name} ({size / GiB:.1f} GiB per GPU)"
        if not self.remedies:
            return f"{head}, and no flag bigclip plans lowers the peak: lower --batch-size"
        if term != name:
            head += f", which no flag bigclip plans lowers; the next, the {term} ({term_size / GiB:.1f} GiB)"
        said = [f"{flags} (peak {peak / GiB:.1f} GiB: {'fits' if fits else 'still too much'})"
                for flags, peak, fits in self.remedies]  # fmt: skip
        return f"{head}: {'; or '.join(said)}"


def _loss_remedies() -> list[Remedy]:
    return [
        ("--loss-chunk-size 1024", lambda s: None if s.loss_chunk_size else replace(s, loss_chunk_size=1024)),
        ("--loss-exchange ring",
         lambda s: replace(s, loss_exchange="ring") if s.loss_chunk_size and s.loss_exchange != "ring" else None),
        ("--local-loss", lambda s: None if s.local_loss or s.loss_chunk_size else replace(s, local_loss=True)),
    ]  # fmt: skip


def _activation_remedies() -> list[Remedy]:
    return [
        ("--grad-checkpointing", lambda s: None if s.grad_checkpointing else replace(s, grad_checkpointing=True)),
        ("--grad-checkpointing-every 1",
         lambda s: replace(s, checkpoint_every=1) if s.grad_checkpointing and s.checkpoint_every > 1 else None),
        ("--grad-checkpointing-policy full",
         lambda s: replace(s, checkpoint_policy="full") if s.grad_checkpointing and s.checkpoint_policy != "full"
         else None),
        ("--batch-size {batch} --accum-freq {accum} (the same global batch)",
         lambda s: replace(s, batch_size=s.batch_size // 2, accum_freq=2 * s.accum_freq) if s.batch_size > 1
         else None),
    ]  # fmt: skip


def _state_remedies(gpus_word: str) -> list[Remedy]:
    return [
        (gpus_word, lambda s: replace(s, gpus=2 * s.gpus)),
        (
            "--optimizer adamw8bit",
            lambda s: replace(s, optimizer="adamw8bit") if s.optimizer == "adamw" else None,
        ),
    ]


def terms(plan: Any) -> list[tuple[str, int]]:
    """The peak phase's terms, largest first (model state as one: the GPUs share it)."""
    m, s = plan.memory, plan.memory.state
    if m.forward_peak >= m.step_peak:
        found = [("model state", s.parameters + s.optimizer + m.persistent_gradients),
                 ("activations", m.activations + m.backward_workspace), ("loss buffers", m.loss_buffers),
                 ("communication buffers", m.communication)]  # fmt: skip
    else:
        found = [("model state", s.parameters + s.optimizer + s.gradients + m.step_temporaries)]
    return sorted(found, key=lambda item: -item[1])


def advise(plan: Any, replan: Callable[[PlanSpec, Hardware], Any], *, gpus_word: str = "") -> Advice:
    """Remedies for the largest term, or the next one when none of its remedies lowers the peak.
    `plan` is a `planner.Plan` and `replan` its `build_plan` (planner imports this module)."""
    gpus_word = gpus_word or f"twice the GPUs (--gpus {2 * plan.spec.gpus})"
    by_term = {"loss buffers": _loss_remedies(), "activations": _activation_remedies(),
               "model state": _state_remedies(gpus_word), "communication buffers": engine_plan(plan.spec.engine).communication_remedies()}  # fmt: skip
    ranked = terms(plan)
    for term, size in ranked:
        found = []
        for flags, change in by_term[term]:
            spec = change(plan.spec)
            if spec is None:
                continue
            other = replan(spec, plan.hardware)
            if other.memory.peak < plan.memory.peak:
                flags = flags.format(batch=spec.batch_size, accum=spec.accum_freq)
                found.append((flags, other.memory.peak, other.fits))
        if found:
            return Advice(ranked[0], (term, size), sorted(found, key=lambda r: r[1]))
    return Advice(ranked[0], ranked[0], [])
