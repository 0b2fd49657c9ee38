"""The fake-device dry run (``mimotron.dryrun``): GPU readiness proven on the CPU.

Each case runs some ranks of one layout class in one process, on the ``fake`` backend
under ``FakeTensorMode`` with ``meta`` standing in for the accelerator: real modules,
real training steps (forward, backward, gradient finalisation, optimizer step), one
evaluation step and the checkpoint state dict. A tensor left on the host and mixed with
device tensors fails the case; so does a collective on a host tensor. The step's reads
of computed values are counted: one for the loss-token count, one for the optimizer's
world collective (docs/design.md, "The data path of one training step", steps 3 and 10);
reads of batch data are none on encoder and colocated ranks (the step counts on the
batch's host copies) and only the shape headers on a language rank. Expert parallelism
adds one read of routing counts per MoE layer and micro-batch, stood in by a balanced
routing whose exchanges add up (``mimotron.dryrun.moe``). The last test shows
the dry run failing on the old behaviour (batches left on the host), naming the batch
key and the parameter it met.
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from mimotron import host_sync
from mimotron.config import load_config
from mimotron.dryrun import DeviceMixError, DryRunReport, StepReport, dry_run
from mimotron.names import LANGUAGE
from mimotron.training import step as step_module
from tests.common import BASE, DIGITS, coloc, colocated, noncolocated, par

# Every sample carries image and audio (the bridges' row counts are then fixed).
SP = ["modules.language.parallel.sequence_parallel=true"]
MOE = ["modules.language.num_experts=4", "modules.language.top_k=2"]
CASES: dict[str, tuple[list[str], list[int] | None]] = {
    # vision | audio | language DP 2: the demo layout, every rank.
    "noncolocated": (noncolocated({}, {}, {"data": 2}), None),
    "colocated-dp2": (colocated(2), [1]),
    "pp2-1f1b": (noncolocated({}, {}, {"pipeline": 2}), None),
    "interleaved-vp2": (noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2})
                        + ["modules.language.num_layers=4"], None),
    "tp2-sp": (noncolocated({}, {}, {"tensor": 2}) + SP, None),
    "cp2": (noncolocated({}, {}, {"context": 2}), [0, 1, 2]),
    "moe-ep2": (colocated(2) + par("language", expert=2) + MOE, [0]),
    "zero1-overlap": (colocated(2) + par("language", shard_optimizer="true")
                      + ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true"],
                      [1]),
    "encoder-batching": (coloc({"data": 2}, {"data": 2}, {"data": 2})
                         + ["train.encoder_batching=true"], [0]),
    "bf16-noncolocated": (noncolocated({}, {}, {"data": 2}) + ["train.precision=bf16"],
                          [0, 1, 2]),
    # bf16 language stage links (their dtype follows the residual stream's on the device).
    "bf16-pp2": (noncolocated({}, {}, {"pipeline": 2}) + ["train.precision=bf16"], None),
    # LoRA adapters on TP layers (a column's partial input gradient, a row's reduce-scatter
    # under SP) across two pipeline stages, and colocated beside the encoders.
    "lora-tp2-sp-pp2": (noncolocated({}, {}, {"tensor": 2, "pipeline": 2}) + SP
                        + ["modules.language.lora.rank=4", "train.precision=bf16"], None),
    "lora-colocated-tp2": (coloc({"tensor": 2, "data": 1}, {"tensor": 2, "data": 1},
                                 {"tensor": 2, "data": 1})
                           + ["modules.language.lora.rank=4"], [0]),
    # The colocated bridge re-slices rows (DP 4 -> DP 2): its gather of presence masks
    # carries each rank's own (mimotron.dryrun.harness.PeerBatches).
    "colocated-bridge": (coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2}), [0, 3]),
    # A colocated pipelined language model: encoders and bridges on every rank, then the
    # language stages (DP 2 x PP 2; TP 2 with SP x PP 2).
    "colocated-pp2": (coloc({"data": 4}, {"data": 4}, {"data": 2, "pipeline": 2}), [0, 3]),
    "colocated-tp2-sp-pp2": (coloc({"data": 4}, {"tensor": 2, "data": 2},
                                   {"tensor": 2, "data": 1, "pipeline": 2}) + SP, [1, 2]),
    # The encoders on the first language stage's ranks (0-1), bridged over their group.
    "first-stage-pp2": (coloc({"data": 2}, {"tensor": 2, "data": 1},
                              {"data": 2, "pipeline": 2}), [1, 2]),
}
# Two steps where the second differs (optimizer state, the overlapped param gather).
TWO_STEPS = ("noncolocated", "zero1-overlap")
# Counts and indices that depend only on the batch (present samples, placeholders) come
# from its host copies (host_sync.host_copy): the data syncs left are the shape headers a
# language rank receives (p2p), and those of TP/SP and of the CP bridge, by file.
DATA_SYNC_FILES = {"mimotron/pipeline/p2p.py"}
MORE_DATA_SYNC_FILES: dict[str, set[str]] = {
    "tp2-sp": {"mimotron/models/language.py"},
    "lora-tp2-sp-pp2": {"mimotron/models/language.py"},
    "cp2": {"mimotron/parallel/context_parallel.py", "mimotron/pipeline/communicator.py",
            "mimotron/training/language_step.py", "mimotron/models/language.py"},
    # One read of every rank's presence per bridge: which rows each slice takes.
    "colocated-bridge": {"mimotron/pipeline/colocated.py"},
    "colocated-pp2": {"mimotron/pipeline/colocated.py"},
    "colocated-tp2-sp-pp2": {"mimotron/pipeline/colocated.py", "mimotron/models/language.py"},
    "first-stage-pp2": {"mimotron/pipeline/colocated.py"},
}
# Expert routing reads its per-expert counts (the router's choices: the all-to-all
# splits and the grouped call's sizes) once per MoE layer and micro-batch, a real
# device-to-host sync each, stood in by a balanced routing: 2 layers x 2 micro-batches.
EXPERT_READS = {"moe-ep2": 4}


def _run(overrides: list[str], ranks: list[int] | None, **kw: object) -> list[DryRunReport]:
    cfg = load_config(DIGITS, [*BASE, *overrides])
    return dry_run(cfg, ranks, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fresh_process() -> Iterator[ProcessPoolExecutor]:
    """One process started for this file's cases, as ``mimotron plan --dry-run`` runs in a
    process of its own (a test worker's earlier files leave other state behind; the
    DTensor plans they cached are dropped by every new world:
    :func:`test_a_dry_run_after_another_in_one_process`)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _two_dry_runs(first: str, second: str) -> None:
    for name in (first, second):  # rank 0 of each: a TP 2 mesh, the same in both worlds
        _run(CASES[name][0], [0], steps=1, evaluate=False, checkpoint=False)


