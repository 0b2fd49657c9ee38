"""``mimotron plan --auto``: the simulation, the cost terms, the search's choices train.

* the simulated makespan of our own plans against schedules drawn by hand (1F1B on two
  stages; two encoders feeding the language model; ranks sharing one core);
* the compute and collective terms against hand-computed FLOPs and ring formulas;
* the device table and a user's file;
* over a grid of worlds and memory limits (digits and the LLaVA-1.5-7B shape), the first
  choice passes ``load_config`` + ``check_layout`` + the data check and its memory
  estimate (recomputed from scratch) is within the limit; its TOML snippet gives the
  same layout;
* the digits choice on 4 ranks, from its snippet, trains 10 iterations matching the
  plain-PyTorch reference (losses, grad norms, final weights).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from mimotron.cli.main import main
from mimotron.config import ParallelConfig, load_config
from mimotron.data.run_data import check_data
from mimotron.estimate.flops import language_model_flops, transformer_layer_flops
from mimotron.estimate.memory import estimate_memory
from mimotron.parallel.layout import (
    Layout,
    ModulePlacement,
    check_layout,
    encoders_on_first_stage,
    is_colocated_pipeline,
    language_pipeline,
)
from mimotron.pipeline.actions import Position, build_1f1b_actions
from mimotron.pipeline.interleaved_actions import build_rank_actions
from mimotron.planner.cost import Calibration, model_vocabulary, step_cost
from mimotron.planner.devices import DeviceSpec, device_table
from mimotron.planner.fit import rank_classes
from mimotron.planner.report import format_table, snippet
from mimotron.planner.search import SearchRequest, search
from mimotron.planner.simulate import Lane, SimulationError, simulate
from mimotron.planner.terms import Links, chunk_compute, tp_efficiency, trainable_params
from tests.common import BASE, DIGITS
from tests.parity import PARITY, run_against_plain_loop

LLAVA_7B = Path(__file__).resolve().parents[1] / "configs" / "llava15_7b_8gpu.toml"
UNIT = {("F", 0): (1.0, 0.0), ("B", 0): (2.0, 0.0)}


def _two_stage_lanes(n: int) -> dict[tuple[str, int], Lane]:
    return {("language", s): Lane(build_1f1b_actions(n, Position("language", s, s, 2, s > 0,
                                                              s < 1)), 1, 2, 1, UNIT)
            for s in range(2)}


def test_two_stage_1f1b_makespan_matches_the_hand_drawn_schedule():
    # Stage 0: F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9] F3 [9,10] B2 [10,12] B3 [13,15]
    # Stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10] F3 [10,11] B3 [11,13]
    result = simulate(_two_stage_lanes(4), lambda src, msg: 0.0)
    assert result.makespan == 15.0  # 4 x (F + B) + (p - 1) x (F + B)
    assert result.finish == {("language", 0): 15.0, ("language", 1): 13.0}
    assert result.busy == {("language", 0): 12.0, ("language", 1): 12.0}
    # 0.5 s per message. Stage 0: F0 [0,1] F1 [1,2] B0 [5,7] F2 [7,8] B1 [8,10] F3 [10,11]
    # B2 [12,14] B3 [15,17]; stage 1: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    # F2 [8.5,9.5] B2 [9.5,11.5] F3 [11.5,12.5] B3 [12.5,14.5].
    slow = simulate(_two_stage_lanes(4), lambda src, msg: 0.5)
    assert slow.makespan == 17.0
    assert slow.finish[("language", 1)] == 14.5
    # Two ranks on one core: every compute shares it, the step is the serial sum.
    assert simulate(_two_stage_lanes(4), lambda src, msg: 0.0, host_cores=1).makespan == 24.0


def test_simulation_ends_where_float_residue_no_longer_moves_the_clock():
    # At a clock of 1e5 s a float step is ~1.5e-11 s: a compute's remaining fixed part of
    # a few 1e-11 s (what subtracting the rounded step leaves) never moved the clock, and
    # the replay spun forever (a 7B model priced on CPU constants). It ends exactly.
    plan = build_1f1b_actions(1, Position("language", 0, 0, 1, False, False))
    lane = Lane(plan, 1, 1, 1, {("F", 0): (1e5, 0.1), ("B", 0): (2e5, 0.1)})
    result = simulate({("language", 0): lane}, lambda src, msg: 0.0)
    assert result.makespan == pytest.approx(3e5 + 0.2, rel=1e-15)
    assert result.busy[("language", 0)] == pytest.approx(3e5 + 0.2, rel=1e-15)
    # Two stages on shared cores at such a clock, and a compute of 1e12 s: the same.
    slow = {k: Lane(v.plan, 1, 2, 1, {("F", 0): (1e12, 0.1), ("B", 0): (2e12, 0.3)})
            for k, v in _two_stage_lanes(4).items()}
    assert simulate(slow, lambda src, msg: 1e-3, host_cores=1).makespan == pytest.approx(
        24e12, rel=1e-12)


def test_simulation_refuses_durations_it_cannot_replay():
    plan = build_1f1b_actions(1, Position("language", 0, 0, 1, False, False))
    for bad in (float("inf"), float("nan"), -1.0):
        lanes = {("language", 0): Lane(plan, 1, 1, 1, {("F", 0): (bad, 0.0),
                                                       ("B", 0): (1.0, 0.0)})}
        with pytest.raises(SimulationError, match=r"language stage 0: F of chunk 0 is "
                           r"priced at .* expected finite seconds >= 0"):
            simulate(lanes, lambda src, msg: 0.0)
    with pytest.raises(SimulationError, match="a message to language stage 1 is priced "
                       "at inf s"):
        simulate(_two_stage_lanes(2), lambda src, msg: float("inf"))
    # The guard on the number of events: 8 actions of two stages need more than 3.
    with pytest.raises(SimulationError, match="did not finish in 3 events"):
        simulate(_two_stage_lanes(2), lambda src, msg: 0.0, max_events=3)


def _encoders_layout() -> Layout:
    modules = {n: ModulePlacement(n, ParallelConfig(rank_offset=i))
               for i, n in enumerate(("vision", "audio", "language"))}
    return Layout(3, False, modules, {"vision": ["language"], "audio": ["language"]})


def test_language_model_waits_for_every_encoder():
    layout = _encoders_layout()
    cost = {"vision": {("F", 0): (1.0, 0.0), ("B", 0): (1.0, 0.0)},
            "audio": {("F", 0): (3.0, 0.0), ("B", 0): (1.0, 0.0)},
            "language": {("F", 0): (1.0, 0.0), ("B", 0): (1.0, 0.0)}}
    lanes = {(m, 0): Lane(build_rank_actions(layout, m, 0, 2), 1, 1, 1, cost[m]) for m in cost}
    result = simulate(lanes, lambda src, msg: 0.0)
    # audio F0 [0,3] F1 [3,6]; language F0 [3,4] B0 [4,5] F1 [6,7] B1 [7,8];
    # vision B0 [5,6] B1 [8,9]; audio B0 [6,7] B1 [8,9].
    assert result.finish == {("language", 0): 8.0, ("vision", 0): 9.0, ("audio", 0): 9.0}
    assert result.makespan == 9.0


def test_compute_term_is_flops_over_the_rate():
    cfg = load_config(DIGITS, [*BASE, "modules.language.parallel.tensor=2",
                               "modules.language.parallel.rank_offset=2",
                               "modules.language.parallel.data=1",
                               "modules.language.recompute=full"])
    device = DeviceSpec("test", 1e12, 10**9, 8, 1e9, 1e8, 1e-5)
    vocab = model_vocabulary(cfg)
    lm = cfg.modules["language"]
    samples = cfg.train.micro_batch_size  # data = 1: the whole micro-batch
    forward = language_model_flops(lm, vocab, samples, cfg.data.seq_length)
    layer = transformer_layer_flops(samples, cfg.data.seq_length, lm.hidden_size)
    rate = 1e12 * 2 * tp_efficiency(2)
    f_s, b_s = chunk_compute(cfg, "language", 0, 0, vocab, device, None)
    assert f_s == pytest.approx(forward / rate, rel=1e-12)
    # Backward: twice the forward, plus full recompute's forward of every layer.
    assert b_s == pytest.approx((2 * forward + lm.num_layers * layer) / rate, rel=1e-12)
    assert tp_efficiency(8) == pytest.approx(1 - 0.04 * 3)


def test_calibrated_tower_frozen_encoder_costs_its_measured_times():
    # freeze = "encoder": only the projector trains, so the measured backward is the
    # projector's; at the measured shape (one rank, the whole micro-batch) the model
    # returns the measured seconds (it divided by a backward factor of 0 before).
    cfg = load_config(DIGITS, [*BASE, 'modules.vision.freeze="encoder"'])
    calibration = Calibration("cpu", {"vision": (0.01, 0.004)})
    f_s, b_s = chunk_compute(cfg, "vision", 0, 0, model_vocabulary(cfg),
                             device_table()["cpu"], calibration)
    assert (f_s, b_s) == (pytest.approx(0.01), pytest.approx(0.004))

def test_collective_costs_follow_the_ring_and_the_node():
    device = DeviceSpec("test", 1e12, 10**9, 4, intra_node_bytes_per_s=1e9,
                        inter_node_bytes_per_s=1e8, latency_s=1e-5)
    links = Links(device, None)
    nbytes = 8e6
    # 4 ranks in a node: 2 (n-1)/n of the buffer over the intra-node link, log2(4) hops.
    assert links.cost("all_reduce", [0, 1, 2, 3], nbytes) == pytest.approx(
        2e-5 + nbytes * 1.5 / 1e9)
    # Across nodes (ranks 0 and 4 with 4 a node): the inter-node link.
    assert links.cost("all_gather", [0, 4], nbytes) == pytest.approx(1e-5 + nbytes * 0.5 / 1e8)
    assert links.cost("p2p", [3, 4], nbytes) == pytest.approx(1e-5 + nbytes / 1e8)
    assert links.cost("all_reduce", [5], nbytes) == 0.0  # a group of one moves nothing


def test_device_table_takes_a_users_file(tmp_path):
    assert {"h100", "h200", "a100-80gb", "a100-40gb", "cpu"} <= set(device_table())
    path = tmp_path / "devices.toml"
    path.write_text("[devices.h100]\nflops_per_s = 4e14\n\n[devices.l40s]\n"
                    "flops_per_s = 1.8e14\nmemory_bytes = 48e9\ndevices_per_node = 8\n"
                    "intra_node_bytes_per_s = 2.4e10\ninter_node_bytes_per_s = 1.2e10\n"
                    "latency_s = 2e-5\n")
    table = device_table(str(path))
    assert table["h100"].flops_per_s == 4e14
    assert table["h100"].memory_bytes == device_table()["h100"].memory_bytes
    assert table["l40s"].memory_bytes == 48 * 10**9
    path.write_text("[devices.h100]\nflops = 1\n")
    with pytest.raises(ValueError, match="devices.h100.flops is not a device field"):
        device_table(str(path))
    path.write_text("[devices.new]\nflops_per_s = 1e12\n")
    with pytest.raises(ValueError, match="new device and needs memory_bytes"):
        device_table(str(path))
    # A count must be whole: int(0.5) would make a node of 0 devices (a division by 0).
    path.write_text("[devices.h100]\ndevices_per_node = 0.5\n")
    with pytest.raises(ValueError, match="devices.h100.devices_per_node=0.5 is invalid"):
        device_table(str(path))
    path.write_text("[devices.h100]\nflops_per_s = nan\n")  # TOML's nan would price nothing
    with pytest.raises(ValueError, match="devices.h100.flops_per_s=nan is invalid"):
        device_table(str(path))
    for key, value in (("flops_per_s", "inf"), ("latency_s", "-1e-5"),
                       ("intra_node_bytes_per_s", "0"), ("layer_overhead_s", "-inf")):
        path.write_text(f"[devices.h100]\n{key} = {value}\n")
        with pytest.raises(ValueError, match=rf"devices.h100.{key}=[-\w.]+ is invalid: "
                           "expected a positive number"):
            device_table(str(path))


def snippet_overrides(text: str) -> list[str]:
    """The snippet as overrides; each ``[modules.<m>.parallel]`` table *replaces* the
    config's (keys it leaves out take their defaults), as the report says."""
    doc = tomllib.loads(text)
    out = [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}"
           for k, v in doc.get("train", {}).items()]
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ParallelConfig)}
    for name, table in doc.get("modules", {}).items():
        for key, value in table.items():
            if key != "parallel":
                out.append(f"modules.{name}.{key}={value}")
        for key, default in defaults.items():
            value = table.get("parallel", {}).get(key, default)
            text_value = str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"modules.{name}.parallel.{key}={text_value.replace(' ', '')}")
    return out


