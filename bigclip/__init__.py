"""bigclip: train very large CLIP models on 1 to 1024 GPUs."""

__version__ = "0.1.0"
