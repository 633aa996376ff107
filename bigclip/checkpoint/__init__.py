"""Checkpoints: storage (local / S3), commit manifest, async save, resume, consolidation."""
