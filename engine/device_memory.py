"""Sizing the KV pool on a GPU, as vLLM does: run one forward at the token budget, measure, and
give the KV cache what is left of `gpu_memory_utilization` of the device.

    KV bytes = utilization * total - weights - activation peak - non-torch memory

weights: what torch holds after loading; activation peak: the most the profiling forward
allocated on top of that (its own small KV pool excluded); non-torch memory: what the device uses
outside torch's allocator (CUDA context, cuBLAS workspaces, NCCL buffers) = used - reserved."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.kv.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaModel
from engine.request import make_request
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

GiB = 1 << 30


class InsufficientMemoryError(ValueError):
    """The device cannot hold the weights, or not one request of max_model_len."""


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total: int
    weights: int
    activation_peak: int
    non_torch: int
    kv_budget: int  # bytes the KV pool may take

    def log_lines(self, utilization: float) -> list[str]:
        def g(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        return [
            f"device memory {g(self.total)} x utilization {utilization} = "
            f"{g(int(self.total * utilization))}",
            f"  weights {g(self.weights)}, activation peak {g(self.activation_peak)}, "
            f"non-torch {g(self.non_torch)}",
            f"  KV cache {g(self.kv_budget)}",
        ]


def profile_gpu_memory(
    model: LlamaModel,
    device: torch.device,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> MemoryProfile:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    temp_kv = _profile_forward(
        model, max_num_batched_tokens, max_num_seqs, max_model_len, block_size
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - temp_kv
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    budget = int(utilization * total) - weights - peak - non_torch
    profile = MemoryProfile(total, weights, peak, non_torch, budget)
    for line in profile.log_lines(utilization):
        log.info("%s", line)
    if budget <= 0:
        raise InsufficientMemoryError(
            f"no memory left for the KV cache: weights {weights / GiB:.2f} GiB + activations "
            f"{peak / GiB:.2f} GiB + non-torch {non_torch / GiB:.2f} GiB exceed "
            f"{utilization} x {total / GiB:.2f} GiB; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or use a smaller dtype or model"
        )
    return profile


def _profile_forward(
    model: LlamaModel,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """One forward of max_num_batched_tokens prompt tokens over up to max_num_seqs requests,
    each sampling (so the LM head runs for as many rows as a step can have); returns the bytes of
    its temporary KV pool, which the caller subtracts from the peak."""
    lengths = _split(max_num_batched_tokens, max_num_seqs, max_model_len - 1)
    blocks = sum(-(-n // block_size) for n in lengths)
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=False)
    runner = ModelRunner(model, blocks, block_size)
    scheduled = []
    for i, n in enumerate(lengths):
        request = make_request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1), 1, 0.0, i)
        assert kv.allocate_slots(request, n)
        scheduled.append(ScheduledRequest(request, n, block_ids=kv.block_ids(request.request_id)))
    runner.execute(SchedulerOutput(scheduled))
    cfg = model.config
    temp = 2 * cfg.num_layers * blocks * block_size * model.num_kv_heads * cfg.head_dim
    return temp * model.dtype.itemsize


def _split(tokens: int, max_seqs: int, max_len: int) -> list[int]:
    """tokens as up to max_seqs prompts of at most max_len each (as even as possible)."""
    count = min(max_seqs, tokens)
    count = max(count, -(-tokens // max_len))
    base, extra = divmod(tokens, count)
    return [min(max_len, base + (i < extra)) for i in range(count)]


def check_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """One request of max_model_len must fit in the pool, or the engine could never serve it."""
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise InsufficientMemoryError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer "
            f"than max_model_len {max_model_len}: set max_model_len to at most {capacity}, or "
            "raise gpu_memory_utilization"
        )
