"""Triton kernels for the GPU path: attention (paged_attention, kv_write) and the fused
non-attention ops (rms_norm, rotary, silu_mul) behind engine/models/ops.py.

Every kernel converts its loads to float32 right after loading (the Triton interpreter computes
bf16 wrongly), masks every load, and uses power-of-two blocks with masks for other sizes, so that
the same code runs on a GPU and, in the tests, on the CPU with TRITON_INTERPRET=1.
"""
