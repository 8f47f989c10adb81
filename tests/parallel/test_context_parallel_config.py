"""Context-parallel settings that cannot work fail early, naming the setting and the fix:
sequence lengths the load-balanced layout (or a convolution's halo) cannot take, head counts
all-to-all cannot split, and mixers without context parallelism. A stand-in CP group (size,
rank) is enough: these checks run before any communication."""

import types

import pytest

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers import delta_rule
from megatron_ext.mixers.common import LinearMixerSubmodules
from megatron_ext.parallel import ContextParallel
from megatron_ext.parallel.linear import check_heads

pytestmark = pytest.mark.usefixtures("megatron_single_process")


class StandInGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_sequence_length_must_divide_into_2cp_chunks_long_enough_for_the_halo():
    cp = ContextParallel(StandInGroup(2))
    assert cp.check_local_length(6, min_chunk=3) == 3
    with pytest.raises(ConfigError, match=r"sequence length 10 is not divisible by 2 \* "
                                          r"context_parallel_size = 4"):
        cp.check_local_length(5)
    with pytest.raises(ConfigError, match="chunks of 2 tokens, fewer than the 3"):
        cp.check_local_length(4, min_chunk=3)


def test_all_to_all_needs_heads_divisible_by_cp():
    cp = ContextParallel(StandInGroup(4))
    check_heads(cp, "state_passing", "kda", key_heads=2)
    with pytest.raises(ConfigError, match=r"kda: 2 key_heads .* context_parallel_size=4"):
        check_heads(cp, "all_to_all", "kda", key_heads=2)


def _pg(cp_size):
    from megatron.core import parallel_state

    return types.SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group(),
                                 cp=StandInGroup(cp_size))


def test_delta_rule_mixer_refuses_all_to_all_it_cannot_split_at_build_time():
    config = harness.tiny_config(context_parallel_size=4)  # 2 key heads
    with pytest.raises(ConfigError, match="heads must divide by TP \\* CP"):
        delta_rule.DeltaRuleMixer(
            config, LinearMixerSubmodules(), layer_number=1, variant="gated_deltanet",
            ext_config=ExtConfig(context_parallel_method="all_to_all"), pg_collection=_pg(4))


def test_cores_without_context_parallelism_are_named():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.mixers.attention import SoftmaxCoreAttention

    class NewCore(SoftmaxCoreAttention):  # a core that does not declare CP support
        pass

    config = harness.tiny_config(context_parallel_size=2)
    with pytest.raises(NotImplementedError, match="not supported by NewCore"):
        NewCore(config, layer_number=1, attn_mask_type=AttnMaskType.causal, pg_collection=_pg(2))


def test_sparse_cores_need_heads_divisible_by_context_parallel_size():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.mixers.sparse_attention import MoBACoreAttention

    config = harness.tiny_config(context_parallel_size=4)  # 4 query heads, 2 key/value heads
    with pytest.raises(ConfigError, match="4 query and 2 key/value heads per tensor-parallel rank "
                                          "must be divisible by context_parallel_size=4"):
        MoBACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          pg_collection=_pg(4))


def test_packed_sequences_that_megatron_cannot_split_are_refused_by_name():
    import torch

    from megatron_ext.parallel.linear import check_sequence

    cp = ContextParallel(StandInGroup(2))
    with pytest.raises(ConfigError, match=r"kda: packed sequences of lengths \[3, 5\] are not divisible"):
        check_sequence(cp, 2, torch.tensor([0, 3, 8]), 4, "kda")
    with pytest.raises(ConfigError, match="kda: a packed document of 8 tokens gives CP chunks of 2"):
        check_sequence(cp, 12, torch.tensor([0, 16, 24]), 4, "kda")
    with pytest.raises(ValueError, match="the local sequence has 10 tokens"):
        check_sequence(cp, 10, torch.tensor([0, 16, 24]), 3, "kda")
    assert check_sequence(cp, 12, torch.tensor([0, 16, 24]), 3, "kda").local_cu_seqlens.tolist() == [0, 4, 8, 10, 12]
