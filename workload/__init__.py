"""Traces of the digest's real load, their replay against any OpenAI-compatible endpoint, and the
metrics of a replay (TTFT, TPOT, ITL, E2E latency, throughput, goodput)."""
