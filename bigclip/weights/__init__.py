"""Model weights beyond the training checkpoint: `--pretrained` (files, URIs, OpenCLIP's tags and
hf-hub models: named.py), readers for every weight source (DCP checkpoints, safetensors, torch
files), and streaming consolidation into safetensors.
May import engines (the Engine interface), checkpoint, storage, models; registry only lazily.
"""
