"""Incremental decoding through Megatron's static inference context.

For a tiny hybrid of each mixer (that mixer, then softmax attention) in fp32: a prefill of the
prompt and then one token per forward give the same logits as one forward over the whole
sequence. The linear mixers carry their recurrent state and short-convolution tails between
calls (a decode step reads only those, never the prefix); softmax layers use Megatron's KV cache.
Mixers that cannot decode yet say so by name.
"""

import pytest
import torch

import harness
from megatron_ext.config import ConfigError
from megatron_ext.registry import MIXERS

pytestmark = pytest.mark.usefixtures("megatron_single_process")

VOCAB, LENGTH, PROMPT = harness.DECODING_VOCAB, 21, 12


@pytest.mark.parametrize("mixer", [m for m in MIXERS], ids=lambda m: m.name)
def test_prefill_then_decode_matches_one_forward(mixer):
    model = harness.decoding_model(mixer.symbol + "*")
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(2, -1), None)
        if mixer.name in harness.CANNOT_DECODE:
            with pytest.raises(ConfigError, match="decod"):
                harness.decode(model, tokens, PROMPT)
            return
        torch.testing.assert_close(harness.decode(model, tokens, PROMPT),
                                   full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [
    {"window_size": (5, 0)},
    {"softmax_type": "learnable"},
    {"window_size": (5, 0), "softmax_type": "off-by-one"},
], ids=["window", "sink", "window+fixed-sink"])
def test_windowed_and_sink_attention_decode(options):
    """'*' layers with a sliding window of 5 earlier tokens and / or a sink decode through
    Megatron's KV cache, attending within the window."""
    model = harness.decoding_model("G*", config_options=options)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(2, -1), None)
        torch.testing.assert_close(harness.decode(model, tokens, PROMPT),
                                   full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("step", [1, 3], ids=["decode", "chunked prefill"])
def test_fox_with_window_and_sink_decodes(step):
    """FoX layers with a window of 5 earlier tokens and a learnable sink decode through
    Megatron's KV cache and the running sums of their log forget gates, one token at a time
    and in chunks of 3."""
    model = harness.decoding_model("GF", config_options={"window_size": (5, 0),
                                                         "softmax_type": "learnable"})
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(2, -1), None)
        torch.testing.assert_close(harness.decode(model, tokens, PROMPT, step=step),
                                   full, atol=2e-5, rtol=1e-4)


def test_window_decode_reads_only_the_window():
    """A decoding step of a windowed '*' layer reads the cached keys and values of its window
    only: values cached before it, made NaN after the prefill, leave the logits unchanged
    (reading them, even under a zero attention weight, would spread the NaN)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    window = 5
    model = harness.decoding_model("*", config_options={"window_size": (window, 0)})
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(7))
    context = StaticInferenceContext(max_batch_size=2, max_sequence_length=64)
    context.materialize_only_last_token_logits = False
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(2, -1), None)
        model(tokens[:, :PROMPT], torch.arange(PROMPT).expand(2, -1), None,
              inference_context=context)
        context.sequence_len_offset = PROMPT
        context.enable_decode_mode()
        (_keys, values), = context.key_value_memory_dict.values()  # [max s, max b, heads, d]
        values[:PROMPT - window].fill_(float("nan"))
        steps = []
        for t in range(PROMPT, LENGTH):
            steps.append(model(tokens[:, t:t + 1], torch.tensor([[t], [t]]), None,
                               inference_context=context))
            context.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, PROMPT:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("symbol", [m.symbol for m in MIXERS  # the linear mixers
                                    if not m.self_attention
                                    and m.name not in harness.CANNOT_DECODE
                                    and m.name != "mla"])
def test_linear_layers_continue_in_chunks(symbol):
    """Linear mixers also continue a sequence several tokens at a time (chunked prefill; Megatron's
    softmax attention turns its mask off after the prompt, so it takes one token per call)."""
    model = harness.decoding_model(symbol * 2)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(2, -1), None)
        torch.testing.assert_close(harness.decode(model, tokens, PROMPT, step=3), full,
                                   atol=2e-5, rtol=1e-4)


def test_hybrid_of_every_decoding_mixer():
    """All the mixers that decode in one model, with prompts of different lengths in the
    batch as Megatron's static batching runs them: the shortest prompt is prefilled and the
    rest of the longer prompts is fed token by token, in lockstep."""
    symbols = "".join(m.symbol for m in MIXERS if m.name not in harness.CANNOT_DECODE)
    model = harness.decoding_model(symbols)
    tokens = torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(3, -1), None)
        torch.testing.assert_close(harness.decode(model, tokens, prompt=4),
                                   full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [{"residual": "mhc"}, {"residual": "attnres_block"},
                                     {"residual": "attnres_full"},
                                     {"cross_layer_routing": "clvr"},
                                     {"cross_layer_routing": "cler_h"}], ids=str)
def test_residual_schemes_and_routing_decode(options):
    """Residual schemes mix each token's layer outputs over depth only, and routing adds a
    per-token term: decoding is unchanged by them."""
    model = harness.decoding_model("GM*N", **options)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens, torch.arange(LENGTH).expand(2, -1), None)
        torch.testing.assert_close(harness.decode(model, tokens, PROMPT),
                                   full, atol=2e-5, rtol=1e-4)


def test_decode_step_reads_only_the_cache():
    """A decode step's cost does not grow with the prefix: the cache a linear layer keeps has
    the same size after a prompt of 5 tokens and of 17 (a state and convolution tails)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    model = harness.decoding_model("G")
    sizes = []
    for prompt in (5, 17):
        context = StaticInferenceContext(max_batch_size=1, max_sequence_length=64)
        tokens = torch.randint(0, VOCAB, (1, prompt))
        with torch.no_grad():
            model(tokens, torch.arange(prompt)[None], None, inference_context=context)
        cache = context.key_value_memory_dict[1]
        sizes.append({name: tuple(t.shape) for name, t in cache.items()})
    assert sizes[0] == sizes[1]
    assert "state" in sizes[0]
