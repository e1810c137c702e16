"""
The ways `dualflow compare` runs one checkpoint's weights, each called like a causal LM:
- primary-only: the aux flow off, i.e. the base model;
- dual-flow: the grouped execution (aux flow on), with the config's aux rounds;
- dual-flow r1, r2, ...: the same with fewer aux rounds (models with `aux_num_rounds` > 1), the decode cost per round;
- two-pass: the same result computed as two batched passes over the layers (`two_pass.TwoPassDualFlow`; models with
  one aux round and no aux adapters);
- single top-k=k_a (MoE): the aux flow off and every token routed to k_a experts ("scale the whole model").
"""

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from modeling_dualflow import DualFlowCache

from ..scoring import mean_token_nll
from .two_pass import TwoPassDualFlow


BASELINE = "primary-only"


@dataclass(frozen=True)
class Variant:
    name: str
    runner: nn.Module  # the model, a twin sharing its weights, or TwoPassDualFlow around it
    forward_kwargs: dict = field(default_factory=dict)
    cache_config: object = None  # config for the cache (sliding-window layers); None: keep every key

    def new_cache(self) -> DualFlowCache:
        return DualFlowCache(config=self.cache_config)

    def step(self, input_ids: torch.Tensor, cache: DualFlowCache) -> torch.Tensor:
        """Feed `input_ids` after the tokens already in `cache`; return the next-token logits (batch, vocab)."""
        outputs = self.runner(input_ids, cache=cache, use_cache=True, logits_to_keep=1, **self.forward_kwargs)
        return outputs.logits[:, -1]

    @torch.no_grad()
    def nll(self, blocks: torch.Tensor, batch_size: int) -> float:
        """Mean next-token NLL of this variant's prediction over `blocks` (num_blocks, T)."""
        return mean_token_nll(self.runner, blocks, batch_size, **self.forward_kwargs)


def with_top_k(model, top_k: int):
    """The same model, configured to route every primary token to `top_k` experts; it shares every tensor of `model`."""
    config = copy.deepcopy(model.config)
    config.num_experts_per_tok = top_k
    with torch.device("meta"):  # no weights allocated: they come from `model` below
        twin = type(model)(config)
    twin.load_state_dict(model.state_dict(), assign=True)
    twin.model.rotary_emb = model.model.rotary_emb  # its tables are buffers outside the state dict
    return twin.eval()


def build_variants(model) -> list[Variant]:
    config = model.config
    variants = [
        Variant(BASELINE, model, {"use_aux_flow": False}, config),
        Variant("dual-flow", model, {"use_aux_flow": True}, config),
    ]
    variants += [
        Variant(f"dual-flow r{rounds}", model, {"use_aux_flow": True, "aux_num_rounds": rounds}, config)
        for rounds in range(1, config.aux_num_rounds)
    ]
    # the two-pass execution walks the layers once for the aux flow, through the shared weights alone
    if config.aux_num_rounds == 1 and not config.aux_adapter_rank:
        variants.append(Variant("two-pass", TwoPassDualFlow(model)))
    if config.num_experts:
        k_a = config.aux_num_experts_per_tok
        variants.append(Variant(f"single top-k={k_a}", with_top_k(model, k_a), {"use_aux_flow": False}, config))
    return variants
