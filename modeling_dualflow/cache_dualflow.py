"""KV cache of a Dual-Flow model: the primary flow's keys and values, nothing else."""

from transformers.cache_utils import DynamicCache


class DualFlowCache(DynamicCache):
    """
    The cache `generate` runs a Dual-Flow model on (and `forward` builds when called with `use_cache=True` and no
    cache). Its contract:

    - It holds the primary flow's keys and values only, one entry per layer, written by the primary rows. The
      auxiliary flow reads them and writes nothing, so the cache is byte for byte the size of the base model's cache
      for the same tokens, and `get_seq_length()` is the number of primary tokens cached (the aux flow adds none).
    - `nbytes()` says how many bytes the cached keys and values take.
    - Everything else is `DynamicCache`'s: sliding-window layers (`config.sliding_window`), `offloading=True`,
      `crop`, `reorder_cache` and `batch_select_indices` for assisted decoding and beam search.

    Static and quantized caches, as transformers prepares them, hold the same primary keys and values and work too.
    """

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        total = 0
        for layer in self.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if tensor is not None and tensor.numel():
                    total += tensor.numel() * tensor.element_size()
        return total


__all__ = ["DualFlowCache"]
