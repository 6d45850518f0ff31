"""Key/value cache for incremental decoding, plus the decode-time state memory blocks carry across steps."""

import torch


class KVCache:
    """Per-layer K/V tensors of shape (B, kv_heads, max_len, d); ``pos`` tokens are filled.

    ``memory_state`` is a free dict owned by the model's memory block (e.g. the previous token id needed by
    the bigram hash of the next decode step).
    """

    def __init__(self, batch_size: int, n_layer: int, n_kv_head: int, head_dim: int, max_len: int,
                 device=None, dtype=torch.float32):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0
        self.memory_state: dict = {}

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, dtype=torch.float32) -> "KVCache":
        cfg = model.config
        device = model.wte.weight.device
        return cls(batch_size, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, max_len, device=device, dtype=dtype)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v (B, kv_heads, T, d) at ``pos`` and return the filled prefix including them."""
        T = k.size(2)
        end = self.pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > max_len {self.max_len}")
        self.k[layer, :, :, self.pos : end] = k.to(self.k.dtype)
        self.v[layer, :, :, self.pos : end] = v.to(self.v.dtype)
        return self.k[layer, :, :, :end].to(k.dtype), self.v[layer, :, :, :end].to(v.dtype)

    def advance(self, T: int) -> None:
        self.pos += T

    def reset(self) -> None:
        self.pos = 0
        self.memory_state = {}
