"""Published, immutable checkpoints: `bigclip publish`, `bigclip checkpoints list|show|verify|rm`,
the sources a publish copies, and leases that keep a name in use from being removed.
An offline tool: may import weights, checkpoint and storage; training imports it only lazily.
"""
