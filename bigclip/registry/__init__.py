"""Published, immutable checkpoints: `bigclip publish`, `bigclip checkpoints list|show|verify|rm|gc`,
the content-addressed blob store names share, the sources a publish copies (local, S3, HTTP,
archives, git, fsspec), and leases that keep a name in use from being removed.
An offline tool: may import weights, checkpoint and storage; training imports it only lazily.
"""
