"""The self-check's cases of the linear-recurrence ops (``selfcheck.py``): their names, input
forms and packing, and the dtypes they run in. The backend policy (``backends.py``) names the
jobs a call relies on from this table, so it lives apart from the checks, which import the op
packages.
"""
import dataclasses

import torch

__all__ = ["CASES", "DECAY_CASES", "DELTA_RULE_CASES", "DPLR_CASES", "DTYPES", "Case"]

DELTA_RULE_CASES = ("deltanet", "gated_deltanet", "kda", "gdn2")
DECAY_CASES = ("none", "constant", "per_head", "per_channel")
DPLR_CASES = ("rwkv7", "per_head", "none")  # g per key channel (RWKV-7's), per head, none
DTYPES = (torch.float32, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str                      # as shown in the table
    form: str                      # the op's input form (delta_rule_inputs' case, decay_inputs'
                                   # decay, dplr_inputs' form)
    packed: bool = False           # sequences of PACKED_LENGTHS packed along T (cu_seqlens)
    segmented: bool = False        # one sequence of SEGMENTED_LEN tokens, whose state walks the
                                   # Triton kernels cut into segments


CASES = {
    "gated_delta_rule": (*(Case(form, form) for form in DELTA_RULE_CASES),
                         Case("kda_packed", "kda", True),
                         *(Case(f"{form}_segmented", form, segmented=True) for form in ("gated_deltanet", "kda"))),
    "decay_linear_attention": (*(Case(form, form) for form in DECAY_CASES),
                               Case("per_channel_packed", "per_channel", True)),
    "dplr_delta_rule": (*(Case(form, form) for form in DPLR_CASES), Case("rwkv7_packed", "rwkv7", True)),
}
