"""The colocated bridge into a context-parallel language model routes rows by position.

Each case runs ``ColocatedTransport.bridge`` on 4 forked gloo ranks for one colocated
layout whose language model has context 2, on a synthetic micro-batch of 8 samples
(sequence 16, CP chunks of 4: CP rank 0 holds positions 0-3 and 12-15, CP rank 1 holds
4-11). Placeholders (3 per item) sit at known positions: some samples lack the modality,
some items straddle a chunk boundary, one sample holds two items (as a packed row does),
and one language slot receives no row at all (its split sizes are all 0).

An encoder row is a deterministic function of its (sample, position), so every rank
knows every row; non-reading encoder TP copies hold a poisoned copy, so reading one
shows. Per rank the test checks (a) the rows received are exactly
``flat[placeholder_selection(...)]`` of the row contract
(:mod:`mimotron.parallel.context_parallel`), (b) only that many arrive — never the
whole slice's embedding — and (c) backward with a known upstream gradient (identical on
language TP copies) gives every encoder rank, TP copies included, the exact gradient of
its rows: counted once, not once per language TP copy.

End to end, colocated layouts whose language model runs CP 2 x DP 2 or CP 2 x TP 2, fed
by vision at DP 4 and audio at TP 2 x DP 2, train like the plain PyTorch loop
(:func:`tests.reference.reference_run`) over 10 iterations: losses, global and
per-module grad norms, final weights at 1e-4 relative, replicas bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from mimotron.config import load_config
from mimotron.config.schema import ParallelConfig
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.context_parallel import placeholder_selection
from mimotron.parallel.layout import Layout, ModulePlacement, check_layout
from mimotron.pipeline import colocated as colocated_module
from mimotron.pipeline.colocated import ColocatedTransport
from mimotron.pipeline.colocated_cp import cp_bridge_geometry, plan_route
from mimotron.pipeline.edges import build_edges, slice_range
from tests.common import BASE, DIGITS, coloc, engine_run
from tests.parity import run_against_plain_loop

WORLD, MBS, SEQ, T, HIDDEN, CP, PID = 4, 8, 16, 3, 4, 2, 99
POISON = 1.0e6  # added to the rows of encoder TP copies that must not be read
# Start positions of each sample's placeholder items (T tokens each); [] = no modality.
ITEMS = [[5], [], [], [], [2], [10, 13], [], [0]]


def _tokens() -> torch.Tensor:
    """The micro-batch's ``[MBS, SEQ]`` tokens: text ids 1..49, placeholders ``PID``."""
    tokens = (torch.arange(MBS * SEQ).reshape(MBS, SEQ) * 7) % 49 + 1
    for sample, starts in enumerate(ITEMS):
        for start in starts:
            tokens[sample, start:start + T] = PID
    return tokens


def _placeholders(tokens: torch.Tensor, first_sample: int) -> torch.Tensor:
    """``[n, 2]`` (micro-batch sample, position) of each placeholder, row-major order."""
    where = (tokens == PID).nonzero()
    return torch.stack([where[:, 0] + first_sample, where[:, 1]], 1)


def _row_values(where: torch.Tensor) -> torch.Tensor:
    """The encoder row of each (sample, position): ``[n, HIDDEN]``, exact in fp32."""
    base = (where[:, 0] * 1000 + where[:, 1] * 10).float()
    return base[:, None] + torch.arange(HIDDEN).float()


def _upstream(where: torch.Tensor) -> torch.Tensor:
    """The language side's gradient of each (sample, position) row (same on TP copies)."""
    base = (where[:, 0] * 17 + where[:, 1] * 3 + 1).float()
    return base[:, None] * (torch.arange(HIDDEN).float() + 1.0) / 8.0


def _layout(vision: dict, language: dict) -> Layout:
    """A colocated layout on ``WORLD`` ranks, built from the pure placement classes.

    Built directly from the placement classes (vision and language only, no config).
    """
    modules = {"vision": ModulePlacement("vision", ParallelConfig(**vision)),
               "language": ModulePlacement("language", ParallelConfig(**language))}
    assert all(m.size == WORLD for m in modules.values())
    return Layout(WORLD, True, modules, {"vision": ["language"]})


def _bridge_rank(rank: int, world: int, vision: dict, language: dict) -> dict:
    layout = _layout(vision, language)
    src, dst = layout.modules["vision"], layout.modules["language"]
    (edge,) = build_edges(layout, {"vision": "image"})
    transport = ColocatedTransport(layout, rank, MBS, [edge])
    tokens = _tokens()
    s_lo, s_hi = slice_range(MBS, src.parallel.data, src.coordinate(rank)["dp"])
    d_lo, d_hi = slice_range(MBS, dst.parallel.data, dst.coordinate(rank)["dp"])
    src_where = _placeholders(tokens[s_lo:s_hi], s_lo)
    rows = _row_values(src_where).reshape(-1, T, HIDDEN)
    if src.coordinate(rank)["tp"] != 0:
        rows = rows + POISON
    rows.requires_grad_()
    out = transport.bridge(edge, rows, {"tokens": tokens[s_lo:s_hi]},
                           {"tokens": tokens[d_lo:d_hi]}, PID)
    # The row contract, written out: flat rows of the language slice, selected.
    dst_where = _placeholders(tokens[d_lo:d_hi], d_lo)
    selection = placeholder_selection(tokens[d_lo:d_hi], PID, CP, dst.coordinate(rank)["cp"])
    (out * _upstream(dst_where[selection])).sum().backward()
    return {"out": out.detach(), "expected": _row_values(dst_where)[selection],
            "slice_rows": len(dst_where), "grad": rows.grad,
            "expected_grad": _upstream(src_where).reshape(-1, T, HIDDEN),
            "cp": dst.coordinate(rank)["cp"]}