def test_a_dry_run_after_another_in_one_process(fresh_process: ProcessPoolExecutor) -> None:
    """DTensor caches sharding plans by device-mesh equality, which ignores process
    groups: a second dry run in one process whose TP mesh equals the first one's got the
    first world's mesh back, and its sequence-parallel reduce-scatter a destroyed group
    ("Could not resolve the process group registered under the name 4"; the cause of the
    ``lora-tp2-sp-pp2`` case failing now and then in a worker that had run other files).
    Every new world drops those plans (``mimotron.runtime.forget_dtensor_plans``)."""
    fresh_process.submit(_two_dry_runs, "lora-colocated-tp2", "colocated-tp2-sp-pp2").result()


@pytest.mark.parametrize("name", list(CASES))
def test_dry_run_keeps_every_tensor_on_the_device(name: str,
                                                  fresh_process: ProcessPoolExecutor) -> None:
    overrides, ranks = CASES[name]
    reports = fresh_process.submit(_run, overrides, ranks,
                                   steps=2 if name in TWO_STEPS else 1,
                                   evaluate=name in ("noncolocated", "colocated-dp2",
                                                     "colocated-pp2", "first-stage-pp2")
                                   ).result()
    assert reports
    expected = {host_sync.TOKEN_COUNT: 1, host_sync.WORLD_SUMS: 1}
    if name in EXPERT_READS:
        expected[host_sync.EXPERT_COUNTS] = EXPERT_READS[name]
    for rep in reports:
        assert rep.device == "meta"
        for step in rep.steps:
            # The step's two reads of computed values (docs/design.md, steps 3 and 10),
            # MoE routing's, and nothing unnamed.
            assert step.host_reads == expected, rep.format()
            _check_data_syncs(name, rep.modules, step, rep.format())
        assert rep.checkpoint_devices.get("meta", 0) > 0
        if rep.evaluation is not None:
            assert rep.evaluation.host_reads == {host_sync.EVAL_SUMS: 1}, rep.format()


