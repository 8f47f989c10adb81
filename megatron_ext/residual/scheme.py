"""What every residual scheme provides to :class:`megatron_ext.specs.ExtTransformerLayer`.

A layer with a scheme runs::

    state = scheme.enter(hidden_states)        # unpack the packed state (layer 1: embedding)
    for sublayer in (token mixer, FFN):
        x = scheme.sublayer_input(state)       # what the sublayer's pre-norm sees
        y = sublayer(x)                        # norm -> mixer/FFN -> bias -> dropout (no add)
        scheme.sublayer_output(state, y)       # fold the output into the state
    return scheme.exit(state)                  # pack (last layer: collapse to [s, b, h])

Between layers, and between pipeline stages, the state is ONE 3-D tensor ``[s, b, K * h]``
(sequence-sharded like hidden states under sequence parallelism), never a view, so that
Megatron's schedules can send it and free it; with pipeline parallelism the stages exchange its
shape per message (``config.variable_seq_lengths``, set by :func:`megatron_ext.residual.prepare`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron_ext.kernels.residual.efficient import Backend


class ResidualScheme(torch.nn.Module):
    """The residual connections of one transformer layer (global number ``layer_number``),
    whose residual-stream ops run with ``backend``
    (:func:`megatron_ext.residual.ops_backend`): the attribute ``backend``, read at every call,
    which may be replaced to run the same model otherwise."""

    def __init__(self, config, layer_number: int, backend: Backend):
        super().__init__()
        self.backend = backend
        self.hidden_size = config.hidden_size
        self.first = layer_number == 1
        self.last = layer_number == config.num_layers

    def enter(self, hidden_states: torch.Tensor):
        raise NotImplementedError

    def sublayer_input(self, state) -> torch.Tensor:
        raise NotImplementedError

    def sublayer_output(self, state, output: torch.Tensor) -> None:
        raise NotImplementedError

    def exit(self, state) -> torch.Tensor:
        raise NotImplementedError

    def check_width(self, hidden_states: torch.Tensor, slots: int, what: str) -> None:
        """Fail clearly when the incoming state is not the ``[s, b, slots * h]`` expected."""
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != slots * self.hidden_size:
            raise RuntimeError(
                f"{type(self).__name__}: layer input has shape {tuple(hidden_states.shape)}, "
                f"expected [s, b, {slots} * {self.hidden_size}] ({what}). With pipeline "
                "parallelism the stages must exchange shapes (config.variable_seq_lengths=True, "
                "set by megatron_ext.specs when the model is built through them)")


def replicated_parameter(config, values: torch.Tensor) -> torch.nn.Parameter:
    """A parameter replicated over tensor-parallel ranks (like a norm weight or the MoE router).

    Under sequence parallelism each TP rank applies it to its own slice of the sequence, so its
    gradient is partial: ``sequence_parallel=True`` makes Megatron's ``finalize_model_grads``
    all-reduce it over the TP group. Without sequence parallelism every TP rank computes the same
    gradient and nothing is reduced. It is counted once (not TP-sharded) in the gradient norm.
    """
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    param = torch.nn.Parameter(values.to(device=device, dtype=config.params_dtype))
    param.sequence_parallel = config.sequence_parallel
    return param


def initialised(config, *shape: int) -> torch.Tensor:
    """A weight drawn with the model's ``init_method`` (fp32, before the cast to params_dtype)."""
    weight = torch.empty(*shape, dtype=torch.float32)
    if config.perform_initialization:
        config.init_method(weight)
    else:
        weight.zero_()
    return weight


def bias_dropout(training: bool, fused: bool):
    """Megatron's bias-dropout-add slot without the add: with a residual scheme a sublayer
    returns ``dropout(F(x) + bias)`` and the scheme does the combining. Same call signature as
    ``get_bias_dropout_add(training, fused)(x_with_bias, residual, prob)``."""

    def apply(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        return F.dropout(x, p=prob, training=training)

    return apply
