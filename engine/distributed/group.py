"""The tensor-parallel group a model shard computes in, and the two collectives it needs.

Megatron's layout: a column-parallel projection (q|k|v, gate|up) leaves each rank with its share
of heads or of the intermediate width, and the row-parallel projection after it (o, down) gives a
partial sum that one all-reduce completes. The vocabulary is split too: the embedding lookup of a
token another rank owns is zero here and the all-reduce fills it in; the LM head's logits are
gathered. With one rank every collective is the identity, so the single-device path is the same
code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # The process group the model's collectives run in (NCCL on CUDA, gloo on CPU), None with
    # one rank. Engine-owned and never registered as torch.distributed's default group, so
    # several engines (one after another in a test, or beside a user's own group) never clash.
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.size == 1:
            return x
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
