import json

import pytest

from capacity.gpus import (
    CATALOGUE,
    DATASHEET_TO_CUDA,
    GIB,
    MIB,
    GpuCatalogError,
    find_gpu,
    load_gpus,
)
from workload.input_file import BadInputFile


def test_catalogue_holds_the_eight_gpus():
    names = {g.name for g in CATALOGUE}
    assert names == {
        "RTX 4090", "L4", "A10G", "L40S", "A100-40GB", "A100-80GB", "H100-SXM", "H200",
    }  # fmt: skip
    for gpu in CATALOGUE:
        assert gpu.bandwidth_gbps > 0 and gpu.bf16_tflops > 0 and gpu.price_per_hour > 0
    assert find_gpu("H100").bf16_tflops == 989 and find_gpu("H100").fp8_tflops == 1979
    assert find_gpu("A100-80GB").fp8_tflops is None  # Ampere: no fp8 tensor cores


def test_memory_is_what_cuda_reports_not_the_datasheet():
    """The datasheet's "80 GB" is not 80 GiB to CUDA: each GPU budgets the total CUDA reported in
    a public log (capacity/data/driver_memory.md), 1-8% under the datasheet figure read as GiB
    (8% on ECC GDDR cards)."""
    expected_gib = {
        "RTX 4090": 23.52, "L4": 22.03, "A10G": 22.06, "L40S": 44.42, "A100-40GB": 39.39,
        "A100-80GB": 79.25, "H100-SXM": 79.19, "H200": 139.80,
    }  # fmt: skip
    for gpu in CATALOGUE:
        assert gpu.memory_bytes / GIB == pytest.approx(expected_gib[gpu.name], abs=0.005)
        assert gpu.memory_bytes == int(gpu.cuda_memory_mib * MIB) < gpu.memory_gb * GIB
        assert gpu.memory_basis == gpu.cuda_memory_source and gpu.cuda_memory_source
    assert find_gpu("H100").memory_bytes == 81091 * MIB and find_gpu("H100").memory_gb == 80
    assert DATASHEET_TO_CUDA == pytest.approx(22559 / (24 * 1024))  # the L4's, the smallest


def test_a_user_gpu_gives_its_cuda_total_or_is_estimated(tmp_path):
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "B200:\n  memory_gb: 180\n  bandwidth_gbps: 8000\n  bf16_tflops: 2250\n"
        "  price_per_hour: 6\n"
        "X1:\n  memory_gb: 48\n  cuda_memory_mib: 46068\n  bandwidth_gbps: 900\n"
        "  bf16_tflops: 300\n  price_per_hour: 1\n"
        "L4:\n  cuda_memory_mib: 22000\n  cuda_memory_source: my nvidia-smi\n"
        "H100:\n  memory_gb: 94\n"  # another card size: the catalogue's CUDA total is dropped
    )
    gpus = load_gpus(path)
    b200 = gpus["B200"]
    assert b200.memory_bytes == int(180 * GIB * DATASHEET_TO_CUDA)
    assert b200.memory_basis.startswith("estimate: the datasheet's 180 GB")
    assert gpus["X1"].memory_bytes == 46068 * MIB
    assert gpus["X1"].memory_basis == "given in gpus.yaml"
    assert gpus["L4"].memory_bytes == 22000 * MIB and gpus["L4"].memory_basis == "my nvidia-smi"
    assert gpus["H100-SXM"].cuda_memory_mib is None
    assert gpus["H100-SXM"].memory_bytes == int(94 * GIB * DATASHEET_TO_CUDA)
    path.write_text("L4: {cuda_memory_mib: 0}\n")
    with pytest.raises(GpuCatalogError, match="'cuda_memory_mib' must be positive"):
        load_gpus(path)
    path.write_text("L4: {cuda_memory_source: 5}\n")
    with pytest.raises(GpuCatalogError, match="'cuda_memory_source' must be a string"):
        load_gpus(path)


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("4090", "RTX 4090"),
        ("rtx 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),  # torch.cuda.get_device_name()
        ("l4", "L4"),
        ("l40s", "L40S"),
        ("A100-80GB", "A100-80GB"),
        ("a100 80gb", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("H100", "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("h200", "H200"),
    ],
)
def test_lookup_by_name_and_alias(query, name):
    assert find_gpu(query).name == name


def test_unknown_or_ambiguous_name():
    with pytest.raises(GpuCatalogError, match="unknown GPU 'A100'; known: .*A100-40GB"):
        find_gpu("A100")


def test_user_yaml_overrides_and_adds(tmp_path):
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "gpus:\n"
        "  h100:\n"
        "    price_per_hour: 2.10\n"
        "  RTX 3090:\n"
        "    memory_gib: 24\n"
        "    bandwidth_gbps: 936\n"
        "    bf16_tflops: 71\n"
        "    price_per_hour: 0.22\n"
        "    aliases: [3090]\n"
    )
    gpus = load_gpus(path)
    h100 = find_gpu("H100", gpus)
    assert h100.price_per_hour == 2.10 and h100.bf16_tflops == 989  # other fields kept
    assert len([g for g in gpus.values() if g.name == "H100-SXM"]) == 1
    rtx3090 = find_gpu("3090", gpus)
    # memory_gib, the field's earlier name, is the datasheet figure too
    assert rtx3090.memory_gb == 24 and rtx3090.fp8_tflops is None
    assert rtx3090.memory_bytes == int(24 * GIB * DATASHEET_TO_CUDA)
    assert rtx3090.interconnect == "unknown" and rtx3090.interconnect_gbps is None
    assert find_gpu("H100").price_per_hour == 2.99  # the built-in catalogue is untouched


def test_user_json_list(tmp_path):
    path = tmp_path / "gpus.json"
    entry = {"name": "B200", "memory_gib": 180, "bandwidth_gbps": 8000, "bf16_tflops": 2250}
    path.write_text(json.dumps([{**entry, "fp8_tflops": 4500, "price_per_hour": 6}]))
    assert load_gpus(path)["B200"].fp8_tflops == 4500.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("RTX 3090: {memory_gib: 24, bf16_tflops: 71, price_per_hour: 0.2}",
         "GPU 'RTX 3090': new GPU lacks required field 'bandwidth_gbps'"),
        ("H100: {price_per_hour: cheap}", "GPU 'H100': field 'price_per_hour' must be a number"),
        ("L4: {memory_gib: -24}", "GPU 'L4': field 'memory_gib' must be positive"),
        ("L4: {memroy_gib: 24}", "GPU 'L4': unknown field 'memroy_gib'"),
        ("L4: 24", "GPU 'L4': expected a mapping of fields"),
        ("- {memory_gib: 24}", "every GPU in the list needs a 'name'"),
        ("just text", "expected a mapping of GPU name"),
        ("L4: {memory_gib: .nan}", "GPU 'L4': field 'memory_gib' must be a finite number"),
        ("L4: {memory_gib: [24", "gpus.yaml:1: not YAML"),
    ],
)  # fmt: skip
def test_bad_user_file(tmp_path, text, message):
    path = tmp_path / "gpus.yaml"
    path.write_text(text)
    # A file that is not YAML is a BadInputFile; one whose fields are wrong, a GpuCatalogError.
    with pytest.raises((GpuCatalogError, BadInputFile), match=message):
        load_gpus(path)
