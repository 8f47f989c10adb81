"""mHC: Manifold-Constrained Hyper-Connections (Xie et al. 2025, DeepSeek-AI, arXiv 2512.24880),
built on Hyper-Connections (Zhu et al. 2024, arXiv 2409.19606), as DeepSeek-V4 uses it.

The residual stream is widened to ``n`` streams ``X [s, b, n, h]``, packed between layers as
``[s, b, n * h]`` (stream m in channels ``m*h : (m+1)*h``). Around each sublayer F (token mixer,
then FFN), with coefficients in fp32 from the RMS-normalised flattened streams (ops in
:mod:`megatron_ext.kernels.residual`; output stream j reads column j of H_res, as in V4):

    u     = sum_m H_pre[m] X[m]                      H_pre  = sigmoid(.) + eps     (collapse)
    X'[j] = H_post[j] F(u) + sum_m H_res[m, j] X[m]  H_post = 2 sigmoid(.)         (expand)
                                                     H_res  = Sinkhorn(.), 20 iterations

Each coefficient is ``gate * (RMSNorm(vec X) @ phi^T) + bias`` (mHC eq. 7-8); the gating
factors start at 0.01 (paper table 5) and the static biases at 0, so at initialisation
H_pre = 1/2, H_post = 1 and H_res is the uniform doubly stochastic matrix J/n: the copied
streams stay equal and each layer acts like a standard residual layer until the dynamic
terms (``phi``, drawn with the model's init_method) separate them. Layer 1 copies the embedding
into the n streams; the last layer collapses them before the final norm, with DeepSeek-V4's
learned ``hc_head`` (``a = sigmoid(gate * RMSNorm(vec X) @ phi_head^T + bias) + eps``,
``sum_j a_j X[j]``) or the mean of the streams.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.utils import make_viewless_tensor

from megatron_ext.kernels.residual import EPS, efficient as ops
from megatron_ext.residual.scheme import ResidualScheme, initialised, replicated_parameter

GATE_INIT = 0.01


class MHCConnection(torch.nn.Module):
    """The mHC coefficients of one sublayer: ``weight [(2 + n) n, n h]`` (phi, with the
    RMSNorm weight folded in), ``bias [(2 + n) n]`` and the gating factors ``gate [3]``."""

    def __init__(self, config, streams: int, sinkhorn_iters: int):
        super().__init__()
        self.streams, self.sinkhorn_iters = streams, sinkhorn_iters
        width = (2 + streams) * streams
        self.weight = replicated_parameter(
            config, initialised(config, width, streams * config.hidden_size))
        self.bias = replicated_parameter(config, torch.zeros(width))
        self.gate = replicated_parameter(config, torch.full((3,), GATE_INIT))

    def forward(self, streams: torch.Tensor, backend: ops.Backend,
                replay: StreamReplay | None = None):
        """The sublayer's input ``u = sum_m H_pre[m] X[m]`` ``[s, b, h]``, with ``H_post
        [s, b, n]`` and ``H_res [s, b, n, n]`` (fp32) for the update after the sublayer, and
        the streams passed through for that update to read (so that the op's backward adds
        the update's gradient of them to its own: ``efficient.mhc_pre``'s pass_through); the
        ops run with ``backend``."""
        return ops.mhc_pre(streams, self.weight, self.bias, self.gate, self.sinkhorn_iters, EPS,
                           _newest(replay), pass_through=True, backend=backend)


class MHCCollapse(torch.nn.Module):
    """DeepSeek-V4's ``hc_head``: the n streams to one hidden state before the final norm."""

    def __init__(self, config, streams: int):
        super().__init__()
        self.weight = replicated_parameter(
            config, initialised(config, streams, streams * config.hidden_size))
        self.bias = replicated_parameter(config, torch.zeros(streams))
        self.gate = replicated_parameter(config, torch.full((1,), GATE_INIT))

    def forward(self, streams: torch.Tensor, backend: ops.Backend,
                replay: StreamReplay | None = None) -> torch.Tensor:
        mixes = ops.rms_project(streams.flatten(-2), self.weight, EPS, _flat_newest(replay),
                                backend=backend)
        weights = torch.sigmoid(mixes * self.gate.float() + self.bias.float()) + EPS
        return ops.stream_mix(streams, weights, _newest(replay), backend=backend)


def _newest(replay: StreamReplay | None):
    """What an mHC op gets as ``recompute_input``: nothing to recompute without a replay."""
    return None if replay is None else replay.newest()


def _flat_newest(replay: StreamReplay | None):
    newest = _newest(replay)
    return None if newest is None else (lambda: newest().flatten(-2))


