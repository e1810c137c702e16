"""
Dual-Flow causal LM for vLLM, built from vLLM's own layers.

The primary flow is the base model: every scheduled token goes through it and it alone writes the paged KV cache.
The aux flow runs only at the rows vLLM samples from (each request's last scheduled token in a step, or every draft
position under speculative decoding); its attention reads the primary layer's cache through a KV-sharing `Attention`
layer with twice the query heads, which writes nothing. Three compiled pieces, each with one dynamic size, chosen per
step outside the graphs (vLLM traces a compiled module once; the dynamic size selects only the compile range, and the
forward context's batch descriptor the CUDA graph):

- every row sampled (pure decode, speculative verification): `DualFlowEveryRowModel`. The aux row sits at its primary
  row's position, so the two flows' rows are stacked and each projection, norm, router and experts call serves both
  (grouped execution), and one call of the aux attention layer attends for both flows, the primary queries and the
  aux queries as its 2H heads over pages read once.
- some rows sampled (prefill, mixed steps): the primary piece (`DualFlowModel`) on every row, then the aux rows piece
  (`DualFlowAuxRowsModel`) on the sampled rows alone, their inputs (token ids, positions, the primary states the
  couplings read, which the primary piece gathers at the sampled rows only) copied into persistent buffers sized for
  the most rows a step samples, as vLLM's Gemma3n runs its cross-decoder. vLLM's KV-sharing fast-prefill metadata (switched on by `DualFlowEngineConfig`) gives the aux
  attention layers exactly the sampled rows, so prefill pays the base model plus one aux row per request.

After the final norm the aux states replace the primary states at the sampled rows: `compute_logits`, the sampler and
everything downstream then see the aux prediction there. Other rows (prompt logprobs) keep the primary flow's states,
i.e. the base model's prediction, unless the engine runs with `aux_at_every_prompt_position` (engine_config.py): fast
prefill then stays off, the aux metadata covers every row, and so does the aux flow.
"""

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.sequence import IntermediateTensors

from . import vllm_internals
from .engine_config import check_supported
from .kv_transfer import moves_kv_this_step


