"""Context parallelism (megatron_ext.parallel) on gloo: every CP run equals the one-process run.

- Op level: state passing and all-to-all around ``gated_delta_rule`` (every variant),
  ``decay_linear_attention`` (every decay form) and ``dplr_delta_rule`` (every decay form), on
  Megatron's load-balanced layout, give the full-sequence outputs and input gradients at this
  rank's positions; so do the convolution halo, RWKV-7's token shift and the attention KV
  gather; and the bytes the collectives move equal the formulas of megatron_ext/parallel/README.md.
- Model level: a tiny GPTModel with every linear mixer but Hedgehog, and '*', under CP = 2
  (both methods), CP = 4, TP = 2 x CP = 2 and TP = 2 x CP = 2 + SP equals CP = 1 in loss and
  gradients, on a batch and on packed documents; so do a model with sliding-window attention
  and sinks, models with MoBA, NSA, DSA, CSA and HCA, one with CSA, attention, DSA and HCA
  under RoPE (on a batch and on packed documents), and one with MLA and DSA on MLA
  (``mla_rope_type`` rope on a batch and on packed documents, yarn on a batch).
- Sparse mixers' volumes: the bytes one layer of MoBA, NSA, DSA, CSA or HCA (and DSA's and
  CSA's dense warm-up), MLA or DSA on MLA moves under CP = 2 with RoPE, forward and backward,
  by kind, equal the README's formulas.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import harness

pytestmark = pytest.mark.dist


@contextlib.contextmanager
def counted_bytes():
    """Count the bytes each collective brings to this rank from the other ranks, by kind."""
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    originals = {name: getattr(dist, name) for name in
                 ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")}

    def counting(name, kind, received):
        def call(out, inp, *args, group=None, **kwargs):
            size = (group or dist.group.WORLD).size()
            counts[kind] += received(out, inp) * (size - 1) // size
            return originals[name](out, inp, *args, group=group, **kwargs)
        return call

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    dist.all_gather_into_tensor = counting("all_gather_into_tensor", "all_gather",
                                           lambda out, inp: nbytes(out))
    dist.reduce_scatter_tensor = counting("reduce_scatter_tensor", "reduce_scatter",
                                          lambda out, inp: nbytes(inp))
    dist.all_to_all_single = counting("all_to_all_single", "all_to_all",
                                      lambda out, inp: nbytes(inp))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _op_cases(cp, batch=2, seq_len=24):
    from megatron_ext.kernels import decay_linear_attention, dplr_delta_rule, gated_delta_rule
    from megatron_ext.kernels.decay import decay_linear_attention_summary
    from megatron_ext.kernels.delta_rule import gated_delta_rule_summary
    from megatron_ext.kernels.cases import DECAY_CASES, DELTA_RULE_CASES, DPLR_CASES
    from megatron_ext.kernels.dplr import dplr_delta_rule_summary
    from megatron_ext.kernels.selfcheck import decay_inputs, delta_rule_inputs, dplr_inputs

    shape = dict(batch=batch, seq_len=seq_len, key_heads=cp, value_heads=2 * cp, key_dim=8,
                 value_dim=6, dtype=torch.float32, with_initial_state=False)
    for case in DELTA_RULE_CASES:
        yield case, gated_delta_rule, gated_delta_rule_summary, delta_rule_inputs(case, **shape)
    for case in DECAY_CASES:
        yield case, decay_linear_attention, decay_linear_attention_summary, decay_inputs(case, **shape)
    for form in DPLR_CASES:
        yield f"dplr {form}", dplr_delta_rule, dplr_delta_rule_summary, dplr_inputs(form, **shape)


def _state_passing_bytes(inputs, cp):
    """README formula, state passing: 2 B H K (V + X) fp32 values from each other rank, X = K
    for the delta rules' full transition (gated and DPLR), 1 for the decay family's diagonal one."""
    batch, _, heads, value_dim = inputs["v"].shape
    key_dim = inputs["k"].shape[-1]
    width = key_dim if {"beta", "erase", "a"} & set(inputs) else 1
    return (cp - 1) * 2 * batch * heads * key_dim * (value_dim + width) * 4


def _all_to_all_bytes(inputs, outputs, cp):
    """README formula, all-to-all: every [B, T/CP, ...] input and output, times (CP-1)/CP."""
    tensors = [t for t in inputs.values() if t.dim() >= 3] + outputs
    return sum(t.numel() * t.element_size() for t in tensors) // cp * (cp - 1) // cp


# Packed documents for CP = 2 and 4: every length a multiple of 2 * CP, chunks of >= 3 tokens
# (the convolution's halo) at CP = 4.
PACKED_LENGTHS = (24, 48, 24)


def _packed_ops_on_cp_ranks(cp, world_size):
    """Both methods on packed sequences (Megatron's per-document split) against the one-rank
    op on the whole pack, outputs and input gradients."""
    from megatron_ext.parallel.context import PackedLayout
    from megatron_ext.parallel.linear import linear_recurrence

    failures = []
    cu_seqlens = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    index = PackedLayout(cp, cu_seqlens).global_index(cp.rank)
    for case, op, summary, inputs in _op_cases(world_size, batch=1, seq_len=sum(PACKED_LENGTHS)):
        full_out, _ = op(**inputs, cu_seqlens=cu_seqlens, backend="chunked")
        weight = torch.randn(full_out.shape, generator=torch.Generator().manual_seed(7))
        full_grads = torch.autograd.grad((full_out * weight).sum(), list(inputs.values()))
        for method in ("state_passing", "all_to_all"):
            local = {n: (t[:, index] if t.dim() >= 3 else t).detach().requires_grad_()
                     for n, t in inputs.items()}
            with counted_bytes() as counts:
                out, _ = linear_recurrence(cp, method, op, summary, local, cu_seqlens=cu_seqlens,
                                           backend="chunked")
                grads = torch.autograd.grad((out * weight[:, index]).sum(), list(local.values()))
            try:
                if method == "state_passing":  # README: 2 B -> 2 D, D documents
                    per_document = _state_passing_bytes(inputs, world_size)  # inputs' batch is 1
                    volume = len(PACKED_LENGTHS) * per_document
                    assert counts == dict(all_gather=volume, reduce_scatter=volume, all_to_all=0), counts
                torch.testing.assert_close(out, full_out[:, index], rtol=1e-4, atol=1e-5)
                for name, grad, full in zip(local, grads, full_grads):
                    if full.dim() >= 3:
                        full = full[:, index]
                    else:
                        dist.all_reduce(grad)
                    torch.testing.assert_close(grad, full, rtol=1e-4, atol=1e-5, msg=name)
            except AssertionError as error:
                failures.append(f"packed {case} {method}: {error}")
    return failures


def ops_on_cp_ranks(rank, world_size):
    from megatron_ext.parallel import ContextParallel
    from megatron_ext.parallel.linear import linear_recurrence

    cp = ContextParallel(dist.group.WORLD)
    failures = _packed_ops_on_cp_ranks(cp, world_size)
    for case, op, summary, inputs in _op_cases(world_size):
        seq_len = inputs["q"].shape[1]
        positions = cp.positions(seq_len // world_size)
        full_out, _ = op(**inputs, backend="chunked")
        weight = torch.randn(full_out.shape, generator=torch.Generator().manual_seed(7))
        full_grads = torch.autograd.grad((full_out * weight).sum(), list(inputs.values()))
        for method in ("state_passing", "all_to_all"):
            local = {n: (t[:, positions] if t.dim() >= 3 else t).detach().requires_grad_()
                     for n, t in inputs.items()}
            with counted_bytes() as counts:
                out, _ = linear_recurrence(cp, method, op, summary, local, backend="chunked")
                grads = torch.autograd.grad((out * weight[:, positions]).sum(), list(local.values()))
            try:
                torch.testing.assert_close(out, full_out[:, positions], rtol=1e-4, atol=1e-5)
                for name, grad, full in zip(local, grads, full_grads):
                    if full.dim() >= 3:
                        full = full[:, positions]
                    else:  # a per-head constant: each rank holds part of its gradient
                        dist.all_reduce(grad)
                    torch.testing.assert_close(grad, full, rtol=1e-4, atol=1e-5, msg=name)
                if method == "state_passing":
                    volume = _state_passing_bytes(inputs, world_size)
                    assert counts == dict(all_gather=volume, reduce_scatter=volume,
                                          all_to_all=0), (counts, volume)
                else:
                    volume = _all_to_all_bytes(inputs, [full_out], world_size)
                    assert counts == dict(all_gather=0, reduce_scatter=0,
                                          all_to_all=2 * volume), (counts, volume)
            except AssertionError as error:
                failures.append(f"{case} {method}: {error}")
    failures += _halo_and_kv_gather(cp, world_size)
    failures += _token_shift(cp, world_size)
    return failures


def _halo_and_kv_gather(cp, world_size):
    """The convolution halo and the attention KV gather: values, and bytes against README."""
    from megatron_ext.kernels.fused.reference import short_conv
    from megatron_ext.parallel.attention import gather_keys_values

    failures = []
    batch, seq_len, heads, dim, width = 2, 24, 2, 8, 4
    full = torch.randn(batch, seq_len, heads, dim, generator=torch.Generator().manual_seed(3))
    positions = cp.positions(seq_len // world_size)
    local = full[:, positions].requires_grad_()
    with counted_bytes() as counts:
        keys, values, allowed = gather_keys_values(cp, local, local, local)
        (keys.sum() + values.sum()).backward()
    volume = 2 * batch * seq_len * heads * dim * 4 * (world_size - 1) // world_size
    if not (torch.equal(keys, full) and torch.equal(allowed, positions[:, None] >= torch.arange(seq_len))
            and counts == dict(all_gather=volume, reduce_scatter=volume, all_to_all=0)):
        failures.append(f"kv gather: {counts}, expected {volume} each way")

    channels = full.flatten(2)
    weight = torch.randn(heads * dim, width, generator=torch.Generator().manual_seed(4))
    with counted_bytes() as counts:
        chunks = cp.split_chunks(channels[:, positions])
        halo = cp.previous_tokens(chunks, width - 1)
    convolved = cp.merge_chunks(short_conv(torch.cat([halo, chunks], 1), weight)[:, width - 1:])
    volume = 2 * batch * (width - 1) * heads * dim * 4 * (world_size - 1)
    if not (torch.allclose(convolved, short_conv(channels, weight)[:, positions])
            and counts["all_gather"] == volume):
        failures.append(f"conv halo: {counts}, expected {volume}")

    # Packed: the halo and the KV gather on Megatron's per-document split.
    from megatron_ext.kernels.fused import sequence_positions
    from megatron_ext.mixers.common import conv_silu_heads
    from megatron_ext.parallel.context import PackedLayout

    total = sum(PACKED_LENGTHS)
    cu_seqlens = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedLayout(cp, cu_seqlens, min_chunk=width - 1)
    index = packed.global_index(cp.rank)
    full = torch.randn(1, total, heads, dim, generator=torch.Generator().manual_seed(5))
    keys, values, allowed = gather_keys_values(cp, full[:, index], full[:, index], full[:, index], cu_seqlens)
    document = torch.repeat_interleave(torch.tensor(PACKED_LENGTHS))
    expected = (torch.arange(total)[None, :] <= index[:, None]) & (document[index][:, None] == document[None, :])
    if not (torch.equal(keys, full) and torch.equal(values, full) and torch.equal(allowed, expected)):
        failures.append("packed kv gather")
    channels = full.flatten(2).transpose(0, 1)  # [s, b = 1, C]
    with counted_bytes() as counts:
        local = conv_silu_heads(channels[index], weight, heads, cp=cp, packed=packed)
    whole = conv_silu_heads(channels, weight, heads, sequence_positions(cu_seqlens, total, None))
    volume = 2 * len(PACKED_LENGTHS) * (width - 1) * heads * dim * 4 * (world_size - 1)  # 2 B -> 2 D
    if not (torch.allclose(local, whole[:, index]) and counts["all_gather"] == volume):
        failures.append(f"packed conv halo: {counts}, expected {volume}")
    return failures


def _token_shift(cp, world_size):
    """RWKV-7's token shift (the token before each token, zeros before a sequence's or document's
    first) on this rank's chunks, and its bytes against the README (the halo at W = 2)."""
    import types

    from megatron_ext.mixers.rwkv7 import Rwkv7Mixer
    from megatron_ext.parallel.context import PackedLayout

    failures = []
    batch, seq_len, hidden = 2, 24, 5
    stand_in = types.SimpleNamespace(cp=cp)  # _previous_tokens reads only self.cp
    full = torch.randn(seq_len, batch, hidden, generator=torch.Generator().manual_seed(6))
    positions = cp.positions(seq_len // world_size)
    with counted_bytes() as counts:
        local = Rwkv7Mixer._previous_tokens(stand_in, full[positions], None, None, None)
    expected = torch.cat([torch.zeros_like(full[:1]), full[:-1]])[positions]
    volume = 2 * batch * hidden * 4 * (world_size - 1)
    if not (torch.equal(local, expected) and counts["all_gather"] == volume):
        failures.append(f"token shift: {counts}, expected {volume}")

    total = sum(PACKED_LENGTHS)
    cu_seqlens = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedLayout(cp, cu_seqlens)
    index = packed.global_index(cp.rank)
    full = torch.randn(total, 1, hidden, generator=torch.Generator().manual_seed(8))
    with counted_bytes() as counts:
        local = Rwkv7Mixer._previous_tokens(stand_in, full[index], None, None, packed)
    expected = torch.cat([torch.zeros_like(full[:1]), full[:-1]])
    expected[cu_seqlens[:-1].long()] = 0.0  # each document starts from zeros
    volume = 2 * len(PACKED_LENGTHS) * hidden * 4 * (world_size - 1)  # 2 B -> 2 D
    if not (torch.equal(local, expected[index]) and counts["all_gather"] == volume):
        failures.append(f"packed token shift: {counts}, expected {volume}")
    return failures


@pytest.mark.skipif(harness.dist_backend() == "nccl", reason="op-level checks on CPU tensors (gloo)")
def test_linear_recurrence_ops_equal_the_full_sequence():
    failures = harness.spawn(ops_on_cp_ranks, 2)
    assert failures == [[]] * 2


# ------------------------------------------------------------------------- model level
# Every linear mixer of the registry but Hedgehog (refused under CP), and '*': GDN, KDA, GDN-2,
# DeltaNet, GLA, RetNet, Lightning, Mamba-2, HGRN-2, RWKV-7, attention.
PATTERN = "GKQNARLMWV*"
# (method, TP, CP, sequence parallel) run by each world size; a world runs its layouts one
# after another, so that the processes start (and import Megatron) once per world size.
LAYOUTS = {
    1: [("state_passing", 1, 1, False)],
    2: [("state_passing", 1, 2, False), ("all_to_all", 1, 2, False)],
    4: [("state_passing", 1, 4, False), ("state_passing", 2, 2, False),
        ("state_passing", 2, 2, True)],
}


def run_cp_layouts(rank, world_size, ckpt_dir):
    """Each layout of this world size: build, load the one-rank weights (the one-rank run saves
    them), one forward-backward on Megatron's CP split of a micro-batch, one on packed
    documents, then one of each model of OTHER_MODELS (a result each, in BATCHES' order). The
    loss is the mean over all tokens, the gradients summed over CP (as Megatron's
    finalize_model_grads does over its DP x CP group)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_ext.config import ExtConfig
    from megatron_ext.parallel import ContextParallel
    from megatron_ext.parallel.context import PackedLayout

    results = []
    for method, tp, cp, sp in LAYOUTS[world_size]:
        ext = ExtConfig(pattern=PATTERN, context_parallel_method=method, kernel_backend="chunked")
        (model,), config = harness.build_layout(ext, tp=tp, sequence_parallel=sp, cp=cp)
        harness.save_or_load([model], ckpt_dir, save=world_size == 1)
        group = ps.get_context_parallel_group()
        # cp_group must be given: without it this helper splits over the whole world.
        batch = get_batch_on_this_cp_rank(harness.layout_batches()[0], is_hybrid_cp=False,
                                          cp_group=group)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        results.append(_step_result(model, config, losses.sum() / (harness.BATCH * harness.SEQ), group))
        # The same weights on packed documents, split per document as Megatron does.
        model.zero_grad()
        tokens, labels, params = _packed_batch()
        index = PackedLayout(ContextParallel(group), params.cu_seqlens_q).global_index(group.rank())
        losses = model(tokens[:, index], torch.arange(len(index))[None], None, labels=labels[:, index],
                       packed_seq_params=params)
        results.append(_step_result(model, config, losses.sum() / tokens.shape[1], group))
        # The other models, each with weights of its own.
        for name, (pattern, ext_options, overrides, packed, position_embedding) in OTHER_MODELS.items():
            ext = ExtConfig(pattern=pattern, context_parallel_method=method, kernel_backend="chunked",
                            **ext_options)
            (model,), config = harness.build_layout(ext, tp=tp, sequence_parallel=sp, cp=cp,
                                                    config_overrides=overrides,
                                                    position_embedding_type=position_embedding)
            group = ps.get_context_parallel_group()  # build_layout made the groups anew
            model_ckpt = f"{ckpt_dir}-{name}"
            if world_size == 1:
                os.makedirs(model_ckpt, exist_ok=True)
            harness.save_or_load([model], model_ckpt, save=world_size == 1)
            if packed:
                losses = model(tokens[:, index], torch.arange(len(index))[None], None,
                               labels=labels[:, index], packed_seq_params=params)
                results.append(_step_result(model, config, losses.sum() / tokens.shape[1], group))
            else:
                losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                results.append(_step_result(model, config, losses.sum() / (harness.BATCH * harness.SEQ),
                                            group))
    return results


# MLA ('+') at DeepSeek-V3's head dims (query/key 128 + 64 RoPE, value 128) on small latents,
# and DSA on MLA ('D' under dsa_attention_type: mla, the indexer's dim covering the 64 RoPE dims).
MLA_DSA = dict(harness.SHORT_SPARSE, mla_q_lora_rank=32, mla_kv_lora_rank=16, mla_qk_head_dim=128,
               mla_qk_pos_emb_head_dim=64, mla_v_head_dim=128, dsa_attention_type="mla",
               dsa_indexer_dim=64)
# name: (pattern, ExtConfig options, TransformerConfig overrides, on packed documents rather
# than the batch, position_embedding_type). Sliding-window attention with a learnable sink;
# MoBA, NSA, FoX and DSA with a sink and CSA and HCA (all-to-all over heads, so 8 query and 4
# key/value heads: divisible by TP * CP in every layout); all six on packed documents; each
# next to a linear mixer. Then CSA, '*', DSA and HCA with RoPE (head dim 8, all rotary: the
# indexers' dim of 8 covers it), on the batch and on packed documents. Then MLA, GDN, '*' (the
# model's RoPE) and DSA on MLA (MLA's own RoPE, with mla_rope_type rope on the batch and on
# packed documents, yarn on the batch).
OTHER_MODELS = {
    "window_sink": ("*G*", {}, dict(window_size=(5, 0), softmax_type="learnable"), False, "none"),
    "sparse": ("BGSFD", harness.SHORT_SPARSE,
               dict(softmax_type="learnable", num_attention_heads=8, num_query_groups=4), False,
               "none"),
    "compressed": ("CGH", harness.SHORT_SPARSE, dict(num_attention_heads=8, num_query_groups=4), False,
                   "none"),
    "sparse_packed": ("BSFDGCH", harness.SHORT_SPARSE, dict(num_attention_heads=8, num_query_groups=4),
                      True, "none"),
    "rope": ("C*DH", harness.SHORT_SPARSE, dict(num_attention_heads=8, num_query_groups=4), False,
             "rope"),
    "rope_packed": ("C*DH", harness.SHORT_SPARSE, dict(num_attention_heads=8, num_query_groups=4),
                    True, "rope"),
    "mla": ("+G*D", MLA_DSA, {}, False, "rope"),
    "mla_packed": ("+G*D", MLA_DSA, {}, True, "rope"),
    "mla_yarn": ("+G*D", dict(MLA_DSA, mla_rope_type="yarn"), {}, False, "rope"),
}


def _packed_batch():
    """Tokens and labels ``[1, T]`` of PACKED_LENGTHS documents, and their PackedSeqParams."""
    from megatron.core.packed_seq_params import PackedSeqParams

    total = sum(PACKED_LENGTHS)
    tokens = torch.randint(0, harness.VOCAB, (1, total + 1), generator=torch.Generator().manual_seed(11))
    cu_seqlens = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max(PACKED_LENGTHS), max_seqlen_kv=max(PACKED_LENGTHS))
    return tokens[:, :-1], tokens[:, 1:], params


def _step_result(model, config, loss, group):
    """Backward of ``loss`` (this rank's share of the mean over all tokens); the loss and the
    gradients summed over CP, as Megatron's finalize_model_grads does over its DP x CP group."""
    from megatron.core import parallel_state as ps

    loss.backward()
    dist.all_reduce(loss.detach(), group=group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
    return dict(losses=[float(loss)], tp_rank=ps.get_tensor_model_parallel_rank(),
                grads=harness.global_grads([model], config))


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """Merged (losses, gradients) by layout; the one-rank run first."""
    ckpt = str(tmp_path_factory.mktemp("cp1"))
    runs = {}
    for world_size, layouts in LAYOUTS.items():
        if not harness.can_spawn(world_size):
            continue
        per_rank = harness.spawn(run_cp_layouts, world_size, ckpt)
        for i, layout in enumerate(layouts):
            for j, batch in enumerate(BATCHES):
                runs[(*layout, batch)] = harness.merge_layout(
                    [results[len(BATCHES) * i + j] for results in per_rank])
    return runs


# What each layout runs: the pattern on a batch and on packed documents, then OTHER_MODELS.
BATCHES = ("batch", "packed", *OTHER_MODELS)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("layout", [layout for world_size in (2, 4) for layout in LAYOUTS[world_size]],
                         ids=lambda layout: "{}-tp{}-cp{}{}".format(*layout[:3], "-sp" * layout[3]))
def test_context_parallel_model_equals_one_rank(cp_runs, layout, batch):
    if (*layout, batch) not in cp_runs:
        pytest.skip(f"CP x TP = {layout[1] * layout[2]} ranks: more than this host's GPUs")
    harness.assert_same_run(cp_runs[("state_passing", 1, 1, False, batch)], cp_runs[(*layout, batch)])


@pytest.mark.parametrize("batch", BATCHES)
def test_state_passing_equals_all_to_all(cp_runs, batch):
    harness.assert_same_run(cp_runs[("all_to_all", 1, 2, False, batch)],
                            cp_runs[("state_passing", 1, 2, False, batch)],
                            atol=1e-6)


# ------------------------------------------------------------------ sparse mixers' volumes
@contextlib.contextmanager
def counted_all_reduce():
    """Count the all-reduces (none is expected of these layers under CP alone): the bytes a
    rank receives in a ring all-reduce (a reduce-scatter, then an all-gather) of an N-byte
    tensor, 2 (CP-1)/CP N."""
    counts = {"all_reduce": 0}
    original = dist.all_reduce

    def call(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None) or dist.group.WORLD
        size = group.size()
        counts["all_reduce"] += 2 * tensor.numel() * tensor.element_size() * (size - 1) // size
        return original(tensor, *args, **kwargs)

    dist.all_reduce = call
    try:
        yield counts
    finally:
        dist.all_reduce = original


# name: (pattern symbol, ExtConfig options): each a GPTModel of that one layer under RoPE.
SPARSE_LAYERS = {"moba": ("B", {}), "nsa": ("S", {}), "dsa": ("D", {}), "csa": ("C", {}),
                 "hca": ("H", {}), "dsa_warmup": ("D", dict(dsa_stage="dense_warmup")),
                 "csa_warmup": ("C", dict(dsa_stage="dense_warmup")), "mla": ("+", MLA_DSA),
                 "dsa_mla": ("D", MLA_DSA)}


def _sparse_layer_volumes(symbol, ext, config, batch, seq_len, rotary_dims, cp):
    """README formulas: bytes a rank receives in one sparse layer's forward and its backward,
    by kind (``all_reduce`` as counted by :func:`counted_all_reduce`)."""
    share = lambda nbytes: nbytes * (cp - 1) // cp  # noqa: E731  (CP-1)/CP of a whole tensor
    hq, hkv, d, hidden = (config.num_attention_heads, config.num_query_groups, config.kv_channels,
                          config.hidden_size)
    e, fp32, local = config.params_dtype.itemsize, 4, seq_len // cp
    if symbol == "+" or ext.dsa_attention_type == "mla":  # MLA: a key/value head per query head
        hkv, qk_dim = hq, ext.mla_qk_head_dim + ext.mla_qk_pos_emb_head_dim
        if symbol == "+":  # all-gather of keys and values (each reduce-scattered back)
            kv = share(batch * seq_len * hq * (qk_dim + ext.mla_v_head_dim) * e)
            return (dict(all_gather=kv, reduce_scatter=0, all_to_all=0, all_reduce=0),
                    dict(all_gather=0, reduce_scatter=kv, all_to_all=0, all_reduce=0))
        d = max(qk_dim, ext.mla_v_head_dim)  # DSA on MLA: v padded to the query dims
    all_to_all = share(batch * local * (2 * hq + 2 * hkv) * d * e)  # q, k, v and the output
    gathered = gathered_back = target = 0
    if symbol == "S":  # NSA's three branch gates per query head, fp32
        all_to_all += share(batch * local * 3 * hq * fp32)
    if symbol == "D":  # the indexer's outputs q_I, k_I, w; backward: reduce-scatter of k_I's
        hi, di = ext.dsa_indexer_heads, ext.dsa_indexer_dim  # (q_I, w: the rank's own rows)
        gathered = share(batch * seq_len * (hi * di + di + hi) * e)
        gathered_back = share(batch * seq_len * di * e)
    if symbol in "CH":  # the compressor's values and gate logits, C channels each per kv head
        channels = 2 * d if symbol == "C" else d
        all_to_all += share(batch * local * hkv * 2 * channels * e)
        gathered += share(seq_len * rotary_dims * fp32)  # Megatron's rotary table (no grad)
    if symbol == "C":  # the indexer's (detached) input, the layer's normalised hidden state
        gathered += share(batch * seq_len * hidden * e)
    if symbol in "DC":  # the indexer loss's target: attention mass over S keys per query, fp32,
        # reduce-scattered by query rows (each rank gets its own tokens'): no all-reduce
        entries = seq_len if symbol == "D" else seq_len // ext.csa_compress_rate
        top_k = ext.dsa_top_k if symbol == "D" else ext.csa_top_k
        # Dense warm-up: every key a query chunk reaches; here one chunk of queries, all keys.
        keys = entries if ext.dsa_stage == "dense_warmup" else min(top_k, entries)
        target = share(batch * seq_len * keys * fp32)
    forward = dict(all_gather=gathered, reduce_scatter=target, all_to_all=all_to_all,
                   all_reduce=0)
    # Backward: the reverse all-to-alls and the reduce-scatter of the gathers that carry
    # gradients; the sparse stage keeps the target for backward, the dense warm-up recomputes
    # it with the loss's chunks, and its reduce-scatter. In the dense warm-up only the indexers
    # train: q, k and v get no gradient, the output still does.
    if ext.dsa_stage == "dense_warmup":
        all_to_all = share(batch * local * hq * d * e)
        gathered_back += target
    backward = dict(all_gather=0, reduce_scatter=gathered_back, all_to_all=all_to_all,
                    all_reduce=0)
    return forward, backward


def sparse_layer_bytes(rank, world_size):
    """Bytes counted in one forward and one backward of a GPTModel of one sparse layer (MoBA,
    NSA, DSA, CSA, HCA, and DSA's and CSA's dense warm-up, all but the indexers frozen), or of
    MLA or DSA on MLA, under CP with RoPE, and the README's volumes of that layer: equal counts of the whole model show
    that the embedding, RoPE table, MLP and output layer add no CP collective."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_ext.config import ExtConfig
    from megatron_ext.mixers.dsa import freeze_all_but_indexers

    results = {}
    for name, (symbol, options) in SPARSE_LAYERS.items():
        ext = ExtConfig(pattern=symbol, **{**harness.SHORT_SPARSE, **options})
        (model,), config = harness.build_layout(
            ext, cp=world_size, position_embedding_type="rope",
            config_overrides=dict(num_attention_heads=8, num_query_groups=4))
        if ext.dsa_stage == "dense_warmup":  # as the entry points do
            freeze_all_but_indexers(model)
        batch = get_batch_on_this_cp_rank(harness.layout_batches()[0], is_hybrid_cp=False,
                                          cp_group=ps.get_context_parallel_group())
        with counted_bytes() as forward, counted_all_reduce() as reduced:
            losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        forward.update(reduced)
        with counted_bytes() as backward, counted_all_reduce() as reduced:
            losses.sum().backward()
        backward.update(reduced)
        rotary_dims = 2 * model.rotary_pos_emb.inv_freq.numel()
        expected = _sparse_layer_volumes(symbol, ext, config, harness.BATCH, harness.SEQ,
                                         rotary_dims, world_size)
        results[name] = ((forward, backward), expected)
    return results


@pytest.mark.skipif(harness.dist_backend() == "nccl", reason="counts a CPU run (gloo)")
def test_sparse_mixer_volumes_equal_the_readme():
    for results in harness.spawn(sparse_layer_bytes, 2):
        for name, (counted, expected) in results.items():
            assert counted == expected, (name, counted, expected)
