"""The engine: KV cache, sampling, and the generation loop behind ``freetoken.LLM``."""