def _assert_trains(config: Path, base: list[str], world: int, device: str, limit: int,
                   micro_batches: tuple[int, ...]) -> bool:
    """Search; the first choice (if any) is valid, fits, and its snippet is the layout."""
    request = SearchRequest(str(config), base, world, device_table()[device], limit,
                            micro_batches=micro_batches, top=1)
    result = search(request)
    if not result.candidates:
        return False
    best = result.candidates[0]
    cfg = load_config(config, best.overrides)
    layout = check_layout(cfg)
    check_data(cfg)
    assert layout.world_size == world
    ranks = [r for r, _ in rank_classes(layout)]
    est = estimate_memory(cfg, layout, model_vocabulary(cfg), ranks)  # no memo: fresh
    assert max(sum(e.total for e in items) for items in est.values()) <= limit
    from_snippet = load_config(config, [*base, *snippet_overrides(snippet(best))])
    assert {n: m.parallel for n, m in from_snippet.modules.items()} == {
        n: m.parallel for n, m in cfg.modules.items()}
    assert {n: m.recompute for n, m in from_snippet.modules.items()} == {
        n: m.recompute for n, m in cfg.modules.items()}
    assert best.cost is not None and best.cost.total > 0 and best.cost.bottleneck
    return True


@pytest.mark.parametrize("world", [1, 2, 4, 8, 64])
def test_digits_first_choice_trains_within_the_limit(world):
    # 64 MiB is roomy for the small demo model; 5 MiB forces sharding or recompute.
    found = [_assert_trains(DIGITS, BASE, world, "cpu", limit, (8,))
             for limit in (64 * 2**20, 5 * 2**20)]
    assert found[0]  # the roomy limit always has a layout


