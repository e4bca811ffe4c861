"""Quantized weights (engine/quant/): each layout's matmul against its own dequantization, the
quantizers' rounding bounds, a quantized folder written and read back, and whole models run
quantized against the same model with the dequantized weights in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.models.loader import load_model
from engine.quant.fp8 import Fp8Weight, quantize_fp8
from engine.quant.int4 import Int4Weight, quantize_int4
from engine.quant.int8 import Int8Weight, quantize_int8
from engine.quant.quantize import quantize_checkpoint, weight_bytes
from nightshift.cli import app
from tests.engine.test_quant_helpers import prefill_logits
from tests.engine.tiny_models import build_tiny_model

# Activations go through the CPU kernels in bfloat16 (8 mantissa bits), so a quantized layer
# matches its own dequantized float32 matmul to about 2^-8 of the output's scale.
KERNEL_TOLERANCE = 2e-2


def _weights():
    torch.manual_seed(0)
    return torch.randn(96, 256) * 0.05


def _layouts(w):
    return {
        "int8 per channel": quantize_int8(w),
        "int8 groups of 32": quantize_int8(w, 32),
        "int4 g32": quantize_int4(w, 32),
        "int4 g64": quantize_int4(w, 64),
        "int4 g128": quantize_int4(w, 128),
        "fp8": quantize_fp8(w),
    }


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("name", list(_layouts(torch.zeros(16, 128))))
def test_quantized_linear_matches_its_dequantized_weight(name: str, rows: int) -> None:
    qw = _layouts(_weights())[name]
    x = torch.randn(rows, 256)
    bias = torch.randn(96)
    ref = x @ qw.dequantize().T + bias
    y = qw.linear(x, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert (y - ref).abs().max() <= KERNEL_TOLERANCE * ref.abs().max()


def test_rounding_stays_within_half_a_step() -> None:
    w = _weights()
    q8 = quantize_int8(w)
    assert ((q8.dequantize() - w).abs() <= q8.scale / 2 + 1e-7).all()
    q4 = quantize_int4(w, 32)
    err = (q4.dequantize() - w).abs().view(96, 8, 32)
    assert (err <= q4.scale[..., None] / 2 + 1e-7).all()
    # fp8 e4m3 keeps 3 mantissa bits: relative error at most 2^-4 above its smallest normals.
    f8 = quantize_fp8(w)
    big = w.abs() > f8.scale * 2**-6
    assert ((f8.dequantize() - w).abs()[big] <= w.abs()[big] * 2**-4).all()


def test_layouts_shrink_the_weight() -> None:
    w = _weights()
    floats = w.numel() * 4
    assert quantize_int8(w).nbytes < floats / 3.9
    assert quantize_int4(w, 32).nbytes < floats / 5  # codes 1/8, two float32 per 32
    assert quantize_fp8(w).nbytes < floats / 3.9


def test_cat_and_slice_keep_the_values() -> None:
    w = _weights()
    for make in (quantize_int8, lambda t: quantize_int4(t, 32), quantize_fp8):
        a, b = make(w[:48]), make(w[48:])
        joined = type(a).cat([a, b])
        assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
        rows = joined.slice(0, 16, 48)
        assert torch.equal(rows.dequantize(), joined.dequantize()[16:48])
        cols = joined.slice(1, 64, 128)
        assert torch.equal(cols.dequantize(), joined.dequantize()[:, 64:128])


@pytest.mark.parametrize("shape", [(96, 256), (48, 64), (1536, 576), (80, 1024)])
def test_int4_keeps_one_copy_of_its_codes_once_it_has_run(shape) -> None:
    # bfloat16 activations run torch's kernel, which has its own layout (float32 ones run ours,
    # on the stored layout)
    torch.manual_seed(1)
    qw = quantize_int4(torch.randn(*shape), 32)
    before = qw.dequantize()
    qw.linear(torch.randn(2, shape[1]).bfloat16())
    assert qw.packed is None  # only torch's CPU kernel's layout is left ...
    assert torch.equal(qw.dequantize(), before)  # ... and the codes come back from it
    assert torch.equal(type(qw).cat([qw, qw]).dequantize(), torch.cat([before, before]))


def test_slicing_inside_a_group_is_refused() -> None:
    with pytest.raises(ValueError, match="groups"):
        quantize_int4(_weights(), 32).slice(1, 16, 80)
    with pytest.raises(ValueError, match="groups"):
        quantize_int8(_weights(), 32).slice(1, 16, 80)


def test_malformed_layouts_are_named() -> None:
    with pytest.raises(ValueError, match="int8"):
        Int8Weight(torch.zeros(4, 32), torch.ones(4, 1), 32)
    with pytest.raises(ValueError, match="scales have shape"):
        Int8Weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2), 32)
    with pytest.raises(ValueError, match="does not divide"):
        Int4Weight(torch.zeros(4, 24, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1), 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 8), torch.ones(4, 1))


def test_embedding_rows_of_a_quantized_table() -> None:
    w = _weights()
    ids = torch.tensor([[3, 0], [95, 3]])
    for qw in _layouts(w).values():
        assert torch.equal(qw.rows(ids, torch.float32), qw.dequantize()[ids])


# --- whole models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "m")


def _dequantized_twin(model):
    """The same model object with every quantized projection replaced by its float32 values."""
    for layer in model.layers:
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            w = getattr(layer, attr)
            if not isinstance(w, torch.Tensor):
                setattr(layer, attr, w.dequantize())
    if not isinstance(model.lm_head, torch.Tensor):
        model.lm_head = model.lm_head.dequantize()
    if not isinstance(model.embed, torch.Tensor):
        model.embed = model.embed.dequantize()
    return model


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_model_logits_match_its_dequantized_twin(tiny: Path, method: str) -> None:
    quant = load_model(tiny, torch.float32, torch.device("cpu"), 64, quantization=method)
    twin = _dequantized_twin(load_model(tiny, torch.float32, torch.device("cpu"), 64,
                                        quantization=method))  # fmt: skip
    assert all(not isinstance(layer.qkv, torch.Tensor) for layer in quant.layers)
    ids = torch.tensor([5, 17, 99, 3, 250, 42, 7, 8])
    a, b = prefill_logits(quant, ids), prefill_logits(twin, ids)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert weight_bytes(quant) < weight_bytes(twin)


def test_quantized_llm_generates_and_reports_errors(tiny: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for method in ("int8", "int4", "fp8"):
        llm = LLM(str(tiny), quantization=method, num_kv_blocks=16)
        out = llm.generate([[5, 17, 99, 3]], params)[0].outputs[0]
        assert len(out.token_ids) == 8
        llm.shutdown()
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny), quantization="int3")
    with pytest.raises(ValueError, match="quant_group_size"):
        LLM(str(tiny), quantization="int4", quant_group_size=48)


def test_int4_group_that_does_not_divide_a_width_is_named(tmp_path: Path) -> None:
    model = build_tiny_model("llama", tmp_path / "m", hidden_size=96, num_attention_heads=6)
    with pytest.raises(ModelLoadError, match="groups of 64 do not divide .* 96"):
        load_model(model, torch.float32, torch.device("cpu"), 64, quantization="int4",
                   group_size=64)  # fmt: skip


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_folder_round_trip(tiny: Path, tmp_path: Path, method: str) -> None:
    dst = tmp_path / method
    quantize_checkpoint(tiny, dst, method, 32)
    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == method and qconfig["quant_method"] == "nightshift"
    assert "model.layers.0.self_attn.q_proj.weight" in qconfig["layout"]
    assert (dst / "model.safetensors").stat().st_size < (tiny / "model.safetensors").stat().st_size
    stored = load_model(dst, torch.float32, torch.device("cpu"), 64)
    at_load = load_model(tiny, torch.float32, torch.device("cpu"), 64, quantization=method)
    for a, b in zip(stored.layers, at_load.layers):
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            assert torch.equal(getattr(a, attr).dequantize(), getattr(b, attr).dequantize())
    with pytest.raises(ModelLoadError, match="holds .* weights"):
        load_model(dst, torch.float32, torch.device("cpu"), 64,
                   quantization="int8" if method != "int8" else "int4")  # fmt: skip


def test_quantize_command(tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["model", "quantize", str(tiny), str(tmp_path / "q"), "--lm-head"])
    assert ok.exit_code == 0, ok.output
    qconfig = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qconfig["lm_head"] and "lm_head.weight" in qconfig["layout"]
    again = runner.invoke(app, ["model", "quantize", str(tiny), str(tmp_path / "q")])
    assert again.exit_code == 2 and "not empty" in again.output
    bad = runner.invoke(
        app, ["model", "quantize", str(tiny), str(tmp_path / "r"), "--quantization", "int2"]
    )
    assert bad.exit_code == 2 and "unknown quantization 'int2'" in bad.output
    twice = runner.invoke(app, ["model", "quantize", str(tmp_path / "q"), str(tmp_path / "s")])
    assert twice.exit_code == 2 and "quantized already" in twice.output


def test_malformed_quantized_folder_is_named(tiny: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q"
    quantize_checkpoint(tiny, dst, "int4", 32)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not one this engine reads"):
        load_model(dst, torch.float32, torch.device("cpu"), 64)


def test_generate_and_serve_refuse_an_unknown_quantization(tiny: Path) -> None:
    runner = CliRunner()
    for command in (["generate", "hi", "--raw"], ["serve"]):
        result = runner.invoke(app, [*command, "--model", str(tiny), "--quantization", "int3"])
        assert result.exit_code == 2, result.output
        assert "quantization must be one of none, int8, int4, fp8" in result.output


def test_generate_takes_threads_and_refuses_a_bad_count(tmp_path: Path) -> None:
    from tests.engine.server.live_server import build_chat_model

    chat = str(build_chat_model(tmp_path / "chat"))
    runner = CliRunner()
    before = torch.get_num_threads()
    try:
        argv = ["generate", "hi", "--model", chat, "--max-tokens", "2", "--threads", "1"]
        ok = runner.invoke(app, argv)
        assert ok.exit_code == 0, ok.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    bad = runner.invoke(app, ["generate", "hi", "--model", chat, "--threads", "0"])
    assert bad.exit_code == 2 and "--threads must be at least 1, not 0" in bad.output
