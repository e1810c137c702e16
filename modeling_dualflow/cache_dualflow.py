"""KV cache of a Dual-Flow model: the primary flow's keys and values, nothing else."""

from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer, StaticSlidingWindowLayer


class DualFlowCache(DynamicCache):
    """
    The cache `generate` runs a Dual-Flow model on: the primary flow's keys and values only, written by the
    primary rows (the aux flow reads them and writes nothing). It is the size of the base model's cache for
    the same tokens, and `get_seq_length()` counts primary tokens. Everything else (sliding-window layers,
    offloading, `crop`, `reorder_cache`, `batch_select_indices`) is `DynamicCache`'s; static and quantized
    caches work too.
    """

    @classmethod
    def from_cache(cls, cache: Cache, config) -> "DualFlowCache":
        """A copy of a cache that the base model filled (a `DynamicCache` or `StaticCache`)."""
        check_cache_shapes(cache, config)
        new = cls(config=config)
        for source, target in zip(cache.layers, new.layers):
            if not source.is_initialized:
                continue
            if isinstance(source, StaticSlidingWindowLayer):
                # its slots are a ring buffer: the order of the tokens it keeps is not the order they came in
                raise ValueError(
                    "a static sliding-window cache cannot be copied: pass it to `generate` as it is"
                )
            length = int(source.get_seq_length())
            # a static layer holds `max_cache_len` slots, a sliding one the last window of tokens
            kept = min(length, source.keys.shape[-2])
            target.update(source.keys[..., :kept, :], source.values[..., :kept, :])
            if isinstance(target, DynamicSlidingWindowLayer):
                target.cumulative_length = length
        return new

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        tensors = [getattr(layer, name, None) for layer in self.layers for name in ("keys", "values")]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


def check_cache_shapes(cache: Cache, config, tp_size: int | None = None) -> None:
    """Refuses a cache filled by a model of other shapes: its keys would fail, or be read as this model's."""
    # under tensor parallelism each rank caches its own share of the heads
    expected = (config.num_hidden_layers, config.num_key_value_heads // (tp_size or 1), config.head_dim)
    for keys in (getattr(layer, "keys", None) for layer in cache.layers):
        found = (
            (len(cache.layers), keys.shape[1], keys.shape[-1])
            if keys is not None and keys.dim() == 4
            else None
        )
        if found not in (None, expected):
            raise ValueError(
                f"the cache holds {found[0]} layers of {found[1]} key/value heads of size {found[2]}, "
                f"this model needs {expected[0]} of {expected[1]} of size {expected[2]}: "
                "it was filled by a model of other shapes"
            )


__all__ = ["DualFlowCache"]