@pytest.mark.parametrize(("world", "limit"), [(8, 40 * 10**9), (64, 80 * 10**9)])
def test_llava_7b_first_choice_trains_within_the_limit(world, limit):
    assert _assert_trains(LLAVA_7B, ["train.global_batch_size=64"], world, "h100", limit,
                          (16,))


def test_colocated_search_tries_a_leaner_rung_when_the_sum_is_over_the_limit():
    # On 4 ranks under 3 MiB the fastest rung of each module fits alone but not the three
    # on one rank; recompute full everywhere (TP 4, micro-batch 1) fits: 2.84 MiB.
    request = SearchRequest(str(DIGITS), [], 4, device_table()["cpu"], 3 * 2**20, top=1)
    result = search(request)
    assert result.candidates, "no layout found although a colocated one fits"
    best = result.candidates[0]
    assert best.peak <= 3 * 2**20
    cfg = load_config(DIGITS, best.overrides)
    est = estimate_memory(cfg, check_layout(cfg), model_vocabulary(cfg), list(range(4)))
    assert max(sum(e.total for e in items) for items in est.values()) <= 3 * 2**20

def test_search_offers_colocated_layouts_with_a_pipelined_language_model():
    """Colocated candidates pipeline the language model (never an encoder, without
    interleaving, and with context parallelism only where the encoders sit on its first
    stage): each one is valid, fits, has one rank class
    per language stage, and its step prices the encoders' phase in series with the
    language stages (more than the stages alone)."""
    request = SearchRequest(str(DIGITS), BASE, 4, device_table()["cpu"], 64 * 2**20,
                            micro_batches=(8,), top=50)
    found = []
    for cand in search(request).candidates:
        cfg = load_config(DIGITS, cand.overrides)
        layout = check_layout(cfg)
        if is_colocated_pipeline(layout):
            found.append(cand)
            language = cfg.modules["language"].parallel
            assert all(m.parallel.pipeline == 1 for n, m in cfg.modules.items()
                       if n != "language")
            assert language.virtual_pipeline == 1
            assert language.context == 1 or encoders_on_first_stage(layout)
            classes = rank_classes(layout)
            assert len(classes) == language.pipeline
            assert sum(n for _, n in classes) == 4
            alone = step_cost(cfg, language_pipeline(layout), device_table()["cpu"])
            assert cand.cost.total > alone.total
            assert cand.cost.compute["vision"] > 0 and cand.cost.bridge >= alone.bridge
            # Later stages join an encoder on every rank with empty slices: the rows move;
            # on the first stage alone, an encoder sliced as the language model passes
            # its rows through.
            passes = all(
                (m.parallel.data, m.parallel.tensor) == (language.data, language.tensor)
                for n, m in cfg.modules.items() if n != "language") and language.context == 1
            assert (cand.cost.bridge == alone.bridge) == (
                encoders_on_first_stage(layout) and passes), cand.overrides
    assert found


