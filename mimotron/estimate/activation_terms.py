"""Saved activations the dense layer count leaves out: MoE layers, DeepStack links.

:func:`mimotron.estimate.memory.layer_bytes_per_token` counts a dense transformer layer
run by SDPA without a mask. Mixture of experts changes what a layer keeps, and
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
* **Packed documents and context parallelism** need no term here: attention runs
  without a mask (:mod:`mimotron.models.attention`), and the keys a context-parallel
  rank reads are :func:`~mimotron.estimate.memory.context_kv_bytes_per_sample`.

* **Qwen3-VL's DeepStack features across pipeline stages**
  (:mod:`mimotron.pipeline.deepstack_link`): a stage link before the last DeepStack layer
  carries its feature sets after the hidden states, and both ends keep the whole link
  tensor until its backward: ``(sets in + sets out) x hidden`` more residual-dtype
  values per position (:func:`deepstack_link_bytes_per_sample`).

A recomputed layer (``modules.<m>.recompute = "full"``) keeps none of its MoE tensors.
"""

from __future__ import annotations

from mimotron.config.hf_resolve import language_spec
from mimotron.config.moe_config import moe_options
from mimotron.config.native_vision import deepstack_source
from mimotron.config.schema import MimoConfig, default_ffn_hidden_size
from mimotron.estimate.widths import BYTES, attention_widths, residual_bytes
from mimotron.names import LANGUAGE
from mimotron.pipeline.deepstack_link import link_extras

ROUTED_INDEX_BYTES = 32
"""Per routed copy: its sort order and token index (int64) and its fp32 weight, measured."""
TOKEN_ROUTER_BYTES = 8
"""Per token beyond the router's 4 bytes per expert, measured."""


def moe_extra_bytes_per_token(cfg: MimoConfig, name: str) -> int:
    """What one MoE layer keeps per token beyond the dense SwiGLU the layer count has.

    Negative when the experts' SwiGLU tensors (``top_k`` narrower ones) are smaller than
    the dense one they replace. 0 for a dense module.
    """
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
    opts = moe_options(cfg.modules[name])
    return 0 if opts is None else sum(opts.is_moe_layer(i) for i in layers)


def extra_layer_bytes_per_sample(cfg: MimoConfig, name: str, layers: list[int],
                                 recomputed: int) -> float:
    """The MoE term of a stage holding ``layers``, per sample of a micro-batch.

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
    return moe * kept


def deepstack_link_bytes_per_sample(cfg: MimoConfig, name: str,
                                    chunks: list[list[int]]) -> int:
    """The DeepStack feature sets on a language stage's links, per sample (module docs):
    the sets :func:`~mimotron.pipeline.deepstack_link.link_extras` gives each link of the
    stage's model ``chunks`` (one without interleaving), but the embeddings' into layer 0.
    """
    source = deepstack_source(cfg)
    if name != LANGUAGE or source is None or not chunks:
        return 0
    sets = sum(n for (j, downstream), n in link_extras(source[1], chunks).items()
               if downstream or chunks[j][0])
    mod = cfg.modules[name]
    tokens = cfg.data.seq_length // mod.parallel.context
    return sets * tokens * mod.hidden_size * residual_bytes(cfg)


def context_keys_read(seq_len: int, context: int) -> int:
    """Keys (per sample) one context-parallel rank's attention reads and keeps.

    A rank holds a head and a tail chunk of ``L = S / 2c`` positions; each attends to
    the keys up to its end (:mod:`mimotron.models.attention.documents`), chunk ``r``
    to ``(r + 1) L`` keys and chunk ``2c - 1 - r`` to ``(2c - r) L``: ``S + L`` on
    every rank. Packed documents read fewer (a document's keys only), so this is
    their upper bound. ``S`` without context parallelism.
    """
    if context == 1:
        return seq_len
    return seq_len + seq_len // (2 * context)


def attention_bytes_per_sample(cfg: MimoConfig, name: str) -> int:
    """What one layer's attention kernel keeps per sample: the rotated queries, the keys
    and values it reads, its output (the compute dtype) and its fp32 log-sum-exp per
    query and head. Divided by ``tensor`` (local heads). No mask and no score matrix
    at any length: the attention backend (:mod:`mimotron.models.attention`) makes
    none. The layer estimate counts all of it but the log-sum-exp (4 bytes per head
    and token, under 0.1% of a layer at the 7B shape).
    """
    mod = cfg.modules[name]
    par = mod.parallel
    q_width, kv_width = attention_widths(cfg, name)
    num_heads = mod.num_heads
    if mod.hf_path:
        num_heads = language_spec(mod).num_heads
    c = BYTES[cfg.train.precision]
    tokens = cfg.data.seq_length // par.context
    keys = context_keys_read(cfg.data.seq_length, par.context)
    lse = 4 * (num_heads // par.tensor) * tokens
    return c * (2 * q_width * tokens + 2 * kv_width * keys) // par.tensor + lse
