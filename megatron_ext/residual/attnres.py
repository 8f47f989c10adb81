"""Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031).

Each sublayer (token mixer, FFN) reads a softmax over depth instead of the running sum:
``h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i`` with a zero-initialised pseudo-query ``w_l``
per sublayer, RMS-normalised keys (weight ``gamma_l``, initialised to one; the score is
``sum_d RMSNorm(v)_d gamma_d w_d``), the raw sources as values and an fp32 softmax. After the
last layer one more query aggregates the sources before the final norm. Zero queries make every
sublayer start from the uniform average of its sources.

- full (``attnres_full``): the sources of a sublayer are the embedding and every earlier
  sublayer output; between layers the state packs them all: ``[s, b, (1 + 2 l) h]`` after
  layer l.
- block (``attnres_block``, N = ``attnres_block_layers`` transformer layers per block): the
  sources are the embedding, the completed blocks (each the sum of its sublayer outputs) and
  the partial sum of the current block. As in the official pseudo-code, the partial sum starts
  as the embedding; the first sublayer of layer i (0-based) with ``i % N == 0`` reads the
  sources, then commits the partial sum as a block (at layer 0: the embedding). The state
  packs ``[completed blocks..., partial]``: ``[s, b, (1 + k) h]`` with k completed blocks.
  A single block (N >= num_layers) is the standard residual plus an isolated embedding source:
  every sublayer reads ``a e + (1 - a) sum_{j<l} f_j``, a learned convex combination of the
  embedding e and the sum of the earlier outputs.

Blocks may span pipeline stages: the partial sum travels in the packed state, so no block size
is tied to the stage split. The sources are views into the packed input plus this layer's own
outputs; :func:`megatron_ext.kernels.residual.efficient.depth_attention` keeps only references
and per-token scalars for backward. The completed blocks are passed as the packed input with
their slot count, ``(packed [s, b, 1 + k, h], k)``, rather than as a slice of it: the op returns
the gradient of the whole packed input (zeros in the partial's slot), which spares autograd the
slice's backward (a zero tensor of the packed state, a copy and an add) at every use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_ext.kernels.residual import efficient as ops
from megatron_ext.residual.scheme import ResidualScheme, replicated_parameter


class DepthQuery(torch.nn.Module):
    """The pseudo-query ``weight`` (zeros) and the key RMSNorm's ``norm_weight`` (ones) of one
    sublayer (or of the final aggregation)."""

    def __init__(self, config):
        super().__init__()
        self.eps = config.layernorm_epsilon
        self.weight = replicated_parameter(config, torch.zeros(config.hidden_size))
        self.norm_weight = replicated_parameter(config, torch.ones(config.hidden_size))

    def forward(self, sources: list) -> torch.Tensor:
        """Attention over ``sources`` (``[s, b, k_i, h]`` groups, or ``(packed, k)`` pairs:
        the first k slots of ``packed [s, b, S, h]``) -> ``[s, b, h]``."""
        return ops.depth_attention(self.weight * self.norm_weight, sources, self.eps)


@dataclass
class _State:
    # [s, b, k_i, h] groups, or (packed [s, b, S, h], k): its first k slots
    sources: list = field(default_factory=list)
    partial: torch.Tensor | None = None  # block: the current block's sum [s, b, h]
    sublayer: int = 0


class AttentionResiduals(ResidualScheme):
    """Full (``block_layers=None``) or block Attention Residuals of one layer."""

    def __init__(self, config, layer_number: int, block_layers: int | None = None):
        super().__init__(config, layer_number)
        self.index = layer_number - 1
        self.block_layers = block_layers
        self.mixer = DepthQuery(config)
        self.ffn = DepthQuery(config)
        self.output = DepthQuery(config) if self.last else None

    def slots_before(self, index: int) -> int:
        """How many ``h``-wide slots the packed state holds before layer ``index`` (0-based)."""
        if self.block_layers is None:
            return 1 + 2 * index
        completed = 0 if index == 0 else (index - 1) // self.block_layers + 1
        return completed + 1

    def enter(self, hidden_states: torch.Tensor) -> _State:
        slots = self.slots_before(self.index)
        self.check_width(hidden_states, slots, "the embedding and earlier sources" if slots > 1
                         else "the embedding")
        sources = hidden_states.unflatten(-1, (slots, self.hidden_size))
        if self.block_layers is None:
            return _State(sources=[sources])
        completed = [(sources, slots - 1)] if slots > 1 else []
        return _State(sources=completed, partial=sources[..., -1, :])

    def _all_sources(self, state: _State) -> list:
        if state.partial is None:
            return state.sources
        return state.sources + [state.partial.unsqueeze(-2)]

    def sublayer_input(self, state: _State) -> torch.Tensor:
        query = (self.mixer, self.ffn)[state.sublayer]
        x = query(self._all_sources(state))
        if (self.block_layers is not None and state.sublayer == 0
                and self.index % self.block_layers == 0):
            state.sources, state.partial = self._all_sources(state), None  # commit the block
        return x

    def sublayer_output(self, state: _State, output: torch.Tensor) -> None:
        if self.block_layers is None:
            state.sources = state.sources + [output.unsqueeze(-2)]
        else:
            state.partial = output if state.partial is None else state.partial + output
        state.sublayer += 1

    def exit(self, state: _State) -> torch.Tensor:
        sources = self._all_sources(state)
        if self.last:
            return self.output(sources)
        return torch.cat([_slots(s).flatten(-2) for s in sources], dim=-1)


def _slots(group) -> torch.Tensor:
    """A source group as ``[s, b, k, h]``: a ``(packed, k)`` pair as its first k slots."""
    if isinstance(group, torch.Tensor):
        return group
    packed, count = group
    return packed[..., :count, :]
