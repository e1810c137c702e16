"""KV cache of a Dual-Flow model: the primary flow's keys and values, nothing else."""

from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer, StaticSlidingWindowLayer


class DualFlowCache(DynamicCache):
    """
    The cache `generate` runs a Dual-Flow model on (and `forward` builds when called with `use_cache=True` and no
    cache). Its contract:

    - It holds the primary flow's keys and values only, one entry per layer, written by the primary rows. The
      auxiliary flow reads them and writes nothing, so the cache is byte for byte the size of the base model's cache
      for the same tokens, and `get_seq_length()` is the number of primary tokens cached (the aux flow adds none).
    - `nbytes()` says how many bytes the cached keys and values take.
    - `from_cache(cache, config)` copies a cache another model filled, such as the base model's prefill.
    - Everything else is `DynamicCache`'s: sliding-window layers (`config.sliding_window`), `offloading=True`,
      `crop`, `reorder_cache` and `batch_select_indices` for assisted decoding and beam search.

    Static and quantized caches, as transformers prepares them, hold the same primary keys and values and work too.
    """

    @classmethod
    def from_cache(cls, cache: Cache, config) -> "DualFlowCache":
        """
        A `DualFlowCache` holding the tokens `cache` holds. The primary flow is the base model, so a cache its source
        family's own class filled (a `DynamicCache` or a `StaticCache`) is one this model can go on from; a cache of
        other shapes is refused.
        """
        check_cache_shapes(cache, config)
        new = cls(config=config)
        for source, target in zip(cache.layers, new.layers):
            if not source.is_initialized:
                continue
            if isinstance(source, StaticSlidingWindowLayer):
                # its slots are a ring buffer: the order of the tokens it keeps is not the order they came in
                raise ValueError("a static sliding-window cache cannot be copied: pass it to `generate` as it is")
            length = int(source.get_seq_length())
            # a static layer holds `max_cache_len` slots, a sliding one the last window of tokens
            kept = min(length, source.keys.shape[-2])
            target.update(source.keys[..., :kept, :], source.values[..., :kept, :])
            if isinstance(target, DynamicSlidingWindowLayer):
                target.cumulative_length = length
        return new

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        total = 0
        for layer in self.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if tensor is not None and tensor.numel():
                    total += tensor.numel() * tensor.element_size()
        return total


def check_cache_shapes(cache: Cache, config, tp_size: int | None = None) -> None:
    """
    Refuse a cache that a model of other shapes filled (layer count, key/value heads, head size): its keys and values
    would fail deep inside attention, or worse, be read as this model's. Layers not filled yet are not checked.
    """
    # under tensor parallelism each rank caches its own share of the heads
    num_heads = config.num_key_value_heads // (tp_size or 1)
    expected = (config.num_hidden_layers, num_heads, config.head_dim)
    filled = [
        layer.keys for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4
    ]
    if not filled:
        return
    found = (len(cache.layers), filled[0].shape[1], filled[0].shape[-1])
    if found != expected or any(keys.shape[1] != num_heads or keys.shape[-1] != config.head_dim for keys in filled):
        raise ValueError(
            f"the cache holds {found[0]} layers of {found[1]} key/value heads of size {found[2]}, this model needs "
            f"{expected[0]} of {expected[1]} of size {expected[2]}: it was filled by a model of other shapes"
        )


__all__ = ["DualFlowCache"]
