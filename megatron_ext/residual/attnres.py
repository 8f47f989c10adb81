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
is tied to the stage split.

Inside a layer the packed input is never sliced, and its gradient never summed by autograd from
several uses (each a pass over the whole state, and for a slice a zero tensor and a copy too):

- each sublayer's depth attention reads the packed input in place and passes it on to the next
  use (``pass_through`` of :func:`megatron_ext.kernels.residual.efficient.depth_attention`), so
  its backward adds its gradient to the one coming from later uses in the same pass;
- where the mixer's output is added to the partial sum that is the packed input's last slot
  (block AttnRes, except in a block's first layer), the FFN's depth attention reads that slot
  plus the output (``last_plus``) rather than a new tensor holding the sum, and passes on the
  one new packed tensor, the input with the mixer's output added, written as it reads it; the
  exit adds the FFN's output into its last slot in place
  (:func:`megatron_ext.kernels.residual.efficient.add_into_last_slot`);
- an output that starts a slot of its own (full: every output; block: the first output of a
  block) is appended at the exit, in one concatenation.

What it costs a training step over the standard residual (GPU time, peak memory) is measured by
benchmarks/residual_step.py (benchmarks/results/residual_step_h200.json).
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

    def forward(self, sources: list, backend: ops.Backend, **options):
        """Attention over ``sources`` (``[s, b, k_i, h]`` groups) -> ``[s, b, h]``, run with
        ``backend``; ``options`` as
        :func:`megatron_ext.kernels.residual.efficient.depth_attention`'s."""
        return ops.depth_attention(self.weight * self.norm_weight, sources, self.eps,
                                   backend=backend, **options)


@dataclass
class _State:
    slots: torch.Tensor  # [s, b, S, h]: the packed state, as the last depth attention passed it
    tail: list = field(default_factory=list)  # outputs that start slots of their own, [s, b, h]
    last_plus: torch.Tensor | None = None  # the mixer's output, to add to the last slot
    sublayer: int = 0
    new_slot: bool = False  # whether the next output starts a slot of its own


class AttentionResiduals(ResidualScheme):
    """Full (``block_layers=None``) or block Attention Residuals of one layer."""

    def __init__(self, config, layer_number: int, block_layers: int | None = None, *,
                 backend: ops.Backend):
        super().__init__(config, layer_number, backend)
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
        return _State(slots=hidden_states.unflatten(-1, (-1, self.hidden_size)))

    def _sources(self, state: _State) -> list:
        return [state.slots, *(output.unsqueeze(-2) for output in state.tail)]

    def sublayer_input(self, state: _State) -> torch.Tensor:
        query = (self.mixer, self.ffn)[state.sublayer]
        # With last_plus, the passed-on slots are a new tensor with it added to the last slot.
        x, state.slots = query(self._sources(state), self.backend, last_plus=state.last_plus,
                               pass_through=True)
        # full: every output is a source; block: the first sublayer of a block commits the
        # partial sum it read as a completed block, and its output starts the next partial.
        state.new_slot = self.block_layers is None or (
            state.sublayer == 0 and self.index % self.block_layers == 0)
        return x

    def sublayer_output(self, state: _State, output: torch.Tensor) -> None:
        if state.new_slot:
            state.tail.append(output)
        elif state.tail:  # block: the partial sum began in this layer
            state.tail[-1] = state.tail[-1] + output
        elif state.sublayer == 0:  # the partial sum is the input's last slot; the FFN reads it
            state.last_plus = output
        else:  # the slots the FFN passed on have the mixer's output in the last already
            state.slots = ops.add_into_last_slot(state.slots, output, backend=self.backend)
        state.sublayer += 1

    def exit(self, state: _State) -> torch.Tensor:
        packed = state.slots.flatten(-2)
        if self.last:
            return self.output([packed.unflatten(-1, (-1, self.hidden_size)),
                                *(output.unsqueeze(-2) for output in state.tail)], self.backend)
        return torch.cat([packed, *state.tail], dim=-1) if state.tail else packed
