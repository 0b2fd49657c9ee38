"""Activation recompute of transformer layers (``modules.<m>.recompute``), applied from outside.

Megatron-Core's ``recompute_granularity`` / torchtitan's ``activation_checkpoint.mode``:
instead of keeping what a layer's backward needs from the forward, keep less and run
part of the forward again during the backward.

* ``full``: every chosen layer runs under
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. It keeps only its input
  (the residual stream) between its forward and its backward, and its backward first
  runs its whole forward again.
* ``selective``: every chosen layer runs under the same checkpoint with a
  selective-checkpoint policy (:class:`~mimotron.models.save_policy.SavePolicy`,
  ``create_selective_checkpoint_contexts``): its forward keeps the outputs of the
  matmuls, of SDPA and of the functional collectives, and the recomputation makes
  everything else again from them (norms, RoPE, SiLU and the gate product, residual
  adds, casts), as torchtitan's selective ``op`` mode and Megatron-Core's
  ``recompute_modules``. It keeps the layer's input, q, k, v, SDPA's output and
  log-sum-exp, ``wo``'s and ``w2``'s outputs and the gate and up projections: about a
  third less than without recompute at Llama-2-7B's shape. What it does not keep
  (c10d's in-place collectives: the CP key/value gather, the MoE all-to-alls; the
  sequence-parallel input gathers) is issued again in the recomputation.
* ``recompute_num_layers = n > 0``: only the first ``n`` layers of each model chunk the
  rank holds (its whole stage without interleaving) are recomputed, Megatron's
  ``block`` method; ``0`` = every layer.

Applied after the module is built and sharded (:func:`apply_recompute`, from
``training/model_setup.py``), like the TP plans: the layer's ``forward`` is replaced on
the instance by a checkpointing wrapper of the original. No wrapper module is inserted,
so parameter names, initialisation, checkpoints, TP/EP plans and Hugging Face weight
maps are unchanged, and forward hooks on the layer's submodules (ZeRO-1's gather
pre-hooks, DTensor's input/output redistributions) run again in the recomputation
like any other forward.

How each part of the engine lives with it:

* **Collectives inside a layer** (TP all-reduces, the sequence-parallel all-gathers, the
  CP key/value all-gather, the EP all-to-alls) are issued again during the backward
  under ``full``, as Megatron does; under ``selective`` only those the policy does not
  keep are. ``early_stop=False``: torch would otherwise end a recomputation as
  soon as the last saved tensor is refilled, a point that depends on which tensors the
  layer saved; running the whole function again, as Megatron's ``CheckpointFunction``
  does, makes every rank of a group re-issue exactly its forward's collectives, in the
  forward's order. The price: the layer's last operations run again although nothing
  needs them (under TP, ``w2``'s output reduction).
* **Gradients** flow through the graph the forward built (non-reentrant checkpoint
  refills its saved tensors only), so gradient hooks (``train.overlap_grad_reduce``,
  ``register_multi_grad_hook`` timers) fire once, as without recompute.
* **RNG**: ``preserve_rng_state=True`` replays the forward's CPU and device RNG states,
  so a layer with randomness recomputes the same numbers (the built-in layers have no
  dropout, so recompute is exact either way).
* **Layer state**: a recomputation must see what the forward saw. An MoE layer consumes
  the per-sample auxiliary-loss weights the schedule set for its micro-batch (and by
  the time of the backward another micro-batch's may be set) and records routing
  statistics; the recomputation gets the forward's weights back and its statistics are
  dropped (:class:`_Replayed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from mimotron.config.schema import RECOMPUTE_MODES
from mimotron.models.moe import MoEFeedForward, MoEStats, moe_layers
from mimotron.models.save_policy import SavePolicy
from mimotron.models.weight_casts import recompute_casts
from mimotron.parallel.virtual_pipeline import chunk_holder

MODE_ATTR = "_mimotron_recompute"
"""Instance attribute naming a layer's recompute mode once :func:`apply_recompute` set it."""


def recomputed_layer_ids(chunks: list[list[int]], num_layers: int) -> list[int]:
    """Global ids of the layers recomputed among a rank's model chunks.

    Args:
        chunks: the global layer ids of each model chunk the rank holds, ascending (one
            chunk, the stage's layers, without interleaving).
        num_layers: ``recompute_num_layers``: the first ``n`` of each chunk; 0 = all.

    Returns:
        The ids, chunk by chunk.
    """
    return [i for chunk in chunks for i in (chunk[:num_layers] if num_layers else chunk)]


def recompute_mode(layer: nn.Module) -> str:
    """``"none"``, ``"selective"`` or ``"full"``: what :func:`apply_recompute` made of a layer."""
    return layer.__dict__.get(MODE_ATTR, "none")


