"""Pieces shared by the mixers: the tensor-parallel base of the linear-recurrent mixers
(delta-rule, decay, Mamba-2) and of our softmax and sparse attention cores, decoding state, and
the short convolution.

- :class:`HeadShardedModule`: a MegatronModule whose raw per-head parameters are sharded over TP
  along dim 0, drawn at full size and sliced (every TP size starts from the same model), and
  declared in ``sharded_state_dict`` so checkpoints reshard; its fused input projections
  (:meth:`~HeadShardedModule.fused_column`) carry a split map so that they reshard too.
- :func:`conv_silu_heads`: the short causal convolution + SiLU (+ L2 norm) of a projection,
  aware of packed sequences and of context parallelism's halo.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from megatron.core.ssm.utils import _split_tensor_factory  # megatron-core's TP split map
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from megatron_ext.config import ConfigError
from megatron_ext.kernels.fused import short_conv, split_projection
from megatron_ext.parallel import ContextParallel
from megatron_ext.parallel.linear import check_heads


@dataclass
class LinearMixerSubmodules:
    column_linear: type = ColumnParallelLinear
    row_linear: type = RowParallelLinear


class HeadShardedModule(MegatronModule):
    """Base of our mixers and attention cores: TP bookkeeping, projections and raw per-head
    parameters."""

    def __init__(self, config, submodules: LinearMixerSubmodules, pg_collection=None):
        super().__init__(config=config)
        self.submodules = submodules
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        self.tp_size = self.tp_group.size() if self.tp_group is not None else 1
        self.tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        self._tp_sharded: list[str] = []
        self._fused_splits: dict[str, dict[str, int]] = {}  # projection -> part -> local width

    def fused_column(self, name: str, in_size: int, parts: dict[str, int]):
        """One column-parallel projection for several outputs of the same input (one GEMM, and
        under SP one all-gather): ``parts`` maps each output's name to its width over all TP
        ranks. Each rank's weight rows are its slices of the parts, in order (``[q_r | k_r |
        v_r | ...]``); apply with :meth:`split_outputs`. Checkpoints save every part as its own
        TP-sharded tensor (``<weight key>.<part>``), so they reshard across TP sizes."""
        for part, size in parts.items():
            if size % self.tp_size:
                raise ConfigError(f"the {part} projection's width {size} is not divisible by "
                                  f"tensor_model_parallel_size={self.tp_size}")
        local = {part: size // self.tp_size for part, size in parts.items()}
        linear = self.column(name, in_size, sum(parts.values()))
        if self.config.perform_initialization and self.config.use_cpu_initialization:
            # Megatron's CPU initialisation slices one master weight into contiguous blocks; draw
            # each part at full size and keep this rank's slice instead, so that every TP size
            # starts from the same model (as for the raw per-head parameters).
            with torch.no_grad():
                masters = []
                for size in parts.values():
                    master = torch.empty(size, in_size, dtype=torch.float32)
                    self.config.init_method(master)
                    masters.append(master.chunk(self.tp_size)[self.tp_rank])
                linear.weight.copy_(torch.cat(masters))
        self._fused_splits[name] = local
        # The layout of the rows, for tools that gather TP shards (Megatron's partition_dim
        # alone would concatenate the ranks' blocks, not the parts).
        linear.weight.fused_part_sizes = tuple(local.values())
        return linear

    def split_outputs(self, name: str, output: torch.Tensor):
        """The parts of the fused projection ``name``'s output ``[s, b, sum of widths]``, as
        views by part name, and ``grad_into(part, view=None)``: where a consumer of that part
        (the short convolution, the gated RMSNorm) writes its gradient, the part's slice of one
        buffer for the whole output's gradient (``ProjectionGradient`` in
        ``megatron_ext.kernels.fused``; ``view``: the consumer's layout of the part)."""
        local = self._fused_splits[name]
        parts, gradient = split_projection(output, list(local.values()))
        index = {part: i for i, part in enumerate(local)}

        def grad_into(part: str, view=None):
            return gradient.part_of(index[part], view)

        return dict(zip(local, parts)), grad_into

    def same_heads(self, config, ext, name: str, pg_collection=None) -> int:
        """Heads and head dims of a linear mixer whose q, k and v have the same heads (the decay
        family, RWKV-7): ``self.heads``, this rank's share of ``ext.linear_num_value_heads``
        (default: the attention's heads), ``self.key_dim`` and ``self.value_dim``
        (``ext.linear_*_head_dim``, default ``kv_channels``), and context parallelism
        (``self.cp``, ``self.cp_method``), its head split checked for the mixer ``name``.
        Returns the heads of all TP ranks (the projections' full widths)."""
        heads = ext.linear_num_value_heads or config.num_attention_heads
        if heads % self.tp_size:
            raise ConfigError(f"linear_num_value_heads={heads} is not divisible by "
                              f"tensor_model_parallel_size={self.tp_size}")
        self.heads = heads // self.tp_size
        self.cp = ContextParallel.of(config, pg_collection)
        self.cp_method = ext.context_parallel_method
        check_heads(self.cp, self.cp_method, name, heads=self.heads)
        self.key_dim = ext.linear_key_head_dim or config.kv_channels
        self.value_dim = ext.linear_value_head_dim or config.kv_channels
        return heads

    def column(self, name: str, in_size: int, out_size: int, gather_output: bool = False,
               config=None, disable_grad_reduce: bool = False):
        """A column-parallel projection (output split over TP), no bias. ``disable_grad_reduce``:
        its input gradient stays this rank's part, for an input whose TP reduction the caller
        does once for several projections."""
        return build_module(
            self.submodules.column_linear, in_size, out_size, config=config or self.config,
            init_method=self.config.init_method, gather_output=gather_output, bias=False,
            skip_bias_add=False, is_expert=False, tp_comm_buffer_name=name,
            tp_group=self.tp_group, disable_grad_reduce=disable_grad_reduce)

    def row(self, name: str, in_size: int, out_size: int):
        """The row-parallel output projection; its bias is returned for bias-dropout-add."""
        return build_module(
            self.submodules.row_linear, in_size, out_size, config=self.config,
            init_method=self.config.output_layer_init_method, bias=self.config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name=name, tp_group=self.tp_group)

    def low_rank_decay_projection(self, prefix: str, in_size: int, rank: int, out_size: int):
        """``linear_decay_down`` then ``linear_decay``: the low-rank projection behind
        per-channel decays (GLA, KDA, GDN-2). The first factor is column-parallel with its
        output gathered (rank is small); the second splits the channels over TP. Apply with
        :meth:`low_rank_decay`."""
        if rank % self.tp_size:
            raise ConfigError(f"linear_decay_rank={rank} is not divisible by "
                              f"tensor_model_parallel_size={self.tp_size}")
        self.linear_decay_down = self.column(f"{prefix}_decay_down", in_size, rank,
                                             gather_output=True)
        # Its input is already the whole sequence (the first factor gathered it under SP).
        full_sequence = copy.copy(self.config)
        full_sequence.sequence_parallel = False
        self.linear_decay = self.column(f"{prefix}_decay", rank, out_size, config=full_sequence)

    def low_rank_decay(self, hidden_states: torch.Tensor) -> torch.Tensor:
        low_rank, _ = self.linear_decay_down(hidden_states)
        out, _ = self.linear_decay(low_rank)
        return out

    def decoding_cache(self, inference_context, packed_seq_params=None) -> dict | None:
        """This layer's state between the forward calls of incremental decoding, or None when
        not decoding: a dict in Megatron's static inference context
        (``key_value_memory_dict[layer_number]``) holding the recurrent state (``"state"``,
        ``[b, heads, K, V]``) and each short convolution's last ``kernel - 1`` inputs; emptied at
        sequence offset 0 (a new prompt). Its size does not depend on the length decoded."""
        if inference_context is None:
            return None
        name = type(self).__name__
        if not inference_context.is_static_batching():
            raise ConfigError(cannot_decode(f"{name} with dynamic batching") + "; use Megatron's "
                              "StaticInferenceContext")
        packed = packed_cu_seqlens(packed_seq_params) is not None
        if getattr(self, "cp", None) is not None or packed:
            raise ConfigError(cannot_decode(f"{name} under context parallelism or with packed "
                                            "(thd) sequences"))
        store = inference_context.key_value_memory_dict
        if inference_context.sequence_len_offset == 0 or self.layer_number not in store:
            store[self.layer_number] = {}
        return store[self.layer_number]

    def sharded_parameter(self, name: str, full: torch.Tensor, no_weight_decay: bool = False):
        """Register this rank's dim-0 slice of ``full`` (drawn identically on every TP rank)."""
        shard = full.chunk(self.tp_size, dim=0)[self.tp_rank].contiguous()
        p = torch.nn.Parameter(shard.to(self.config.params_dtype))
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        if no_weight_decay:
            p._no_weight_decay = True
        self.register_parameter(name, p)
        self._tp_sharded.append(name)
        return p

    def conv_parameter(self, name: str, channels: int, kernel: int):
        """A depthwise filter ``[channels, kernel]`` with torch's default Conv1d init."""
        bound = 1.0 / math.sqrt(kernel)
        return self.sharded_parameter(name, torch.empty(channels, kernel).uniform_(-bound, bound))

    def decay_parameters(self, heads: int, dt_size: int):
        """Mamba-2 / GDN decay parameters: ``A_log`` (A in [1, 16]) per head and ``dt_bias``
        = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1], one per ``dt_size`` entry."""
        self.sharded_parameter("A_log", torch.empty(heads).uniform_(1, 16).log(),
                               no_weight_decay=True)
        dt = torch.exp(torch.empty(dt_size).uniform_(math.log(1e-3), math.log(1e-1)))
        dt = dt.clamp(min=1e-4)
        self.sharded_parameter("dt_bias", dt + torch.log(-torch.expm1(-dt)), no_weight_decay=True)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            own, prefix, {name: 0 for name in self._tp_sharded}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, child in self.named_children():
            sharded.update(sharded_state_dict_default(
                child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group))
        for name, local in self._fused_splits.items():
            key = f"{prefix}{name}.weight"
            sharded[key] = _split_tensor_factory(sharded[key], list(local.values()), list(local), 0)
        return sharded


