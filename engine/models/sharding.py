"""Which slice of each checkpoint tensor a tensor-parallel rank holds.

Query heads, the MLP's intermediate width and the vocabulary are split evenly across ranks. KV
heads are split too when there are at least as many as ranks; with fewer (GQA with 2 KV heads on
4 ranks), each KV head is replicated on size / num_kv_heads consecutive ranks, which keeps every
rank's query heads next to the KV head they attend to (vLLM's rule). The vocabulary is padded to
a multiple of the size: the last rank's padding rows are zero and their logits are dropped.
Norm weights are whole on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelLoadError
from engine.models.model_config import ModelConfig

# A tensor's slice: (dimension, start, stop) of the checkpoint's [out, in] layout.
Slice = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        cfg, n = self.config, self.size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel size of {n}")
        if cfg.num_heads % n:
            raise ModelLoadError(
                f"tensor_parallel_size {n} does not divide the model's {cfg.num_heads} "
                f"attention heads; choose a divisor of {cfg.num_heads}"
            )
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ModelLoadError(
                f"tensor_parallel_size {n} and the model's {cfg.num_kv_heads} KV heads: one must "
                "divide the other"
            )
        if cfg.intermediate_size % n:
            raise ModelLoadError(
                f"tensor_parallel_size {n} does not divide the MLP width {cfg.intermediate_size}"
            )

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def _kv_head_start(self) -> int:
        cfg, n = self.config, self.size
        if cfg.num_kv_heads >= n:
            return self.rank * self.num_kv_heads
        return self.rank // (n // cfg.num_kv_heads)

    def slice_for(self, name: str) -> Slice | None:
        """This rank's slice of tensor `name`, or None when every rank holds all of it."""
        if self.size == 1:
            return None
        cfg, d = self.config, self.config.head_dim
        inter = cfg.intermediate_size // self.size
        q = (self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)
        kv_start = self._kv_head_start() * d
        kv = (kv_start, kv_start + self.num_kv_heads * d)
        vocab = (self.vocab_start, min(cfg.vocab_size, self.vocab_start + self.vocab_per_rank))
        rules = {
            "self_attn.q_proj.weight": (0, *q),
            "self_attn.q_proj.bias": (0, *q),
            "self_attn.k_proj.weight": (0, *kv),
            "self_attn.k_proj.bias": (0, *kv),
            "self_attn.v_proj.weight": (0, *kv),
            "self_attn.v_proj.bias": (0, *kv),
            "self_attn.o_proj.weight": (1, *q),
            "mlp.gate_proj.weight": (0, self.rank * inter, (self.rank + 1) * inter),
            "mlp.up_proj.weight": (0, self.rank * inter, (self.rank + 1) * inter),
            "mlp.down_proj.weight": (1, self.rank * inter, (self.rank + 1) * inter),
            "embed_tokens.weight": (0, *vocab),
            "lm_head.weight": (0, *vocab),
        }
        for suffix, rule in rules.items():
            if name.endswith(suffix):
                return rule
        return None

    def padded_rows(self, name: str) -> int | None:
        """The row count a vocabulary shard is padded to (the last rank's may be short)."""
        if self.size > 1 and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self.vocab_per_rank
        return None
