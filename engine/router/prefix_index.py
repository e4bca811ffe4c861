"""What the router believes each replica's prefix cache holds: per replica, the block hashes of
the prompts it was sent, least recently used first out beyond a capacity. It is an estimate
(the replica evicts by its own pressure), and only needs to be good enough to send a paper's
review where its summary went; llm-d's prefix-cache scorer and SGLang's cache-aware router keep
the same kind of shadow."""

from __future__ import annotations

from collections import OrderedDict

# 65,536 blocks of 64 characters: about a million tokens per replica, a large GPU's KV pool.
DEFAULT_CAPACITY_BLOCKS = 65_536


class PrefixIndex:
    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the prefix index needs room for a block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, replica: str, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` the replica is believed to hold."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        for i, h in enumerate(hashes):
            if h not in held:
                return i
        return len(hashes)

    def insert(self, replica: str, hashes: list[bytes]) -> None:
        """The replica was sent a prompt with these blocks: it holds them now."""
        held = self._blocks.setdefault(replica, OrderedDict())
        # Last block first, so that a prompt's first blocks are the most recent and outlive its
        # tail, as a cache keeps shared roots longer than the leaves below them.
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def forget(self, replica: str) -> None:
        """The replica left (or restarted with an empty cache)."""
        self._blocks.pop(replica, None)
