"""Engine configuration: what the caller sets, before the model and memory are known."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

QUANTIZATIONS = (None, "none", "int8", "int4", "fp8")
# The KV pool's formats (engine/attention/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp8", "int8")


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on a GPU
    device: str = "auto"  # auto: cuda when present, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact pool size; else from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; default below
    # On a GPU without num_kv_blocks / kv_cache_memory: the fraction of device memory the engine
    # may use; the KV pool gets what weights, the activation peak and non-torch memory leave.
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped
    enable_prefix_caching: bool = True
    seed: int = 0
    profile_path: Path | None = None  # step profiler: one JSON line per step when set
    # torch CPU threads; None: OMP_NUM_THREADS when set, else the physical cores this process
    # may use (affinity, cgroup quota; engine/cpu_threads.py)
    num_threads: int | None = None
    # auto (cuda: triton, cpu: torch), torch, cpu (torch with fused C kernels; opt-in), triton
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # Speculative decoding (engine/spec/): None, "ngram" (prompt lookup) or "draft" (a smaller
    # model with the same tokenizer, at draft_model). Each step proposes up to
    # num_speculative_tokens per decoding request and the target verifies them in one forward.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    # n-gram proposer: the longest suffix of n tokens, prompt_lookup_max >= n >= prompt_lookup_min,
    # that occurred earlier in the request proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Tensor parallelism (engine/executor/multiproc.py): the model split over this many ranks,
    # worker processes started here, or, when the environment names a torchrun-style rendezvous
    # (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), ranks joined from wherever they run.
    tensor_parallel_size: int = 1
    # Weight quantization (engine/quant/): None keeps what the checkpoint holds (a float folder
    # runs in `dtype`, a quantized one in its own format); "int8" (per output channel), "int4"
    # (groups of quant_group_size input elements) or "fp8" quantize a float checkpoint at load.
    quantization: str | None = None
    quant_group_size: int = 32
    # The KV pool's elements (engine/attention/kv_quant.py): auto, the model's dtype; fp8
    # (e4m3) or int8, one byte each plus a float32 scale per token and KV head: nearly twice the
    # blocks of a bf16 pool in the same memory (1.9x at head_dim 64; 3.8x float32's, on CPU).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.profile_path is not None:
            self.profile_path = Path(self.profile_path)

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, cpu or triton, "
                f"not {self.attention_backend!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        self._validate_speculative()
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)}, "
                f"not {self.quantization!r}"
            )
        if self.quant_group_size not in (32, 64, 128):
            raise ValueError(f"quant_group_size must be 32, 64 or 128, got {self.quant_group_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"not {self.kv_cache_dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def _validate_speculative(self) -> None:
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be ngram or draft, not {self.speculative!r}")
        if self.speculative is None:
            if self.draft_model is not None:
                raise ValueError("draft_model is set but speculative is not 'draft'")
            return
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative='draft' needs draft_model (a model folder)")
        if self.speculative == "ngram" and self.draft_model is not None:
            raise ValueError("draft_model is only used with speculative='draft'")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
