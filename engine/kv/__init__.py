"""Paged KV cache: the block pool (ref counts, LRU free queue, prefix hashes) and its manager."""
