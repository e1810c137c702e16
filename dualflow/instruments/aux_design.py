"""
Design variants of the aux flow that `dualflow experiment --arms design` trains from scratch. Each
changes one thing of a freshly initialised model before training. They live here, not in the model files: a variant
becomes a `DualFlowConfig` field only once it wins (the project's published results say which did).
"""

import copy

import torch
from torch import nn

from modeling_dualflow import DualFlowForCausalLM


class NormedGainCoupling(nn.Module):
    """c_l * rmsnorm(h_l): the per-channel gain on the *normalised* primary state, so its scale does not grow with depth."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, primary_states: torch.Tensor) -> torch.Tensor:
        variance = primary_states.float().pow(2).mean(-1, keepdim=True)
        normed = (primary_states.float() * torch.rsqrt(variance + self.eps)).to(primary_states.dtype)
        return self.weight * normed


class LowRankCoupling(nn.Module):
    """c_l * h_l + B A h_l: today's gain plus a rank-`rank` map that can mix channels (B zero, so it starts as today)."""

    def __init__(self, hidden_size: int, rank: int = 8):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.down = nn.Parameter(torch.randn(rank, hidden_size) * hidden_size**-0.5)
        self.up = nn.Parameter(torch.zeros(hidden_size, rank))

    def forward(self, primary_states: torch.Tensor) -> torch.Tensor:
        return self.weight * primary_states + primary_states @ self.down.T @ self.up.T


class AuxFinalNorm(nn.Module):
    """
    The final norm with a weight of its own for the aux rows (a cheap aux-specific part; starts equal to the shared
    one). Only for forwards that run the aux flow at every position, as this experiment's training and scoring do:
    the stacked rows are then [primary (T); aux (T)].
    """

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.aux_norm = copy.deepcopy(norm)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[1] % 2:
            raise ValueError("AuxFinalNorm needs the aux flow at every position (stacked rows [primary; aux])")
        primary, aux = hidden_states.chunk(2, dim=1)
        return torch.cat([self.norm(primary), self.aux_norm(aux)], dim=1)


COUPLING_FORMS = {"normed gain": NormedGainCoupling, "gain + rank 8": LowRankCoupling}


@torch.no_grad()
def apply_aux_design(
    model: DualFlowForCausalLM,
    coupling_form: str | None = None,
    aux_final_norm: bool = False,
) -> None:
    """
    `coupling_form`: a key of `COUPLING_FORMS` replaces every layer's coupling; `aux_final_norm`: the aux rows get a
    final norm of their own (`AuxFinalNorm`).
    """
    if aux_final_norm:
        model.model.norm = AuxFinalNorm(model.model.norm)
    if coupling_form is not None:
        for layer in model.model.layers:
            layer.aux_coupling = COUPLING_FORMS[coupling_form](model.config.hidden_size)
