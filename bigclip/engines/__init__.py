"""Sharding engines behind one interface: torch FSDP2 and DeepSpeed ZeRO."""
