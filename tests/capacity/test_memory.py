import pytest

from capacity.gpus import find_gpu
from capacity.memory import (
    CUDA_CONTEXT_BYTES,
    CUDA_GRAPH_BYTES_PER_LAYER,
    GIB,
    MIB,
    NCCL_NVLINK_BYTES,
    NON_TORCH_BYTES,
    MemoryPlanError,
    activation_peak_bytes,
    kv_bytes_per_token,
    overhead_bytes,
    overheads,
    plan_memory,
    weight_bytes,
)
from capacity.model_specs import ModelSpec, ModelSpecError, find_model, load_model_spec
from engine.model_fetch import default_model_dir, is_converted

LLAMA_8B = find_model("Llama-3.1-8B")
LLAMA_70B = find_model("Llama-3.1-70B")

# 2 layers, hidden 256, 4 heads x 64, 2 KV heads, MLP 512, vocab 1000, untied. Per layer the
# matrices (in, out) are q (256, 256), k (256, 128), v (256, 128), o (256, 256), gate (256, 512),
# up (256, 512), down (512, 256): 589,824 weights; 1,179,648 over both layers. Everything else:
# embedding 256,000 + lm_head 256,000 + 2 x 2 RMSNorms of 256 + final norm 256 = 513,280.
TINY = ModelSpec("tiny", 2, 256, 4, 2, 64, 512, 1000, False, 512)


def test_kv_bytes_per_token():
    # 2 (K and V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes
    assert kv_bytes_per_token(LLAMA_8B, "bf16") == 131_072
    assert kv_bytes_per_token(LLAMA_8B, "fp8") == 65_536
    assert kv_bytes_per_token(LLAMA_8B, "int8") == 65_536
    assert kv_bytes_per_token(LLAMA_8B, "fp8_e5m2") == 65_536
    assert kv_bytes_per_token(LLAMA_8B, "float32") == 262_144
    assert kv_bytes_per_token(LLAMA_8B, "bf16", tp=2) == 65_536  # 4 KV heads per GPU
    # tp=16 > 8 KV heads: each GPU keeps one (replicated) head, not half of one
    assert kv_bytes_per_token(LLAMA_8B, "bf16", tp=16) == 2 * 32 * 1 * 128 * 2


def test_weight_bytes_by_dtype():
    assert weight_bytes(TINY, "bf16") == (1_179_648 + 513_280) * 2 == 3_385_856
    assert weight_bytes(TINY, "fp16") == 3_385_856
    assert weight_bytes(TINY, "fp32") == (1_179_648 + 513_280) * 4
    # fp8: 1 byte per linear weight + a float32 scale per output channel
    # (256 + 128 + 128 + 256 + 512 + 512 + 256 = 2048 per layer); the rest in bf16.
    assert weight_bytes(TINY, "fp8") == 1_179_648 + 2 * 2048 * 4 + 513_280 * 2 == 2_222_592
    assert weight_bytes(TINY, "int8") == weight_bytes(TINY, "fp8")
    # int4: half a byte per linear weight = 589,824; groups of 128 inputs per output channel:
    # q 2x256 + k 2x128 + v 2x128 + o 2x256 + gate 2x512 + up 2x512 + down 4x256 = 4608 per
    # layer, 9216 in all, each a 16-bit scale + 4-bit zero = 20 bits: 23,040 bytes; rest bf16.
    assert weight_bytes(TINY, "int4") == 589_824 + 23_040 + 513_280 * 2 == 1_639_424
    assert weight_bytes(LLAMA_8B, "bf16") == 2 * 8_030_261_248
    with pytest.raises(MemoryPlanError, match="unknown dtype 'int3'"):
        weight_bytes(TINY, "int3")


def test_activation_peak():
    # T = 64 tokens, 8 sampled rows, bf16. The layer: stream 3 x 64 x 256 = 49,152; attention
    # 64 x (2 x 256 + 2 x 128) = 49,152; MLP 3 x 64 x 512 = 98,304 (the larger);
    # (49,152 + 98,304) x 2 bytes = 294,912. The sampler: hidden 64 x 256 x 2 = 32,768 + logits
    # 8 x 1000 x (2 + 3 x 4) = 112,000 -> 144,768. The peak is the layer's.
    assert activation_peak_bytes(TINY, 64, 8, "bf16") == 294_912
    # Sampled rows never exceed the tokens of the step: 4 rows. The layer: (3 x 4 x 256 +
    # 3 x 4 x 512) x 2 = 18,432; the sampler: 4 x 256 x 2 + 4 x 1000 x 14 = 58,048, the peak.
    assert activation_peak_bytes(TINY, 4, 256, "bf16") == 58_048
    # int4 weights still compute in bf16
    assert activation_peak_bytes(TINY, 64, 8, "int4") == activation_peak_bytes(TINY, 64, 8)


