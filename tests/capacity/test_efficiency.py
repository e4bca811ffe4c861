"""The datasheet coefficients: efficiencies per chip family, fp8 tensor cores, other engines,
all-reduce terms only with TP, and a table file checked as it is read."""

from __future__ import annotations

import json

import pytest

from capacity.efficiency import DEFAULTS, engine_key, load_table, save_table, with_values
from capacity.gpus import find_gpu
from workload.input_file import BadInputFile

TABLE = with_values(
    DEFAULTS,
    {
        "hopper.gemm": 0.5,
        "hopper.memory": 0.8,
        "hopper.t_step": 0.002,
        "ampere.gemm": 0.7,
        "fp8_gemm": 0.9,
        "allreduce_nvlink_s": 2e-5,
        "engine:tensorrt-llm": 1.2,
    },
)


def test_coefficients_follow_the_family_and_the_dtype():
    h100, a100 = find_gpu("H100"), find_gpu("A100-80GB")
    c = TABLE.coefficients(h100, "bf16")
    assert c.k_compute == pytest.approx(1 / (0.5 * h100.bf16_tflops * 1e12))
    assert c.k_memory == pytest.approx(1 / (0.8 * h100.bandwidth_gbps * 1e9))
    assert c.t_step == 0.002 and c.t_allreduce == 0 and c.k_link == 0
    fp8 = TABLE.coefficients(h100, "fp8")
    assert fp8.k_compute == pytest.approx(1 / (0.5 * 0.9 * h100.fp8_tflops * 1e12))
    assert fp8.attention == c.attention  # attention stays 16-bit
    # The A100 has no fp8 tensor cores: fp8 weights are dequantized into 16-bit GEMMs.
    assert TABLE.coefficients(a100, "fp8").k_compute == TABLE.coefficients(a100, "bf16").k_compute
    assert TABLE.coefficients(a100, "bf16").k_compute == pytest.approx(
        1 / (0.7 * a100.bf16_tflops * 1e12)
    )


def test_tp_adds_the_links_latency_and_bandwidth():
    h100, l4 = find_gpu("H100"), find_gpu("L4")
    c = TABLE.coefficients(h100, "bf16", tp=2)
    assert c.t_allreduce == 2e-5
    assert c.k_link == pytest.approx(1 / (h100.interconnect_gbps * 1e9 / 2))
    assert TABLE.coefficients(l4, "bf16", tp=2).t_allreduce == DEFAULTS.allreduce_pcie_s


def test_other_engines_scale_the_gemms_not_the_bandwidth():
    h100 = find_gpu("H100")
    vllm = TABLE.coefficients(h100, "bf16", engine="vLLM")
    trt = TABLE.coefficients(h100, "bf16", engine="TensorRT-LLM (Triton tensorrtllm_backend)")
    assert trt.k_compute == pytest.approx(vllm.k_compute / 1.2)
    assert trt.k_memory == vllm.k_memory
    assert engine_key("nm-vllm (Neural Magic fork of vLLM)") == "vllm"


def test_unknown_gpu_family_uses_the_defaults():
    gpu = find_gpu("H100")
    other = type(gpu)(**{**{f: getattr(gpu, f) for f in gpu.__slots__}, "name": "Mystery"})
    c = TABLE.coefficients(other, "bf16")
    assert c.k_compute == pytest.approx(1 / (DEFAULTS.default.gemm * gpu.bf16_tflops * 1e12))


def test_table_round_trips_and_bad_files_name_the_field(tmp_path):
    path = tmp_path / "eff.json"
    save_table(TABLE, path)
    assert load_table(path) == TABLE
    data = json.loads(path.read_text())
    data["generations"]["hopper"]["gemm"] = 3.0
    path.write_text(json.dumps(data))
    with pytest.raises(BadInputFile, match="gemm"):
        load_table(path)
    path.write_text("[1, 2]")
    with pytest.raises(BadInputFile):
        load_table(path)
