"""KV streaming from many prefill instances to one decode instance: handshake, backends, traffic classes."""
