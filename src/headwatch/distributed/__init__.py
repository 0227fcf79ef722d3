"""Reductions across processes and the resolution of sharded weights (FSDP1, FSDP2, DeepSpeed ZeRO)."""
