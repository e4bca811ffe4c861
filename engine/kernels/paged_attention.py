"""Paged attention in Triton: K/V are read straight from the block pool through the block tables
(no gather copy), for decodes (one query token per request) and prefill chunks (many).

Layout shared by both kernels: the pool is [num_blocks, block_size, Hkv, D]; key position p of
request r lives in block block_tables[r, p // block_size] at offset p % block_size. A tile of
BLOCK_N key positions loads its block ids as a vector, so the tile size is independent of the
block size (any block size works, a tile may span several blocks or part of one). Each program
serves one KV head and all the query heads that share it (GQA), so every K/V row it loads is
used by the whole group; the group's query heads are rows of the tl.dot operand. Softmax is the
online (flash) form in base 2: running max m, running sum l, fp32 accumulator.

Decode (`paged_decode`), grid (num_decodes, Hkv, num_partitions):
    program (r, h, p) attends the G query heads of KV head h over context partition p (keys
    [p * P, (p + 1) * P) of request r, P = partition_size). The G rows are padded to 16 (tl.dot
    needs M >= 16 on a GPU). One decode token per request gives too few programs to fill a GPU
    when contexts are long (batch 8 x 8 KV heads = 64 programs, each walking 32k keys), so the
    context is split into partitions (split-K / flash-decoding) that run in parallel; each writes
    its normalized partial output with its max and sum, and `_decode_reduce_kernel`, grid
    (num_decodes, Hq), rescales and combines them. When the longest context fits one partition
    the decode kernel writes the output directly and the reduce is skipped.

Prefill (`paged_prefill`), grid (num_requests, cdiv(max_q_len, BLOCK_Q), Hkv):
    program (r, i, h) takes BLOCK_Q query tokens of request r's chunk times the G query heads of
    KV head h as the BLOCK_M = BLOCK_Q * G rows of one tile (row m is token m // G, head m % G),
    and walks the keys 0..last position of its tokens. Query t of a chunk of q_len tokens sits at
    position seq_len - q_len + t (the earlier context is already in the pool) and sees keys up to
    and including itself. Programs past the end of a shorter chunk exit at once.

Quantized pools (fp8 / int8 codes with a float32 scale per key position and KV head, in scale
pools [num_blocks, block_size, Hkv]; engine/attention/kv_quant.py): a tile's K scales multiply
its logits after q @ k (a scale per key: q . (c s) = (q . c) s, and the codes enter the dot
unchanged: e4m3 and int8 codes are exact in fp16/bf16); its V rows are dequantized in fp32 as they
are loaded (scaling the probabilities instead, p_j s_j, would underflow fp16 for small values).
The dots run in q's dtype.

Numerics: loads are converted to fp32 right away (the interpreter computes bf16 wrongly); the
dots take fp16/bf16 operands on a GPU (tensor cores; the probabilities are rounded to the input
dtype for P @ V, as FlashAttention does) and fp32 with IEEE precision (no TF32) for fp32 inputs
and for bf16 under the interpreter. Accumulation is fp32; outputs are in q's dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.attention.kv_quant import check_scale_pools

# triton.jit picks the interpreter when the kernel is defined, from this variable.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634
# Finite start for the running max: a row whose keys are all masked so far keeps m = -1e30, and
# exp2(-inf - m) = 0 instead of the NaN that exp2(-inf - -inf) would give.
_NEG_BIG = tl.constexpr(-1.0e30)
DEFAULT_PARTITION_SIZE = 512


def _fix_interpreter_loop_bounds() -> None:
    """Let the interpreter take scalar tensors as `range` bounds under NumPy >= 2.4.

    The interpreter holds a scalar as a 1-element array and converts a loop bound with
    int(array), which NumPy 2.4 refuses for arrays of ndim > 0 ("only 0-dimensional arrays can
    be converted to Python scalars"); every loop of these kernels has such a bound. Wrap the
    interpreter's per-launch patching of triton.language so that tensor.__index__ takes the
    element first. Interpreter only; compiled kernels never see this.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "nightshift_index_fix", False):
        return

    def index(self) -> int:
        return int(self.handle.data.item())

    def patch_lang(fn):
        scope = original(fn)
        if hasattr(scope, "set_attr"):  # Triton >= 3.5 restores what the scope records
            scope.set_attr(tl.core.tensor, "__index__", index)
        else:
            tl.core.tensor.__index__ = index
        return scope

    patch_lang.nightshift_index_fix = True
    interpreter._patch_lang = patch_lang


if _INTERPRET:
    _fix_interpreter_loop_bounds()