class StreamReplay:
    """mHC recomputation over one run of consecutive layers (paper section 4.3, "store only
    the block input"): the layers' mHC ops keep no stream tensor for backward; this keeps the
    first state ``X_0`` and, per sublayer k, the connection, its output ``y_k`` (kept for
    backward anyway) and the backend its ops ran with, and re-creates ``X_k`` on demand in
    backward by replaying ``X_{k+1} = update(X_k, y_k, coefficients(X_k))`` without a graph.

    A replay starts at a layer whose input did not come from the previous layer of the same
    forward pass, i.e. at the first layer of every pipeline stage and VPP chunk (the received
    tensor is the stage's input and kept by Megatron anyway), so recomputation never crosses a
    stage border. In backward the first request replays the whole run once; each state is
    dropped after its last use.
    """

    _TAG = "_megatron_ext_stream_replay"

    def __init__(self, first_state: torch.Tensor):
        self.states = {0: first_state}
        self.steps: list[tuple[MHCConnection, torch.Tensor, ops.Backend]] = []
        self.uses: collections.Counter = collections.Counter()

    @classmethod
    def continuing(cls, hidden_states: torch.Tensor, streams: torch.Tensor) -> "StreamReplay":
        """The replay that produced ``hidden_states`` as its newest state, or a new one."""
        tag = getattr(hidden_states, cls._TAG, None)
        if tag is not None and tag[1] == len(tag[0].steps):
            return tag[0]
        return cls(streams.detach())

    def tag(self, packed: torch.Tensor) -> torch.Tensor:
        setattr(packed, self._TAG, (self, len(self.steps)))
        return packed

    def newest(self) -> Callable[[], torch.Tensor]:
        """A callable giving the newest state in backward, for ONE op that would keep it."""
        index = len(self.steps)
        self.uses[index] += 1
        return functools.partial(self._state, index)

    def append(self, connection: MHCConnection, output: torch.Tensor,
               backend: ops.Backend) -> None:
        self.steps.append((connection, output.detach(), backend))

    def _state(self, index: int) -> torch.Tensor:
        if index not in self.states:
            start = max(i for i in self.states if i < index)
            streams = self.states[start]
            with torch.no_grad():
                for k in range(start, index):
                    connection, output, backend = self.steps[k]
                    _, post, res, _ = connection(streams, backend)  # the same ops as in forward
                    streams = ops.stream_update(streams, output, post, res, backend=backend)
                    self.states[k + 1] = streams
        streams = self.states[index]
        self.uses[index] -= 1
        if self.uses[index] == 0 and index:
            del self.states[index]
        return streams


@dataclass
class _State:
    streams: torch.Tensor  # [s, b, n, h]
    replay: StreamReplay | None
    pending: tuple | None = None  # (connection, H_post, H_res) of the open sublayer
    sublayer: int = 0


class MHC(ResidualScheme):
    """The two mHC connections of one layer, plus the expansion (layer 1) or the collapse
    (last layer). ``recompute``: keep no stream tensor for backward (see StreamReplay)."""

    def __init__(self, config, layer_number: int, streams: int = 4, sinkhorn_iters: int = 20,
                 collapse: str = "learned", recompute: bool = False, *, backend: ops.Backend):
        super().__init__(config, layer_number, backend)
        self.streams, self.recompute = streams, recompute
        self.mixer = MHCConnection(config, streams, sinkhorn_iters)
        self.ffn = MHCConnection(config, streams, sinkhorn_iters)
        learned = self.last and collapse == "learned"
        self.collapse = MHCCollapse(config, streams) if learned else None

    def enter(self, hidden_states: torch.Tensor) -> _State:
        if self.first:
            self.check_width(hidden_states, 1, "the embedding")
            streams = hidden_states.unsqueeze(-2).repeat(1, 1, self.streams, 1)
        else:
            self.check_width(hidden_states, self.streams, f"{self.streams} mHC streams")
            streams = hidden_states.unflatten(-1, (self.streams, self.hidden_size))
        replay = StreamReplay.continuing(hidden_states, streams) if self.recompute else None
        return _State(streams, replay)

    def sublayer_input(self, state: _State) -> torch.Tensor:
        connection = (self.mixer, self.ffn)[state.sublayer]
        sublayer_input, post, res, state.streams = connection(state.streams, self.backend,
                                                              state.replay)
        state.pending = (connection, post, res)
        return sublayer_input

    def sublayer_output(self, state: _State, output: torch.Tensor) -> None:
        connection, post, res = state.pending
        state.streams = ops.stream_update(state.streams, output, post, res,
                                          _newest(state.replay), backend=self.backend)
        if state.replay is not None:
            state.replay.append(connection, output, self.backend)
        state.pending, state.sublayer = None, state.sublayer + 1

    def exit(self, state: _State) -> torch.Tensor:
        if self.last:
            if self.collapse is not None:
                return self.collapse(state.streams, self.backend, state.replay)
            return state.streams.float().mean(-2).to(state.streams.dtype)
        packed = make_viewless_tensor(state.streams.flatten(-2), requires_grad=True,
                                      keep_graph=True)
        return state.replay.tag(packed) if state.replay is not None else packed