def cannot_decode(what: str) -> str:
    """The message of a layer that has no incremental decoding yet."""
    return (f"{what} cannot decode incrementally yet (Megatron's inference context): decoding "
            "covers the linear mixers and '*' attention")


def recurrent_state(cache: dict | None) -> dict:
    """The recurrence's options when decoding: start from the cached state (none at a new
    prompt) and return the final one."""
    if cache is None:
        return {}
    return {"initial_state": cache.get("state"), "output_final_state": True}


def packed_cu_seqlens(packed_seq_params):
    """``cu_seqlens`` of ``thd``-packed sequences, or None for ordinary batches."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        return packed_seq_params.cu_seqlens_q
    return None


def conv_silu_heads(x: torch.Tensor, weight: torch.Tensor, heads: int, positions=None, cp=None,
                    packed=None, l2_norm: bool = False, cache: dict | None = None,
                    name: str | None = None, grad_into=None):
    """``[s, b, heads * d]`` projection -> causal conv + SiLU (+ L2 norm per head) -> ``[b, s,
    heads, d]``, in one kernel (:func:`megatron_ext.kernels.fused.short_conv`, which reads the
    projection in place). ``positions``: each token's index within its packed sequence
    (:func:`~megatron_ext.kernels.fused.sequence_positions`), or None.

    Under context parallelism (``cp``, a :class:`~megatron_ext.parallel.ContextParallel`) the
    local sequence is two chunks of Megatron's load-balanced layout, or with packed sequences
    (``packed``, a :class:`~megatron_ext.parallel.context.PackedLayout`) two chunks of each
    document; each chunk is convolved after its halo, the ``kernel - 1`` tokens before it,
    which may live on another rank.

    Decoding (``cache``, a layer's :meth:`HeadShardedModule.decoding_cache`): the inputs follow
    the ``kernel - 1`` inputs before them, kept in ``cache[name]`` from the previous call.

    ``grad_into``: where the gradient of ``x`` (``[s, b, heads * d]``) goes, from
    :meth:`HeadShardedModule.split_outputs`; used without context parallelism or decoding.
    """
    s, b = x.shape[:2]
    x = x.transpose(0, 1)
    halo = weight.shape[1] - 1
    head_dim = x.shape[-1] // heads if l2_norm else None

    def conv(inputs, positions=None, grad_into=None):
        return short_conv(inputs, weight, positions, head_dim, grad_into=grad_into)

    if cache is not None:
        before = cache.get(name)
        seen = x if before is None else torch.cat([before, x], dim=1)
        cache[name] = seen[:, max(seen.shape[1] - halo, 0):].clone()
        x = conv(seen)[:, seen.shape[1] - s:]
    elif cp is None or halo == 0:
        x = conv(x, positions, None if grad_into is None else lambda: grad_into().transpose(0, 1))
    elif packed is not None:  # b = 1; one convolution per piece, after its halo
        pieces = packed.split(x)
        before = cp.before_tails(torch.cat([piece[:, piece.shape[1] - halo:] for piece in pieces]))
        x = torch.cat([conv(torch.cat([before[i:i + 1], piece], dim=1))[:, halo:]
                       for i, piece in enumerate(pieces)], dim=1)
    else:
        chunks = cp.split_chunks(x)
        chunks = torch.cat([cp.previous_tokens(chunks, halo), chunks], dim=1)
        x = cp.merge_chunks(conv(chunks)[:, halo:])
    return x.reshape(b, s, heads, -1)