@triton.jit
def _kv_tile_offsets(
    block_table_row_ptr,
    pos,
    valid,
    kv_head,
    stride_b,
    stride_s,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
):
    """Pool offsets (without the head_dim term) of key positions pos [BLOCK_N]."""
    block_ids = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    return block_ids.to(tl.int64) * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head * stride_h


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_offs,
    v_offs,
    s_offs,
    valid,
    allowed,
    qk_scale,
    offs_d,
    d_mask,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One online-softmax step of the rows of q ([M, D], dot dtype) over a tile of keys.

    k_offs / v_offs [N] locate the tile's keys (s_offs their scales, when QUANT), valid [N]
    masks its loads, allowed [M, N] says which row may see which key. Returns the updated
    (acc [M, D], m_i [M], l_i [M])."""
    # K is loaded transposed, [D, N], ready for q @ k.
    k = tl.load(
        k_cache_ptr + k_offs[None, :] + offs_d[:, None],
        mask=d_mask[:, None] & valid[None, :],
        other=0.0,
    ).to(tl.float32)
    if DOT_FP32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k.to(q.dtype))
    if QUANT:  # each key's dequantization scale
        s = s * tl.load(k_scale_ptr + s_offs, mask=valid, other=0.0)[None, :]
    # Scale after the dot: scaling q first would round it once more in fp16/bf16.
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + v_offs[:, None] + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    if QUANT:  # dequantized in fp32 before any rounding to the dot dtype
        v = v * tl.load(v_scale_ptr + s_offs, mask=valid, other=0.0)[:, None]
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_s_b,
    stride_s_s,
    stride_bt,
    num_heads,
    max_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    part_start = part * PARTITION_SIZE
    if part_start >= seq_len:  # a shorter context than the batch's longest
        return
    part_end = tl.minimum(part_start + PARTITION_SIZE, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    row_mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + r * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    ).to(tl.float32)
    if not DOT_FP32:
        q = q.to(out_ptr.dtype.element_ty)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    bt_row = block_tables_ptr + r * stride_bt
    for start in range(part_start, part_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < part_end
        k_offs = _kv_tile_offsets(
            bt_row, pos, valid, kv_head, stride_kc_b, stride_kc_s, stride_kc_h, BLOCK_SIZE
        )
        v_offs = _kv_tile_offsets(
            bt_row, pos, valid, kv_head, stride_vc_b, stride_vc_s, stride_vc_h, BLOCK_SIZE
        )
        s_offs = _kv_tile_offsets(
            bt_row, pos, valid, kv_head, stride_s_b, stride_s_s, 1, BLOCK_SIZE
        )
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_offs,
            v_offs, s_offs, valid, valid[None, :], qk_scale, offs_d, d_mask, DOT_FP32, QUANT,
        )  # fmt: skip

    out = acc / l_i[:, None]
    if SPLIT:
        # Partials are [num_decodes, Hq, max_parts, (D)], contiguous, fp32.
        row = (r * num_heads + heads) * max_parts + part
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_mask)
        tl.store(part_max_ptr + row, m_i, mask=offs_g < GROUP)
        tl.store(part_sum_ptr + row, l_i, mask=offs_g < GROUP)
    else:
        tl.store(
            out_ptr + r * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    max_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
):
    """Program (r, h) combines the partitions of request r, query head h: each partial output
    is weighted by its sum rescaled to the global max, l_p * 2^(m_p - M)."""
    r = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)
    base = (r * num_heads + head) * max_parts
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m_run = tl.full([BLOCK_P], _NEG_BIG, dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        mask = p0 + offs_p < num_parts
        m_p = tl.load(part_max_ptr + base + p0 + offs_p, mask=mask, other=_NEG_BIG)
        m_run = tl.maximum(m_run, m_p.to(tl.float32))
    m_all = tl.max(m_run, 0)

    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_P], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        mask = p0 + offs_p < num_parts
        m_p = tl.load(part_max_ptr + base + p0 + offs_p, mask=mask, other=_NEG_BIG)
        l_p = tl.load(part_sum_ptr + base + p0 + offs_p, mask=mask, other=0.0)
        w = tl.where(mask, l_p.to(tl.float32) * tl.exp2(m_p.to(tl.float32) - m_all), 0.0)
        o = tl.load(
            part_out_ptr + (base + p0 + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w[:, None] * o, 0)
        total += w
    out = acc / tl.sum(total, 0)
    tl.store(
        out_ptr + r * stride_o_t + head * stride_o_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_s_b,
    stride_s_s,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    r = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + r).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + r + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:  # a shorter chunk than the batch's longest
        return
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    context_len = seq_len - q_len  # keys already in the pool before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    # Row m is query token m // GROUP of the tile and query head m % GROUP of the KV group; the
    # last BLOCK_M - BLOCK_Q * GROUP rows are padding when GROUP does not divide BLOCK_M.
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    row_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_q_t + heads[:, None] * stride_q_h
        + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    ).to(tl.float32)  # fmt: skip
    if not DOT_FP32:
        q = q.to(out_ptr.dtype.element_ty)
    q_pos = context_len + tok

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = block_tables_ptr + r * stride_bt
    # The tile's last token sees keys 0..kv_end - 1; earlier tokens a causal prefix of those.
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < kv_end
        k_offs = _kv_tile_offsets(
            bt_row, pos, valid, kv_head, stride_kc_b, stride_kc_s, stride_kc_h, BLOCK_SIZE
        )
        v_offs = _kv_tile_offsets(
            bt_row, pos, valid, kv_head, stride_vc_b, stride_vc_s, stride_vc_h, BLOCK_SIZE
        )
        s_offs = _kv_tile_offsets(
            bt_row, pos, valid, kv_head, stride_s_b, stride_s_s, 1, BLOCK_SIZE
        )
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_offs,
            v_offs, s_offs, valid, allowed, qk_scale, offs_d, d_mask, DOT_FP32, QUANT,
        )  # fmt: skip

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_o_t + heads[:, None] * stride_o_h
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )  # fmt: skip


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs keep IEEE fp32 dots; the interpreter cannot do bf16 dots."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRET)


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate q [T, Hq, D] against the pools [blocks, block_size, Hkv, D]; return the GQA
    group size Hq / Hkv."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads}x{head_dim} do not fit the pool's {num_kv_heads}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV pools need a contiguous head_dim")
    return num_heads // num_kv_heads


def _scale_args(
    k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """(K scales, V scales, their block and slot strides, QUANT) for a launch; an unquantized
    pool passes its own tensors, never read."""
    if not check_scale_pools(k_cache, kv_scales):
        return k_cache, k_cache, 0, 0, False
    k_scale, v_scale = kv_scales
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), True


def _tile_sizes(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, default BLOCK_N): keys per tile shrink for big heads to bound registers."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, 64 if block_d <= 128 else 32


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one query token per request. q [N, Hq, D]; block_tables [N, max_blocks] and
    seq_lens [N] (context lengths including the token itself) on q's device. max_seq_len (the
    longest context, which sizes the grid) avoids a device sync when given. partition_size, a
    power of two >= 16, is the split-K partition; contexts longer than it are split and reduced.
    Writes into out ([N, Hq, D], may be a view) when given; returns it. kv_scales: the K and V
    scale pools of an fp8/int8 pool ([num_blocks, block_size, Hkv] float32 each)."""
    group = _check_shapes(q, k_cache, v_cache)
    k_scale, v_scale, stride_s_b, stride_s_s, quant = _scale_args(k_cache, kv_scales)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_reqs, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    block_d, default_n = _tile_sizes(head_dim)
    block_n = min(block_n or default_n, partition_size)
    max_parts = triton.cdiv(max_seq_len, partition_size)
    split = max_parts > 1
    if split:
        part_out = torch.empty(
            (num_reqs, num_heads, max_parts, head_dim), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(
            (num_reqs, num_heads, max_parts), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
    else:  # unused by the kernel
        part_out = part_max = part_sum = out
    _decode_kernel[(num_reqs, k_cache.shape[2], max_parts)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out, part_out, part_max,
        part_sum, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_s_b, stride_s_s,
        block_tables.stride(0), num_heads, max_parts,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], PARTITION_SIZE=partition_size, SPLIT=split,
        DOT_FP32=_dot_in_fp32(q.dtype), QUANT=quant, num_warps=4,
    )  # fmt: skip
    if split:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens,
            out.stride(0), out.stride(1), num_heads, max_parts,
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_P=min(triton.next_power_of_2(max_parts), 32 if block_d <= 128 else 16),
            PARTITION_SIZE=partition_size, num_warps=4,
        )  # fmt: skip
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks whose earlier context may already be in the pool.
    q [T, Hq, D] holds the chunks back to back: request r's rows are
    query_start_loc[r]:query_start_loc[r + 1] (an int tensor [R + 1] on q's device, starting at
    0); seq_lens [R] counts each request's context including its chunk; block_tables [R, max
    blocks]. max_q_len (the longest chunk, which sizes the grid) avoids a device sync when given.
    Writes into out ([T, Hq, D], may be a view) when given; returns it. kv_scales: as
    paged_decode's."""
    group = _check_shapes(q, k_cache, v_cache)
    k_scale, v_scale, stride_s_b, stride_s_s, quant = _scale_args(k_cache, kv_scales)
    if q.stride(-1) != 1:
        q = q.contiguous()
    head_dim = q.shape[2]
    if out is None:
        out = torch.empty_like(q)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        return out
    if max_q_len is None:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_d, default_n = _tile_sizes(head_dim)
    # Rows are (token, head of the group) pairs; at least 16 (tl.dot's minimum) and one group.
    block_m = max(block_m or (64 if block_d <= 128 else 32), 16, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_reqs, triton.cdiv(max_q_len, block_q), k_cache.shape[2])](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_s_b, stride_s_s,
        block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n or default_n, BLOCK_SIZE=k_cache.shape[1],
        DOT_FP32=_dot_in_fp32(q.dtype), QUANT=quant, num_warps=4 if block_d <= 128 else 8,
    )  # fmt: skip
    return out
