"""Attention backends: the torch reference (CPU, and the oracle in tests); Triton on GPU later."""