def _check_data_syncs(name: str, modules: list[str], step: StepReport, report: str) -> None:
    """Only the allowed files sync on batch data; encoder and colocated ranks not at all
    (before host copies: 6 per step on an encoder rank of ``noncolocated``, 10 on a
    language rank, 12 on a colocated rank)."""
    files = {re.sub(r":\d+$", "", site.split(" at ")[-1]) for site in step.data_syncs}
    assert files <= DATA_SYNC_FILES | MORE_DATA_SYNC_FILES.get(name, set()), report
    if name not in MORE_DATA_SYNC_FILES and (LANGUAGE not in modules or len(modules) > 1):
        assert step.data_syncs == {} and step.num_syncs == 2 + EXPERT_READS.get(name, 0), (
            report)
    if name in ("noncolocated", "pp2-1f1b", "bf16-noncolocated") and modules == [LANGUAGE]:
        # The first stage reads the two bridges' shape headers; a later stage nothing.
        assert sum(step.data_syncs.values()) <= 2, report


def test_routing_stand_in_adds_up() -> None:
    """Every row of the table splits the routed choices evenly; what a rank receives from
    each peer is what it sends it (the exchanges' sizes agree both ways)."""
    from mimotron.dryrun.moe import routing_counts

    sent, *received = routing_counts((3, 4), 13)  # own counts + 2 peer tables, E = 4
    assert sent == [4, 3, 3, 3] and all(r == sent for r in received)
    assert routing_counts((4,), 8) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="total"):
        routing_counts((2, 4), None)


def test_dry_run_fails_on_host_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old behaviour: the step hands host batches to the model."""
    monkeypatch.setattr(step_module, "microbatches_to_device", lambda mbs, device: mbs)
    with pytest.raises(DeviceMixError) as info:
        _run(ONE_RANK_LANGUAGE, None, steps=1, evaluate=False, checkpoint=False)
    message = str(info.value)
    assert "cpu" in message and "meta" in message
    assert "(host)" in message and "micro-batch 0" in message, message
    assert "parameter " in message, message


ONE_RANK_LANGUAGE = colocated(1)


def test_plan_dry_run_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from mimotron.cli.main import main

    code = main(["plan", "--dry-run", str(DIGITS), *BASE, *ONE_RANK_LANGUAGE,
                 "log.dir=/tmp/mimotron-dry-run-cli"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dry run of rank 0 of 1 on fake meta" in out and "no device mix" in out
    assert f"1 x {host_sync.TOKEN_COUNT}" in out


def test_step_prefetcher_and_cpu_placement_change_nothing() -> None:
    """The background step builder yields the wrapped iterator's steps (with the packed
    counts of the step it returns); on the CPU the device copy is the identity."""
    import torch

    from mimotron.training.data_provider import StepPrefetcher, microbatches_to_device

    class Steps:
        def __init__(self) -> None:
            self.k = 0
            self.step_samples = 0

        def __iter__(self) -> Steps:
            return self

        def __next__(self) -> list:
            self.k += 1
            self.step_samples = 10 * self.k
            return [{"language": {"tokens": torch.full((2, 3), self.k)}}]

    prefetcher = StepPrefetcher(Steps(), torch.device("cpu"))
    try:
        for k in (1, 2, 3):
            mbs = next(prefetcher)
            assert int(mbs[0]["language"]["tokens"][0, 0]) == k
            assert prefetcher.step_samples == 10 * k
    finally:
        prefetcher.close()
    assert microbatches_to_device(mbs, torch.device("cpu")) is mbs


def test_sync_free_gather_matches_boolean_indexing() -> None:
    """The encoder's gather from a host count (an accelerator's path) takes the rows
    boolean indexing takes, in its order: plain and packed ``[B, K]`` masks, none and
    all present."""
    import torch

    from mimotron.models.mimo import present_order

    gen = torch.Generator().manual_seed(0)
    for shape in ((8,), (6, 3), (5,), (4, 2)):
        inputs = torch.randn(*shape, 2, 3, generator=gen)
        for mask in (torch.rand(shape, generator=gen) < 0.5, torch.zeros(shape, dtype=torch.bool),
                     torch.ones(shape, dtype=torch.bool)):
            order = present_order(mask, int(mask.sum()))
            assert torch.equal(order, mask.flatten().nonzero().flatten())
            rows = inputs.flatten(0, mask.dim() - 1).index_select(0, order)
            assert torch.equal(rows, inputs[mask])
