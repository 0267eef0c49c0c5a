"""Attention kernels: attention with log-sum-exp, LSE merge, paged decode attention, KV pack/unpack."""