def test_search_offers_encoders_on_the_first_stage():
    """First-stage candidates: every encoder on exactly the first stage's ranks of a
    pipelined language model (the validator calls it so), each valid and fitting, its
    encoders' memory on those ranks only, its step the encoders' phase in series with
    the language stages; the report names the placement."""
    request = SearchRequest(str(DIGITS), BASE, 4, device_table()["cpu"], 64 * 2**20,
                            micro_batches=(8,), top=50)
    result = search(request)
    found = [c for c in result.candidates if c.placement == "first stage"]
    assert found
    for cand in found:
        cfg = load_config(DIGITS, cand.overrides)
        layout = check_layout(cfg)
        language = cfg.modules["language"].parallel
        stage = 4 // language.pipeline
        assert encoders_on_first_stage(layout) and stage < 4
        assert all(m.parallel.size == stage for n, m in cfg.modules.items() if n != "language")
        est = estimate_memory(cfg, layout, model_vocabulary(cfg), [0, 3])
        assert {e.module for e in est[3]} == {"language"} and len(est[0]) == 3
        alone = step_cost(cfg, language_pipeline(layout), device_table()["cpu"])
        assert cand.cost.total > alone.total
        # The encoders hold the step anyway: one forward and backward for it.
        assert cfg.train.encoder_batching and "encoder_batching = true" in snippet(cand)
    table = "\n".join(format_table(result, request))
    assert " first stage " in table


