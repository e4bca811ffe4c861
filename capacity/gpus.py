"""GPU catalogue: memory, bandwidth, peak dense throughput, interconnect and an assumed price, for
the GPUs people commonly serve LLMs on; a user YAML or JSON file adds GPUs or overrides fields.

Memory is two numbers. `memory_gb` is the datasheet's ("24 GB"), for display. What the planner
budgets with is the total CUDA reports (`torch.cuda.mem_get_info()`, which vLLM multiplies by
gpu_memory_utilization): less than the datasheet's GB read as GiB, by the driver's reservation and,
on GDDR cards with ECC (L4, A10G, L40S), the ECC bits (an H100's 80 GB is 79.19 GiB to CUDA, an
L4's 24 GB 22.03 GiB). `cuda_memory_mib` holds that total for each GPU, copied from a public log
(capacity/data/driver_memory.md, with the quoted lines); a GPU without one (a user file's) is
estimated from its datasheet GB by the smallest ratio of the two in the catalogue.

Throughputs are dense (NVIDIA datasheets quote 2x "with sparsity"; serving never uses it), in the
accumulate mode serving kernels use (fp32 accumulate). Interconnect bandwidth is the total of both
directions, as NVIDIA quotes it (PCIe 4.0 x16 = 32 GB/s each way = 64 GB/s).

Prices are assumptions, not facts: a typical on-demand USD price for one GPU-hour, as listed on
public price pages in 2025-2026 (sources per entry). They move often and vary by provider and
region; override them with a file or the command line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from workload.input_file import BadInputFile, parse_json, read_text

GIB = 1 << 30
MIB = 1 << 20
MAX_FIELD = 1e9  # any GPU field beyond it (GiB, GB/s, TFLOP/s, USD/h) is a typo, not a GPU


class GpuCatalogError(ValueError):
    """An unknown GPU name, or a user GPU file that does not validate."""


@dataclass(slots=True, frozen=True)
class GpuSpec:
    name: str
    memory_gb: float  # the datasheet's number ("24 GB"), for display: not what CUDA can use
    bandwidth_gbps: float  # memory bandwidth, GB/s (10^9 bytes)
    bf16_tflops: float  # dense tensor-core peak
    fp8_tflops: float | None  # dense; None where the GPU has no fp8 tensor cores
    interconnect: str  # "PCIe 4.0 x16", "NVLink 4", ...
    interconnect_gbps: float | None  # GPU-to-GPU GB/s, both directions; None if unknown
    price_per_hour: float  # USD per GPU-hour, on demand: an assumption (see module docstring)
    aliases: tuple[str, ...] = ()
    # The total CUDA reports (torch.cuda.mem_get_info()[1] / 2^20, vLLM's total_memory GiB x
    # 1024), and where that figure comes from; None: estimated from memory_gb.
    cuda_memory_mib: float | None = None
    cuda_memory_source: str = ""

    @property
    def memory_bytes(self) -> int:
        """The GPU memory the planner budgets: CUDA's total (vLLM's total_memory)."""
        if self.cuda_memory_mib is not None:
            return int(self.cuda_memory_mib * MIB)
        return int(self.memory_gb * GIB * DATASHEET_TO_CUDA)

    @property
    def memory_basis(self) -> str:
        """Where memory_bytes comes from."""
        if self.cuda_memory_mib is not None:
            return self.cuda_memory_source or "given in a GPU file"
        return (
            f"estimate: the datasheet's {self.memory_gb:g} GB x {DATASHEET_TO_CUDA:.3f} (the "
            "smallest CUDA total / datasheet ratio in the catalogue); give cuda_memory_mib"
        )


def _driver(mib: float, source: str) -> dict:
    return {"cuda_memory_mib": mib, "cuda_memory_source": source}


# Sources: the NVIDIA datasheet of each GPU (RTX 4090: the Ada Lovelace architecture whitepaper,
# appendix table), except where noted.
CATALOGUE: tuple[GpuSpec, ...] = (
    # 24 GB GDDR6X, 1008 GB/s; 165.2 TFLOPS bf16 and 330.3 fp8 with fp32 accumulate (GeForce runs
    # fp32 accumulate at half the fp16-accumulate rate). No NVLink.
    # Price: RunPod secure cloud list, 2025 (marketplaces such as Vast.ai run ~$0.3-0.5).
    # CUDA total 23.52 GiB (24084 MiB): torch "GPU 0 has a total capacity of 23.52 GiB",
    # https://github.com/Soul-AILab/SoulX-FlashTalk/issues/5 (another OOM line reads 23.68 GiB;
    # 2x4090 in vllm issue #13061 implies 23.55 GiB). The least certain row of the table.
    GpuSpec(
        "RTX 4090", 24, 1008, 165.2, 330.3, "PCIe 4.0 x16", 64, 0.69,
        aliases=("4090", "RTX-4090", "GeForce RTX 4090"),
        **_driver(24084, "torch: total capacity 23.52 GiB (SoulX-FlashTalk issue #5)"),
    ),
    # 24 GB GDDR6, 300 GB/s; 121 bf16 / 242.5 fp8 dense (the datasheet's 242 / 485 are sparse).
    # Price: AWS g6.xlarge (1 L4), us-east-1 on demand, $0.8048/h, 2025.
    # CUDA total 22.03 GiB (22559 MiB, ECC on): torch "GPU 0 has a total capacity of 22.03 GiB",
    # https://github.com/ArcInstitute/evo2/issues/190 (nvidia-smi: 23034 MiB).
    GpuSpec(
        "L4", 24, 300, 121, 242.5, "PCIe 4.0 x16", 64, 0.80, aliases=("NVIDIA L4",),
        **_driver(22559, "torch: total capacity 22.03 GiB (evo2 issue #190)"),
    ),
    # AWS's variant of the A10: same 24 GB GDDR6 at 600 GB/s, fewer tensor TFLOPS. NVIDIA
    # publishes no A10G datasheet; 70 TFLOPS bf16 is the figure in Baseten's "NVIDIA A10 vs A10G
    # for ML model inference" (the A10 datasheet says 125). Ampere: no fp8.
    # Price: AWS g5.xlarge (1 A10G), us-east-1 on demand, $1.006/h, 2025.
    # CUDA total 22587 MiB (22.06 GiB): torch get_device_properties "NVIDIA A10G ...
    # total_memory=22587MB" in torchcodec's published CUDA example (driver_memory.md's URL).
    GpuSpec(
        "A10G", 24, 600, 70, None, "PCIe 4.0 x16", 64, 1.01,
        **_driver(22587, "torch: total_memory=22587MB (torchcodec docs build)"),
    ),
    # 48 GB GDDR6, 864 GB/s; 362.05 bf16 / 733 fp8 dense.
    # Price: AWS g6e.xlarge (1 L40S), us-east-1 on demand, $1.861/h, 2025.
    # CUDA total 44.42 GiB (45486 MiB, ECC on): torch "total capacity of 44.42 GiB",
    # https://github.com/stepfun-ai/Step-Video-T2V/issues/8 (nvidia-smi: 46068 MiB).
    GpuSpec(
        "L40S", 48, 864, 362.05, 733, "PCIe 4.0 x16", 64, 1.86,
        **_driver(45486, "torch: total capacity 44.42 GiB (Step-Video-T2V issue #8)"),
    ),
    # SXM4: 40 GB HBM2, 1555 GB/s; 312 bf16 dense; NVLink 3 at 600 GB/s. No fp8.
    # Price: Lambda on-demand 1x A100 40GB, 2025.
    # CUDA total 40339 MiB: deviceQuery "NVIDIA A100-SXM4-40GB ... 40339 MBytes (42298834944
    # bytes)", https://github.com/bottlerocket-os/bottlerocket/pull/3873.
    GpuSpec(
        "A100-40GB", 40, 1555, 312, None, "NVLink 3", 600, 1.29,
        aliases=("A100 40GB", "A100-40G", "A100-SXM4-40GB"),
        **_driver(40339, "CUDA deviceQuery: 40339 MBytes (bottlerocket PR #3873)"),
    ),
    # SXM4: 80 GB HBM2e, 2039 GB/s; 312 bf16 dense; NVLink 3 at 600 GB/s. No fp8.
    # Price: Lambda 8x A100 80GB SXM per GPU, 2025 (mercatus-ai.com "Cloud GPU pricing", May 2026:
    # $1.10-1.50 specialty clouds, $1.50-3.00 hyperscalers).
    # CUDA total 79.25 GiB (81152 MiB): torch "total capacity of 79.25 GiB" on "an A100",
    # https://github.com/HiDream-ai/VAREdit/issues/6 (form factor not stated; the PCIe card's
    # CUDA total is 81049 MiB, ekondis/mixbench issue #47).
    GpuSpec(
        "A100-80GB", 80, 2039, 312, None, "NVLink 3", 600, 1.79,
        aliases=("A100 80GB", "A100-80G", "A100-SXM4-80GB"),
        **_driver(81152, "torch: total capacity 79.25 GiB (VAREdit issue #6)"),
    ),
    # SXM5: 80 GB HBM3, 3350 GB/s; 989 bf16 / 1979 fp8 dense; NVLink 4 at 900 GB/s.
    # Price: Lambda 8x H100 SXM per GPU, 2025 (mercatus-ai.com, May 2026: $2.50-3.50 specialty).
    # CUDA total 79.19 GiB (81091 MiB): vLLM 0.19 "worker init memory snapshot: ...
    # total_memory=79.19GiB" in every H100 log of the llm-d-planner accuracy sweep
    # (llm-d-incubation/llm-d-planner, commit d3121e0, accuracy/results/v0.19.0/logs).
    GpuSpec(
        "H100-SXM", 80, 3350, 989, 1979, "NVLink 4", 900, 2.99,
        aliases=("H100", "H100 SXM", "H100-80GB", "H100-SXM5-80GB", "H100 80GB HBM3"),
        **_driver(81091, "vLLM 0.19: total_memory=79.19GiB (llm-d-planner sweep logs)"),
    ),
    # SXM: 141 GB HBM3e, 4800 GB/s; same Hopper compute as H100 SXM; NVLink 4 at 900 GB/s.
    # Price: mercatus-ai.com "Cloud GPU pricing", May 2026: $3.50-4.50 at specialty clouds.
    # CUDA total 143156 MiB (139.80 GiB): torch "_CudaDeviceProperties(name='NVIDIA H200', ...
    # total_memory=143156MB", ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py.
    GpuSpec(
        "H200", 141, 4800, 989, 1979, "NVLink 4", 900, 3.99,
        aliases=("H200-SXM", "H200 SXM", "H200 141GB"),
        **_driver(143156, "torch: total_memory=143156MB (achatbot, a Modal run)"),
    ),
)  # fmt: skip

# A GPU without a CUDA total (a user file's) budgets its datasheet GB as GiB times the smallest
# CUDA-total / datasheet ratio above (the L4's, ECC on: 0.918), so that the estimate never
# exceeds what a catalogued GPU of its size gives CUDA.
DATASHEET_TO_CUDA = min(g.cuda_memory_mib * MIB / (g.memory_gb * GIB) for g in CATALOGUE)

_REQUIRED = ("memory_gb", "bandwidth_gbps", "bf16_tflops", "price_per_hour")
_OPTIONAL_DEFAULTS = {
    "fp8_tflops": None,
    "interconnect": "unknown",
    "interconnect_gbps": None,
    "aliases": (),
    "cuda_memory_mib": None,
    "cuda_memory_source": "",
}
_OLD_NAMES = {"memory_gib": "memory_gb"}  # an earlier name of the same datasheet figure


def load_gpus(extra_file: str | Path | None = None) -> dict[str, GpuSpec]:
    """The catalogue by name, with the GPUs of extra_file (YAML or JSON) added or merged over
    existing ones field by field."""
    gpus = {g.name: g for g in CATALOGUE}
    if extra_file is None:
        return gpus
    path = Path(extra_file)
    for name, fields in _read_entries(path).items():
        current = _lookup(gpus, name)
        gpu = _build(path, name, fields, current)
        gpus.pop(current.name if current else "", None)
        gpus[gpu.name] = gpu
    return gpus


def find_gpu(name: str, gpus: dict[str, GpuSpec] | None = None) -> GpuSpec:
    """Case-insensitive lookup by name, alias or torch/nvidia-smi device name
    ("NVIDIA H100 80GB HBM3", "4090", "a100-80gb")."""
    gpus = load_gpus() if gpus is None else gpus
    gpu = _lookup(gpus, name)
    if gpu is None:
        raise GpuCatalogError(f"unknown GPU {name!r}; known: {', '.join(gpus)}")
    return gpu


def _key(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", str(name).lower())
    return re.sub(r"^(nvidia)?(geforce)?", "", key)


def _lookup(gpus: dict[str, GpuSpec], name: str) -> GpuSpec | None:
    key = _key(name)
    for gpu in gpus.values():
        if key in {_key(n) for n in (gpu.name, *gpu.aliases)}:
            return gpu
    return None


def _read_entries(path: Path) -> dict[str, dict]:
    text = read_text(path)
    if path.suffix == ".json":
        raw = parse_json(text, path)
    else:
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            # PyYAML's own message spans lines, with a caret drawing; keep the problem and line.
            mark = getattr(e, "problem_mark", None)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            line = mark.line + 1 if mark is not None else None
            raise BadInputFile(path, f"not YAML: {problem}", line) from None
        except RecursionError:
            raise BadInputFile(path, "not YAML we read: nested too deeply") from None
    if raw is None:
        raise BadInputFile(path, "the file is empty")
    if isinstance(raw, dict) and "gpus" in raw:
        raw = raw["gpus"]
    if isinstance(raw, list):  # [{name: ..., field: ...}, ...]
        if not all(isinstance(e, dict) and "name" in e for e in raw):
            raise GpuCatalogError(f"{path}: every GPU in the list needs a 'name'")
        raw = {str(e["name"]): {k: v for k, v in e.items() if k != "name"} for e in raw}
    if not isinstance(raw, dict):
        raise GpuCatalogError(f"{path}: expected a mapping of GPU name -> fields, or a list")
    for name, fields in raw.items():
        if not isinstance(fields, dict):
            raise GpuCatalogError(f"{path}: GPU {name!r}: expected a mapping of fields")
    return {str(k): v for k, v in raw.items()}


def _build(path: Path, name: str, fields: dict, current: GpuSpec | None) -> GpuSpec:
    where = f"{path}: GPU {name!r}"
    known = set(_REQUIRED) | set(_OPTIONAL_DEFAULTS)
    for field in fields:
        if field not in known and field not in _OLD_NAMES:
            raise GpuCatalogError(f"{where}: unknown field {field!r}; known: {sorted(known)}")
    for field, value in fields.items():  # checked under the name the file uses
        _validate(where, field, value)
    fields = {_OLD_NAMES.get(k, k): v for k, v in fields.items()}
    if current is not None:
        base = dataclasses.asdict(current)
        if "memory_gb" in fields and "cuda_memory_mib" not in fields:
            # Another card size: the catalogue's CUDA total was another card's.
            base |= {"cuda_memory_mib": None, "cuda_memory_source": ""}
    else:
        missing = [f for f in _REQUIRED if f not in fields]
        if missing:
            raise GpuCatalogError(f"{where}: new GPU lacks required field {missing[0]!r}")
        base = {"name": name, **_OPTIONAL_DEFAULTS}
    merged = {**base, **fields}
    for field in known:
        merged[field] = _validate(where, field, merged[field])
    if "cuda_memory_mib" in fields and "cuda_memory_source" not in fields:
        merged["cuda_memory_source"] = f"given in {path.name}"
    return GpuSpec(**merged)


def _validate(where: str, field: str, value: object) -> object:
    if field in ("interconnect", "cuda_memory_source"):
        if not isinstance(value, str):
            raise GpuCatalogError(f"{where}: field {field!r} must be a string, got {value!r}")
        return value
    if field == "aliases":
        if not isinstance(value, list | tuple) or not all(isinstance(a, str | int) for a in value):
            raise GpuCatalogError(f"{where}: field 'aliases' must be a list of names")
        return tuple(str(a) for a in value)
    if value is None and field in _OPTIONAL_DEFAULTS:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GpuCatalogError(f"{where}: field {field!r} must be a number, got {value!r}")
    # YAML's .nan and .inf, and JSON's NaN and 1e400, are floats too.
    if not math.isfinite(value) or not value <= MAX_FIELD:
        raise GpuCatalogError(f"{where}: field {field!r} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and field != "price_per_hour"):
        raise GpuCatalogError(f"{where}: field {field!r} must be positive, got {value!r}")
    return float(value)
