"""Two of HF's mask helpers as the patcher wraps them (transformers.masking_utils): the
packed-sequence check and SDPA's causal-mask decision, answered without work on positions HF
generates itself while a patched causal-LM forward runs."""

from __future__ import annotations

import torch

from tigon import ambient

# ---- HF's packed-sequence check ----

def make_find_packed_sequence_indices(original):
    """HF's ``masking_utils.find_packed_sequence_indices`` (which reads the GPU: a host sync
    every forward), answering "not packed" without looking while a patched causal-LM forward
    runs on positions HF generates itself (no position_ids, attention mask or cache given: a
    plain arange, so nothing is packed). Without the sync the host can queue the next step
    while the GPU finishes the last one."""
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if ambient.GENERATED_POSITIONS.on:
            return None
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices._tigon = "packed-sequence check skipped on generated positions"
    return find_packed_sequence_indices


# ---- HF's SDPA causal-mask decision ----

IGNORE_CAUSAL_MASK_PARAMS = ("padding_mask", "q_length", "kv_length", "q_offset", "kv_offset",
                             "local_attention_size")


def make_ignore_causal_mask_sdpa(original):
    """HF's ``masking_utils._ignore_causal_mask_sdpa`` (may SDPA run with ``is_causal=True``
    instead of a materialised [B, 1, T, T] mask?), answering yes also while torch.compile traces,
    when a patched causal-LM forward runs without attention mask, positions or cache: the answer
    eager HF gives there. HF answers no whenever it traces (with torch < 2.14 it cannot tell
    compile from export), and SDPA with an explicit mask runs slower attention kernels (on the
    H100, Qwen2.5-0.5B at batch 128: cuDNN's backward 1.40 ms a call against 0.75 with is_causal)."""
    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset=0, kv_offset=0,
                                 local_attention_size=None, *args, **kwargs):
        if (ambient.GENERATED_POSITIONS.on and padding_mask is None and not torch.is_tensor(q_offset)
                and q_offset == 0 and kv_offset == 0 and q_length == kv_length
                and (local_attention_size is None or kv_length < local_attention_size)):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size,
                        *args, **kwargs)

    _ignore_causal_mask_sdpa._tigon = "is_causal SDPA also under torch.compile on generated positions"
    return _ignore_causal_mask_sdpa