LAYOUTS = {
    # fan-in 4 -> 2: every encoder replica feeds one language DP replica's two CP ranks
    "vision_dp4-language_cp2_dp2": ({"data": 4}, {"context": 2, "data": 2}),
    # encoder TP copies on both sides; language TP copies send their gradient once
    "vision_tp2_dp2-language_cp2_tp2": ({"tensor": 2, "data": 2},
                                        {"tensor": 2, "context": 2}),
    # same DP slices, but an encoder replica's TP copies sit on different CP ranks
    "vision_tp2_dp2-language_cp2_dp2": ({"tensor": 2, "data": 2},
                                        {"context": 2, "data": 2}),
    # fan-out 1 -> 2: one encoder replica (TP 4) feeds both language DP replicas
    "vision_tp4-language_cp2_dp2": ({"tensor": 4}, {"context": 2, "data": 2}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_bridge_routes_each_cp_rank_its_positions(name: str) -> None:
    vision, language = LAYOUTS[name]
    results = run_ranks(WORLD, _bridge_rank, vision, language, timeout_s=60)
    for rank, r in enumerate(results):
        assert r["out"].shape == r["expected"].shape, f"rank {rank}: row count"
        assert torch.equal(r["out"], r["expected"]), f"rank {rank}: rows"
        assert torch.equal(r["grad"], r["expected_grad"]), f"rank {rank}: encoder gradient"
    # Only a CP rank's positions travel: each placeholder row reaches exactly the
    # language TP copies of its (DP, CP) slot, not every rank of its DP replica.
    num_rows = int((_tokens() == PID).sum())
    assert sum(len(r["out"]) for r in results) == num_rows * language.get("tensor", 1)
    assert sum(len(r["out"]) for r in results) < sum(r["slice_rows"] for r in results)
    if language.get("data", 1) > 1:  # the slot of samples 0-3 at CP rank 0 gets nothing
        assert any(len(r["out"]) == 0 for r in results)


def test_route_rejects_rows_that_do_not_match_the_placeholders() -> None:
    layout = _layout({"data": 4}, {"context": 2, "data": 2})
    (edge,) = build_edges(layout, {"vision": "image"})
    geo = cp_bridge_geometry(layout, edge, 0, MBS)
    tokens = _tokens()
    with pytest.raises(ValueError, match="one row per placeholder token"):
        plan_route(geo, tokens[0:2], tokens[0:4], PID, num_flat_rows=T + 1)


PARITY_ITERS = 10
PARITY = ["train.iters=10"]
PARITY_LAYOUTS = {
    # (Language CP 2 x DP 2 beside the same encoders: tests/test_encoder_batching.py.)
    # language CP 2 x TP 2: its TP copies return their (identical) gradients once
    "vision-dp4-audio-tp2dp2-language-cp2tp2": coloc(
        {"data": 4}, {"tensor": 2, "data": 2}, {"context": 2, "tensor": 2, "data": 1}),
}


def _recording_engine_run(rank: int, world: int, overrides: list[str], num_iters: int
                          ) -> dict:
    """:func:`engine_run`, also recording the shape of every CP bridge output."""
    shapes: list[tuple[int, ...]] = []
    bridge = colocated_module.cp_bridge

    def recording_bridge(*args: object) -> torch.Tensor:
        out = bridge(*args)
        shapes.append(tuple(out.shape))
        return out

    colocated_module.cp_bridge = recording_bridge  # this forked rank only
    return {**engine_run(rank, world, overrides, num_iters), "bridge_shapes": shapes}


@pytest.mark.parametrize("name", list(PARITY_LAYOUTS))
def test_colocated_context_parallel_matches_plain_loop(name: str) -> None:
    overrides = PARITY + PARITY_LAYOUTS[name]
    cfg = load_config(DIGITS, BASE + overrides)
    layout = check_layout(cfg)  # the validator accepts CP in a colocated placement
    assert layout.colocated and layout.world_size == WORLD
    # CP and the layout change neither model nor data: the plain loop of PARITY alone.
    results = run_against_plain_loop(PARITY_LAYOUTS[name], [], _recording_engine_run,
                                     PARITY_ITERS, schedule=PARITY)
    # The CP bridge ran on every rank for both encoders and returned [n_local, H] rows.
    hidden = cfg.modules["language"].hidden_size
    for rank, res in enumerate(results):
        shapes = res["bridge_shapes"]
        assert shapes and all(len(s) == 2 and s[1] == hidden for s in shapes), rank
        assert sum(s[0] for s in shapes) > 0, rank