class DualFlowMLP(nn.Module):
    """Dense SwiGLU MLP (dense layers and the Qwen2-MoE shared expert, scaled by sigmoid(expert_gate(x)))."""

    def __init__(
        self,
        config,
        intermediate_size: int,
        quant_config,
        reduce_results: bool = True,
        expert_gate: nn.Module | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()
        self.expert_gate = expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        if self.expert_gate is not None:
            out = torch.sigmoid(self.expert_gate(x)[0]) * out
        return out


UNCHOSEN_LOGIT = -1e9  # an expert a chunk row does not route to: weight exp(-1e9) = 0 after any softmax
PADDING_LOGIT = -1e4  # ranks above every unchosen expert, so top-k picks it, and still weighs 0


def aux_chunk_logits(
    aux_logits: torch.Tensor, k_p: int, k_a: int, norm_topk_prob: bool, primary_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Router logits that make a top-k_p router (FusedMoE's own softmax top-k, renormalised or not) route the aux rows
    with k_a experts: each aux row becomes ceil(k_a / k_p) chunk rows of k_p (expert, weight) slots, chunk-major
    ([chunk 0 of every row; chunk 1; ...]). A chunk row's logits are log(w / s) at its experts (s: the chunk's weight
    sum, which the caller multiplies back), so softmax gives w / s and renormalising changes nothing. Slots left over
    when k_p does not divide k_a weigh 0 and point at an expert the same token streams anyway: the row's own first
    chunk, or (k_a < k_p) the primary row's experts at the same position (`primary_logits`, when there is one).

    aux_logits: (P, E); primary_logits: (P, E) or None. Returns chunk logits (chunks * P, E) in fp32 and the chunk
    weight sums (chunks * P, 1).
    """
    probs = F.softmax(aux_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k_a, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    chunks = -(-k_a // k_p)
    padding = chunks * k_p - k_a
    if padding:
        if chunks > 1:
            padding_ids = ids[:, :padding]
        else:  # rank the other experts by the primary router (the aux router's own ranking without a primary row)
            ranking = probs if primary_logits is None else F.softmax(primary_logits, dim=-1, dtype=torch.float32)
            padding_ids = ranking.scatter(1, ids, -1.0).topk(padding, dim=-1).indices
        ids, weights = torch.cat([ids, padding_ids], dim=-1), F.pad(weights, (0, padding))
    num_aux = aux_logits.shape[0]
    ids = ids.view(num_aux, chunks, k_p).transpose(0, 1).reshape(-1, k_p)
    weights = weights.view(num_aux, chunks, k_p).transpose(0, 1).reshape(-1, k_p)
    sums = weights.sum(dim=-1, keepdim=True)
    slot_logits = torch.log(weights / sums).clamp(min=PADDING_LOGIT)
    logits = torch.full((ids.shape[0], aux_logits.shape[-1]), UNCHOSEN_LOGIT, device=ids.device)
    return logits.scatter(1, ids, slot_logits), sums


class DualFlowSparseMoeBlock(nn.Module):
    """
    Shared router and experts for both flows, one experts call per layer, FusedMoE's own routing for every row.
    FusedMoE takes one top-k, so it is built with k_p: primary rows route as in the base model; with k_a != k_p each
    aux row enters as ceil(k_a / k_p) chunk rows whose router logits select its experts (`aux_chunk_logits`), and the
    chunks' outputs are summed back. The layout is a function of the call's inputs: no state between calls.

    A shared expert (Qwen2-MoE) goes into FusedMoE (`shared_experts=`, one all-reduce for both under tensor
    parallelism, as vLLM's Qwen2-MoE) wherever every row enters once. With chunk rows FusedMoE would add the shared
    expert to every chunk row, which the weighted sum of chunks cannot take out when the aux weights do not sum to 1,
    so there it runs beside FusedMoE, reduced on its own.
    """

    def __init__(self, config, quant_config, prefix: str = ""):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.aux_top_k = config.aux_num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.shared_expert = None
        self.shared_expert_in_experts = not config.use_aux_flow or self.aux_top_k == self.top_k  # no chunk rows
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert_gate = ReplicatedLinear(
                config.hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate"
            )
            self.shared_expert = DualFlowMLP(
                config,
                config.shared_expert_intermediate_size,
                quant_config,
                reduce_results=not self.shared_expert_in_experts,
                expert_gate=self.shared_expert_gate,
                prefix=f"{prefix}.shared_expert",
            )
        self.experts = FusedMoEFactory(
            shared_experts=self.shared_expert if self.shared_expert_in_experts else None,
            num_experts=config.num_experts,
            top_k=self.top_k,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor, num_primary: int) -> torch.Tensor:
        # hidden_states: [T primary rows; aux rows]: T aux rows at the primary rows' positions (every row sampled), or
        # the aux rows alone (T = 0: the aux rows piece)
        router_logits, _ = self.gate(hidden_states)
        num_aux = hidden_states.shape[0] - num_primary
        if num_aux == 0 or self.aux_top_k == self.top_k:
            out = self.experts(hidden_states=hidden_states, router_logits=router_logits)
        else:
            primary_logits = router_logits[:num_primary] if num_primary else None
            chunk_logits, chunk_sums = aux_chunk_logits(
                router_logits[num_primary:], self.top_k, self.aux_top_k, self.norm_topk_prob, primary_logits
            )
            chunks = chunk_logits.shape[0] // num_aux
            rows = torch.cat([hidden_states[:num_primary], hidden_states[num_primary:].repeat(chunks, 1)])
            logits = torch.cat([router_logits[:num_primary].float(), chunk_logits])
            out = self.experts(hidden_states=rows, router_logits=logits)
            aux_out = (out[num_primary:] * chunk_sums.to(out.dtype)).view(chunks, num_aux, -1).sum(dim=0)
            out = torch.cat([out[:num_primary], aux_out])
        if self.shared_expert is not None and not self.shared_expert_in_experts:
            out = out + self.shared_expert(hidden_states)
        return out


class DualFlowAuxAdapter(nn.Module):
    """
    The aux rows' low-rank delta `up(down(x))` on the output of a shared weight (`aux_adapter_rank`). Under tensor
    parallelism it is split like the weight it adapts: `sharded="output"` (q_proj) gives each rank the delta of its
    own heads, `sharded="input"` (o_proj) takes each rank's heads and sums `down` across ranks; the MLP output's is
    replicated.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, sharded: str | None = None, prefix: str = ""):
        super().__init__()
        down = RowParallelLinear if sharded == "input" else ReplicatedLinear
        up = ColumnParallelLinear if sharded == "output" else ReplicatedLinear
        self.down = down(in_features, rank, bias=False, return_bias=False, prefix=f"{prefix}.down")
        self.up = up(rank, out_features, bias=False, return_bias=False, prefix=f"{prefix}.up")

    def forward(self, output: torch.Tensor, inputs: torch.Tensor, num_primary: int) -> torch.Tensor:
        """`output` with the delta of `inputs` added to its aux rows (>= num_primary); primary rows untouched."""
        delta = self.up(self.down(inputs[num_primary:]))
        return torch.cat([output[:num_primary], output[num_primary:] + delta])


def aux_adapter(config, in_features: int, out_features: int, sharded: str | None = None, prefix: str = ""):
    """The checkpoint's aux adapter at `prefix` when the aux flow runs; None otherwise, so rank 0 costs nothing."""
    if not (config.aux_adapter_rank and config.use_aux_flow):
        return None
    return DualFlowAuxAdapter(in_features, out_features, config.aux_adapter_rank, sharded, prefix)


def stack_heads(first: torch.Tensor, second: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(N, H * d) twice -> (N, 2H * d): per KV head its H / Hkv heads of `first`, then as many of `second`, so that an
    attention call with 2H heads over Hkv KV heads gives both sets the KV heads they have in an H-head call."""
    rows = first.shape[0]
    return torch.cat([first.view(rows, num_kv_heads, -1), second.view(rows, num_kv_heads, -1)], dim=2).view(rows, -1)


def split_heads(stacked: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The inverse of `stack_heads` on an attention output, in one copy: (N, 2H * d) -> (2, N, H * d)."""
    rows = stacked.shape[0]
    return stacked.view(rows, num_kv_heads, 2, -1).permute(2, 0, 1, 3).reshape(2, rows, -1)


class DualFlowAttention(nn.Module):
    """q/k/v and o projections over [primary; aux] rows; the primary rows attend and fill the cache, the aux rows
    attend through `aux_attn` (`aux_paged_attention`, built by the model), which reads the same cache: in one call
    with the primary queries where every row is sampled, alone in the aux rows piece."""

    def __init__(self, config, cache_config, quant_config, prefix: str = ""):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qk_norm = config.qk_norm
        self.clip_qkv = config.clip_qkv
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        if config.qk_norm == "per_head":
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        elif config.qk_norm == "full":  # whole projection (OLMoE); check_supported keeps this to one TP rank
            self.q_norm = RMSNorm(self.q_size, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            self.head_dim, max_position=config.max_position_embeddings, rope_parameters=config.rope_parameters
        )
        q_dim = config.num_attention_heads * self.head_dim
        self.aux_q_adapter = aux_adapter(config, config.hidden_size, q_dim, "output", f"{prefix}.aux_q_adapter")
        self.aux_o_adapter = aux_adapter(config, q_dim, config.hidden_size, "input", f"{prefix}.aux_o_adapter")
        self.attention_args = dict(
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=config.sliding_window,
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, prefix=f"{prefix}.attn", **self.attention_args
        )

    def aux_paged_attention(self, prefix: str) -> Attention:
        """The aux flow's attention: 2H query heads (`stack_heads`: the primary queries or zeros, then the aux queries)
        over this layer's cache, which it reads and never writes (KV sharing)."""
        return Attention(
            2 * self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            prefix=prefix,
            kv_sharing_target_layer_name=self.attn.layer_name,
            **self.attention_args,
        )

    def can_attend_both_flows_at_once(self) -> bool:
        """Whether `_attend_both_flows` can run here: the backend writes the cache in its own op, and queries are not
        quantised inside the attention layer (fp8 KV cache); otherwise every step takes the two-call path."""
        return not (
            vllm_internals.attention_backend_writes_cache_in_its_call(self.attn)
            or vllm_internals.attention_quantises_queries(self.attn)
        )

    def _norm_per_head(self, states: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        by_head = states.view(*states.shape[:-1], -1, self.head_dim)
        return norm(by_head).view(states.shape)

    def _attend_both_flows(self, q, k, v, num_primary: int, aux_attn: Attention) -> torch.Tensor:
        """Every row sampled: aux row i sits at primary row i's position. Write the primary K/V, then attend both
        flows' queries as 2H heads in one call of `aux_attn`: the cache pages are read once per layer for both."""
        rows, head_dim = num_primary, self.head_dim
        key = k[:rows].view(rows, self.num_kv_heads, head_dim)
        value = v[:rows].view(rows, self.num_kv_heads, head_dim)
        query = stack_heads(q[:rows], q[rows:], self.num_kv_heads).view(rows, -1, head_dim)
        output = vllm_internals.write_cache_then_attend(self.attn, aux_attn, query, key, value)
        return split_heads(output.view(rows, -1), self.num_kv_heads).flatten(0, 1)  # [primary rows; aux rows]

    def forward(self, positions, hidden_states, num_primary: int, aux_attn: Attention | None) -> torch.Tensor:
        # hidden_states: normed, [T primary rows; aux rows]: with aux_attn and T > 0, T aux rows, aux row i at primary
        # row i (every row sampled); with T = 0 the aux rows alone (the aux rows piece, extra rounds)
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.aux_q_adapter is not None:  # on the projection, before norms and clipping (as in transformers)
            q = self.aux_q_adapter(q, hidden_states, num_primary)
        if self.qk_norm == "full":  # OLMoE normalises the whole projection, then clips
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (x.clamp(min=-self.clip_qkv, max=self.clip_qkv) for x in (q, k, v))
        if self.qk_norm == "per_head":
            q, k = self._norm_per_head(q, self.q_norm), self._norm_per_head(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        if aux_attn is None:
            attn_output = self.attn(q, k, v)
        elif num_primary:
            attn_output = self._attend_both_flows(q, k, v, num_primary, aux_attn)
        else:
            # The aux rows alone, after the primary piece wrote this step's K/V: the aux queries, zeros in the primary
            # heads. Their k/v are never written: a KV-sharing layer only reads its target's cache.
            query = stack_heads(torch.zeros_like(q), q, self.num_kv_heads)
            attn_output = split_heads(aux_attn(query, k, v), self.num_kv_heads)[1]
        output, _ = self.o_proj(attn_output)
        if self.aux_o_adapter is not None:
            output = self.aux_o_adapter(output, attn_output, num_primary)
        return output


class DualFlowGain(nn.Module):
    """A per-channel gain: the coupling c_l (the aux rows add c_l * h_l, the primary state entering the layer at the
    same position) and, with `aux_num_rounds` > 1, the gate on a layer's update in the extra aux rounds."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))


class DualFlowDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, cache_config, quant_config, prefix: str = ""):
        super().__init__()
        self.self_attn = DualFlowAttention(config, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        if config.is_moe_layer(layer_idx):
            self.mlp = DualFlowSparseMoeBlock(config, quant_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = DualFlowMLP(config, config.intermediate_size, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.use_aux_flow:  # a primary-only engine builds and loads none of the aux flow's weights
            self.aux_coupling = DualFlowGain(config.hidden_size)
            if config.aux_num_rounds > 1:
                self.aux_round_gate = DualFlowGain(config.hidden_size)
        self.aux_mlp_adapter = aux_adapter(
            config, config.hidden_size, config.hidden_size, prefix=f"{prefix}.aux_mlp_adapter"
        )

    def forward(
        self, positions, hidden_states, num_primary: int, aux_attn=None, primary_entering=None, extra_round=False
    ):
        # hidden_states: the T primary rows alone (aux_attn None), [T primary rows; T aux rows at the same positions]
        # (every row sampled), or the P aux rows alone (T = 0); primary_entering: (P, hidden), the primary state that
        # entered this layer at the aux rows' positions
        layer_input = hidden_states
        if primary_entering is not None:
            coupled = self.aux_coupling.weight * primary_entering
            hidden_states = torch.cat([hidden_states[:num_primary], hidden_states[num_primary:] + coupled])
        attn_out = self.self_attn(positions, self.input_layernorm(hidden_states), num_primary, aux_attn)
        normed, hidden_states = self.post_attention_layernorm(attn_out, hidden_states)  # fused residual add + norm
        is_moe = isinstance(self.mlp, DualFlowSparseMoeBlock)
        mlp_out = self.mlp(normed, num_primary) if is_moe else self.mlp(normed)
        if self.aux_mlp_adapter is not None:  # the delta of the MLP's (normed) input, added to the block's output
            mlp_out = self.aux_mlp_adapter(mlp_out, normed, num_primary)
        hidden_states = hidden_states + mlp_out
        if extra_round:
            return layer_input + self.aux_round_gate.weight * (hidden_states - layer_input)
        return hidden_states


def one_dynamic_size(positions: torch.Tensor, rows: torch.Tensor) -> None:
    """Tell the compiler that the positions' length is the rows' count, so a compiled piece has one dynamic size (the
    one vLLM picks its graphs by): the rotary embedding's custom op does not tie the two."""
    torch._check(positions.shape[-1] == rows.shape[0])


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class DualFlowModel(nn.Module):
    """
    The weights (the checkpoint's names) and the primary piece: every scheduled token through the primary flow (the
    base model), which writes this step's K/V. With the aux flow on it also returns, per row and layer, the primary
    state entering that layer (what the couplings read), for the aux rows piece (`DualFlowAuxRowsModel`).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.use_aux_flow = config.use_aux_flow
        self.aux_num_rounds = config.aux_num_rounds
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            DualFlowDecoderLayer(config, i, cache_config, quant_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.use_aux_flow:
            self.aux_embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=f"{prefix}.aux_embed_tokens"
            )
            # Built after every primary attention layer: vLLM hands its fast-prefill (sampled rows only) metadata to
            # the trailing run of KV-sharing layers in construction order.
            self.aux_attn = nn.ModuleList(
                layer.self_attn.aux_paged_attention(f"{prefix}.aux_attn.{i}") for i, layer in enumerate(self.layers)
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def sampled_rows(self, num_tokens: int) -> tuple[torch.Tensor, int] | None:
        """
        Rows of this step's tokens whose logits vLLM samples from, as the aux attention metadata sees them: the
        indices as long as the aux layers' queries (padded for graphs by repeating the last one) and how many are
        real. None when vLLM samples every row (pure decode, speculative verification, `aux_at_every_prompt_position`)
        or the step is a dummy run without metadata. Read outside the compiled pieces: it depends on the step's
        metadata, not on tensors.
        """
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # one metadata dict per micro-batch (vLLM's dual-batch overlap)
            raise ValueError(
                "Dual-Flow in vLLM does not run dual-batch overlap micro-batches: start the engine without enable_dbo"
            )
        if metadata is None:
            return None
        sampled = vllm_internals.sampled_rows_metadata(metadata.get(self.aux_attn[0].layer_name))
        primary_metadata = metadata.get(self.layers[0].self_attn.attn.layer_name)
        # Fast prefill off, or a step whose every scheduled token is sampled.
        if sampled is None or sampled[1] == getattr(primary_metadata, "num_actual_tokens", num_tokens):
            return None
        rows, num_sampled = sampled
        return rows.long(), num_sampled

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        aux_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Returns the T rows' final (normed) primary states; given `aux_rows` (indices into the T rows, of a fixed
        # length: not a second dynamic size) also (len(aux_rows), layers, hidden): the state entering each layer there.
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        one_dynamic_size(positions, hidden_states)
        entering = None
        if aux_rows is not None:
            entering = hidden_states.new_empty(aux_rows.shape[0], len(self.layers), hidden_states.shape[1])
        for i, layer in enumerate(self.layers):
            if entering is not None:  # gathered now: the layer's fused residual add may update its input in place
                entering[:, i] = hidden_states.index_select(0, aux_rows)
            hidden_states = layer(positions, hidden_states, hidden_states.shape[0])
        hidden_states = self.norm(hidden_states)
        return hidden_states if entering is None else (hidden_states, entering)

    def run_every_row(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Both flows through every layer, aux row i at primary row i: one q/k/v, o, router and experts call for both
        flows, one attention call (the pages read once). Returns the aux rows' final states."""
        num_primary = input_ids.shape[0]
        one_dynamic_size(positions, input_ids)
        hidden_states = torch.cat([self.embed_input_ids(input_ids), self.aux_embed_tokens(input_ids)])
        stacked_positions = torch.cat([positions, positions])
        entering = []
        for layer, aux_attn in zip(self.layers, self.aux_attn):
            entering.append(hidden_states[:num_primary])
            hidden_states = layer(stacked_positions, hidden_states, num_primary, aux_attn, entering[-1])
        return self.norm(self.extra_aux_rounds(positions, hidden_states[num_primary:], entering))

    def run_aux_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, entering: torch.Tensor) -> torch.Tensor:
        """The aux flow alone at P rows, over the K/V the primary piece wrote: input_ids, positions (P,), entering
        (P, layers, hidden) the primary states entering each layer there. Returns the P rows' final states."""
        aux_states = self.aux_embed_tokens(input_ids)
        one_dynamic_size(positions, aux_states)
        entering = entering.unbind(1)
        for layer, aux_attn, primary_entering in zip(self.layers, self.aux_attn, entering):
            aux_states = layer(positions, aux_states, 0, aux_attn, primary_entering)
        return self.norm(self.extra_aux_rounds(positions, aux_states, entering))

    def extra_aux_rounds(self, positions, aux_states: torch.Tensor, entering) -> torch.Tensor:
        # Rounds 2..R: the aux rows alone pass through every layer again, coupled to the same primary states and
        # reading the same cached primary K/V; nothing is written.
        for _ in range(self.aux_num_rounds - 1):
            for layer, aux_attn, primary_entering in zip(self.layers, self.aux_attn, entering):
                aux_states = layer(positions, aux_states, 0, aux_attn, primary_entering, extra_round=True)
        return aux_states


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class DualFlowEveryRowModel(nn.Module):
    """
    The compiled piece for steps in which vLLM samples every row (pure decode, speculative verification): `model`'s
    layers, both flows grouped (`DualFlowModel.run_every_row`). A separate piece because vLLM traces each compiled
    module once; it holds no weights of its own.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: DualFlowModel):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model.run_every_row(input_ids, positions)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "entering": 0})
class DualFlowAuxRowsModel(nn.Module):
    """
    The compiled piece for the aux flow in steps in which vLLM samples some rows only (prefill, mixed steps): runs
    after the primary piece, on the P sampled rows alone (`DualFlowModel.run_aux_rows`). One dynamic size, P, which
    selects the compile range; the CUDA graph is picked by the batch descriptor, set to P around this piece
    (`batch_descriptor_for`). Its inputs are views of persistent buffers (`DualFlowForCausalLM`): a graph captured
    for a larger P reads the same addresses, computes every row on its own, and the rows past the step's P are
    dropped.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: DualFlowModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, entering: torch.Tensor) -> torch.Tensor:
        return self.model.run_aux_rows(input_ids, positions, entering)


@contextmanager
def batch_descriptor_for(num_rows: int):
    """
    The forward context's batch descriptor set to `num_rows` while a piece runs on fewer rows than the step (the aux
    rows piece on the padded sampled rows): vLLM's piecewise CUDA-graph wrapper picks the graph to replay by the
    descriptor, not by the piece's input size, so without this a mixed step would replay the graph captured for the
    step's padded token count, every aux layer on T rows instead of P. As vLLM's Gemma4 runs its cross-decoder.
    """
    context = get_forward_context()
    step = context.batch_descriptor
    if step is not None:
        context.batch_descriptor = replace(step, num_tokens=num_rows)
    try:
        yield
    finally:
        context.batch_descriptor = step


def max_sampled_rows(vllm_config: VllmConfig) -> int:
    """
    The most rows the aux rows piece runs on in one step, padding for graphs included: every scheduled token when the
    aux flow runs at every row (fast prefill off); otherwise each request's sampled tokens (1, plus the drafts under
    speculative decoding), padded as vLLM pads them: to the next CUDA-graph capture size, a size vLLM may later round
    up to a multiple of the tokens per request (full decode graphs with speculation).
    """
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if not vllm_config.cache_config.kv_sharing_fast_prefill:
        return max_tokens
    speculative = vllm_config.speculative_config
    per_request = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
    rows = vllm_config.scheduler_config.max_num_seqs * per_request
    capture_sizes = vllm_config.compilation_config.cudagraph_capture_sizes or ()
    padded = min((size for size in capture_sizes if size >= rows), default=rows)
    return min(max_tokens, -(-padded // per_request) * per_request)


class AuxRowInputs:
    """
    Persistent buffers, sized for the most sampled rows of a step (`max_sampled_rows`), as vLLM's Gemma3n keeps its
    cross-decoder's (a CUDA graph reads its inputs from the addresses it was captured with): `rows`, the indices at
    which the primary piece gathers the entering states (all of them valid: past the step's rows the last one
    repeats), and the aux rows piece's inputs.
    """

    def __init__(self, max_rows: int, num_layers: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.rows = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.entering = torch.zeros(max_rows, num_layers, hidden_size, dtype=dtype, device=device)

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` copied into the first places of `self.rows`, its last index into the rest; returns `self.rows`."""
        if rows.shape[0] > self.rows.shape[0]:
            raise ValueError(
                f"Dual-Flow in vLLM: a step samples {rows.shape[0]} rows, more than the {self.rows.shape[0]} its "
                "buffers hold (max_num_seqs times the tokens per request, padded to a capture size)"
            )
        self.rows[: rows.shape[0]].copy_(rows)
        self.rows[rows.shape[0] :] = rows[-1]
        return self.rows

    def fill(self, rows, input_ids, positions, entering) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs at `rows` copied in (`entering`: already gathered at `self.rows`); returns views of the first
        len(rows) rows."""
        views = tuple(buffer[: rows.shape[0]] for buffer in (self.input_ids, self.positions, self.entering))
        for view, source in zip(views, (input_ids[rows], positions[rows], entering[: rows.shape[0]])):
            view.copy_(source)
        return views


class DualFlowForCausalLM(nn.Module):
    # HF names -> vLLM's stacked linears; fused (`experts.gate_up_proj`) and per-expert expert weights go to FusedMoE.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
            ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
        },
        # The aux adapters' bare `down` / `up` matrices -> vLLM linear layers
        orig_to_new_suffix={"_adapter.down": "_adapter.down.weight", "_adapter.up": "_adapter.up.weight"},
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        # The engine hook checked the configuration before vLLM resolved its defaults (asynchronous scheduling, graph
        # modes, what the platform sets): check the one the model runs with too.
        check_supported(config, vllm_config)
        self.config = config
        self.model = DualFlowModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.every_row_model = None
        if config.use_aux_flow:
            # Each piece gets its own compiled graph and cache entry.
            with vllm_internals.compiled_model_tag("dualflow_aux_rows"):
                self.aux_rows_model = DualFlowAuxRowsModel(
                    vllm_config=vllm_config, prefix=maybe_prefix(prefix, "aux_rows_model"), model=self.model
                )
            self.aux_row_inputs = AuxRowInputs(
                max_sampled_rows(vllm_config),
                config.num_hidden_layers,
                config.hidden_size,
                vllm_config.model_config.dtype,
                next(self.model.parameters()).device,
            )
            if self.model.layers[0].self_attn.can_attend_both_flows_at_once():
                with vllm_internals.compiled_model_tag("dualflow_every_row_sampled"):
                    self.every_row_model = DualFlowEveryRowModel(
                        vllm_config=vllm_config, prefix=maybe_prefix(prefix, "every_row_model"), model=self.model
                    )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        capturing: bool = False,
    ) -> torch.Tensor:
        # `capturing`: vLLM's model runner V2 is capturing graphs (DualFlowModelState); its capture steps carry real
        # attention metadata, so `attn_metadata is None` (the V1 runner's dummy runs) does not say so there.
        if not self.config.use_aux_flow:
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        num_tokens = input_ids.shape[0]
        sampled = self.model.sampled_rows(num_tokens)
        # A step whose KV connector loads or saves takes the two-call path: vLLM's connector hooks wrap each layer's
        # own attention call, and the every-row piece writes the primary K/V without one.
        if sampled is None and self.every_row_model is not None and not moves_kv_this_step():
            context = get_forward_context()
            if context.attn_metadata is None or (
                capturing and context.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE
            ):
                self.warm_other_pieces(input_ids, positions)
            return self.every_row_model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if sampled is None and get_forward_context().attn_metadata is None:
            sampled = self.dummy_rows(num_tokens, positions.device), None
        if sampled is None:
            sampled = torch.arange(num_tokens, device=positions.device), num_tokens
        return self.primary_then_aux_rows(input_ids, positions, *sampled)

    def warm_other_pieces(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """
        A dummy run (warm-up, profiling, the V1 runner's graph capture: no attention metadata) or V2's piecewise
        capture of a step of T tokens: compile, warm (capture) the primary piece at T and the aux rows piece with as
        many rows sampled as a step samples at most, so that serving replays what was captured here. V2 captures with
        attention metadata for all T rows: the aux rows piece runs there only where it can run on all T, since its
        attention reads metadata for the rows it gets (T beyond the most rows a step samples: no step runs it so).
        """
        rows = self.dummy_rows(input_ids.shape[0], positions.device)
        if get_forward_context().attn_metadata is None or rows.shape[0] == input_ids.shape[0]:
            self.primary_then_aux_rows(input_ids, positions, rows)
        else:
            self.model(input_ids, positions, aux_rows=self.aux_row_inputs.select(rows))

    def get_model_state_cls(self):
        """The inputs vLLM's model runner V2 (only it asks) gives the model: its own, and `capturing` at capture."""
        from .model_state import DualFlowModelState

        return DualFlowModelState

    def dummy_rows(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The rows a dummy run samples: its first tokens, no more than a real step samples."""
        return torch.arange(min(num_tokens, self.aux_row_inputs.rows.shape[0]), device=device)

    def primary_then_aux_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, num_sampled: int | None = None
    ) -> torch.Tensor:
        """
        A step in which the aux flow predicts at `rows` only: the primary piece on every row, then the aux rows piece
        on `rows` from the persistent buffers. The first num_sampled rows (all by default) get the aux prediction,
        every other row keeps the primary flow's. Rows past num_sampled pad the step for graphs (the last row
        repeated, their attention output never written): they are dropped, so each row is written once, by its real
        aux state, as vLLM's Gemma3n cuts its padded rows.
        """
        primary_states, entering = self.model(input_ids, positions, aux_rows=self.aux_row_inputs.select(rows))
        # A copy: vLLM may hand a piece's output over from a graph memory pool that the next piece's graph reuses (the
        # note at vLLM's Gemma3n fast prefill).
        states = primary_states.clone()
        with batch_descriptor_for(rows.shape[0]):
            aux_states = self.aux_rows_model(*self.aux_row_inputs.fill(rows, input_ids, positions, entering))
        num_sampled = rows.shape[0] if num_sampled is None else num_sampled
        return states.index_copy_(0, rows[:num_sampled], aux_states[:num_sampled])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # A primary-only engine builds no aux weights (embedding, couplings, round gates, adapters), a one-round engine
        # no round gates.
        # The loader tests a missing module's name followed by "." against these.
        unused_prefixes, unused_suffixes = [], []
        if not self.config.use_aux_flow:
            unused_prefixes.append("model.aux_embed_tokens.")
            unused_suffixes.extend(["_adapter.", ".aux_coupling.", ".aux_round_gate."])
        elif self.config.aux_num_rounds == 1:
            unused_suffixes.append(".aux_round_gate.")
        loader = AutoWeightsLoader(
            self, ignore_unexpected_prefixes=unused_prefixes, ignore_unexpected_suffixes=unused_suffixes
        )
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
