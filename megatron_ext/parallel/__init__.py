"""Parallel pieces that are not one mixer's business: Megatron's load-balanced context-parallel
layout and its collectives (:mod:`.context`), state-passing and all-to-all context parallelism
for the linear recurrences (:mod:`.linear`), and the KV all-gather of softmax attention
(:mod:`.attention`). Communication volumes: README.md in this folder."""

from megatron_ext.parallel.context import ContextParallel

__all__ = ["ContextParallel"]
