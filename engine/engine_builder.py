"""Building an engine: load the model where it runs, size the KV cache, start the executor, and
hand EngineCore its parts. EngineCore only steps; everything that depends on weights and device
memory happens here once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from engine.attention.kv_quant import kv_cache_format
from engine.config import EngineConfig
from engine.cpu_threads import configure_threads
from engine.device_memory import MemoryProfile, check_fits, profile_gpu_memory
from engine.distributed.rendezvous import Rendezvous, env_rendezvous, join_timeout
from engine.engine_core import EngineCore
from engine.executor import Executor
from engine.executor.uniproc import UniprocExecutor
from engine.kv.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaModel
from engine.models.loader import load_model, resolve_device, resolve_dtype, resolve_kernels
from engine.models.model_config import ModelConfig, load_model_config
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerConfig
from engine.spec.proposer import build_proposer

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and how the model runs: what every rank (or the single process) loads it with."""

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    kernels: str
    quantization: str | None = None  # int8, int4, fp8: the float checkpoint quantized at load
    quant_group_size: int = 32


def build_engine_core(
    config: EngineConfig,
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> EngineCore:
    """tokenizer: only for structured output (grammars are compiled against it) and for
    checking a draft model's."""
    model_config = load_model_config(model_dir)
    placement = place(config, model_dir, model_config)
    device = placement.device
    executor = build_executor(config, placement)
    try:
        kv = KVCacheManager(executor.num_blocks, config.block_size, config.enable_prefix_caching)
        # A draft model writes its guesses' K/V after the step: the scheduler reserves them.
        lookahead = config.num_speculative_tokens if config.speculative == "draft" else 0
        scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                placement.max_model_len,
                lookahead,
            ),
            kv,
        )
        core = EngineCore(
            scheduler,
            executor,
            Sampler(),
            None,
            time.time,
            config=config,
            vocab_size=model_config.vocab_size,
            eos_token_ids=model_config.eos_token_ids,
            max_model_len=placement.max_model_len,
            device=device,
            hidden_size=model_config.hidden_size,
            tokenizer=tokenizer,
        )
        core.proposer = build_proposer(config, core, placement)
    except BaseException:
        executor.shutdown()
        raise
    logger.info(
        "engine: %s on %s/%s (%s kernels, tensor parallel %d), %d KV blocks x %d tokens "
        "(kv_cache_dtype %s: %s), max_model_len %d",
        model_dir,
        device,
        placement.dtype,
        placement.kernels,
        config.tensor_parallel_size,
        executor.num_blocks,
        config.block_size,
        config.kv_cache_dtype,
        kv_cache_format(config.kv_cache_dtype, placement.dtype).describe(),
        placement.max_model_len,
    )
    return core


def place(config: EngineConfig, model_dir: Path, model_config: ModelConfig) -> Placement:
    config.validate()
    configure_threads(config.num_threads)  # logs the count and where it came from
    device = resolve_device(config.device)
    return Placement(
        model_dir,
        device,
        resolve_dtype(config.dtype, device),
        resolve_max_model_len(config, model_config),
        resolve_kernels(config.attention_backend, device),
        None if config.quantization == "none" else config.quantization,
        config.quant_group_size,
    )


def run_tensor_parallel_worker(config: EngineConfig, rv: Rendezvous) -> None:
    """This process is rank rv.rank > 0 of an env:// rendezvous: load its shard and run rank
    0's steps until rank 0 shuts down."""
    from engine.executor.worker import run_worker
    from engine.model_fetch import resolve_model

    model_dir = resolve_model(config.model)
    placement = place(config, model_dir, load_model_config(model_dir))
    logger.info("tensor-parallel rank %d of %d: joining %s:%d", rv.rank, rv.size, rv.host, rv.port)
    run_worker(config, placement, rv, join_timeout())


def build_executor(config: EngineConfig, placement: Placement) -> Executor:
    env_rendezvous(config.tensor_parallel_size)  # WORLD_SIZE=2 with one rank: refused
    if config.tensor_parallel_size > 1:
        from engine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, placement)
    model = load_model(
        placement.model_dir,
        placement.dtype,
        placement.device,
        placement.max_model_len,
        placement.kernels,
        quantization=placement.quantization,
        group_size=placement.quant_group_size,
    )
    num_blocks, _ = kv_blocks(config, model, placement)
    executor = UniprocExecutor(model, num_blocks, config.block_size, config.kv_cache_dtype)
    if capture_graphs(config, placement):
        executor.runner.capture_cuda_graphs(placement.max_model_len, config.max_num_seqs)
    return executor


def capture_graphs(config: EngineConfig, placement: Placement) -> bool:
    return (
        placement.device.type == "cuda"
        and placement.kernels == "triton"
        and not config.enforce_eager
        and config.tensor_parallel_size == 1
    )


def kv_blocks(
    config: EngineConfig, model: LlamaModel, placement: Placement
) -> tuple[int, MemoryProfile | None]:
    """The KV pool's size in blocks for this rank's model (its KV heads), and on a GPU sized by
    profiling, the memory profile it came from."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, None
    bytes_per_block = kv_bytes_per_block(config, model, placement)
    budget = config.kv_cache_memory
    if budget is None and placement.device.type == "cuda":
        profile = profile_gpu_memory(
            model,
            placement.device,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            placement.max_model_len,
            config.block_size,
        )
        blocks = profile.kv_budget // bytes_per_block
        check_fits(blocks, config.block_size, placement.max_model_len)
        return int(blocks), profile
    if budget is None:
        wanted = (
            config.max_num_seqs * placement.max_model_len // config.block_size * bytes_per_block
        )
        budget = min(_DEFAULT_CPU_KV_BYTES, wanted)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds no KV block ({bytes_per_block} bytes each)"
        )
    return int(blocks), None


def kv_bytes_per_block(config: EngineConfig, model: LlamaModel, placement: Placement) -> int:
    """One block of this rank's pool (its KV heads) in config.kv_cache_dtype, scales included;
    capacity.memory.kv_bytes_per_token(..., token_scales=True) models the same bytes."""
    fmt = kv_cache_format(config.kv_cache_dtype, placement.dtype)
    per_token = fmt.bytes_per_token(
        model.config.num_layers, model.num_kv_heads, model.config.head_dim
    )
    # A draft model keeps K/V for the same blocks, in the same format: a block costs both.
    if config.speculative == "draft":
        from engine.model_fetch import resolve_model

        draft = load_model_config(resolve_model(config.draft_model))
        per_token += fmt.bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim)
    return config.block_size * per_token


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    # Without sliding-window attention, full attention equals it only up to the window.
    if model_config.sliding_window:
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens"
        )
    return config.max_model_len
