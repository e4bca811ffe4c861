"""The end-of-run report: what the ops person reads in the log, and the command's exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from digest.run_cost import NightCost, Pricing, night_cost

EXIT_OK = 0
EXIT_FAILED = 1  # the run itself failed (source unreachable, lock held, ...)
EXIT_USAGE = 2
EXIT_PARTIAL = 3  # the digest was published, but some papers failed; it lists them


@dataclass(slots=True)
class RunReport:
    run_id: int
    digest_date: date
    status: str  # succeeded | partial | failed (every paper failed)
    papers_total: int
    papers_done: int
    papers_failed: int
    calls: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    wall_s: float
    failed: list[tuple[str, str]] = field(default_factory=list)  # (paper id, error)
    outputs: list[Path] = field(default_factory=list)
    papers_below_cut: int = 0  # ranked below --max-papers: listed, not summarised
    deliveries: list[str] = field(default_factory=list)  # one line per delivery target
    delivery_failed: bool = False  # the digest is stored and published, but a send failed
    # What the public page leaves out (issue 19) is said here, for the operator.
    prompt_version: str = ""
    unverified: list[tuple[str, list[str]]] = field(default_factory=list)  # (paper id, facts)
    pricing: Pricing | None = None  # None: no cost line

    @property
    def exit_code(self) -> int:
        codes = {"succeeded": EXIT_OK, "partial": EXIT_PARTIAL}
        # A failed delivery is retried by the next run (systemd retries exit 1) or by
        # `digest deliver`; the published digest is not redone.
        return EXIT_FAILED if self.delivery_failed else codes.get(self.status, EXIT_FAILED)

    @property
    def completion_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost(self) -> NightCost | None:
        return night_cost(self.pricing, self.prompt_tokens, self.completion_tokens, self.wall_s)

    def lines(self) -> list[str]:
        out = [
            f"digest {self.digest_date.isoformat()} (run {self.run_id}): {self.status}"
            # The run's status is the papers'; a failed delivery makes the exit 1 all the same.
            + ("; delivery failed" if self.delivery_failed else ""),
            f"  papers: {self.papers_total} listed, {self.papers_done} done, "
            f"{self.papers_failed} failed"
            + (f", {self.papers_below_cut} below --max-papers" if self.papers_below_cut else ""),
            f"  model calls this run: {self.calls}; tokens: {self.prompt_tokens} prompt "
            f"({self.cached_tokens} cached), {self.completion_tokens} completion",
            f"  wall time {self.wall_s:.1f} s, {self.completion_tokens_per_s:.1f} "
            f"completion tokens/s",
        ]
        if (cost := self.cost) is not None:
            out.append(cost.line())
        if self.prompt_version:
            out.append(f"  prompt version {self.prompt_version}")
        out += [
            f"  unverified: {pid}: the summary names {', '.join(facts)}, not in the paper's text"
            for pid, facts in self.unverified
        ]
        out += [f"  failed: {pid}: {error}" for pid, error in self.failed]
        out += [f"  wrote {path}" for path in self.outputs]
        out += [f"  {line}" for line in self.deliveries]
        if self.delivery_failed:
            day = self.digest_date.isoformat()
            out.append(
                f"  the digest is stored and published; send it again: digest deliver --date {day}"
            )
        return out
