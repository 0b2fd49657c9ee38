"""The planner's step-time model on fixed layouts: each term moves the way it must.

Pure functions (no ranks, no training): the terms of :func:`step_cost` and
:func:`chunk_compute` as one degree changes (TP, DP, PP, CP, EP, recompute, the
placement), the per-micro-batch fixed cost of the device constants, the report's
memory units, its uncertainty remark, and ``--headroom``'s fit test.
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.estimate.flops import transformer_layer_flops
from mimotron.parallel.layout import check_layout
from mimotron.planner.cost import Calibration, StepCost, model_vocabulary, step_cost
from mimotron.planner.devices import DeviceSpec, device_table
from mimotron.planner.options import ModuleOption
from mimotron.planner.report import format_report, memory_unit, uncertainty_remark
from mimotron.planner.search import Candidate, SearchRequest, SearchResult, search
from mimotron.planner.terms import (
    Links,
    chunk_collectives,
    chunk_compute,
    layer_params,
    replica_ranks,
    ring_factor,
    tp_efficiency,
)
from tests.common import BASE, DIGITS, colocated, noncolocated

# No fixed overhead: the FLOP and byte terms alone, on a 4-device node.
DEVICE = DeviceSpec("test", 1e12, 10**9, 4, intra_node_bytes_per_s=1e9,
                    inter_node_bytes_per_s=1e8, latency_s=1e-5)
NO_OVERLAP = ["train.overlap_grad_reduce=false"]


def _cost(*overrides: str, device: DeviceSpec = DEVICE) -> StepCost:
    cfg = load_config(DIGITS, [*BASE, *NO_OVERLAP, *overrides])
    return step_cost(cfg, check_layout(cfg), device)


def _lm(**degrees: int) -> list[str]:
    return noncolocated({}, {}, degrees)


def test_tensor_parallel_adds_collectives_per_layer():
    costs = [_cost(*_lm(tensor=t)).collectives["language"] for t in (1, 2, 4)]
    assert costs[0] == 0.0 < costs[1] < costs[2]


# TP 4 inside one node of 8: 2 hops (log2 4), ring factors 2 (3/4) and 3/4, 2 GB/s.
TP_DEVICE = DeviceSpec("tp", 1e12, 10**9, 8, intra_node_bytes_per_s=2e9,
                       inter_node_bytes_per_s=1e8, latency_s=3e-5)


def _hand_collective(ring: float, nbytes: float, tp: int = 4) -> float:
    """One ring collective over ``tp`` ranks of a node of TP_DEVICE, from first principles:
    ``ceil(log2 tp)`` latencies plus ``ring x bytes`` at the intra-node bandwidth."""
    hops = {2: 1, 4: 2, 8: 3}[tp]
    return hops * 3e-5 + ring * nbytes / 2e9


def _tp_chunk(*overrides: str, module: str = "language") -> tuple[float, float, object]:
    cfg = load_config(DIGITS, [*BASE, *overrides])
    layout = check_layout(cfg)
    links = Links(TP_DEVICE, None)
    return (*chunk_collectives(cfg, module, 0, 0, layout.modules[module], links), cfg)


@pytest.mark.parametrize("layers", [2, 3])
def test_tensor_parallel_collectives_equal_the_hand_count(layers):
    # The language model on one stage (first and last) at TP 4, no SP: per layer the two
    # row-wise projections (wo, w2) all-reduce their output forward and the five
    # column-wise ones (wq, wk, wv, w1, w3) their input's gradient backward; the
    # vocabulary-parallel embedding all-reduces forward, the column-wise head its input
    # gradient backward, the loss makes 4 small all-reduces of [samples, tokens] fp32.
    fwd, bwd, cfg = _tp_chunk(*_lm(tensor=4), f"modules.language.num_layers={layers}")
    samples, seq, h = 8, 64, 64  # micro-batch 8 (data 1), seq_length 64, hidden 64
    assert (cfg.train.micro_batch_size, cfg.data.seq_length,
            cfg.modules["language"].hidden_size) == (samples, seq, h)
    act = samples * seq * h * 4  # fp32 activations of the whole micro-batch
    all_reduce = _hand_collective(2 * 3 / 4, act)
    loss = _hand_collective(2 * 3 / 4, samples * seq * 4)
    assert fwd == pytest.approx(2 * layers * all_reduce + all_reduce + 4 * loss, rel=1e-12)
    assert bwd == pytest.approx(5 * layers * all_reduce + all_reduce, rel=1e-12)


def test_sequence_parallel_collectives_equal_the_hand_count():
    # With SP each layer's two regions all-gather their input and reduce-scatter their
    # output forward, the reverse backward; the head gathers its input forward and
    # scatters its gradient backward; the embedding's all-reduce and the loss's stay.
    fwd, bwd, _ = _tp_chunk(*_lm(tensor=4), "modules.language.parallel.sequence_parallel=true")
    layers, act = 2, 8 * 64 * 64 * 4
    gather = scatter = _hand_collective(3 / 4, act)
    all_reduce = _hand_collective(2 * 3 / 4, act)
    loss = _hand_collective(2 * 3 / 4, 8 * 64 * 4)
    assert fwd == pytest.approx(layers * 2 * (gather + scatter) + gather + all_reduce
                                + 4 * loss, rel=1e-12)
    assert bwd == pytest.approx(layers * 2 * (gather + scatter) + scatter, rel=1e-12)


@pytest.mark.parametrize("hf", [False, True])
def test_encoder_tensor_parallel_collectives_equal_the_hand_count(hf):
    # The vision encoder (2 layers of width 32, 16 output tokens) at TP 2: per layer 2
    # row-wise all-reduces forward, the column-wise ones backward (5 with SwiGLU's w3, a
    # Hugging Face layer's fc1 alone: 4); the projector's fc2 all-reduces its output (in
    # the language model's width) forward, fc1 its input gradient backward.
    cfg = load_config(DIGITS, [*BASE, *noncolocated({"tensor": 2}, {}, {}),
                               "modules.vision.num_layers=2"])
    vit = cfg.modules["vision"]
    if hf:
        vit.hf_path = "/not/read"  # read only by the builder, not by the cost model
    links = Links(TP_DEVICE, None)
    fwd, bwd = chunk_collectives(cfg, "vision", 0, 0, check_layout(cfg).modules["vision"],
                                 links)
    tokens, lm_h = vit.num_output_tokens, cfg.modules["language"].hidden_size
    assert (vit.num_layers, vit.hidden_size, tokens, lm_h) == (2, 32, 16, 64)
    all_reduce = _hand_collective(2 * 1 / 2, 8 * tokens * 32 * 4, tp=2)
    projected = _hand_collective(2 * 1 / 2, 8 * tokens * lm_h * 4, tp=2)
    columns = 4 if hf else 5
    assert fwd == pytest.approx(2 * 2 * all_reduce + projected, rel=1e-12)
    assert bwd == pytest.approx(columns * 2 * all_reduce + all_reduce, rel=1e-12)


def test_data_parallel_adds_reduction():
    costs = [_cost(*_lm(data=d)).data_parallel["language"] for d in (1, 2, 4)]
    assert costs[0] == 0.0 < costs[1] < costs[2]  # 2 (n-1)/n of the gradients, more hops


def test_pipeline_bubble_grows_with_stages_at_fixed_micro_batches():
    deep = ["modules.language.num_layers=4", "train.micro_batch_size=2"]  # 8 micro-batches
    idle = [_cost(*deep, *_lm(pipeline=p)).pipeline_idle for p in (1, 2, 4)]
    assert idle[0] < idle[1] < idle[2]
    assert idle[1] > 0.0


def test_full_recompute_adds_one_forward_of_the_layers():
    cfg = load_config(DIGITS, [*BASE, *_lm(), "modules.language.recompute=full"])
    plain = load_config(DIGITS, [*BASE, *_lm()])
    vocab = model_vocabulary(cfg)
    f_s, b_full = chunk_compute(cfg, "language", 0, 0, vocab, DEVICE, None)
    _, b_none = chunk_compute(plain, "language", 0, 0, vocab, DEVICE, None)
    lm = cfg.modules["language"]
    layers = lm.num_layers * transformer_layer_flops(cfg.train.micro_batch_size,
                                                     cfg.data.seq_length, lm.hidden_size)
    assert b_full - b_none == pytest.approx(layers / 1e12, rel=1e-12)
    assert 0.3 * f_s < b_full - b_none < f_s  # the layers' forward, not the head's


def test_split_layout_has_a_bridge_and_colocated_none():
    assert _cost(*_lm()).bridge > 0.0
    assert _cost(*colocated(2)).bridge == 0.0  # each rank's slices coincide: no transfer


def test_context_and_expert_parallel_add_collectives():
    assert _cost(*_lm(context=2)).collectives["language"] > 0.0
    moe = ["modules.language.num_experts=4", "modules.language.top_k=2"]
    assert _cost(*moe, *_lm(data=2, expert=2)).collectives["language"] > 0.0
    assert _cost(*moe, *_lm(data=2)).collectives["language"] == 0.0


def test_fixed_cost_per_micro_batch_from_the_device():
    # Per layer and per end, per micro-batch: paid whole whatever the samples or TP.
    slow = DeviceSpec("test", 1e12, 10**9, 4, 1e9, 1e8, 1e-5, layer_overhead_s=0.01)
    cfg = load_config(DIGITS, [*BASE, *_lm(tensor=2)])
    vocab = model_vocabulary(cfg)
    f0, b0 = chunk_compute(cfg, "language", 0, 0, vocab, DEVICE, None)
    f1, b1 = chunk_compute(cfg, "language", 0, 0, vocab, slow, None)
    units = cfg.modules["language"].num_layers + 2  # the layers, the embedding, the head
    assert f1 - f0 == pytest.approx(0.01 * units)
    assert b1 - b0 == pytest.approx(2 * 0.01 * units)  # backward: twice the forward's
    assert tp_efficiency(2) < 1.0  # (the FLOP part shrank with TP, this did not)


def test_fewer_micro_batches_win_on_one_cpu_rank():
    # Same FLOPs at every micro-batch size: the fixed cost per micro-batch decides.
    cpu = device_table()["cpu"]
    request = SearchRequest(str(DIGITS), BASE, 1, cpu, 2**30, top=3, micro_batches=(1, 4, 16))
    result = search(request)
    best = {m: min(c.cost.total for c in result.candidates if c.micro_batch == m)
            for m in (1, 4, 16)}
    assert best[16] < best[4] < best[1]
    assert result.candidates[0].micro_batch == 16


def test_report_units_uncertainty_and_headroom():
    assert memory_unit(3 * 2**20) == (2**20, "MiB")
    assert memory_unit(80 * 10**9) == (2**30, "GiB")
    cpu = device_table()["cpu"]
    limit = 6 * 2**20  # the fastest layouts need 3.6-5.3 MiB
    request = SearchRequest(str(DIGITS), BASE, 2, cpu, limit, top=2, micro_batches=(8,))
    roomy = search(request)
    tight_peak = roomy.candidates[0].peak
    # Keep enough free that the roomiest choice no longer fits: it must not be chosen.
    headroom = 1.0 - (tight_peak - 1) / limit
    strict = search(SearchRequest(str(DIGITS), BASE, 2, cpu, limit, top=2,
                                  micro_batches=(8,), headroom=headroom))
    assert all(c.peak <= limit * (1 - headroom) for c in strict.candidates)
    assert tight_peak not in [c.peak for c in strict.candidates]
    text = format_report(roomy, request)
    assert "peak MiB" in text and " / 6.00" in text and "fit in 6.00 MiB, 0% kept free" in text
    # A CPU priced from device constants claims no ±X %; with an error it names it.
    assert "not a meaningful step time" in uncertainty_remark(roomy, request)
    h100 = SearchRequest(str(DIGITS), BASE, 2, device_table()["h100"], limit, top=2)
    assert "±15%" in uncertainty_remark(roomy, h100)


def test_hf_encoder_layer_has_two_mlp_matrices():
    cfg = load_config(DIGITS, BASE)
    vit = cfg.modules["vision"]
    h, f = vit.hidden_size, vit.ffn_hidden_size or 96
    vit.ffn_hidden_size = f
    attention = 4 * h * h
    assert layer_params(cfg, "vision") == attention + 3 * h * f  # built-in: SwiGLU
    vit.hf_path = "/not/read"  # a Hugging Face tower: fc1, fc2
    assert layer_params(cfg, "vision") == attention + 2 * h * f


def test_bridge_fans_out_to_more_language_replicas():
    # Each encoder on one rank feeds the language model's 2 DP ranks: 2 messages of half
    # the micro-batch each, both ways, per micro-batch.
    cfg = load_config(DIGITS, [*BASE, *_lm(data=2)])
    lm = cfg.modules["language"]
    half = cfg.train.micro_batch_size / 2
    one_way = max(2 * (DEVICE.latency_s + half * cfg.modules[e].num_output_tokens
                       * lm.hidden_size * 4 / DEVICE.intra_node_bytes_per_s)
                  for e in cfg.encoder_names)
    assert _cost(*_lm(data=2)).bridge == pytest.approx(cfg.num_microbatches * 2 * one_way)


def test_each_pipeline_stage_reduces_among_its_own_ranks():
    cfg = load_config(DIGITS, [*BASE, "modules.language.num_layers=4",
                               *_lm(data=2, pipeline=2)])
    placement = check_layout(cfg).modules["language"]
    assert replica_ranks(placement, 0) == [2, 3] and replica_ranks(placement, 1) == [4, 5]
    assert ring_factor("all_reduce", 4) == 1.5 and ring_factor("p2p", 2) == 1.0
    with pytest.raises(ValueError, match="kind='broadcast' is invalid"):
        ring_factor("broadcast", 2)


def _ranked(*totals: float) -> SearchResult:
    """Search results of the given predicted steps (one language option each)."""
    option = ModuleOption(data=2)
    return SearchResult([Candidate({"language": option}, 8, False, t,
                                   cost=StepCost({}, {}, {}, 0.0, 0.0, 0.0, t, "compute"))
                         for t in totals])


def test_a_calibrated_report_does_not_suggest_calibrating():
    close = _ranked(1.0, 1.05, 1.5)
    calibration = Calibration("cpu", {"language": (0.5, 1.0)})
    calibrated = SearchRequest(str(DIGITS), BASE, 2, device_table()["cpu"], 2**30,
                               calibration, top=3)
    remark = uncertainty_remark(close, calibrated)
    assert remark == ("#1, #2 are within the model's error (±10%, calibrated) of #1: "
                      "indistinguishable by this model; measure them (a few training "
                      "steps each) to choose.")
    assert "--calibrate" not in format_report(close, calibrated, explain=True,
                                              calibration_note="calibrated (measured)")
    # Priced from device constants, calibrating is what would tell them apart.
    h100 = SearchRequest(str(DIGITS), BASE, 2, device_table()["h100"], 2**30, top=3)
    assert "(--calibrate, or a few training steps each)" in uncertainty_remark(close, h100)


def test_step_time_at_a_tiny_flop_rate_is_finite():
    # 1 FLOP/s (a device table's typo): a step of ~4e8 s, whose clock no longer moves by
    # a compute's float residue; the replay must end all the same.
    crawl = DeviceSpec("crawl", 1.0, 10**9, 4, 1e9, 1e8, 1e-5, layer_overhead_s=0.01)
    cfg = load_config(DIGITS, [*BASE, *NO_OVERLAP, *_lm(tensor=2)])
    f_s, b_s = chunk_compute(cfg, "language", 0, 0, model_vocabulary(cfg), crawl, None)
    total = step_cost(cfg, check_layout(cfg), crawl).total
    language = cfg.num_microbatches * (f_s + b_s)
    # The language model's own computes, plus the encoders' first forward before them.
    assert 1e8 < language <= total < 1.1 * language
