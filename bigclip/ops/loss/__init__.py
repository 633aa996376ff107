"""Contrastive losses across the data-parallel group: the chunked CLIP/SigLIP loss (exact, memory
flat in the global batch), its row exchanges (ring, all-gather), input checks and baselines.
Knows only features, logit_scale/bias and a process group; imports config and errors.
"""
