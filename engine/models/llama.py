"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

The forward takes all of a step's tokens as one sequence [T] (no padding); attention is the only
place where requests are told apart, through AttentionMetadata. Projections are fused (q|k|v and
gate|up) so that each layer runs four large matmuls instead of seven (engine/models/linear.py
picks the fastest kernel for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.kv_quant import LayerKVCache
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import SINGLE, TensorParallel
from engine.errors import ModelLoadError
from engine.kernels.cpu_decode import DecodeStep
from engine.models.linear import linear
from engine.models.model_config import ModelConfig
from engine.models.ops import make_ops
from engine.models.rotary import cos_sin_cache
from engine.models.sharding import ShardPlan


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused kernel: one pass instead of six ops, and bit-identical to HF's float32 formula
    # (normalize in float32, then scale). Half precision is normalized in float32, as HF does.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        backend: AttentionBackend | None = None,
        ops: str = "torch",
        tp: TensorParallel = SINGLE,
        plan: ShardPlan | None = None,
    ) -> None:
        """weights: the checkpoint's tensors, or with tensor parallelism this rank's slices of
        them (plan says which)."""
        self.config = config
        self.tp = tp
        plan = plan or ShardPlan(config, tp.rank, tp.size)
        # This rank's heads; the whole model's with one rank.
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.vocab_start, self.vocab_per_rank = plan.vocab_start, plan.vocab_per_rank
        self.backend = backend or TorchAttentionBackend()
        self.ops = make_ops(ops)
        self.scale = config.head_dim**-0.5
        self.embed = _take(weights, "model.embed_tokens.weight")
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        self.norm = _take(weights, "model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = _take(weights, "lm_head.weight")
        device = self.norm.device
        self.cos_sin = (
            cos_sin_cache(config.rope, config.head_dim, max_positions).to(device).contiguous()
        )
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        # A decode step as one compiled call where the model is int4 on the CPU (None: layer
        # by layer below). Set by the loader once the weights are final (quantized).
        self.decode_step: DecodeStep | None = None

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv = cat_rows([_take(w, p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        gate_up = cat_rows(
            [_take(w, p + "mlp.gate_proj.weight"), _take(w, p + "mlp.up_proj.weight")]
        )
        bias = None
        if self.config.qkv_bias:
            bias = torch.cat([_take(w, p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        return LayerWeights(
            input_norm=_take(w, p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            q_norm=_take(w, p + "self_attn.q_norm.weight") if self.config.qk_norm else None,
            k_norm=_take(w, p + "self_attn.k_norm.weight") if self.config.qk_norm else None,
            o_proj=_take(w, p + "self_attn.o_proj.weight"),
            post_norm=_take(w, p + "post_attention_layernorm.weight"),
            gate_up=gate_up,
            down=_take(w, p + "mlp.down_proj.weight"),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype  # the activations' (weights may be quantized)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        cfg, ops = self.config, self.ops
        hidden = self._embed(input_ids)
        if self.decode_step is not None:
            out = self.decode_step.run(hidden, positions, kv_caches, meta)
            if out is not None:
                return out
        rotary = ops.rotary_inputs(positions, self.cos_sin, self.dtype)
        residual = hidden
        for i, layer in enumerate(self.layers):
            if i == 0:
                hidden = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                hidden, residual = ops.add_rms_norm(
                    hidden, residual, layer.input_norm, cfg.rms_norm_eps
                )
            hidden = self._attention(hidden, layer, rotary, kv_caches[i], meta)
            hidden, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps)
            hidden = linear(ops.silu_and_mul(linear(hidden, layer.gate_up)), layer.down)
            hidden = self.tp.all_reduce(hidden)  # down is row-parallel: partial sums
        hidden, _ = ops.add_rms_norm(hidden, residual, self.norm, cfg.rms_norm_eps)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        # Vocab-parallel: rows of tokens another rank owns are zero here; the sum fills them.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        hidden = self._lookup(local.masked_fill(outside, 0))
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(ids, self.embed)
        return self.embed.rows(ids, self.dtype)  # a quantized table (a GGUF's Q8_0, say)

    def _attention(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if layer.q_norm is not None:
            q = self.ops.rms_norm(
                q.reshape(num_tokens, self.num_heads, cfg.head_dim), layer.q_norm, cfg.rms_norm_eps
            )
            k = self.ops.rms_norm(
                k.reshape(num_tokens, self.num_kv_heads, cfg.head_dim),
                layer.k_norm,
                cfg.rms_norm_eps,
            )
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, cfg.head_dim
            )
        # q and k heads rotate together: one rotary pass over [T, Hq + Hkv, D].
        qk = self.ops.rotary(qk, rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, cfg.head_dim)
        # An fp8/int8 pool carries its scales (engine/attention/kv_quant.py); else None.
        scales = kv_cache.scales
        self.backend.write_kv(k, v, kv_cache.k, kv_cache.v, meta, scales)
        out = self.backend.forward(q, kv_cache.k, kv_cache.v, meta, self.scale, kv_scales=scales)
        # o is row-parallel: each rank's heads give a partial sum.
        return self.tp.all_reduce(linear(out.view(num_tokens, self.q_size), layer.o_proj))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32; under tensor parallelism every rank must call it with the
        same rows (the vocabulary shards are gathered)."""
        logits = linear(hidden, self.lm_head).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.config.vocab_size]


def cat_rows(parts: list):
    """Weights stacked along the output dimension: tensors, or quantized weights of one kind."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ModelLoadError(f"cannot fuse projections stored in different formats ({names})")
    return kinds.pop().cat(parts)


def _add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def _take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
    return weights[name]
