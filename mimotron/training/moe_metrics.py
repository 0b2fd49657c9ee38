"""The mixture-of-experts fields of a train record: aux losses and per-layer expert load.

Every MoE layer accumulates detached statistics while it trains
(:class:`mimotron.models.moe.MoEStats`: tokens per expert, summed per-sample aux and
z-losses, samples). At each log line :func:`local_moe_sums` takes them from this rank's
language layers (language TP rank 0 only: TP ranks hold the same tokens; pipeline
stages hold disjoint layers and data-parallel replicas disjoint samples, so plain sums
over ranks count every token once); they ride on the logger's one all-gather and
:func:`moe_record` turns the world sums into the record's fields:

* ``moe_aux_loss`` — mean over MoE layers and samples of the load-balancing loss
  ``E · Σ_e f_e · P_e`` (1 = balanced), over the log interval;
* ``moe_z_loss`` — the same mean of the router z-loss (only when its coefficient is set);
* ``moe_load_min`` / ``moe_load_max`` / ``moe_load_cv`` — per MoE layer (a dict keyed by
  global layer index): the fewest and most (token, choice) pairs any expert received
  over the interval, and the coefficient of variation (std / mean) of the counts;
* ``moe_dropped_tokens`` — tokens not computed by their experts: always 0 (dropless).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from mimotron.models.moe import moe_layers, pop_moe_stats


def local_moe_sums(language_model: nn.Module | None, counts_here: bool) -> dict[str, list]:
    """This rank's MoE statistics since the last call, keyed by global layer index.

    Args:
        language_model: this rank's language model part (``None`` off the language block).
        counts_here: whether this rank's tokens count (language TP rank 0); the stats
            are taken (reset) either way.

    Returns:
        Layer index -> ``[aux_sum, z_sum, samples, tokens of expert 0, ...]``.
    """
    if language_model is None or not moe_layers(language_model):
        return {}
    out: dict[str, list] = {}
    for name, st in pop_moe_stats(language_model).items():
        if not counts_here or st.tokens_per_expert is None:
            continue
        layer = name.split(".")[1]  # "layers.<i>.mlp"
        out[layer] = [float(st.aux_sum), float(st.z_sum), float(st.num_samples),
                      *(float(c) for c in st.tokens_per_expert.tolist())]
    return out


def add_moe_sums(total: dict[str, list], mine: dict[str, list]) -> None:
    """Add one rank's :func:`local_moe_sums` into ``total`` in place."""
    for layer, values in mine.items():
        acc = total.setdefault(layer, [0.0] * len(values))
        for i, v in enumerate(values):
            acc[i] += v


def moe_record(sums: dict[str, list], z_loss: bool) -> dict[str, Any]:
    """The record's MoE fields from the world sums (empty for a dense model).

    Args:
        sums: layer index -> summed ``[aux, z, samples, tokens per expert...]``.
        z_loss: whether the z-loss is on (``moe_z_loss`` is logged only then).
    """
    if not sums:
        return {}
    layers = sorted(sums, key=int)
    samples = sum(sums[n][2] for n in layers)
    record: dict[str, Any] = {
        "moe_aux_loss": sum(sums[n][0] for n in layers) / samples if samples else None,
    }
    if z_loss:
        record["moe_z_loss"] = sum(sums[n][1] for n in layers) / samples if samples else None
    mins, maxs, cvs = {}, {}, {}
    for n in layers:
        load = sums[n][3:]
        mean = sum(load) / len(load)
        std = math.sqrt(sum((c - mean) ** 2 for c in load) / len(load))
        mins[n], maxs[n] = min(load), max(load)
        cvs[n] = std / mean if mean else None
    record.update(moe_load_min=mins, moe_load_max=maxs, moe_load_cv=cvs,
                  moe_dropped_tokens=0)
    return record
