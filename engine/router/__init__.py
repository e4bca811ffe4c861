"""Data parallelism: an OpenAI-compatible router in front of several `nightshift serve`
replicas (prefix-aware routing, health checks, retries before the first byte, streaming
passthrough, aggregated /metrics), and `serve --data-parallel-size N`, which starts N engines
behind one."""
