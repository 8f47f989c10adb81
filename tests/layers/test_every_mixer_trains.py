"""A tiny hybrid of each registered mixer (that mixer, then attention) learns a fixed batch."""

import pytest
import torch

import harness
from megatron_ext.registry import MIXERS

pytestmark = pytest.mark.usefixtures("megatron_single_process")


@pytest.mark.parametrize("symbol", [m.symbol for m in MIXERS if m.name != "attention"])
def test_tiny_hybrid_trains(symbol):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2)
    torch.manual_seed(0)
    ext = ExtConfig(pattern=symbol + "*", **harness.SHORT_SPARSE)
    model = GPTModel(config, block_spec(config, ext=ext), vocab_size=96,
                     max_sequence_length=48, position_embedding_type="none")
    tokens = torch.randint(0, 96, (4, 49), generator=torch.Generator().manual_seed(1))
    losses = harness.fit(model, tokens)
    assert losses[-1] < losses[0] - 0.5, losses
