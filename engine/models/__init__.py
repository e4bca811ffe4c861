"""Model definitions and weight loading (one decoder family covers Llama, Mistral, Qwen2, Qwen3)."""