def apply_recompute(part: nn.Module, mode: str, num_layers: int = 0) -> list[int]:
    """Make the layers of one module part recompute their activations in backward.

    Args:
        part: a built module part: a language model (stage) or an encoder part
            (``ModalitySubmodule``), plain or TP/EP-sharded, with its ``layer_chunks``
            set under interleaving.
        mode: ``"none"`` (nothing happens), ``"selective"`` or ``"full"`` (module docs).
        num_layers: recompute the first ``num_layers`` layers of each model chunk (0 =
            every layer).

    Returns:
        The global ids of the recomputed layers.

    Raises:
        ValueError: an unknown mode or a negative ``num_layers``.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} is invalid: expected one of {RECOMPUTE_MODES}")
    if num_layers < 0:
        raise ValueError(f"recompute_num_layers={num_layers} is invalid: expected >= 0")
    if mode == "none":
        return []
    holder = chunk_holder(part)
    chunks = holder.layer_chunks or [sorted(int(i) for i in holder.layers)]
    chosen = recomputed_layer_ids(chunks, num_layers)
    sequence_parallel = _is_sequence_parallel(holder)
    for i in chosen:
        layer = holder.layers[str(i)]
        assert recompute_mode(layer) == "none", f"recompute applied twice to layer {i}"
        _checkpoint_layer(layer, mode == "selective", sequence_parallel)
        layer.__dict__[MODE_ATTR] = mode
    return chosen


def _is_sequence_parallel(holder: nn.Module) -> bool:
    """Whether the layers' linear inputs are gathered over TP (sequence parallelism)."""
    return getattr(holder, "sequence_parallel_group", None) is not None


def _checkpoint(function: Callable[..., Any], *args: Any,
                policy: Callable[[], SavePolicy] | None = None, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant checkpoint, recomputed in full.

    ``policy``: makes the selective-checkpoint policy of this call (``None``: keep
    nothing but the inputs).
    """
    extra = {}
    if policy is not None:
        extra["context_fn"] = lambda: create_selective_checkpoint_contexts(policy())
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                      early_stop=False, **extra, **kwargs)


def _checkpoint_layer(layer: nn.Module, selective: bool, sequence_parallel: bool) -> None:
    """The layer's forward, on the instance, becomes a checkpointed call of itself
    (with :class:`SavePolicy` when ``selective``)."""
    forward = layer.forward
    moe = list(moe_layers(layer).values())
    policy = (lambda: SavePolicy(keep_gathers=not sequence_parallel)) if selective else None

    def recomputed_forward(*args: Any, **kwargs: Any) -> Any:
        return _checkpoint(_Replayed(forward, moe), *args, policy=policy, **kwargs)

    layer.forward = recomputed_forward


class _Replayed:
    """A layer's forward as one checkpoint calls it: the forward, then recomputations.

    The first call is the forward. A later call is a recomputation during the backward,
    which must compute what the forward computed: each MoE layer gets back the
    auxiliary-loss weights its forward consumed (the autograd function injecting their
    gradient saves them, and recomputation must save the same tensors), and what it
    records into the routing statistics is dropped (the forward counted the tokens).
    Its matmuls read the step's 16-bit weight copies, as the forward's did
    (:func:`~mimotron.models.weight_casts.recompute_casts`).

    Args:
        forward: the layer's original (bound) forward.
        moe: the MoE layers inside it.
    """

    def __init__(self, forward: Callable[..., Any], moe: list[MoEFeedForward]) -> None:
        self.forward = forward
        self.moe = moe
        # Taken before the forward runs: it consumes them (sets them to None).
        self.aux_weights = [m.aux_weights for m in moe]
        # The step's 16-bit weight copies, taken in the forward: autograd does not carry
        # them (a torch-function mode) into the backward, where the recomputation runs.
        self.casts = recompute_casts()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        replaying = _replaying(self.moe, self.aux_weights) if self.moe else contextlib.nullcontext()
        with self.casts, replaying:
            return self.forward(*args, **kwargs)


@contextlib.contextmanager
def _replaying(moe: list[MoEFeedForward], weights: list[torch.Tensor | None]) -> Iterator[None]:
    """The forward's aux weights in place, statistics recorded aside; both restored after."""
    kept = [(m.aux_weights, m.stats) for m in moe]
    for m, w in zip(moe, weights, strict=True):
        m.aux_weights, m.stats = w, MoEStats()
    try:
        yield
    finally:
        for m, (w, stats) in zip(moe, kept, strict=True):
            m.aux_weights, m.stats = w, stats
