"""
vLLM's KV connectors for the Dual-Flow model: they move the primary layers' KV, the base model's, and nothing else.

The aux attention layers are KV-sharing layers (`kv_sharing_target_layer_name`): they read their primary layer's pages
and own none. vLLM's connectors do not tell them apart: the runner registers them with the target's pages, the
attention ops save and wait for each layer they run, and the ExampleConnector loads every forward-context layer that
has a `kv_cache`. So the engine configuration (engine_config.py) swaps the configured connector class for a subclass
that leaves the KV-sharing layers out of those four calls (`DualFlow<connector name>`, built here by name); the
scheduler side, the files and the wire format stay the connector's own, so the other side can be a base-model engine.
"""

import dataclasses
from functools import cache, cached_property

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory


PREFIX = "DualFlow"
# The connectors run and tested with the Dual-Flow model (on vLLM's CPU build).
TESTED_CONNECTORS = ("ExampleConnector",)


class SkipKVSharingLayers:
    """Mixed in before a vLLM KV connector class: its layer-facing calls skip the KV-sharing layers."""

    @cached_property
    def _kv_sharing_layers(self) -> frozenset[str]:
        layers = self._vllm_config.compilation_config.static_forward_context
        return frozenset(name for name, layer in layers.items() if getattr(layer, "kv_sharing_target_layer_name", None))

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches({name: kv for name, kv in kv_caches.items() if name not in self._kv_sharing_layers})

    def start_load_kv(self, forward_context, **kwargs):
        layers = forward_context.no_compile_layers
        owning = {name: layer for name, layer in layers.items() if name not in self._kv_sharing_layers}
        super().start_load_kv(dataclasses.replace(forward_context, no_compile_layers=owning), **kwargs)

    def wait_for_layer_load(self, layer_name):
        if layer_name not in self._kv_sharing_layers:
            super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if layer_name not in self._kv_sharing_layers:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)


@cache
def connector_class(name: str) -> type:
    """`DualFlow<connector name>`: the connector vLLM registers under that name, without the KV-sharing layers."""
    return type(PREFIX + name, (SkipKVSharingLayers, KVConnectorFactory.get_connector_class_by_name(name)), {})


def __getattr__(name: str):
    # vLLM imports the connector class by name from `kv_connector_module_path`, in every process that builds one.
    if name.startswith(PREFIX) and name[len(PREFIX) :] in TESTED_CONNECTORS:
        return connector_class(name[len(PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_connector_without_kv_sharing_layers(kv_transfer_config) -> None:
    """Point the engine's KV transfer configuration at the connector's subclass here; refuse untested connectors."""
    if kv_transfer_config.kv_connector_module_path == __name__:  # already done (the hook may run more than once)
        return
    name = kv_transfer_config.kv_connector
    if kv_transfer_config.kv_connector_module_path or name not in TESTED_CONNECTORS:
        raise ValueError(
            f"Dual-Flow in vLLM runs the KV connector {' or '.join(TESTED_CONNECTORS)} only (tested), not {name!r}: "
            "the serving guide lists what is supported"
        )
    kv_transfer_config.kv_connector = PREFIX + name
    kv_transfer_config.kv_connector_module_path = __name__
