"""Structured output (guided decoding) with llguidance: a request's constraint becomes a grammar
(`grammar.py`, compiled once per tokenizer and spec), each constrained request carries its own
matcher (`matcher.py`), and the sampler masks the constrained rows of a step's logits with the
matchers' token bitmasks (`bitmask.py`)."""
