"""
vLLM's KV connectors for the Dual-Flow model: they move the primary layers' KV, the base model's, and nothing else.

The aux attention layers are KV-sharing layers (`kv_sharing_target_layer_name`): they read their primary layer's pages
and own none. vLLM's connectors do not tell them apart: the runner registers them with the target's pages, the
attention ops save and wait for each layer they run, and the ExampleConnector loads every forward-context layer that
has a `kv_cache`. So the engine configuration (engine_config.py) swaps the configured connector class for a subclass
that leaves the KV-sharing layers out of those four calls (`DualFlow<connector name>`, built here by name); the
scheduler side, the files and the wire format stay the connector's own, so the other side can be a base-model engine.

The other side must serve this model's primary flow (its source model, or the checkpoint itself). Where a connector's
wire format lets the consumer see the other side's shapes, KV of another model is refused by vLLM's own mechanism for
KV that fails to load: its blocks are reported as load errors, and the engine's `kv_load_failure_policy` applies
(by default the request ends with an error; "recompute" computes the prompt here instead). Over NIXL, vLLM's handshake
compares the two engines' model names among other things: the consumer is told its producer's (`producer_model`).
"""

import copy
import dataclasses
from functools import cache, cached_property

import torch
from safetensors import safe_open
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ReqMeta
from vllm.logger import init_logger


logger = init_logger(__name__)


PREFIX = "DualFlow"
# The connectors run and tested with the Dual-Flow model (on vLLM's CPU build), and the roles each ran in.
TESTED_ROLES = {
    "ExampleConnector": ("kv_producer", "kv_consumer", "kv_both"),
    "NixlConnector": ("kv_consumer",),
}
TESTED_CONNECTORS = tuple(TESTED_ROLES)
# Why each is refused under tensor parallelism.
NOT_WITH_TENSOR_PARALLELISM = {
    "ExampleConnector": "its files carry no rank: the ranks overwrite each other's KV",
    "NixlConnector": "never run with this model",
}
# What a Dual-Flow consumer of the NixlConnector accepts KV from: the model its producer was started with.
PRODUCER_MODEL = "producer_model"


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


@dataclasses.dataclass
class LoadFromConnector(ReqMeta):
    """The ExampleConnector's load of a request (it writes the whole aligned prompt), with the tokens the connector
    provides: `num_external_tokens` from `first_external_token` on. The blocks before them are the engine's own
    prefix cache, which other requests may share."""

    first_external_token: int = 0
    num_external_tokens: int = 0


