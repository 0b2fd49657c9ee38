"""What an FSDP2 rank holds for a module (:mod:`mimotron.parallel.fsdp`), for the
memory estimate: sharded weights, gradients and optimizer state, and the gathered units'
buffers."""

from __future__ import annotations

from mimotron.config.schema import MimoConfig, default_ffn_hidden_size
from mimotron.estimate.widths import (
    BYTES,
    attention_widths,
    mlp_saved_tensors,
    optimizer_state_bytes_per_param,
)


def fsdp_memory_bytes(cfg: MimoConfig, name: str, num_params: int, vocab_size: int,
                      num_trainable: int | None = None) -> dict[str, int]:
    """What an FSDP2 rank holds for module ``name``: ``weights``, ``grads``, ``optimizer``
    and ``buffers`` (bytes), given the ``num_params`` of its (TP-local) stage.

    Between steps: the fp32 shards of parameters, gradients and Adam's two moments, each
    ``1 / dp`` (16 bytes per parameter / dp). While a unit runs, its gathered parameters
    (compute dtype) are added, and the next one's, prefetched; while its gradients are
    reduce-scattered, their fp32 full size. ``buffers`` counts the largest unit twice in
    the gathered dtype plus its fp32 gradients, and is held on top of the activations.
    ``num_trainable`` (default: all ``num_params``) are those with gradients and
    optimizer state (a frozen tower has neither).
    """
    mod = cfg.modules[name]
    dp = mod.parallel.data
    gathered = 4 if cfg.train.precision == "fp32" else BYTES[cfg.train.precision]
    unit = largest_unit_params(cfg, name, vocab_size)
    trained = num_params if num_trainable is None else num_trainable
    return {
        "weights": num_params * 4 // dp,
        "grads": trained * 4 // dp,
        "optimizer": trained * optimizer_state_bytes_per_param(cfg, name) // dp,
        "buffers": unit * (2 * gathered + 4),
    }


def largest_unit_params(cfg: MimoConfig, name: str, vocab_size: int) -> int:
    """Parameters of the largest FSDP unit a rank gathers, TP-local: a transformer layer
    or, for the language model, the embedding / output head (vocabulary x hidden)."""
    mod = cfg.modules[name]
    h = mod.hidden_size
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    q_width, kv_width = attention_widths(cfg, name)
    matrices = 3 if mlp_saved_tensors(cfg, name) == 4 else 2  # SwiGLU or fc1/fc2
    layer = h * (2 * q_width + 2 * kv_width) + matrices * h * f
    ends = vocab_size * h if mod.is_language else 0
    return max(layer, ends) // mod.parallel.tensor
