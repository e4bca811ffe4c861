"""The fused float32 CPU ops (engine/kernels/cpu_ops.c) against the torch path they replace:
RMSNorm (with the residual add), SiLU-and-mul, and paged decode attention against the torch
attention backend on a shuffled block pool with GQA. Each build the machine runs is checked."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu_ops
from engine.models.ops import CpuOps, TorchOps, make_ops

MARCHES = ["native", "x86-64-v3", "x86-64"] if platform.machine() == "x86_64" else ["native"]
pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or not (shutil.which("gcc") or shutil.which("cc")),
    reason="the CPU kernels are built with a C compiler on Linux",
)


@pytest.fixture(scope="module", params=MARCHES)
def kernel(request) -> cpu_ops.CpuOpsKernel:
    if request.param == "x86-64-v3" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    return cpu_ops.build(request.param)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_norms_match_torch(kernel, rows):
    torch.manual_seed(rows)
    x, res, w = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.randn(576)
    ref, x_before = TorchOps(), x.clone()
    torch.testing.assert_close(kernel.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    normed, total = kernel.add_rms_norm(x, res, w, 1e-6)
    ref_normed, ref_total = ref.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, ref_total)  # the residual sum is exact
    torch.testing.assert_close(normed, ref_normed)
    assert torch.equal(x, x_before) and normed.data_ptr() != x.data_ptr()  # inputs untouched


@pytest.mark.parametrize("rows", [1, 20])
def test_silu_and_mul_matches_torch_over_a_wide_range(kernel, rows):
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * 1539) * 20  # odd width: the vector loop's tail too
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -10.0, 0.0, 1e-6, 10.0, 88.0, 200.0])
    expected = F.silu(gate_up[:, :1539]) * gate_up[:, 1539:]
    torch.testing.assert_close(kernel.silu_and_mul(gate_up), expected, rtol=2e-6, atol=1e-6)


def _paged(seq_lens: list[int], block_size: int, hkv: int, d: int, pool_blocks: int = 64):
    """A shuffled block pool holding each request's keys and values, with its metadata."""
    torch.manual_seed(sum(seq_lens))
    k_pool = torch.randn(pool_blocks, block_size, hkv, d)
    v_pool = torch.randn(pool_blocks, block_size, hkv, d)
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(pool_blocks)[: sum(need)]
    width = max(need)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = ids[at : at + n]
        at += n
    reqs = len(seq_lens)
    meta = AttentionMetadata(
        num_decodes=reqs,
        query_start_loc=list(range(reqs + 1)),
        slot_mapping=torch.zeros(reqs, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens),
        seq_lens_list=list(seq_lens),
        block_size=block_size,
    )
    return k_pool, v_pool, meta


@pytest.mark.parametrize("seq_lens,block_size", [([1], 16), ([37, 150, 600, 16], 16), ([5, 70], 4)])
# GQA groups of 3 and 4 with 64- and 128-wide heads take the AVX512 code where built with it;
# a group of 12 and 32-wide heads the portable loops
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (12, 1, 64), (4, 4, 32)])
def test_paged_decode_matches_the_torch_backend(kernel, seq_lens, block_size, hq, hkv, d):
    k_pool, v_pool, meta = _paged(seq_lens, block_size, hkv, d, pool_blocks=200)
    q = torch.randn(len(seq_lens), hq, d)
    expected = TorchAttentionBackend().forward(q, k_pool, v_pool, meta, 0.125)
    out = kernel.paged_decode(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cpu_backend_takes_decodes_and_leaves_the_rest_to_torch():
    # Two decodes and a 5-token prompt chunk in one step: the decodes go through the kernel,
    # the chunk through the torch path; the whole matches the torch backend.
    hq, hkv, d, bs = 4, 2, 32, 16
    seq_lens = [20, 33, 40]
    k_pool, v_pool, meta = _paged(seq_lens, bs, hkv, d)
    meta = AttentionMetadata(
        num_decodes=2,
        query_start_loc=[0, 1, 2, 7],
        slot_mapping=torch.zeros(7, dtype=torch.int64),
        block_tables=meta.block_tables,
        seq_lens=meta.seq_lens,
        seq_lens_list=seq_lens,
        block_size=bs,
    )
    q = torch.randn(7, hq, d)
    backend = CpuAttentionBackend()
    assert backend._kernel is not None
    out = backend.forward(q, k_pool, v_pool, meta, 0.2)
    torch.testing.assert_close(out, TorchAttentionBackend().forward(q, k_pool, v_pool, meta, 0.2))


def test_cpu_ops_fall_back_for_other_dtypes():
    ops = make_ops("cpu")
    assert isinstance(ops, CpuOps)
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert ops.rms_norm(x, w, 1e-5).dtype == torch.bfloat16
    assert torch.equal(ops.rms_norm(x, w, 1e-5), TorchOps().rms_norm(x, w, 1e-5))
