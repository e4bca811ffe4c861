"""The datasheet coefficients: efficiencies per chip family, fp8 tensor cores, other engines,
all-reduce terms only with TP, and a table file checked as it is read."""

from __future__ import annotations

import json

import pytest

from capacity.efficiency import (
    DEFAULTS,
    engine_key,
    get,
    link_traffic,
    load_table,
    parameter_names,
    save_table,
    with_values,
)
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
    pcie = TABLE.coefficients(l4, "bf16", tp=2)
    # NCCL's ring over PCIe: 2 (tp - 1) hops; the table's latency is that of 8 GPUs.
    assert pcie.t_allreduce == pytest.approx(DEFAULTS.allreduce_pcie_s / 7)
    assert TABLE.coefficients(l4, "bf16", tp=8).t_allreduce == DEFAULTS.allreduce_pcie_s
    # One-shot custom all-reduce over NVLink: the same latency at any size.
    assert TABLE.coefficients(h100, "bf16", tp=8).t_allreduce == c.t_allreduce
    # A ring over PCIe reaches its own share of the link (host bridges), not NVLink's.
    assert pcie.k_link == pytest.approx(1 / (DEFAULTS.link_pcie * l4.interconnect_gbps * 1e9 / 2))
    slower = with_values(TABLE, {"link_pcie": 0.2})
    assert slower.coefficients(l4, "bf16", tp=2).k_link > pcie.k_link
    assert slower.coefficients(h100, "bf16", tp=2).k_link == c.k_link


def test_a_table_written_before_a_field_existed_loads_with_its_default(tmp_path):
    path = tmp_path / "old.json"
    save_table(TABLE, path)
    data = json.loads(path.read_text())
    del data["link_pcie"]
    path.write_text(json.dumps(data))
    assert load_table(path).link_pcie == DEFAULTS.link_pcie


def test_other_engines_scale_the_gemms_not_the_bandwidth():
    h100 = find_gpu("H100")
    vllm = TABLE.coefficients(h100, "bf16", engine="vLLM")
    trt = TABLE.coefficients(h100, "bf16", engine="TensorRT-LLM (Triton tensorrtllm_backend)")
    assert trt.k_compute == pytest.approx(vllm.k_compute / 1.2)
    assert trt.k_memory == vllm.k_memory
    assert engine_key("nm-vllm (Neural Magic fork of vLLM)") == "vllm"
    # Their fixed costs per step and per layer have their own factor.
    lean = with_values(TABLE, {"engine_overhead:tensorrt-llm": 0.5, "t_layer": 1e-4})
    trt = lean.coefficients(h100, "bf16", engine="TensorRT-LLM")
    assert trt.t_step == pytest.approx(0.5 * vllm.t_step) and trt.t_layer == pytest.approx(5e-5)
    assert lean.coefficients(h100, "bf16", engine="vLLM").t_layer == 1e-4


def test_an_engine_on_one_generation_has_its_own_factor():
    h100, a100, l40s = find_gpu("H100"), find_gpu("A100-80GB"), find_gpu("L40S")
    table = with_values(
        TABLE,
        {"engine:tensorrt-llm/ampere": 1.1, "engine_overhead:tensorrt-llm/hopper": 0.5},
    )
    trt, vllm = "TensorRT-LLM", "vLLM"
    a = table.coefficients(a100, "bf16", engine=trt)
    assert a.k_compute == pytest.approx(
        table.coefficients(a100, "bf16", engine=vllm).k_compute / 1.1
    )
    # Elsewhere the engine's plain factor applies; vLLM is the reference everywhere.
    h = table.coefficients(h100, "bf16", engine=trt)
    assert h.k_compute == pytest.approx(table.coefficients(h100, "bf16").k_compute / 1.2)
    assert h.t_step == pytest.approx(0.5 * table.coefficients(h100, "bf16").t_step)
    assert (
        table.coefficients(l40s, "bf16", engine=trt).t_step
        == table.coefficients(l40s, "bf16").t_step
    )
    assert get(table, "engine:tensorrt-llm/ada") == 1.2  # what applies there: the plain one
    names = parameter_names(("hopper",), ("tensorrt-llm/hopper", "vllm-v0/ampere", "vllm/ada"))
    assert "engine:tensorrt-llm/hopper" in names and "engine_overhead:vllm-v0/ampere" in names
    assert "engine:vllm-v0/ampere" not in names and not any("vllm/ada" in n for n in names)


