"""fp8 / int8 KV pools through the Triton kernels, against the torch backend on the same pools.

The write kernel must store exactly the codes and scales kv_quant.quantize_kv computes (on a GPU,
fp32 division may round differently: within one code step there); the attention kernels must
read the pool as the torch backend does after its gather and dequantize, within the float
tolerance of the dtype (both compute attention over the same dequantized values). As in
test_paged_attention, the Triton side gets scale pools (and fp8 codes) that are NaN outside the
requests' contexts, so a read past a context fails, and NaN-filled outputs. Under the
interpreter, so shapes are small (~20 s for the file).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.kv_quant import allocate_layer, kv_cache_format, quantize_kv
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kernels.kv_write import write_kv_cache
from tests.engine.kernels.test_paged_attention import (
    CUDA,
    DEVICE,
    TOL,
    _fields,
    build_meta,
    context_slots,
    model_like_qkv,
)

QUANTIZED = ["fp8", "int8"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_write_stores_the_reference_codes_and_scales(name):
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, num_kv_heads, head_dim = 5, 16, 3, 48  # neither a power of two
    fmt = kv_cache_format(name, torch.float32)
    pool = allocate_layer(fmt, num_blocks, bs, num_kv_heads, head_dim, torch.device(DEVICE))
    pool.k_scale.fill_(math.nan)
    pool.v_scale.fill_(math.nan)
    _, k, v = model_like_qkv(12, 4, num_kv_heads, head_dim, torch.float32)  # k: a strided view
    k = k * torch.logspace(-2, 2, 12, device=DEVICE)[:, None, None]  # rows of many ranges
    k[2, 1] = 0.0  # an all-zero row
    slots = torch.randperm(num_blocks * bs, generator=gen)[:12].to(DEVICE)
    slots[4] = -1  # padding: nothing stored
    write_kv_cache(k, v, pool.k, pool.v, slots, pool.scales)
    kept = slots >= 0
    for x, codes, scales in ((k, pool.k, pool.k_scale), (v, pool.v, pool.v_scale)):
        want_codes, want_scales = quantize_kv(x[kept], fmt.dtype)
        got_codes = codes.view(-1, num_kv_heads, head_dim)[slots[kept]]
        got_scales = scales.view(-1, num_kv_heads)[slots[kept]]
        torch.testing.assert_close(got_scales, want_scales, rtol=1e-6, atol=0)
        if CUDA:  # the GPU's fp32 division may round a code the other way
            step = want_scales[..., None] * (2**-3 if name == "fp8" else 1.0)
            got = got_codes.float() * got_scales[..., None]
            assert ((got - want_codes.float() * want_scales[..., None]).abs() <= step).all()
        else:
            assert torch.equal(got_codes.float(), want_codes.float())
        untouched = scales.view(-1, num_kv_heads).isnan().all(1).sum()
        assert untouched == num_blocks * bs - int(kept.sum())


# (requests as (cached_len, q_len), Hq, Hkv, head_dim, block_size, dtype, partition_size)
CASES = {
    "mixed-gqa-fp32-split": (
        [(37, 1), (80, 1), (5, 1), (30, 5), (0, 23), (40, 17)],
        4, 2, 64, 16, torch.float32, 32,
    ),
    "mixed-gqa3-fp16": (
        [(70, 1), (12, 1), (0, 25), (33, 14)],
        6, 2, 32, 32, torch.float16, 512,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_torch_on_a_quantized_pool(case, name):
    requests, num_heads, num_kv_heads, head_dim, bs, dtype, partition = CASES[case]
    seed = list(CASES).index(case)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    meta, num_blocks = build_meta(requests, bs, spare_blocks=2, gen=gen)
    num_tokens = meta.query_start_loc[-1]
    q, k, v = model_like_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    fmt = kv_cache_format(name, dtype)
    device = torch.device(DEVICE)
    # The cached context, quantized by the torch backend in an earlier "step".
    ref = allocate_layer(fmt, num_blocks, bs, num_kv_heads, head_dim, device)
    cached = context_slots(meta, "cached")
    past = [torch.randn(len(cached), num_kv_heads, head_dim, device=DEVICE).to(dtype) for _ in "kv"]
    past_meta = AttentionMetadata(**{**_fields(meta), "slot_mapping": cached})
    TorchAttentionBackend().write_kv(*past, ref.k, ref.v, past_meta, ref.scales)
    tri = _poisoned_copy(ref, cached)

    TorchAttentionBackend().write_kv(k, v, ref.k, ref.v, meta, ref.scales)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().forward(
        q, ref.k, ref.v, AttentionMetadata(**_fields(meta)), scale, kv_scales=ref.scales
    )
    backend = TritonAttentionBackend(partition_size=partition)
    backend.write_kv(k, v, tri.k, tri.v, meta, tri.scales)
    out = torch.full_like(q, math.nan)
    backend.forward(q, tri.k, tri.v, meta, scale, kv_scales=tri.scales, out=out)
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # The step's tokens were stored, and nothing outside the contexts.
    full = context_slots(meta, "all")
    flat = tri.k_scale.view(-1, num_kv_heads)
    assert not flat[full].isnan().any()
    assert flat.isnan().all(1).sum() == flat.shape[0] - full.numel()


def _poisoned_copy(pool, keep: torch.Tensor):
    """pool with NaN scales (and, for fp8, NaN codes) everywhere but at the flat slots keep."""
    out = type(pool)(*(t.clone() for t in pool))
    for codes, scales in ((out.k, out.k_scale), (out.v, out.v_scale)):
        lost = torch.ones(scales.shape[0] * scales.shape[1], dtype=torch.bool, device=DEVICE)
        lost[keep] = False
        scales.view(-1, scales.shape[2])[lost] = math.nan
        if codes.dtype == torch.float8_e4m3fn:
            codes.view(torch.uint8).view(-1, *codes.shape[2:])[lost] = 0x7F  # e4m3fn NaN
    return out


def test_a_pool_without_its_scales_is_refused():
    pool = allocate_layer(
        kv_cache_format("int8", torch.float32), 2, 16, 1, 16, torch.device(DEVICE)
    )
    x = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="needs scales exactly when it holds fp8/int8"):
        write_kv_cache(x, x, pool.k, pool.v, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="KV scales must be contiguous float32"):
        bad = (pool.k_scale.half(), pool.v_scale)
        write_kv_cache(x, x, pool.k, pool.v, torch.zeros(1, dtype=torch.int64, device=DEVICE), bad)


@pytest.mark.parametrize("name", QUANTIZED)
def test_triton_engine_matches_torch_engine_on_a_quantized_cache(tmp_path, name):
    """The whole engine on the Triton path: mixed steps, chunked prefill, a prefix hit."""
    from engine import LLM, SamplingParams
    from tests.engine.tiny_models import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "llama")
    shared = [5, 9, 13, 2, 77, 31, 8, 90, 4, 6, 11, 3, 8, 19, 20, 21]  # one block
    prompts = [shared + [22], shared + [40], [3, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = {}
    for kernels in ("torch", "triton"):
        llm = LLM(
            model=str(model), device="cpu", attention_backend=kernels, kv_cache_dtype=name,
            block_size=16, max_num_batched_tokens=16, num_kv_blocks=32,
        )  # fmt: skip
        results[kernels] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        assert llm.engine.core.kv.prefix_stats.hit_tokens == 16
    assert results["triton"] == results["torch"]
