"""Key/value cache for incremental decoding, plus the decode-time state memory blocks carry across steps."""

import torch


class KVCache:
    """Per-layer K/V storage of shape (B, kv_heads, max_len, d); ``pos`` tokens are filled.

    Each layer's K and V are stored in the dtype the model writes them in (``dtype=None``, the default: allocated
    at the layer's first ``update``), so ``update`` returns views of the storage with no conversion. A fixed
    ``dtype`` allocates every layer up front in that dtype. Either way a later write in another dtype is an error:
    converting it would silently round (a wider write into narrower storage) or change the dtype attention sees.

    ``memory_state`` is a free dict owned by the model's memory block (e.g. the previous token id needed by
    the bigram hash of the next decode step).
    """

    def __init__(self, batch_size: int, n_layer: int, n_kv_head: int, head_dim: int, max_len: int,
                 device=None, dtype: torch.dtype | None = None):
        self.shape = (batch_size, n_kv_head, max_len, head_dim)
        self.device = device
        # lists, not one (n_layer, ...) tensor: K and V of each layer take the dtype of their own first write, so
        # nothing forces one dtype on all of them (outside autocast a caller may write fp32 k beside a bf16 v;
        # under autocast causal_attention casts both to SDPA's dtype first)
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        if dtype is not None:
            for layer in range(n_layer):
                self.k[layer], self.v[layer] = self._alloc(dtype, device), self._alloc(dtype, device)
        self.max_len = max_len
        self.pos = 0
        self.memory_state: dict = {}

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> "KVCache":
        cfg = model.config
        device = model.wte.weight.device
        return cls(batch_size, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, max_len, device=device, dtype=dtype)

    def _alloc(self, dtype, device) -> torch.Tensor:
        # empty, not zeros: only the filled prefix [:pos] is ever read
        return torch.empty(self.shape, dtype=dtype, device=device)

    def _store(self, buf: list, layer: int, new: torch.Tensor, name: str) -> torch.Tensor:
        """Write ``new`` (B, kv_heads, T, d) at ``pos`` into layer ``layer`` of ``buf``; return the filled prefix
        (B, kv_heads, pos+T, d) as a view of the storage."""
        if buf[layer] is None:
            buf[layer] = self._alloc(new.dtype, self.device if self.device is not None else new.device)
        store = buf[layer]
        if new.dtype != store.dtype:
            raise TypeError(f"KV cache layer {layer}: {name} arrives as {new.dtype} but the cache holds "
                            f"{store.dtype} (allocated at the first write); decode in one dtype, or build the "
                            f"cache with dtype={new.dtype}")
        end = self.pos + new.size(2)
        store[:, :, self.pos : end] = new
        return store[:, :, :end]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v (B, kv_heads, T, d) at ``pos`` and return views (B, kv_heads, pos+T, d) of the filled prefix
        including them, in the storage's (= the written) dtype. Both are checked before anything is written: a
        batch, head count or head dim other than the cache's (a batch of 1 would broadcast over every row) is a
        ValueError naming the expected and the got shape."""
        batch, heads, _, head_dim = self.shape
        tokens = k.size(2) if k.dim() == 4 else "T"
        expected = (batch, heads, tokens, head_dim)
        for name, new in (("k", k), ("v", v)):
            if tuple(new.shape) != expected:
                raise ValueError(f"KV cache layer {layer}: {name} has shape {tuple(new.shape)}, expected "
                                 f"({', '.join(map(str, expected))}) (batch, kv heads, tokens, head dim; the cache "
                                 f"was built for batch {batch}, {heads} kv heads of dim {head_dim})")
        end = self.pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > max_len {self.max_len}")
        return self._store(self.k, layer, k, "k"), self._store(self.v, layer, v, "v")

    def advance(self, T: int) -> None:
        self.pos += T

    def reset(self) -> None:
        self.pos = 0
        self.memory_state = {}
