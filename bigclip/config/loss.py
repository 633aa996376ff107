"""The contrastive loss and how it sees other ranks' features."""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.config.fields import LOSS_EXCHANGES, LOSSES, opt
from bigclip.errors import ConfigError


@dataclass
class LossConfig:
    loss: str = opt("clip", "Contrastive loss: CLIP softmax or SigLIP sigmoid.", choices=LOSSES)
    siglip: bool = opt(False, "OpenCLIP's switch for --loss siglip.")
    local_loss: bool = opt(False, "Logits of local features against global ones only (OpenCLIP semantics).")
    gather_with_grad: bool = opt(False, "All-gather features with gradients (OpenCLIP semantics).")
    loss_chunk_size: int = opt(
        0,
        "Compute the loss exactly in tiles of this many rows x columns (0: unchunked OpenCLIP loss). "
        "Per-rank loss memory is then O(local batch x (chunk + embed dim)), flat in the world size.",
    )
    loss_exchange: str = opt(
        "ring",
        "How the chunked loss sees other ranks' features: 'ring' (chunks passed to the neighbour, "
        "flat memory) or 'allgather' (all features gathered, memory grows with the global batch).",
        choices=LOSS_EXCHANGES,
    )

    def validate(self) -> None:
        if self.siglip:
            self.loss = "siglip"
        if self.loss_chunk_size < 0:
            raise ConfigError(
                f"--loss-chunk-size must be 0 (unchunked) or positive, got {self.loss_chunk_size}"
            )
        if self.loss not in LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.loss_exchange not in LOSS_EXCHANGES:
            raise ConfigError(
                f"--loss-exchange must be one of {', '.join(LOSS_EXCHANGES)}, got {self.loss_exchange!r}"
            )
