"""The planner checked against reality on this machine: calibrate the performance model on a
step profile recorded while replaying one trace, predict a different trace, replay that one for
real, and compare makespan and mean end-to-end latency.

Both replays run against a fresh `nightshift serve` (its own process, as deployed) with the same
engine settings the simulation gets, in batch mode (everything sent at once, as the nightly job
does). Each server first serves a short warm-up (first calls pay one-off costs the simulation does
not model); its steps are left out of the calibration."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from capacity.calibrate import Calibration, fit, load_samples
from capacity.model_specs import load_model_spec
from capacity.perf import PerfModel, model_costs
from capacity.simulate import EngineShape, simulate
from engine.model_fetch import resolve_model
from engine.server.server_process import start_server_process
from workload.prompt_tokens import TokenPrompts
from workload.replay import ReplayConfig, replay
from workload.trace import TraceRecord

log = logging.getLogger(__name__)

SERVED_NAME = "validate"
WARMUP = [TraceRecord(0, 300, 16, [900_000 + i]) for i in range(4)]


@dataclass(frozen=True, slots=True)
class ValidationSettings:
    model: str = "default"
    num_kv_blocks: int = 1200
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048


@dataclass(slots=True)
class Validation:
    settings: ValidationSettings
    calibration: Calibration
    real_makespan_s: float
    predicted_makespan_s: float
    real_mean_e2e_s: float
    predicted_mean_e2e_s: float

    @property
    def makespan_error_pct(self) -> float:
        return (self.predicted_makespan_s - self.real_makespan_s) / self.real_makespan_s * 100

    @property
    def e2e_error_pct(self) -> float:
        return (self.predicted_mean_e2e_s - self.real_mean_e2e_s) / self.real_mean_e2e_s * 100

    def to_json(self) -> dict:
        return {
            "settings": asdict(self.settings),
            "calibration": self.calibration.to_json(),
            "real_makespan_s": self.real_makespan_s,
            "predicted_makespan_s": self.predicted_makespan_s,
            "makespan_error_pct": self.makespan_error_pct,
            "real_mean_e2e_s": self.real_mean_e2e_s,
            "predicted_mean_e2e_s": self.predicted_mean_e2e_s,
            "e2e_error_pct": self.e2e_error_pct,
        }


def run_validation(
    train: list[TraceRecord],
    test: list[TraceRecord],
    settings: ValidationSettings,
    workdir: Path,
    machine: str,
) -> Validation:
    folder = resolve_model(settings.model)
    spec = load_model_spec(folder)
    workdir.mkdir(exist_ok=True)  # its folder must exist (workload/output_file.py)
    profile = workdir / "train-steps.jsonl"
    profile.unlink(missing_ok=True)
    log.info("replaying the training trace (%d requests) with the step profiler", len(train))
    _serve_and_replay(folder, settings, train, profile)
    warm_steps = _count_lines(workdir / "warmup-steps.jsonl")
    samples = load_samples(profile)[warm_steps:]
    calibration = fit(samples, model_costs(spec, "fp32"), machine)
    log.info("replaying the test trace (%d requests) for real", len(test))
    result = _serve_and_replay(folder, settings, test, None)
    summary = result["summary"]
    if summary["requests"]["failed"]:
        raise RuntimeError(f"the test replay had failures: {summary['failures']}")
    engine = EngineShape(
        num_blocks=settings.num_kv_blocks,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
    )
    model = PerfModel(model_costs(spec, "fp32"), calibration.coefficients)
    sim = simulate(test, model.step_time, engine, batch=True)
    predicted_e2e = sum(r.e2e_s for r in sim.requests) / len(sim.requests)
    return Validation(
        settings,
        calibration,
        summary["makespan_s"],
        sim.makespan_s,
        summary["e2e_s"]["mean"],
        predicted_e2e,
    )


def _serve_and_replay(
    folder: Path, settings: ValidationSettings, trace: list[TraceRecord], profile: Path | None
) -> dict:
    args = [
        "--model",
        str(folder),
        "--served-model-name",
        SERVED_NAME,
        "--num-kv-blocks",
        str(settings.num_kv_blocks),
        "--block-size",
        str(settings.block_size),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--max-model-len",
        str(settings.max_model_len),
    ]
    if profile is not None:
        args += ["--profile-path", str(profile)]
    prompts = TokenPrompts(vocab_size=49152, seed=0).prompt
    with start_server_process(args) as server:
        config = ReplayConfig(server.base_url, SERVED_NAME, mode="batch")
        replay(WARMUP, config, prompts)
        if profile is not None:
            # The warm-up's steps are the profile so far: remember how many to skip.
            warm = profile.parent / "warmup-steps.jsonl"
            warm.write_text(profile.read_text() if profile.exists() else "")
        return replay(trace, config, prompts)


def _count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0
