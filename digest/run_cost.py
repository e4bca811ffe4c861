"""What a night cost, for the run report: the tokens the run recorded at a price per million
(a cloud API), or the GPU-hours the self-hosted server was up for the run at a price per hour
(the capacity catalogue's assumed on-demand price for the GPU, or the operator's own)."""

from __future__ import annotations

from dataclasses import dataclass

from capacity.gpus import find_gpu


@dataclass(slots=True, frozen=True)
class Pricing:
    """Either token prices (USD per million prompt / completion tokens) or a GPU: a catalogue
    name, how many the server holds, and optionally the operator's own USD per GPU-hour."""

    price_in_per_mtok: float | None = None
    price_out_per_mtok: float | None = None
    gpu: str | None = None
    gpus: int = 1
    price_per_gpu_hour: float | None = None

    def __post_init__(self) -> None:
        """Each refusal names the option to fix (the command prints it as its one line)."""
        tokens = self.price_in_per_mtok is not None or self.price_out_per_mtok is not None
        if tokens and self.gpu is not None:
            raise ValueError(
                "--price-per-mtok and --gpu: price the night by tokens or by GPU-hours, not both"
            )
        if tokens and (self.price_in_per_mtok is None or self.price_out_per_mtok is None):
            raise ValueError(
                "--price-per-mtok: token pricing needs both the prompt and the completion price"
            )
        if self.price_per_gpu_hour is not None and self.gpu is None:
            raise ValueError("--gpu-price: a price per GPU-hour needs the GPU (--gpu)")
        for option, prices in (
            ("--price-per-mtok", (self.price_in_per_mtok, self.price_out_per_mtok)),
            ("--gpu-price", (self.price_per_gpu_hour,)),
        ):
            # `not 0 <= p` also catches NaN, which compares false with everything.
            bad = [p for p in prices if p is not None and not 0 <= p < 1e6]
            if bad:
                raise ValueError(f"{option}: prices must be between 0 and 1e6 USD, not {bad[0]!r}")
        if not 1 <= self.gpus <= 1024:
            raise ValueError(f"--gpus must be between 1 and 1024, not {self.gpus}")
        if self.gpu is not None:
            try:
                find_gpu(self.gpu)  # an unknown name fails at start, not after the night
            except ValueError as exc:
                raise ValueError(f"--gpu: {exc}") from None


@dataclass(slots=True, frozen=True)
class NightCost:
    usd: float
    basis: str  # how it was computed, for the report line

    def line(self) -> str:
        return f"  cost: ${self.usd:.4f} ({self.basis})"


def night_cost(
    pricing: Pricing | None, prompt_tokens: int, completion_tokens: int, wall_s: float
) -> NightCost | None:
    if pricing is None:
        return None
    if pricing.gpu is None:
        assert pricing.price_in_per_mtok is not None and pricing.price_out_per_mtok is not None
        usd = (
            prompt_tokens * pricing.price_in_per_mtok
            + completion_tokens * pricing.price_out_per_mtok
        ) / 1e6
        basis = (
            f"{prompt_tokens} prompt tokens at ${pricing.price_in_per_mtok:g}/M + "
            f"{completion_tokens} completion tokens at ${pricing.price_out_per_mtok:g}/M"
        )
        return NightCost(usd, basis)
    gpu = find_gpu(pricing.gpu)
    per_hour = (
        gpu.price_per_hour if pricing.price_per_gpu_hour is None else pricing.price_per_gpu_hour
    )
    source = "catalogue" if pricing.price_per_gpu_hour is None else "given"
    # The server is held for the whole run: its wall time is what a rented GPU bills.
    gpu_hours = pricing.gpus * wall_s / 3600
    basis = f"{gpu_hours:.4f} GPU-hours of {gpu.name} at ${per_hour:g}/h ({source})"
    return NightCost(gpu_hours * per_hour, basis)
