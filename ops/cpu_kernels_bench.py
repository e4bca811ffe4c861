"""The CPU kernels side by side on the default model's shapes: the int4 matmuls of a whole decode
step (the 120 projections of 30 layers, streamed one after another as a step does) for torch's
`_weight_int4pack_mm_for_cpu` and ours on the row-tiled layout (this CPU's build, and the AVX2
build where it can run), and decode attention (ours against the torch backend's gather +
scaled_dot_product_attention). Random weights in the model's shapes: speed does not depend on
the values. Medians of interleaved repeats, milliseconds.

    .venv/bin/python ops/cpu_kernels_bench.py [--threads 2] [--rows 1,2,4,8,16,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu_ops, cpu_quant
from engine.quant.int4 import quantize_int4, tile_codes

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, 30 layers
SHAPES = [(832, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
LAYERS, HQ, HKV, D, BLOCK = 30, 9, 3, 64, 16


def _median_ms(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm: layouts, first-touch pages
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so load hits every side alike
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def int4_step(rows: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    weights = [[quantize_int4(torch.randn(n, k), 32) for n, k in SHAPES] for _ in range(LAYERS)]
    for layer in weights:
        for w in layer:  # float16 scales, as the GGUF's Q4_1 blocks hold them
            w.scale, w.low = w.scale.half().float(), w.low.half().float()
    tiled = [
        [(t, s.half(), lo.half()) for t, s, lo in (tile_codes(w.codes(), w.scale, w.low, 32)
                                                   for w in layer)]
        for layer in weights
    ]  # fmt: skip
    torch_side = [[quantize_int4(torch.randn(n, k), 32) for n, k in SHAPES] for _ in range(LAYERS)]
    for layer in torch_side:
        for w in layer:
            w._cpu_layout()  # torch's blocked layout, made once
    kernels = {f"ours {cpu_quant.build('native').isa}": cpu_quant.build("native")}
    if "avx2" in open("/proc/cpuinfo").read():
        kernels["ours avx2"] = cpu_quant.build("x86-64-v3")
    print(f"int4: {len(SHAPES) * LAYERS} projections of a decode step, ms (median of {repeats})")
    print(f"{'rows':>6}" + "".join(f"{name:>22}" for name in ["torch int4pack", *kernels]))
    for m in rows:
        xs = [torch.randn(m, k) for _, k in SHAPES]

        def run_torch(xs: list[torch.Tensor] = xs) -> None:
            for layer in torch_side:
                for w, x in zip(layer, xs):
                    w.linear(x)

        def ours(kernel, xs: list[torch.Tensor] = xs) -> Callable[[], None]:
            def run() -> None:
                for layer in tiled:
                    for (t, s, lo), x, (n, _) in zip(layer, xs, SHAPES):
                        kernel.int4_tiled_matmul(x, t, s, lo, 32, n)

            return run

        fns = {"torch": run_torch} | {name: ours(k) for name, k in kernels.items()}
        ms = _median_ms(fns, repeats)
        print(f"{m:>6}" + "".join(f"{v:>22.2f}" for v in ms.values()))


def attention(repeats: int) -> None:
    kernel = cpu_ops.kernel()
    if kernel is None:
        print("attention: no compiled CPU ops here")
        return
    print(f"\ndecode attention, one layer, {HQ} query / {HKV} KV heads of {D}, us")
    for reqs, context in [(1, 150), (1, 464), (8, 464), (32, 464)]:
        blocks = -(-context // BLOCK)
        pool = (reqs * blocks + 8, BLOCK, HKV, D)
        k_pool, v_pool = torch.randn(pool), torch.randn(pool)
        tables = torch.randperm(pool[0])[: reqs * blocks].view(reqs, blocks)
        meta = AttentionMetadata(
            num_decodes=reqs, slot_mapping=torch.zeros(reqs, dtype=torch.int64),
            block_tables=tables, seq_lens=torch.full((reqs,), context),
            query_start_loc=list(range(reqs + 1)), seq_lens_list=[context] * reqs,
            block_size=BLOCK,
        )  # fmt: skip
        q = torch.randn(reqs, HQ, D)

        def ours(q=q, k_pool=k_pool, v_pool=v_pool, meta=meta) -> None:
            kernel.paged_decode(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, D**-0.5)

        def torch_backend(q=q, k_pool=k_pool, v_pool=v_pool, meta=meta) -> None:
            meta.cache.clear()
            TorchAttentionBackend().forward(q, k_pool, v_pool, meta, D**-0.5)

        ms = _median_ms({"ours": ours, "torch": torch_backend}, repeats * 10)
        print(
            f"  {reqs:>2} x {context} keys: ours {1000 * ms['ours']:8.1f}   torch backend "
            f"{1000 * ms['torch']:8.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; kernel ISA {cpu_quant.isa()}")
    int4_step([int(r) for r in args.rows.split(",")], args.repeats)
    attention(args.repeats)


if __name__ == "__main__":
    main()
