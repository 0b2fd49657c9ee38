"""Interleaved 1F1B plans: Megatron's counts, and every rank's plan run together.

The simulator executes all (module, stage) plans of a layout at once over FIFO channels
(one per ordered pair of ranks, as point-to-point messages match in posting order):
sends never block, a receive blocks until its channel has a message and checks that the
message is the one it names. It fails on a deadlock, a mismatched message, a compute
without its input, or a (chunk, micro-batch) computed twice or never.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, plan_layout
from mimotron.parallel.virtual_pipeline import chunk_layers
from mimotron.pipeline.interleaved_plan import (
    build_rank_plan,
    interleaved_compute_order,
    num_warmup,
)
from mimotron.pipeline.plan import Action, build_1f1b_plan, pipeline_positions

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
    return plan_layout(cfg)


def _virtual(layout: Layout, m: str) -> tuple[int, int]:
    par = layout.modules[m].parallel
    return par.pipeline, par.virtual_pipeline


def _route(layout: Layout, node: Node, a: Action) -> list[tuple[Node, tuple]]:
    """``(peer, message label)`` of every message a send or receive action moves."""
    m, s = node
    p, v = _virtual(layout, m)
    encoders = [e for e in layout.modules if e != LANGUAGE]
    c, k = a.chunk, a.microbatch
    if a.kind == "send_forward":
        if s < p - 1:
            return [((m, s + 1), ("F", c, k))]
        if c < v - 1:
            return [((m, 0), ("F", c + 1, k))]
        return [((LANGUAGE, 0), ("F", 0, k, m))]
    if a.kind == "send_backward":
        if s > 0:
            return [((m, s - 1), ("B", c, k))]
        if c > 0:
            return [((m, p - 1), ("B", c - 1, k))]
        return [((e, _virtual(layout, e)[0] - 1), ("B", _virtual(layout, e)[1] - 1, k))
                for e in encoders]
    if a.kind == "recv_forward":
        if s > 0 or c > 0:
            return [((m, s - 1 if s > 0 else p - 1), ("F", c, k))]
        return [((e, _virtual(layout, e)[0] - 1), ("F", 0, k, e)) for e in encoders]
    assert a.kind == "recv_backward", a
    if s < p - 1 or c < v - 1:
        return [((m, s + 1 if s < p - 1 else 0), ("B", c, k))]
    return [((LANGUAGE, 0), ("B", c, k))]


def _expand(a: Action) -> list[Action]:
    """1F1B's paired transfers as a send then a receive (sends never block)."""
    if a.kind == "send_forward_recv_backward":
        return [Action("send_forward", a.microbatch), Action("recv_backward", a.other)]
    if a.kind == "send_backward_recv_forward":
        return [Action("send_backward", a.microbatch), Action("recv_forward", a.other)]
    return [a]


def simulate(layout: Layout, num_mb: int, forward_only: bool = False) -> dict[Node, list]:
    """Run every rank's plan together; return each node's computes in execution order."""
    plans = {node: deque(x for a in build_rank_plan(layout, node[0], node[1], num_mb,
                                                    forward_only=forward_only)
                         for x in _expand(a))
             for node in pipeline_positions(layout)}
    channels: dict[tuple[Node, Node], deque] = {}
    have: dict[Node, set] = {n: set() for n in plans}
    done: dict[Node, list] = {n: [] for n in plans}
    while any(plans.values()):
        progressed = False
        for node, plan in plans.items():
            while plan and _step(layout, node, plan[0], channels, have[node], done[node]):
                plan.popleft()
                progressed = True
        assert progressed, f"deadlock: next actions {({n: p[0] for n, p in plans.items() if p})}"
    assert not any(channels.values()), "messages never received"
    return done


def _step(layout, node, a, channels, have, done) -> bool:
    m, s = node
    p, v = _virtual(layout, m)
    key = (a.chunk, a.microbatch)
    if a.kind.startswith("send"):
        for peer, label in _route(layout, node, a):
            channels.setdefault((node, peer), deque()).append(label)
        return True
    if a.kind.startswith("recv"):
        routes = _route(layout, node, a)
        if not all(channels.get((peer, node)) for peer, _ in routes):
            return False
        for peer, label in routes:
            got = channels[(peer, node)].popleft()
            assert got == label, f"{node} expected {label} from {peer}, got {got}"
            have.add((got[0], got[1], got[2]))
        return True
    first = s == 0 and a.chunk == 0 and (m != LANGUAGE or not layout.modules.keys() - {m})
    if a.kind == "F":
        assert first or ("F", *key) in have, f"{node} runs F{key} without its input"
    else:
        last = s == p - 1 and a.chunk == v - 1 and m == LANGUAGE
        assert ("F", *key) in [(x[0], x[1], x[2]) for x in done], f"{node} B{key} before F"
        assert last or ("B", *key) in have, f"{node} runs B{key} without its gradient"
    done.append((a.kind, *key))
    return True


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
    for forward_only in (False, True):
        done = simulate(layout, num_mb, forward_only)
        for (m, _), ops in done.items():
            v = layout.modules[m].parallel.virtual_pipeline
            kinds = ("F",) if forward_only else ("F", "B")
            expected = sorted((kind, c, k) for kind in kinds for c in range(v)
                              for k in range(num_mb))
            assert sorted(ops) == expected  # each (chunk, micro-batch) exactly once


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
        assert build_rank_plan(layout, node[0], node[1], 4) == build_1f1b_plan(4, pos)


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
        plan_layout(load_config(DIGITS, base + override))


def test_plan_memory_counts_the_chunks():
    from mimotron.parallel.memory import (
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
    assert activation_bytes(inter, "vision") == activation_bytes(inter, "vision", in_flight=5)
    # Two chunk forwards (one per chunk) hold what one micro-batch of the flat stage does.
    assert activation_bytes(inter, "vision", in_flight=2) == activation_bytes(
        flat, "vision", in_flight=1)
    assert activation_bytes(inter, "vision", in_flight=5) > activation_bytes(
        inter, "vision", in_flight=3)