def test_the_nvswitch_reduces_so_hopper_moves_less_than_a_ring():
    """An all-reduce on HGX H100/H200 (NVLink 4 through NVSwitch with NVLink SHARP) moves about
    the message per GPU, a ring 2 (tp - 1) / tp of it: equal at TP 2, 4/7 of the ring's time at
    TP 8. The A100's NVLink 3 switch and PCIe cannot reduce: ring traffic at every size."""
    h100, h200, a100, l40s = (find_gpu(n) for n in ("H100", "H200", "A100-80GB", "L40S"))
    assert link_traffic(h100, 2) == 1.0
    assert link_traffic(h100, 4) == pytest.approx(4 / 6)
    assert link_traffic(h200, 8) == pytest.approx(8 / 14)
    assert link_traffic(a100, 8) == link_traffic(l40s, 8) == 1.0
    ring = TABLE.coefficients(a100, "bf16", tp=8).k_link * a100.interconnect_gbps
    assert ring == pytest.approx(
        TABLE.coefficients(a100, "bf16", tp=2).k_link * a100.interconnect_gbps
    )
    tp8 = TABLE.coefficients(h100, "bf16", tp=8).k_link
    assert tp8 == pytest.approx(TABLE.coefficients(h100, "bf16", tp=2).k_link * 8 / 14)


def test_a_generation_can_have_its_own_nvlink_share(tmp_path):
    h100, a100 = find_gpu("H100"), find_gpu("A100-80GB")
    shared = TABLE.coefficients(a100, "bf16", tp=4).k_link
    table = with_values(TABLE, {"hopper.link": 0.5})
    assert table.coefficients(h100, "bf16", tp=4).k_link == pytest.approx(
        link_traffic(h100, 4) / (0.5 * h100.interconnect_gbps * 1e9 / 2)
    )
    assert table.coefficients(a100, "bf16", tp=4).k_link == shared  # ampere: the shared share
    assert get(table, "ampere.link") == table.link and get(table, "hopper.link") == 0.5
    path = tmp_path / "links.json"
    save_table(table, path)
    assert load_table(path) == table  # null for the generations without one
    data = json.loads(path.read_text())
    data["generations"]["hopper"]["link"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(BadInputFile, match="link"):
        load_table(path)


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


def test_per_layer_cost_counts_each_layer_of_each_step():
    # A layer's kernels cost microseconds however little they compute: a step of a 36-layer model
    # pays 36 times the per-layer cost on top of the per-step one.
    from capacity.model_specs import load_model_spec
    from capacity.perf import PerfModel, StepShape, model_costs

    table = with_values(TABLE, {"t_layer": 1e-4})
    c = table.coefficients(find_gpu("H100"), "bf16")
    assert c.t_layer == 1e-4
    shape = StepShape(num_batched_tokens=1, sampled_rows=1, attention_pairs=1, context_tokens=1)
    spec = load_model_spec("Qwen2.5-3B")
    with_layers = PerfModel(model_costs(spec), c).terms(shape).overhead
    without = PerfModel(model_costs(spec), TABLE.coefficients(find_gpu("H100"), "bf16"))
    assert with_layers - without.terms(shape).overhead == pytest.approx(36 * 1e-4)


def test_eager_adds_the_per_layer_launch_cost():
    h100 = find_gpu("H100")
    graphs = TABLE.coefficients(h100, "bf16")
    eager = TABLE.coefficients(h100, "bf16", eager=True)
    assert eager.t_layer == pytest.approx(graphs.t_layer + DEFAULTS.t_layer_eager)
    assert eager.t_step == graphs.t_step and eager.k_compute == graphs.k_compute


def test_soft_roofline_is_slower_than_either_ceiling_near_the_ridge():
    from capacity.perf import roofline

    assert roofline(2.0, 1.0) == 2.0  # p = 0: the larger, as before
    at_ridge = roofline(1.0, 1.0, 2.0)
    assert at_ridge == pytest.approx(2**0.5)  # neither ceiling reached at the ridge
    assert roofline(10.0, 1.0, 4.0) == pytest.approx(10.0, rel=1e-3)  # far from it: the ceiling
    soft = with_values(TABLE, {"roofline_p": 3.0}).coefficients(find_gpu("H100"), "bf16")
    assert soft.roofline_p == 3.0
