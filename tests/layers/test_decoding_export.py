"""Decoding and export on the GPU (skipped without one): the CUDA kernels, Megatron's KV cache
on the device and RoPE, which megatron-core 0.19 runs on a GPU only.

- A tiny hybrid of every mixer that decodes: the prompt in one forward, then one token per
  forward, gives the logits of one forward over the whole sequence. In fp32 the difference is
  at most a tenth of the bf16 model's own error against fp32 (the kernels' TF32 products), and
  in bf16 at most twice it (decoding adds no more than bf16 itself does).
- An exported hybrid with RoPE softmax layers, loaded with transformers on the GPU: fp32 logits
  equal megatron-ext's, bf16 logits within the same bound of them, and ``generate`` decoding
  incrementally gives the tokens of recomputing the sequence at every step.
"""

import pytest
import torch

import harness
from megatron_ext.registry import MIXERS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("megatron_on_cuda")]

LENGTH, PROMPT = 45, 17
DECODING = "".join(m.symbol for m in MIXERS if m.name not in harness.CANNOT_DECODE)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def full_forward(model, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return model(tokens, positions, None)


@pytest.fixture(autouse=True)
def no_tf32_in_torch():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_hybrid_of_every_decoding_mixer_decodes_on_cuda():
    # hidden 128, 4 heads: head dim 32, which the Triton kernels take.
    model = harness.decoding_model(DECODING, config_options={"hidden_size": 128,
                                                             "ffn_hidden_size": 256}).cuda()
    tokens = torch.randint(0, harness.DECODING_VOCAB, (3, LENGTH),
                           generator=torch.Generator().manual_seed(2)).cuda()
    full = full_forward(model, tokens)
    with torch.no_grad():
        fp32_error = relative_error(harness.decode(model, tokens, PROMPT), full)
        model.bfloat16()
        bf16_full = full_forward(model, tokens)
        bf16_own = relative_error(bf16_full, full)
        bf16_error = relative_error(harness.decode(model, tokens, PROMPT), bf16_full)
    print(f"decode vs one forward: fp32 {fp32_error:.3g}, bf16 {bf16_error:.3g}; "
          f"bf16 vs fp32 {bf16_own:.3g}")
    assert 0 < bf16_own < 0.1
    assert fp32_error <= 0.1 * bf16_own
    assert bf16_error <= 2 * bf16_own


def test_export_with_rope_on_cuda(tmp_path):
    pytest.importorskip("transformers", reason="the extra megatron-ext[hf] is not installed")
    settings = harness.settings_of("GK*M*Q", position_embedding_type="rope")
    model, hf = harness.exported_random_model(tmp_path, settings, dtype=torch.float32,
                                              device_map="cuda")
    model.cuda()
    tokens = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(5)).cuda()
    expected = full_forward(model, tokens)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected, atol=0, rtol=0)
        runs = [hf.generate(tokens[:1, :9], max_new_tokens=8, do_sample=False,
                            use_cache=use_cache) for use_cache in (True, False)]
        torch.testing.assert_close(runs[0], runs[1], atol=0, rtol=0)
        fp32_error = relative_error(harness.decode(model, tokens, 9), expected)
        bf16_own = relative_error(hf.bfloat16()(tokens).logits, expected)
    print(f"exported bf16 vs fp32: {bf16_own:.3g}; decode vs one forward in fp32: "
          f"{fp32_error:.3g}")
    assert 0 < bf16_own < 0.1
    assert fp32_error <= 0.1 * bf16_own