class RefuseOtherModelsFiles:
    """
    Mixed in before the ExampleConnector, whose files hold one layer's KV of one prompt and nothing of the model that
    wrote them: a request whose files miss one of this model's KV-owning layers (a producer with fewer layers) or hold
    KV of another shape per token (other heads or head size) is not loaded, and the blocks it was to get from the
    connector are load errors: not the blocks of its prompt the engine found in its own prefix cache, which other
    running requests may share. A producer with more layers of the same shapes cannot be told apart by these files.
    """

    # Scheduler side: which tokens each request loads from the connector, past its local prefix cache hit.

    @cached_property
    def _local_hits(self) -> dict[str, int]:
        return {}

    @cached_property
    def _external_tokens(self) -> dict[str, tuple[int, int]]:
        return {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._local_hits[request.request_id] = num_computed_tokens
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        local_hit = self._local_hits.pop(request.request_id, 0)
        if num_external_tokens > 0:
            self._external_tokens[request.request_id] = (local_hit, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request, block_ids):
        self._local_hits.pop(request.request_id, None)  # a request that ends before it is scheduled
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output):
        # The loads the ExampleConnector adds, in its order: new requests, then those resumed after preemption.
        cached = scheduler_output.scheduled_cached_reqs
        loading = [new.req_id for new in scheduler_output.scheduled_new_reqs if new.req_id in self._external_tokens]
        loading += [id_ for id_ in cached.req_ids if id_ in cached.resumed_req_ids and id_ in self._external_tokens]
        metadata = super().build_connector_meta(scheduler_output)  # it asserts one load per request it was told of
        loading = iter(loading)
        for i, request in enumerate(metadata.requests):
            if not request.is_store:
                fields = {field.name: getattr(request, field.name) for field in dataclasses.fields(ReqMeta)}
                first, count = self._external_tokens[next(loading)]
                metadata.requests[i] = LoadFromConnector(
                    **fields, first_external_token=first, num_external_tokens=count
                )
        self._external_tokens.clear()
        return metadata

    # Worker side

    def start_load_kv(self, forward_context, **kwargs):
        metadata = self._get_connector_metadata()
        loaded = []
        for request in metadata.requests:
            problem = None if request.is_store else self._kv_file_problem(request, forward_context.no_compile_layers)
            if problem is None:
                loaded.append(request)
            else:
                logger.warning("KV of a %d-token prompt not loaded: %s", len(request.slot_mapping), problem)
                first = request.first_external_token
                external = request.slot_mapping[first : first + request.num_external_tokens]
                self._blocks_with_load_errors.update((external // self._block_size).tolist())
        metadata.requests = loaded
        super().start_load_kv(forward_context, **kwargs)

    def _kv_file_problem(self, request, layers) -> str | None:
        # what the connector writes into a layer's pages for these tokens: [tokens, ...] in the pages' own layout
        slots = torch.zeros(len(request.slot_mapping), dtype=torch.long, device="meta")
        for name, layer in layers.items():
            pages = getattr(layer, "kv_cache", None)
            if pages is None:
                continue
            path = self._generate_filename_debug(name, request.token_ids, request.mm_hashes)
            try:
                with safe_open(path, "pt") as file:
                    shape = tuple(file.get_slice("kv_cache").get_shape())
            except FileNotFoundError:
                return f"the producer wrote no KV for layer {name} (a model with fewer layers)"
            expected = tuple(torch.empty(pages.shape, device="meta")[slots, :, slots].shape)
            if shape != expected:
                return (
                    f"layer {name} holds KV of shape {list(shape)}, this model's take {list(expected)} (another model)"
                )
        return None

    @cached_property
    def _blocks_with_load_errors(self) -> set[int]:
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks = super().get_block_ids_with_load_errors() | self._blocks_with_load_errors
        self._blocks_with_load_errors.clear()
        return blocks


class MovesKVAroundLayers:
    """Mixed in before the ExampleConnector, which loads and saves in its layer hooks (around each attention call)."""

    def moves_kv_in_layers(self) -> bool:
        """Whether the step under way loads or saves a prompt: the step's metadata lists the requests."""
        return bool(self._get_connector_metadata().requests)


class AcceptNamedProducer:
    """
    Mixed in before the NixlConnector. vLLM's NIXL handshake refuses a producer whose compatibility hash differs from
    the consumer's own; the hash covers the vLLM version, the model as each engine was started (its path or name),
    the dtype, KV heads, head size, layer count, attention backend and KV cache dtype. So a Dual-Flow consumer accepts
    KV from an engine serving the same checkpoint and refuses its base model's engine. With `producer_model` in
    `kv_connector_extra_config` (the model the producer was started with, as it was given) the consumer expects that
    model's hash, with everything else its own: KV from an engine serving that model, and no other.
    """

    def register_kv_caches(self, kv_caches):
        # vLLM's NIXL package loads the NIXL library: imported where the connector runs, not by every engine
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import compute_nixl_compatibility_hash

        super().register_kv_caches(kv_caches)
        producer_model = self._vllm_config.kv_transfer_config.get_from_extra_config(PRODUCER_MODEL, None)
        if producer_model is None:
            return
        # The handshake compares the producer's hash with `compat_hash`; the consumer's own, computed above, stays
        # in the metadata it advertises.
        vllm_config = copy.copy(self._vllm_config)
        model_config = copy.copy(vllm_config.model_config)
        object.__setattr__(model_config, "model", producer_model)
        object.__setattr__(vllm_config, "model_config", model_config)
        worker = self.connector_worker
        worker.compat_hash = compute_nixl_compatibility_hash(
            vllm_config, worker.backend_name, transfer_mode=worker._TRANSFER_MODE
        )
        logger.info("NixlConnector: KV accepted from producers serving %s", producer_model)

    def moves_kv_in_layers(self) -> bool:
        """Never: NIXL reads a prompt's blocks between steps (the request waits), and its layer hooks do nothing."""
        return False


# What each tested connector adds: the checks its wire format allows on the consumer side, and when it moves KV.
CONNECTOR_MIXINS = {
    "ExampleConnector": (RefuseOtherModelsFiles, MovesKVAroundLayers),
    "NixlConnector": (AcceptNamedProducer,),
}


@cache
def connector_class(name: str) -> type:
    """`DualFlow<connector name>`: the connector vLLM registers under that name, without the KV-sharing layers."""
    bases = (SkipKVSharingLayers, *CONNECTOR_MIXINS[name], KVConnectorFactory.get_connector_class_by_name(name))
    return type(PREFIX + name, bases, {})


def __getattr__(name: str):
    # vLLM imports the connector class by name from `kv_connector_module_path`, in every process that builds one.
    if name.startswith(PREFIX) and name[len(PREFIX) :] in TESTED_CONNECTORS:
        return connector_class(name[len(PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def moves_kv_this_step() -> bool:
    """Whether the engine's KV connector loads or saves anything around the layers' attention calls in the step under
    way (its metadata is bound for the step)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return False
    connector = get_kv_transfer_group()
    return connector.has_connector_metadata() and connector.moves_kv_in_layers()


def uses_kv_connector(vllm_config) -> bool:
    """Whether the engine is configured with a KV connector (disaggregated prefill, KV offloading)."""
    return vllm_config.kv_transfer_config is not None and vllm_config.kv_transfer_config.kv_connector is not None


def use_connector_without_kv_sharing_layers(kv_transfer_config) -> None:
    """Point the engine's KV transfer configuration at the connector's subclass here; refuse untested connectors and
    roles."""
    if kv_transfer_config.kv_connector_module_path == __name__:  # already done (the hook may run more than once)
        return
    name = kv_transfer_config.kv_connector
    if kv_transfer_config.kv_connector_module_path or name not in TESTED_CONNECTORS:
        raise ValueError(
            f"Dual-Flow in vLLM runs the KV connector {' or '.join(TESTED_CONNECTORS)} only (tested), not {name!r}: "
            "the serving guide lists what is supported"
        )
    role = kv_transfer_config.kv_role
    if role not in TESTED_ROLES[name]:
        raise ValueError(
            f"Dual-Flow in vLLM runs the {name} as {' or '.join(TESTED_ROLES[name])} only (tested), not as {role!r}: "
            "prefill with vLLM's engine on the base model, decode with Dual-Flow"
        )
    kv_transfer_config.kv_connector = PREFIX + name
    kv_transfer_config.kv_connector_module_path = __name__
