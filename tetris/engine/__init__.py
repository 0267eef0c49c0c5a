"""Single-instance engine: paged KV cache, block manager, sampling, continuous batching."""
