"""A user's own script: a hybrid GPTModel from megatron-ext's specs, one training step.

    python examples/own_script.py                 # CPU (one process) or one GPU
    torchrun --nproc-per-node 2 examples/own_script.py --tp 2    # GPUs, tensor parallel

The only megatron-ext line is ``block_spec(config, pattern=...)``; everything else is plain
megatron-core.
"""

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.specs import block_spec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pattern", default="GG*G", help="one symbol or name per layer")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo",
                            rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    torch.manual_seed(0)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    else:
        # No model-parallel RNG streams on one CPU process (megatron's tracker is CUDA-only).
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    config = TransformerConfig(
        num_layers=len(args.pattern), hidden_size=128, num_attention_heads=4,
        num_query_groups=2, normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=args.tp, use_cpu_initialization=not cuda,
        bf16=cuda, params_dtype=torch.bfloat16 if cuda else torch.float32)
    model = GPTModel(config, block_spec(config, pattern=args.pattern), vocab_size=512,
                     max_sequence_length=128, position_embedding_type="none")
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    print(f"layers: {[type(layer.self_attention).__name__ for layer in model.decoder.layers]}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (2, 129), device=device)
    for step in range(3):
        loss = model(tokens[:, :-1], torch.arange(128, device=device).expand(2, -1), None,
                     labels=tokens[:, 1:]).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
