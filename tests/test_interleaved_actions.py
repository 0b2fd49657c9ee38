"""Interleaved 1F1B plans: Megatron's counts, and every rank's plan checked together.

:func:`mimotron.pipeline.actions_check.check_action_lists` takes all (module, stage) plans of a
layout at once: per rank, each (chunk, micro-batch) computed once, sends after their
compute, computes after the receives they consume; per channel, sends and receives
pair up in order; all together, no deadlock with non-blocking sends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, check_layout
from mimotron.parallel.virtual_pipeline import chunk_layers
from mimotron.pipeline.actions import build_1f1b_actions, pipeline_positions
from mimotron.pipeline.actions_check import check_action_lists, layout_topology, ring_topology
from mimotron.pipeline.interleaved_actions import (
    build_interleaved_actions,
    build_interleaved_forward_only_actions,
    build_rank_actions,
    interleaved_compute_order,
    num_warmup,
)

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"

Node = tuple[str, int]  # (module, pipeline stage)


def _layout(vision: tuple[int, int], audio: tuple[int, int] | None,
            language: tuple[int, int], num_mb: int) -> Layout:
    """Non-colocated blocks (TP = DP = 1) of (pipeline, virtual_pipeline) per module."""
    over, offset = [f"train.global_batch_size={8 * num_mb}", "train.micro_batch_size=8"], 0
    mods = {"vision": vision, "audio": audio, LANGUAGE: language}
    for name, pv in mods.items():
        if pv is None:
            continue
        p, v = pv
        over += [f"modules.{name}.num_layers={max(p * v, 1)}", f"modules.{name}.parallel.data=1",
                 f"modules.{name}.parallel.pipeline={p}",
                 f"modules.{name}.parallel.virtual_pipeline={v}",
                 f"modules.{name}.parallel.rank_offset={offset}"]
        offset += p
    if audio is None:
        over += ["modules.audio.parallel.rank_offset=99"]
    cfg = load_config(DIGITS, over)
    if audio is None:
        del cfg.modules["audio"]
    return check_layout(cfg)


CASES = [  # (vision, audio, language) as (pipeline, virtual), micro-batches
    ((1, 1), (1, 1), (2, 2), 4),
    ((1, 1), None, (2, 2), 2),
    ((2, 1), (1, 1), (2, 3), 6),
    ((1, 1), (1, 1), (3, 2), 6),
    ((1, 1), (1, 1), (4, 2), 8),
    ((2, 2), (1, 1), (1, 1), 4),
    ((2, 2), (1, 1), (2, 1), 6),
    ((2, 2), (1, 1), (2, 2), 4),
    ((3, 2), (2, 1), (3, 2), 6),
    ((2, 3), None, (4, 1), 8),
]


@pytest.mark.parametrize("vision,audio,language,num_mb", CASES)
def test_all_ranks_run_together(vision, audio, language, num_mb):
    layout = _layout(vision, audio, language, num_mb)
    topology = layout_topology(layout)
    for forward_only in (False, True):
        plans = {node: build_rank_actions(layout, *node, num_mb, forward_only=forward_only)
                 for node in topology}
        check_action_lists(topology, plans, num_mb, forward_only)  # raises ActionListError


@pytest.mark.parametrize("p,v,n", [(2, 2, 2), (2, 2, 8), (3, 2, 3), (4, 2, 4), (4, 3, 12),
                                   (3, 4, 9), (2, 4, 6)])
def test_one_interleaved_module_checks(p, v, n):
    topology = ring_topology("m", p, v)
    train = {node: build_interleaved_actions(n, p, v, node[1], has_prev=False, has_next=False)
             for node in topology}
    check_action_lists(topology, train, n)
    evaluate = {node: build_interleaved_forward_only_actions(n, p, v, node[1], has_prev=False,
                                                          has_next=False)
                for node in topology}
    check_action_lists(topology, evaluate, n, forward_only=True)


@pytest.mark.parametrize("p,v,n", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 3, 12), (3, 4, 9)])
def test_megatron_order_and_warmup(p, v, n):
    for r in range(p):
        order = interleaved_compute_order(n, p, v, r)
        warm = min((p - r - 1) * 2 + (v - 1) * p, n * v)
        assert num_warmup(n, p, v, r) == warm
        first_b = next(i for i, op in enumerate(order) if op[0] == "B")
        assert first_b == min(warm + 1, n * v)  # warm-up forwards, then one steady forward
        forwards = [op[1:] for op in order if op[0] == "F"]
        # Groups of p micro-batches per chunk, chunks ascending (Megatron's numbering).
        assert forwards[:p * v] == [(c, k) for c in range(v) for k in range(p)]
        backwards = [op[1:] for op in order if op[0] == "B"]
        assert backwards[:p * v] == [(c, k) for c in reversed(range(v)) for k in range(p)]


def test_v1_is_the_1f1b_plan():
    layout = _layout((1, 1), (1, 1), (2, 1), 4)
    for node, pos in pipeline_positions(layout).items():
        assert build_rank_actions(layout, node[0], node[1], 4) == build_1f1b_actions(4, pos)


def test_chunk_layers_interleave_and_cover():
    assert chunk_layers(8, 2, 2, 0) == [[0, 1], [4, 5]]
    assert chunk_layers(8, 2, 2, 1) == [[2, 3], [6, 7]]
    every = sorted(i for r in range(3) for c in chunk_layers(7, 3, 2, r) for i in c)
    assert every == list(range(7))


@pytest.mark.parametrize("override,match", [
    (["train.global_batch_size=24"], "multiple of modules.language.parallel.pipeline=2"),
    (["modules.language.parallel.pipeline=1", "modules.language.parallel.data=1",
      "modules.audio.parallel.rank_offset=1"], "needs modules.language.parallel.pipeline > 1"),
    (["modules.language.num_layers=3"], "cannot fill pipeline x virtual_pipeline = 4"),
    (["modules.language.parallel.layers_per_stage=[1,3]"], "layers_per_stage"),
])
def test_validator_refuses(override, match):
    base = ["modules.language.num_layers=4", "modules.language.parallel.data=1",
            "modules.language.parallel.pipeline=2",
            "modules.language.parallel.virtual_pipeline=2",
            "train.global_batch_size=32", "train.micro_batch_size=8"]
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        check_layout(load_config(DIGITS, base + override))


def test_plan_memory_counts_the_chunks():
    from mimotron.estimate.memory import (
        activation_bytes,
        interleaved_chunks_in_flight,
        stage_parameter_counts,
    )

    over = ["modules.vision.num_layers=4", "modules.vision.parallel.pipeline=2",
            "modules.vision.parallel.data=1", "modules.audio.parallel.rank_offset=2",
            "modules.language.parallel.rank_offset=3", "modules.language.parallel.data=1"]
    flat = load_config(DIGITS, over)
    inter = load_config(DIGITS, [*over, "modules.vision.parallel.virtual_pipeline=2"])
    # Same layers per rank (2 of 4), the ends where they were: same weights.
    assert stage_parameter_counts(inter, "vision", 64) == stage_parameter_counts(flat,
                                                                                "vision", 64)
    # Interleaving: rank r holds (p - r - 1) * 2 + (v - 1) * p + 1 chunk forwards at once
    # (5 on rank 0, 3 on rank 1), each half of its layers.
    assert [interleaved_chunks_in_flight(inter, "vision", s) for s in (0, 1)] == [5, 3]
    # At its peak rank 0 holds 4 forwards of chunk 0 (each with the front end's saved
    # input) and 1 of chunk 1: more than 5 spread evenly (3 with the front end).
    assert activation_bytes(inter, "vision") > activation_bytes(inter, "vision", in_flight=5)
    # Two chunk forwards (one per chunk) hold what one micro-batch of the flat stage does.
    assert activation_bytes(inter, "vision", in_flight=2) == activation_bytes(
        flat, "vision", in_flight=1)
    assert activation_bytes(inter, "vision", in_flight=5) > activation_bytes(
        inter, "vision", in_flight=3)
