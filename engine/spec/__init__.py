"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection sampler
that verifies their tokens against the target model, and the counters that say how well it went."""
