"""Nightshift: a self-hosted LLM inference engine, the nightly digest it serves, and the tools
that measure and plan it. The `nightshift` command lives in `nightshift.cli`."""

__version__ = "0.1.0"
