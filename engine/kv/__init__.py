"""Paged KV-cache bookkeeping: the block pool, hashing and the per-request manager.
Pure Python: no tensors here, only block ids."""