def test_activation_peak_as_vllm_logged_it():
    """Llama-3.1-8B: vLLM logged 2.07 GiB at 20,000 batched tokens (V0, 256 sequences; vllm
    issue #10517), where the layer's peak is the larger, and 1.89 GiB at 8,192 tokens and 1,024
    sequences (vLLM 0.19, llm-d), where the sampler's is: -6%, the sampler's scratch beyond its
    float32 copies not counted."""
    assert activation_peak_bytes(LLAMA_8B, 20_000, 256) / GIB == pytest.approx(2.07, abs=0.02)
    assert activation_peak_bytes(LLAMA_8B, 8192, 1024) / GIB == pytest.approx(1.89, rel=0.07)


def test_llama_8b_on_a_24gb_card():
    """An RTX 4090: 23.52 GiB to CUDA (24,084 MiB), not the datasheet's 24 GB read as GiB."""
    plan = plan_memory(
        LLAMA_8B,
        find_gpu("4090").memory_bytes,
        dtype="bf16",
        utilization=0.9,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        max_model_len=8192,
    )
    # budget      = floor(0.9 x 24,084 x 2^20 = 0.9 x 25,253,904,384)    = 22,728,513,945
    # weights     = 8,030,261,248 params x 2                              = 16,060,522,496
    # activations = the sampler's: hidden 2048 x 4096 x 2 = 16,777,216
    #               + logits 256 x 128,256 x (2 + 3 x 4) = 459,669,504     =    476,446,720
    #               (the layer's (3 x 2048 x 4096 + 3 x 2048 x 14336) x 2 = 226,492,416)
    # overhead    = non-torch 0.25 GiB 268,435,456 + CUDA graphs 32 layers x 28 MiB
    #               939,524,096 (tp=1: no NCCL)                          =  1,207,959,552
    # KV pool     = 22,728,513,945 - 16,060,522,496 - 476,446,720 - 1,207,959,552
    #             = 4,983,585,177 bytes
    # block       = 16 tokens x 131,072 = 2,097,152 bytes -> floor(2376.3) = 2376 blocks
    assert plan.budget_bytes == 22_728_513_945
    assert plan.weight_bytes == 16_060_522_496
    assert plan.activation_bytes == 476_446_720
    assert plan.overhead_bytes == 1_207_959_552
    assert plan.overheads.cuda_graph_bytes == 32 * CUDA_GRAPH_BYTES_PER_LAYER
    assert plan.bytes_per_block == 2_097_152
    assert plan.num_blocks == 2376
    assert plan.num_tokens == 38_016
    assert plan.kv_bytes == 2376 * 2_097_152
    assert plan.warnings == ()  # 2.35 GiB beside the budget
    # p50 / p90 / p99 request lengths (input + output): 1000 -> 63 blocks, 4096 -> 256, 8192 -> 512
    assert [plan.max_concurrent(n) for n in (1000, 4096, 8192)] == [37, 9, 4]


def test_tensor_parallel_splits_weights_kv_and_activations():
    one = 80 * GIB
    kwargs = dict(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=32768)
    plan = plan_memory(LLAMA_70B, one, tp=4, **kwargs)
    # Matrices, embedding and lm_head split four ways (vocab 128,256 = 4 x 32,064); the RMSNorms
    # (80 layers x 2 x 8192 + final 8192 = 1,318,912) are replicated.
    norms = 80 * 2 * 8192 + 8192
    assert plan.weight_bytes == (70_553_706_496 - norms) // 4 * 2 + norms * 2
    assert plan.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # 8 KV heads / 4
    graphs = 80 * CUDA_GRAPH_BYTES_PER_LAYER
    assert plan.overhead_bytes == NON_TORCH_BYTES + NCCL_NVLINK_BYTES + graphs
    one_gpu = activation_peak_bytes(LLAMA_70B, 8192, 256)
    assert plan.activation_bytes < one_gpu
    replicated = plan_memory(LLAMA_70B, one, tp=16, **kwargs)
    assert replicated.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    with pytest.raises(ModelSpecError, match="tp=3"):
        plan_memory(LLAMA_70B, one, tp=3, **kwargs)


