"""Llama-family model in torch, weight loading and tokenizers."""