def test_encoder_batching_prices_the_encoders_once_a_step():
    """Under encoder batching a pipelined colocated step prices each encoder as one
    micro-batch of the whole step: its per-micro-batch fixed costs (5 ms a layer and end
    on ``cpu``) once instead of 8 times; the language stages' terms do not change."""
    cpu = device_table()["cpu"]
    layout_keys = [*BASE, "train.micro_batch_size=2", "modules.language.parallel.data=2",
                   "modules.language.parallel.pipeline=2",
                   *[f"modules.{m}.parallel.{k}={v}" for m in ("vision", "audio", "language")
                     for k, v in (("rank_offset", 0),)],
                   *[f"modules.{m}.parallel.data=2" for m in ("vision", "audio")]]
    costs = {}
    for batched in (False, True):
        cfg = load_config(DIGITS, [*layout_keys, f"train.encoder_batching={str(batched).lower()}"])
        layout = check_layout(cfg)
        assert encoders_on_first_stage(layout) and cfg.num_microbatches == 8
        costs[batched] = step_cost(cfg, layout, cpu)
    for m in ("vision", "audio"):
        assert 0 < costs[True].compute[m] < costs[False].compute[m] / 2, (m, costs)
    assert costs[True].compute["language"] == costs[False].compute["language"]


def test_plan_auto_command(capsys):
    assert main(["plan", "--auto", str(DIGITS), *BASE, "--world", "2", "--device", "cpu",
                 "--top", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "best layout (#1) as TOML" in out and "[modules.language.parallel]" in out
    assert "pipeline idle" in out or "compute (" in out
    assert main(["plan", "--auto", str(DIGITS), *BASE, "--world", "2", "--device", "cpu",
                 "--device-memory", "1MiB"]) == 2
    assert "no layout fits" in capsys.readouterr().out
    assert main(["plan", "--auto", str(DIGITS), "--device", "tpu", "--world", "2"]) == 2
    assert "--device='tpu' is invalid" in capsys.readouterr().err


def test_plan_auto_refuses_a_world_it_cannot_fill(capsys):
    # A billion ranks was told "no layout fits ... raise --world": now the valid range.
    assert main(["plan", "--auto", str(DIGITS), *BASE, "--world", "1000000000",
                 "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "mimotron plan --auto: invalid option: --world=1000000000 is invalid: --auto needs "
        "the number of ranks, 1 to 1,048,576, e.g. --world 8\n")
    # Within the range but beyond the model: the most ranks its layouts can take. Per
    # module tensor (powers of 2 dividing 4 heads) x context (the language model: 2c
    # divides 64 tokens, 8 at most) x data (a divisor of the micro-batch, at most the
    # global batch 16) x pipeline (its layers: 1, 1, 2).
    most = 4 * 1 * 16 * 1 + 4 * 1 * 16 * 1 + 4 * 8 * 16 * 2
    assert main(["plan", "--auto", str(DIGITS), *BASE, "--world", str(most + 1),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mimotron plan --auto: invalid config: --world={most + 1} is "
                          f"invalid for {DIGITS}: the layouts --auto searches use at most "
                          f"{most:,} ranks")
    assert err.endswith("lower --world or raise train.global_batch_size\n")


def test_digits_choice_on_four_ranks_matches_the_plain_loop():
    base = [*PARITY, *BASE]
    request = SearchRequest(str(DIGITS), base, 4, device_table()["cpu"], 2**30, top=1,
                            micro_batches=(8,))
    best = search(request).candidates[0]
    layout = snippet_overrides(snippet(best))
    assert check_layout(load_config(DIGITS, [*base, *layout])).world_size == 4
    run_against_plain_loop(layout, [], num_iters=10)


def test_data_parallel_reduction_is_exposed_unless_overlapped():
    layout_keys = ["modules.language.parallel.data=2", "modules.language.parallel.rank_offset=2"]
    device = device_table()["cpu"]
    exposed = {}
    for overlap in (False, True):
        cfg = load_config(DIGITS, [*BASE, *layout_keys,
                                   f"train.overlap_grad_reduce={str(overlap).lower()}"])
        layout = check_layout(cfg)
        exposed[overlap] = step_cost(cfg, layout, device).data_parallel["language"]
    cfg = load_config(DIGITS, [*BASE, *layout_keys])
    grads = 4 * trainable_params(cfg, "language", 0, model_vocabulary(cfg))
    # Ranks 2 and 3 reduce the fp32 gradients: 2 (n-1)/n of them at 1 GB/s, one hop.
    assert exposed[False] == pytest.approx(device.latency_s + grads / 1e9)
    assert exposed[True] == 0.0  # hidden by the last backward (tens of ms on this model)


def test_the_report_predicts_mfu_and_warns_when_the_batch_cannot_fill_the_world():
    """``plan --auto`` prints each candidate's MFU (model FLOPs of the step over its
    predicted time and the world's datasheet peak) and tokens per second per device,
    and warns, with the MFU the best layout implies, where the global batch is smaller
    than the world; a device with no known peak (the CPU) predicts no MFU."""
    from mimotron.estimate.flops import model_flops_per_iteration
    from mimotron.planner.report import format_report, predicted_mfu

    h100 = device_table()["h100"]
    request = SearchRequest(str(LLAVA_7B), ["train.global_batch_size=32"], 64, h100,
                            80 * 10**9, top=1)
    result = search(request)
    best = result.candidates[0]
    cfg = load_config(LLAVA_7B, best.overrides)
    flops = sum(model_flops_per_iteration(cfg, model_vocabulary(cfg),
                                          {"vision": 32.0}).values())
    assert best.model_flops == pytest.approx(flops)
    mfu = flops / best.cost.total / (989e12 * 64)
    assert predicted_mfu(best, request) == pytest.approx(mfu)
    report = format_report(result, request)
    assert f"{mfu:.0%}" in report.splitlines()[5]
    assert (f"warning: a global batch of 32 samples cannot keep 64 ranks busy (0.5 samples "
            f"per rank per step); the best layout found implies MFU {mfu:.0%}") in report
    enough = SearchRequest(str(LLAVA_7B), ["train.global_batch_size=64"], 64, h100,
                           80 * 10**9, top=1)
    assert "cannot keep" not in format_report(search(enough), enough)
    assert predicted_mfu(best, dataclasses.replace(request, device=device_table()["cpu"])
                         ) is None
