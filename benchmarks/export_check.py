"""Check an exported checkpoint on the GPU: ``megatron-ext export`` of a run, loaded with
``transformers`` (``AutoModelForCausalLM``, ``trust_remote_code=True``), against megatron-ext's own
loading of the same checkpoint.

On ``--device`` (default cuda), for ``--batch`` sequences of ``--length`` tokens (the
tokenizer's encoding of the text of ``--text-file`` when the export has a tokenizer, random ids
otherwise):

- fp32: the largest logit difference between the exported model and megatron-ext's model;
- bf16: the exported model cast to bf16 against the fp32 logits (largest difference relative
  to the largest fp32 logit, mean absolute difference, agreement of the top-1 token);
- generation: ``generate`` (greedy, ``--new-tokens``) decoding incrementally against
  ``generate(use_cache=False)``, which recomputes the sequence each step: the tokens must be the
  same in fp32; milliseconds per new token of each.

Writes ``--out`` (JSON) and prints one line per check; exits non-zero when the fp32 logits
differ by more than ``--fp32-tolerance`` or fp32 generation differs.

    python benchmarks/export_check.py RUN_DIR HF_DIR --tokenizer-model TOKENIZER \\
        --out benchmarks/results/export_check_h200.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from megatron_ext.doctor import add_commit_argument, stamp


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def reference_model(run_dir: pathlib.Path, device: str):
    """megatron-ext's model of the run's newest checkpoint (fp32), without transformers."""
    import yaml

    from megatron_ext import train
    from megatron_ext.export import find_checkpoint, load_weights
    from megatron_ext.hf import build_gpt_model

    run_dir, checkpoint = find_checkpoint(run_dir)
    settings = train.RunSettings.from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    model = build_gpt_model(settings, train._padded_vocab(settings.data.vocab_size, 1))
    load_weights(model, checkpoint)
    return model.to(device).eval(), checkpoint


def input_tokens(hf_dir: pathlib.Path, vocab: int, batch: int, length: int, text_file,
                 device: str) -> torch.Tensor:
    """``[batch, length]`` ids: consecutive pieces of the text's encoding, or random ids."""
    if text_file and (hf_dir / "tokenizer.model").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
        ids = tokenizer(pathlib.Path(text_file).read_text())["input_ids"]
        if len(ids) >= batch * length:
            return torch.tensor(ids[:batch * length], device=device).view(batch, length)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def timed_generate(model, prompt: torch.Tensor, new_tokens: int, use_cache: bool):
    torch.cuda.synchronize() if prompt.is_cuda else None
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, use_cache=use_cache, pad_token_id=0)
    torch.cuda.synchronize() if prompt.is_cuda else None
    return out[:, prompt.shape[1]:], 1e3 * (time.perf_counter() - start) / new_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=pathlib.Path, help="a train or pretrain run directory")
    parser.add_argument("hf_dir", type=pathlib.Path, help="where the export is written")
    parser.add_argument("--tokenizer-model", default=None, help="ship this sentencepiece model")
    parser.add_argument("--text-file", default=None, help="text whose tokens are the inputs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--fp32-tolerance", type=float, default=1e-4,
                        help="largest fp32 logit difference allowed, relative to the largest logit")
    parser.add_argument("--out", required=True)
    add_commit_argument(parser)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from megatron_ext.export import export

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    record = {"environment": stamp(args.commit), "command": "python " + " ".join(sys.argv)}
    log(f"exporting {args.run_dir} -> {args.hf_dir}")
    export(args.run_dir, args.hf_dir, tokenizer_model=args.tokenizer_model)
    reference, checkpoint = reference_model(args.run_dir, args.device)
    record["checkpoint"] = checkpoint.name
    record["parameters"] = sum(p.numel() for p in reference.parameters())
    tokens = input_tokens(args.hf_dir, reference.vocab_size, args.batch, args.length,
                          args.text_file, args.device)
    with torch.no_grad():
        positions = torch.arange(args.length, device=args.device).expand(args.batch, -1)
        expected = reference(tokens, positions, None).float()
    del reference
    scale = expected.abs().max().item()

    fp32 = AutoModelForCausalLM.from_pretrained(args.hf_dir, trust_remote_code=True,
                                                dtype=torch.float32, device_map=args.device)
    diff = (logits_of(fp32, tokens) - expected).abs().max().item()
    record["fp32"] = {"max_abs_diff": diff, "max_logit": scale, "relative": diff / scale}
    log(f"fp32 exported vs megatron-ext: max |diff| {diff:.3g} (largest logit {scale:.3g})")
    prompt = tokens[:, :args.prompt_length]
    generated, ms_cached = timed_generate(fp32, prompt, args.new_tokens, use_cache=True)
    recomputed, ms_recomputed = timed_generate(fp32, prompt, args.new_tokens, use_cache=False)
    same = bool(torch.equal(generated, recomputed))
    record["generate_fp32"] = {
        "new_tokens": args.new_tokens, "same_tokens_as_recomputing": same,
        "ms_per_token_incremental": round(ms_cached, 2),
        "ms_per_token_recomputing": round(ms_recomputed, 2)}
    log(f"fp32 generate: incremental == recomputing: {same}; {ms_cached:.1f} ms/token "
        f"(recomputing {ms_recomputed:.1f})")
    del fp32

    bf16 = AutoModelForCausalLM.from_pretrained(args.hf_dir, trust_remote_code=True,
                                                dtype=torch.bfloat16, device_map=args.device)
    got = logits_of(bf16, tokens)
    error = (got - expected).abs()
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    record["bf16"] = {"relative_max_diff": error.max().item() / scale,
                      "mean_abs_diff": error.mean().item(), "top1_agreement": top1}
    log(f"bf16 exported vs fp32: max |diff| / max |logit| {record['bf16']['relative_max_diff']:.3g}"
        f", mean |diff| {record['bf16']['mean_abs_diff']:.3g}, top-1 agreement "
        f"{record['bf16']['top1_agreement']:.4f}")
    generated, ms_cached = timed_generate(bf16, prompt, args.new_tokens, use_cache=True)
    recomputed, _ = timed_generate(bf16, prompt, args.new_tokens, use_cache=False)
    record["generate_bf16"] = {
        "tokens_equal_to_recomputing": int((generated == recomputed).sum()),
        "of": generated.numel(), "ms_per_token_incremental": round(ms_cached, 2)}
    if (args.hf_dir / "tokenizer.model").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.hf_dir, trust_remote_code=True)
        record["generate_bf16"]["sample"] = tokenizer.decode(generated[0].tolist())
    log(f"bf16 generate: {record['generate_bf16']}")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    ok = record["fp32"]["relative"] <= args.fp32_tolerance and same
    log(f"{'ok' if ok else 'FAILED'}: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
