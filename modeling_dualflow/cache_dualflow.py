"""KV cache of a Dual-Flow model: the primary flow's keys and values, nothing else."""

from transformers.cache_utils import DynamicCache


class DualFlowCache(DynamicCache):
    """
    A `DynamicCache` holding the primary flow's K/V only. The auxiliary flow reads these keys/values and writes no
    state, so the cache of a Dual-Flow model is byte for byte the size of its base model's cache for the same tokens.
    Sliding-window layers (`config.sliding_window`) are handled as `DynamicCache(config=...)` does.
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
