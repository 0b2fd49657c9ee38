"""Saved activations the dense layer count leaves out: MoE layers and attention masks.

:func:`mimotron.parallel.memory.layer_bytes_per_token` counts a dense transformer layer
run by SDPA without a mask. Two options change what a layer keeps beyond that, and
:func:`extra_layer_bytes_per_sample` adds them for a module stage:

* **Mixture of experts** (``num_experts > 0``): an MoE layer keeps, in place of the
  SwiGLU of ``ffn_hidden_size``, for every one of a token's ``top_k`` routed copies the
  expert's SwiGLU tensors (``4 x c f_e``, ``f_e`` the expert width, divided by
  ``expert_tensor``), three ``c h`` rows (the dispatched input, the expert's output and
  the unsorted copy the routing weights multiply) and 32 bytes of indices and weights;
  per token the fp32 router scores (4 bytes per expert) and 8 more bytes; a shared
  expert its own SwiGLU (``4 x c`` its width), and with its gate the shared output
  and the sigmoid the gate multiplies. Measured against the tensors autograd saves
  (``tests/test_activation_terms.py``: the whole model within 0.6%). Expert-parallel
  ranks are counted as if routing were balanced (each rank computes ``T x top_k``
  rows); the all-to-all's own buffers are not counted.
* **Attention masks** (``data.packing``, or ``context > 1``): the attention then runs
  with an explicit boolean mask (:func:`~mimotron.parallel.context_attention.
  context_attention_mask`), which SDPA converts to the queries' dtype in every layer
  and keeps for backward: ``c x (S / cp) x S`` bytes per layer, per sample for packed
  rows (``[B, 1, S/cp, S]``), per micro-batch for the causal context-parallel mask
  (``[1, 1, S/cp, S]``). The boolean masks of a forward (2 bytes per position pair
  and sample, measured, whatever the depth) are left out.

A recomputed layer (``modules.<m>.recompute``) runs its attention core again in
backward, so keeps no converted mask; under ``full`` recompute it keeps none of its MoE
tensors either.
"""

from __future__ import annotations

from mimotron.config import MimoConfig
from mimotron.names import LANGUAGE

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ROUTED_INDEX_BYTES = 32
"""Per routed copy: its sort order and token index (int64) and its fp32 weight, measured."""
TOKEN_ROUTER_BYTES = 8
"""Per token beyond the router's 4 bytes per expert, measured."""


def moe_extra_bytes_per_token(cfg: MimoConfig, name: str) -> int:
    """What one MoE layer keeps per token beyond the dense SwiGLU the layer count has.

    Negative when the experts' SwiGLU tensors (``top_k`` narrower ones) are smaller than
    the dense one they replace. 0 for a dense module.
    """
    from mimotron.models.blocks import default_ffn_hidden_size
    from mimotron.models.build import moe_options

    mod = cfg.modules[name]
    opts = moe_options(mod)
    if opts is None:
        return 0
    h, c, par = mod.hidden_size, BYTES[cfg.train.precision], mod.parallel
    dense_f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    expert_f = opts.ffn_hidden_size or dense_f
    routed = 4 * c * expert_f // par.expert_tensor + 3 * c * h + ROUTED_INDEX_BYTES
    shared_f = opts.shared_ffn_hidden_size or opts.num_shared_experts * expert_f
    # The gate's product keeps the shared output and the sigmoid.
    shared = 4 * c * shared_f + (c * (h + 1) if opts.shared_expert_gate and shared_f else 0)
    moe = opts.top_k * routed + 4 * opts.num_experts + TOKEN_ROUTER_BYTES + shared
    return moe - 4 * c * dense_f // par.tensor


def num_moe_layers(cfg: MimoConfig, name: str, layers: list[int]) -> int:
    """How many of the global layer indices ``layers`` are MoE layers (0 if dense)."""
    from mimotron.models.build import moe_options

    opts = moe_options(cfg.modules[name])
    return 0 if opts is None else sum(opts.is_moe_layer(i) for i in layers)


def mask_bytes_per_sample(cfg: MimoConfig, name: str) -> float:
    """One layer's converted attention mask, per sample of the micro-batch (0 without)."""
    mod = cfg.modules[name]
    par = mod.parallel
    if name != LANGUAGE or not (cfg.data.packing or par.context > 1):
        return 0.0
    seq = cfg.data.seq_length
    mask = BYTES[cfg.train.precision] * (seq // par.context) * seq
    if cfg.data.packing:
        return float(mask)  # [B, 1, S / cp, S]: one row block per sample
    return mask / (cfg.train.micro_batch_size // par.data)  # [1, 1, S / cp, S]


def extra_layer_bytes_per_sample(cfg: MimoConfig, name: str, layers: list[int],
                                 recomputed: int) -> float:
    """The MoE and mask terms of a stage holding ``layers``, per sample of a micro-batch.

    Args:
        cfg: the run config.
        name: the module.
        layers: the global layer indices the rank holds.
        recomputed: how many of them recompute in backward (``modules.<m>.recompute``).
    """
    mod = cfg.modules[name]
    tokens = cfg.data.seq_length // mod.parallel.context if name == LANGUAGE else 0
    kept = 1.0 - (recomputed / len(layers) if layers and mod.recompute == "full" else 0.0)
    moe = num_moe_layers(cfg, name, layers) * tokens * moe_extra_bytes_per_token(cfg, name)
    return moe * kept + (len(layers) - recomputed) * mask_bytes_per_sample(cfg, name)
