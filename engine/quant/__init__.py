"""Weight quantization: integer and fp8 weight layouts, their matmuls, and where they come from
(a float checkpoint quantized at load, a quantized folder, a GGUF file's own blocks)."""
