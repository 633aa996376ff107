"""Which model a run builds and the model-level options applied to it."""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.config.fields import installed, opt
from bigclip.config.linear_kinds import LINEAR_KINDS, linear_kind
from bigclip.config.linear_speedups import FILTERS
from bigclip.errors import ConfigError

MAX_CONTEXT_LENGTH = 8192  # tokens: 256 MiB of fp32 causal mask; CLIP's 77, SigLIP's 64, BERT-like towers 512


@dataclass
class ModelConfig:
    model: str = opt(
        "tiny", "Model config name (see `bigclip models`), e.g. ViT-bigG-14, or hf-hub:ORG/REPO (OpenCLIP's)."
    )
    pretrained: str = opt(
        "",
        "Initial weights: an OpenCLIP tag (laion2b_s34b_b79k), a path, s3:// or https:// URI, or registry:NAME.",
    )
    force_patch_dropout: float = opt(
        0.0, "Fraction of image patches dropped during training (class token kept)."
    )
    grad_checkpointing: bool = opt(False, "Recompute each residual block's activations in backward.")
    grad_checkpointing_every: int = opt(
        1, "With --grad-checkpointing, checkpoint one residual block in N (the others keep activations)."
    )
    grad_checkpointing_policy: str = opt(
        "full",
        "With --grad-checkpointing: `full` keeps only each checkpointed block's input; `ops` also keeps"
        " attention and every other matmul output (torchtitan's selective checkpointing: less recompute).",
        choices=("full", "ops"),
    )
    torchcompile: bool = opt(False, "torch.compile each residual block.")
    torchcompile_mode: str = opt(
        "",
        "With --torchcompile: torch.compile's mode, e.g. max-autotune or reduce-overhead (default: torch's).",
    )
    torchcompile_backend: str = opt(
        "", "With --torchcompile: torch.compile's backend, e.g. inductor or eager (default: inductor)."
    )
    linear_kind: str = opt(
        "none",
        "The residual blocks' linears: 16-bit (none), SwitchBack int8 (switchback-*: MLP linears), or"
        " torchao float8 (fp8-*: MLP and attention linears; an fp8 GPU, emulated on CPU).",
        choices=tuple(LINEAR_KINDS),
    )
    int8_attention: bool = opt(False, "With a SwitchBack --linear-kind, also swap the attention projections.")
    linear_filter: str = opt(
        "auto",
        "Which linears --linear-kind converts: auto (those measured faster than bf16 at their shape on this "
        "run's GPU family; every one where none was measured, as on a CPU), all, or a GPU family's measured "
        "shapes on any machine (config/linear_speedups.py).",
        choices=FILTERS,
    )
    force_quick_gelu: bool = opt(
        False, "QuickGELU activations, as OpenAI's weights need (= a -quickgelu model)."
    )
    force_image_size: list[int] = opt([], "Override the model's image size: N or N N (square only).")
    force_context_length: int = opt(0, "Override the text tower's context length (0: the model's).")
    cache_dir: str = opt(
        "",
        "Cache for downloaded weights: the Hugging Face cache of tags and hf-hub models (default: HF_HOME's), "
        "DIR/downloads for https:// and s3:// files (default: $BIGCLIP_CACHE).",
    )
    lock_image: bool = opt(False, "Freeze the image tower (LiT); frozen weights get no optimizer state.")
    lock_image_unlocked_groups: int = opt(
        0, "With --lock-image, leave the last N layer groups of the image tower trainable."
    )
    lock_text: bool = opt(False, "Freeze the text tower; frozen weights get no optimizer state.")
    lock_text_unlocked_layers: int = opt(
        0, "With --lock-text, leave the last N layer groups of the text tower trainable."
    )
    lock_text_freeze_layer_norm: bool = opt(
        False, "With --lock-text, freeze the LayerNorms of locked layers too (else they stay trainable)."
    )

    def validate(self) -> None:
        if isinstance(self.force_image_size, int):  # from a YAML file: `force_image_size: 224`
            self.force_image_size = [self.force_image_size]
        size = self.force_image_size
        if size and (len(size) > 2 or len(set(size)) != 1 or size[0] < 1):
            raise ConfigError(f"--force-image-size takes N or N N (bigclip's ViTs are square), got {size}")
        if not 0 <= self.force_context_length <= MAX_CONTEXT_LENGTH:
            raise ConfigError(
                f"--force-context-length {self.force_context_length}: give 1 to {MAX_CONTEXT_LENGTH} tokens (CLIP "
                "captions take 77; the text tower's mask and attention grow with its square: "
                f"{self.force_context_length**2 * 4 / 2**30:.3g} GiB for the mask alone)"
            )
        if not 0.0 <= self.force_patch_dropout < 1.0:
            raise ConfigError(f"--force-patch-dropout must be in [0, 1), got {self.force_patch_dropout}")
        refined = self.grad_checkpointing_every != 1 or self.grad_checkpointing_policy != "full"
        if refined and not self.grad_checkpointing:
            raise ConfigError(
                "--grad-checkpointing-every/--grad-checkpointing-policy refine --grad-checkpointing: add it"
            )
        if self.grad_checkpointing_every < 1:
            raise ConfigError(f"--grad-checkpointing-every must be >= 1, got {self.grad_checkpointing_every}")
        if (self.torchcompile_mode or self.torchcompile_backend) and not self.torchcompile:
            raise ConfigError("--torchcompile-mode and --torchcompile-backend need --torchcompile; add it")
        self._check_linear_kind()
        self._check_locks()
        from bigclip.models.families import family_of

        family_of(self.model, pretrained=self.pretrained).check(self)

    def _check_linear_kind(self) -> None:
        kind = linear_kind(self.linear_kind)
        if self.int8_attention and kind.attention != "optional":
            raise ConfigError(
                f"--int8-attention needs a SwitchBack --linear-kind (an --int8 mode), not {kind.name!r}: "
                "add e.g. --int8 switchback-global (fp8 kinds always include the attention projections)"
            )
        if kind.package and not installed(kind.package):
            raise ConfigError(
                f"--linear-kind {kind.name} needs {kind.package}, which is not installed: "
                f"pip install 'bigclip[{kind.family}]'"
            )

    def _check_locks(self) -> None:
        """Refuse --lock-* options that cannot apply, saying what to do instead. (Here, not in
        models/lock.py, which applies them: the check needs only this config.)"""
        for flag, count, lock, needed in (
            (
                "--lock-image-unlocked-groups",
                self.lock_image_unlocked_groups,
                self.lock_image,
                "--lock-image",
            ),
            ("--lock-text-unlocked-layers", self.lock_text_unlocked_layers, self.lock_text, "--lock-text"),
        ):
            if count < 0:
                raise ConfigError(f"{flag} must be 0 or more, got {count}")
            if count and not lock:
                raise ConfigError(f"{flag} {count} has an effect only with {needed}; add {needed}")
        if self.lock_text_freeze_layer_norm and not self.lock_text:
            raise ConfigError("--lock-text-freeze-layer-norm has an effect only with --lock-text; add it")
