"""GGUF blocks loaded into our layouts (engine/quant/gguf_blocks.py): every supported block type
dequantizes to exactly the `gguf` package's values, and a tiny GGUF model (Q4_1 projections with
llama.cpp's Q/K row order, a Q8_0 embedding) runs through the loader as its float twin does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.errors import ModelLoadError
from engine.models.loader import load_model
from engine.models.weights import load_weights
from engine.quant.gguf_blocks import load_gguf_weights, tensor_weight
from engine.quant.int4 import Int4Weight
from engine.quant.int8 import Int8Weight
from tests.engine.test_quant_helpers import prefill_logits
from tests.engine.tiny_models import build_tiny_model

ROWS, COLS = 32, 512


def _random_blocks(qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of a K-quant (which `gguf` cannot quantize): random bytes, with the fp16
    super-block scales set to small finite values."""
    size, scales = {T.Q4_K: (144, (0, 2)), T.Q6_K: (210, (208,))}[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // 256, size), dtype=np.uint8)
    for at in scales:
        d = rng.uniform(-0.01, 0.01, blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K])
def test_blocks_dequantize_exactly_as_gguf_does(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    if qtype in (T.Q4_K, T.Q6_K):
        data = _random_blocks(qtype, rng)
    else:
        data = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    ref = torch.from_numpy(dequantize(data, qtype).reshape(ROWS, COLS).copy())
    ours = tensor_weight(data, qtype, (ROWS, COLS), "w")
    kind = Int4Weight if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else Int8Weight
    assert isinstance(ours, kind)
    assert torch.equal(ours.dequantize(), ref)  # the same float32 values, bit for bit
    # ... and a matmul reads what the file holds: 4.5 bits a weight for Q4_0 (5 for Q4_1), 8.5
    # for Q8_0, not a float32 copy (our scales and zeros are bfloat16 pairs per 32).
    bits = ours.nbytes * 8 / (ROWS * COLS)
    assert bits == {T.Q4_0: 5.0, T.Q4_1: 5.0, T.Q4_K: 5.0, T.Q8_0: 8.5, T.Q6_K: 9.0}[qtype]


def test_a_block_type_without_integer_layout_is_named() -> None:
    data = quantize(np.ones((ROWS, COLS), dtype=np.float32), T.Q5_0)
    with pytest.raises(ModelLoadError, match=r"'blk.3.attn_q.weight' is Q5_0"):
        tensor_weight(data, T.Q5_0, (ROWS, COLS), "blk.3.attn_q.weight")


# --- a tiny GGUF model ------------------------------------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert's Q/K row order (what engine.gguf_convert undoes)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(hf_dir: Path, path: Path, heads: int, kv_heads: int) -> None:
    weights, _ = load_weights(hf_dir, torch.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", heads)
    writer.add_uint32("llama.attention.head_count_kv", kv_heads)
    for name, tensor in weights.items():
        w = tensor.numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", quantize(w, T.Q8_0), raw_dtype=T.Q8_0)
            continue
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
            continue
        _, _, layer, *module, _ = name.split(".")
        module = ".".join(module)
        gname = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
        if w.ndim == 1:
            writer.add_tensor(gname, w)
            continue
        if module == "self_attn.q_proj":
            w = _permute(w, heads)
        elif module == "self_attn.k_proj":
            w = _permute(w, kv_heads)
        writer.add_tensor(gname, quantize(np.ascontiguousarray(w), T.Q4_1), raw_dtype=T.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    hf = build_tiny_model("llama", root / "hf", tied=True)
    path = root / "tiny.Q4_1.gguf"
    _write_gguf(hf, path, heads=4, kv_heads=2)
    return hf, path


def test_gguf_weights_load_in_hf_order(tiny_gguf) -> None:
    hf, path = tiny_gguf
    ours, shapes = load_gguf_weights(path, torch.float32)
    floats, _ = load_weights(hf, torch.float32)
    assert isinstance(ours["model.layers.0.self_attn.q_proj.weight"], Int4Weight)
    assert isinstance(ours["model.embed_tokens.weight"], Int8Weight)
    for name, w in floats.items():
        assert shapes[name] == tuple(w.shape)
        got = ours[name] if isinstance(ours[name], torch.Tensor) else ours[name].dequantize()
        # 4-bit blocks are lossy; the rows must be back in HF's order (a wrong order would put
        # each row next to another row's values).
        tolerance = 0.6 if w.dim() == 2 else 0.0
        assert (got - w).abs().max() <= tolerance * w.abs().max() + 1e-6, name


def test_int4_on_a_gguf_converted_folder_reads_the_blocks(tiny_gguf, monkeypatch) -> None:
    hf, path = tiny_gguf
    import engine.model_fetch as mf

    monkeypatch.setattr(mf, "gguf_source", lambda folder: path if folder == hf else None)
    quant = load_model(hf, torch.float32, torch.device("cpu"), 64, quantization="int4")
    assert isinstance(quant.embed, Int8Weight) and quant.lm_head is quant.embed  # tied: Q8_0
    # Its float twin: the GGUF's own values, dequantized, in the float path.
    twin = load_model(hf, torch.float32, torch.device("cpu"), 64, quantization="int4")
    for layer in twin.layers:
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            setattr(layer, attr, getattr(layer, attr).dequantize())
    twin.embed = twin.lm_head = twin.embed.dequantize()
    ids = torch.tensor([5, 17, 99, 3, 250, 42, 7, 8])
    a, b = prefill_logits(quant, ids), prefill_logits(twin, ids)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    # Another group size cannot take the 32-wide blocks: the float folder is quantized instead.
    regrouped = load_model(
        hf, torch.float32, torch.device("cpu"), 64, quantization="int4", group_size=64
    )
    assert regrouped.layers[0].qkv.group == 64 and isinstance(regrouped.embed, torch.Tensor)