def test_weights_that_do_not_fit():
    with pytest.raises(MemoryPlanError, match=r"weights take 131\.4\d GiB .* 0\.9 x 80\.00"):
        plan_memory(LLAMA_70B, 80 * GIB, max_num_batched_tokens=2048, max_num_seqs=256)
    # On 18 GiB, Llama-3.1-8B's 14.96 GiB of weights fit the 16.2 GiB budget, but activations
    # (0.44 GiB) and overhead (1.13 GiB) take the rest.
    with pytest.raises(MemoryPlanError, match="no memory left for the KV cache"):
        plan_memory(LLAMA_8B, 18 * GIB, max_num_batched_tokens=2048, max_num_seqs=256)
    # A fixed pool (kv_cache_memory) ignores utilization, but the whole must fit the GPU.
    with pytest.raises(MemoryPlanError, match="KV pool take 20.53 GiB .* 20.00 GiB"):
        plan_memory(
            LLAMA_8B, 20 * GIB, kv_cache_memory=4 * GIB, max_num_batched_tokens=2048,
            max_num_seqs=256, max_model_len=8192,
        )  # fmt: skip


def test_max_model_len_that_does_not_fit():
    with pytest.raises(MemoryPlanError, match=r"max_model_len 131072 needs 8192 KV blocks .* 2376"):
        plan_memory(
            LLAMA_8B, find_gpu("4090").memory_bytes, max_num_batched_tokens=2048, max_num_seqs=256
        )
    with pytest.raises(MemoryPlanError, match="exceeds .* max_position_embeddings 131072"):
        plan_memory(
            LLAMA_8B, 80 * GIB, max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=200_000
        )


def test_headroom_for_the_cuda_context():
    """vLLM needs the free memory at startup (total less the CUDA context) to hold the budget.
    Nothing beside the budget never does: refused. Less than the H100's 0.51 GiB context may
    not: planned, with a warning (vLLM 0.7 ran 2x RTX 4090 at 0.98, 0.47 GiB beside it)."""
    args = dict(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192)
    with pytest.raises(MemoryPlanError, match="utilization 1 leaves nothing beside the budget"):
        plan_memory(LLAMA_8B, find_gpu("4090").memory_bytes, utilization=1.0, **args)
    tight = plan_memory(LLAMA_8B, find_gpu("4090").memory_bytes, utilization=0.98, **args)
    assert tight.num_blocks > 0 and len(tight.warnings) == 1
    assert "leaves 0.47 GiB beside the budget" in tight.warnings[0]
    assert "Free memory on device" in tight.warnings[0]
    assert tight.cuda_context_bytes == CUDA_CONTEXT_BYTES == round(0.51 * GIB)


def test_overhead_switches():
    """Non-torch memory always; NCCL buffers with tp > 1 over NVLink only (PCIe adds none:
    2x RTX 4090 logged 0.25 GiB in all); CUDA graphs per layer unless eager or vLLM <= 0.20."""
    assert overhead_bytes(LLAMA_8B, 1, cuda_graphs=False) == NON_TORCH_BYTES == 256 * MIB
    graphs = 32 * CUDA_GRAPH_BYTES_PER_LAYER
    assert overhead_bytes(LLAMA_8B, 2) == NON_TORCH_BYTES + NCCL_NVLINK_BYTES + graphs
    assert overhead_bytes(LLAMA_8B, 2, nvlink=False) == NON_TORCH_BYTES + graphs
    items = overheads(LLAMA_70B, 4)
    assert (items.non_torch_bytes, items.nccl_bytes) == (NON_TORCH_BYTES, NCCL_NVLINK_BYTES)
    assert items.cuda_graph_bytes == 80 * 28 * MIB
    assert NCCL_NVLINK_BYTES == round(1.85 * GIB)


def _engine_blocks(model_dir, kv_cache_memory: int) -> int:
    from engine.config import EngineConfig
    from engine.engine_builder import build_engine_core

    config = EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=kv_cache_memory)
    return build_engine_core(config, model_dir).num_blocks


def _planner_blocks(model_dir, kv_cache_memory: int) -> int:
    plan = plan_memory(
        load_model_spec(model_dir),
        64 * GIB,
        dtype="fp32",  # the engine's dtype on CPU
        kv_cache_memory=kv_cache_memory,
        max_num_batched_tokens=1024,
        max_num_seqs=64,
        max_model_len=256,
    )
    return plan.num_blocks


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.engine.tiny_models import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.mark.parametrize("budget", [300_000, 1 << 20, 12_345_678])
def test_planner_blocks_equal_engine_blocks_tiny_model(tiny_qwen2, budget):
    # 2 layers x 2 KV heads x head_dim 16: 2 x 2 x 2 x 16 x 4 bytes = 512 bytes per token in fp32
    assert _planner_blocks(tiny_qwen2, budget) == _engine_blocks(tiny_qwen2, budget)


@pytest.mark.parametrize("budget", [123_456_789])
def test_planner_blocks_equal_engine_blocks_default_model(budget):
    folder = default_model_dir()
    if not is_converted(folder):
        pytest.skip("default model not fetched")
    assert _planner_blocks(folder, budget) == _engine_blocks(folder, budget)
