"""Context parallelism in the language model trains like the plain PyTorch loop.

Non-colocated layouts with ``modules.language.parallel.context = 2`` are compared over 10
iterations with :func:`tests.reference.reference_run` (losses, global grad norm, token
counts, per-module grad norms as stepped, final weights at 1e-4 relative, replicas
bitwise equal): CP 2 fed by vision DP 2 (fan-in: encoder DP 2, language DP 1), language
DP 2 x CP 2 (fan-out), CP 2 x TP 2 with sequence parallelism, CP 2 x PP 2 with the
language optimizer sharded over ``dp x cp``, and packed rows with CP 2. Each run also
checks that attention ran on ``S / 2`` local positions, that encoder leaders sent
each CP rank only the rows of its placeholders, and that a custom forward step was
refused. Unit tests: each CP rank's attention output (and input gradient) equals its
rows of full attention, causal and with documents, CP 2 and 4; partial loss sums and the
exact-match reduction, also through the evaluation step; rejected layouts name the
field; ``mimotron plan``, the activation and optimizer estimates, the checkpoint layout
description; checkpoints resume across CP degrees.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.models.language import LanguageModel, language_loss
from mimotron.models.mimo import MimoModel
from mimotron.parallel.context_parallel import load_balanced_positions
from mimotron.parallel.layout import check_layout
from mimotron.training.language_step import context_parallel_counts, language_loss_step
from mimotron.training.step import default_forward_step
from tests.common import BASE, DIGITS, coloc, noncolocated
from tests.context_parallel import HIDDEN, SEQ, attention_rows, check_cp_run, cp_engine_run
from tests.parity import (
    engine_results,
    packed_reference,
    records_by_iteration,
    reference,
    train,
)
from tests.reference import PACKING

NUM_ITERS = 10
PARITY = ["train.iters=10"]
SP = ["modules.language.parallel.sequence_parallel=true"]

CASES = {
    # Fan-in: vision DP 2 feeds a language DP 1 x CP 2 (5 ranks).
    "vision-dp2|language-cp2": noncolocated({"data": 2}, {}, {"context": 2}),
    # Fan-out: vision and audio DP 1 feed a language DP 2 x CP 2 (6 ranks, dp x cp = 4).
    "language-dp2cp2": noncolocated({}, {}, {"data": 2, "context": 2}),
    # CP x TP with sequence parallelism: the packed test below (and the HF decoder's).
    "language-cp2pp2-zero": noncolocated({}, {}, {"context": 2, "pipeline": 2})
    + ["modules.language.parallel.shard_optimizer=true"],
    # CP 4: chunks of 8 positions; each rank's two chunks read 16 to 64 keys.
    "language-cp4": noncolocated({}, {}, {"context": 4}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matches_plain_loop(name):
    overrides = PARITY + CASES[name]
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = engine_results(overrides, NUM_ITERS, cp_engine_run, world)
    # CP does not change the model or data: the plain loop of PARITY alone.
    check_cp_run(results, reference([], NUM_ITERS, PARITY), overrides)


PACKED_CP = {"language-cp2": {"context": 2}, "language-cp4": {"context": 4},
             "language-cp2tp2-sp": {"context": 2, "tensor": 2}}


@pytest.mark.parametrize("name", list(PACKED_CP))
def test_packed_context_parallel_matches_plain_loop(name):
    """Packed rows (causal within documents, per-document RoPE) with CP 2, CP 4 (chunks
    of 8 positions: documents span several chunks and ranks), and CP 2 x TP 2 under
    sequence parallelism (the attention plan passes SP's input plans)."""
    language = PACKED_CP[name]
    sp = ["modules.language.parallel.sequence_parallel=true"] if "sp" in name else []
    overrides = ["data.packing=true", "train.iters=12", *noncolocated({}, {}, language), *sp]
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = engine_results(overrides, NUM_ITERS, cp_engine_run, world)
    check_cp_run(results, packed_reference(PACKING, NUM_ITERS), overrides)


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_cp_attention_equals_rows_of_full_attention(packed, world):
    """Outputs and input gradients (through the K/V gather's backward) match, per rank.

    CP 4 cuts the 16 positions into chunks of 2, so documents span several chunks.
    """
    for res in run_ranks(world, attention_rows, packed, timeout_s=120):
        assert res["out_err"] <= 1e-5 * res["scale"], res
        assert res["grad_err"] <= 1e-4, res


INVALID = [
    pytest.param(noncolocated({"context": 2}, {}, {}), "modules.vision.parallel.context=2 is "
                 "invalid: encoders' inputs are short", id="encoder"),
    pytest.param(noncolocated({}, {}, {"context": 2}) + ["data.seq_length=66"],
                 r"data.seq_length=66 is invalid with modules.language.parallel.context=2",
                 id="split"),
    pytest.param(noncolocated({}, {}, {"context": 2, "tensor": 4}) + SP + ["data.seq_length=68"],
                 r"data.seq_length=68 is invalid with modules.language.parallel.context=2 and "
                 r"modules.language.parallel.sequence_parallel=true", id="sp-split"),
    pytest.param(noncolocated({}, {}, {"context": 2}) + ["modules.language.num_experts=4"],
                 "modules.language.parallel.context=2 is invalid with "
                 "modules.language.num_experts=4", id="moe"),
]


@pytest.mark.parametrize(("overrides", "needle"), INVALID)
def test_context_parallel_rejections_name_the_field(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        check_layout(load_config(DIGITS, BASE + overrides))


def test_plan_prints_context_parallel_ranks(capsys):
    from mimotron.cli.plan import run_plan

    overrides = BASE + noncolocated({}, {}, {"context": 2, "tensor": 2}) + SP
    assert run_plan(str(DIGITS), overrides) == 0
    out = capsys.readouterr().out
    # Rank map: language ranks 2-5 are tp 0/1 x cp 0/1.
    assert "   5  language    1  1  0  0" in out
    assert "each of 2 CP ranks holds seq / 2 = 32 positions" in out
    assert "norm regions hold 32 / 2 = 16 positions per rank" in out


def test_activation_estimate_divides_by_context():
    from mimotron.estimate.memory import activation_bytes

    def estimate(language: dict, *extra: str) -> int:
        cfg = load_config(DIGITS, BASE + noncolocated({}, {}, language) + list(extra))
        return activation_bytes(cfg, "language")

    plain, cp2 = estimate({}), estimate({"context": 2})
    # Half the positions, plus the keys and values attention reads beyond its own: each
    # chunk of S / 4 reads the keys up to its end, S + S / 4 in all, S / 4 + S / 2 of
    # them not its own. 2 tensors x 2 bytes (16-bit) x hidden / tp per key and layer;
    # 2 layers, 8 samples per micro-batch, fp32 (twice the 16-bit bytes). No mask.
    layers, samples, fp32 = 2, 8, 2
    read_kv = layers * 2 * 2 * HIDDEN * (SEQ // 4 + SEQ // 2) * samples * fp32
    assert cp2 == plain // 2 + read_kv
    tp2_sp, cp2_tp2_sp = estimate({"tensor": 2}, *SP), estimate({"context": 2, "tensor": 2}, *SP)
    assert cp2_tp2_sp == tp2_sp // 2 + read_kv // 2 and tp2_sp < plain


def test_optimizer_estimate_shards_over_dp_times_cp():
    """With shard_optimizer the language optimizer is sharded over dp x cp (optim/build)."""
    from mimotron.estimate.memory import estimate_memory

    def language_optimizer(language: dict) -> int:
        cfg = load_config(DIGITS, BASE + noncolocated({}, {}, language) + [
            "modules.language.parallel.shard_optimizer=true"])
        estimates = estimate_memory(cfg, check_layout(cfg), 64)
        return max(e.optimizer for per_rank in estimates.values() for e in per_rank
                   if e.module == "language")

    assert language_optimizer({"context": 2}) * 2 == language_optimizer({})
    assert language_optimizer({"context": 2, "data": 2}) * 4 == language_optimizer({})


def test_checkpoint_layout_description_names_the_cp_degree():
    """A resume message tells a CP 2 layout from a DP 1 one on the same ranks."""
    from dataclasses import asdict

    from mimotron.checkpoint.state import describe_layout

    def described(language: dict) -> str:
        layout = check_layout(load_config(DIGITS, BASE + noncolocated({}, {}, language)))
        return describe_layout({"world_size": layout.world_size, "device": "cpu", "ranks": [
            [asdict(role) for role in roles] for roles in layout.rank_map()]})

    assert "language 2-3 (tp1 cp2 pp1 dp1)" in described({"context": 2})
    assert "language 2-2 (tp1 pp1 dp1)" in described({})  # unchanged without CP


def _cp_counts(rank: int, world: int) -> dict:
    """Loss pieces, token count and exact match of one CP rank vs the whole sequence."""
    torch.manual_seed(0)
    logits = torch.randn(4, 8, 5)
    labels = logits.argmax(-1)
    labels[1, 1] = (labels[1, 1] + 1) % 5  # wrong only at a position of CP rank 0
    labels[2, 3] = (labels[2, 3] + 1) % 5  # wrong only at a position of CP rank 1
    mask = torch.ones(4, 8)
    mask[:, 0] = 0
    mask[3] = 0  # nothing scored: never correct
    whole_loss, whole_tokens, whole_correct = language_loss(logits, labels, mask)
    pos = load_balanced_positions(8, world, rank)
    loss, _, local_correct = language_loss(logits[:, pos], labels[:, pos], mask[:, pos])
    tokens, correct = context_parallel_counts(dist.group.WORLD, mask, mask[:, pos],
                                              local_correct)
    dist.all_reduce(loss)
    return {"loss": (float(loss), float(whole_loss)), "tokens": (float(tokens),
            float(whole_tokens)), "correct": (correct.tolist(), whole_correct.tolist())}


def test_cp_loss_pieces_sum_and_exact_match_is_reduced():
    """Partial loss sums add up; counts and per-sample exact match are the whole sequence's."""
    for res in run_ranks(2, _cp_counts, timeout_s=120):
        got, want = res["loss"]
        assert abs(got - want) <= 1e-5 * want
        assert res["tokens"][0] == res["tokens"][1] == 21.0
        assert res["correct"][0] == res["correct"][1] == [True, False, False, False]


def test_checkpoints_resume_across_context_parallel_degrees(tmp_path):
    """CP 1 -> CP 2 (language ZeRO over dp x cp) -> CP 1, following the one-process run.

    The CP 2 run also evaluates (iteration 4): eval loss and accuracy as one process's.
    """
    common = [*BASE, "train.iters=6", "log.interval=1", "log.progress=false",
              "checkpoint.load=auto", "eval.iters=1", "eval.interval=4"]
    one_rank = coloc({"data": 1}, {"data": 1}, {"data": 1})
    cp2 = noncolocated({}, {}, {"context": 2}) + [
        "modules.language.parallel.shard_optimizer=true"]
    run_ranks(1, train, common + one_rank + [
        f"log.dir={tmp_path}/ref", f"checkpoint.dir={tmp_path}/ref/ckpt",
        "checkpoint.interval=2", "train.exit_interval=6"], timeout_s=120)
    run_ranks(4, train, common + cp2 + [
        f"log.dir={tmp_path}/cp2", f"checkpoint.dir={tmp_path}/cp2/ckpt",
        f"checkpoint.load={tmp_path}/ref/ckpt/iter_0000002", "checkpoint.interval=2",
        "train.exit_interval=4"], timeout_s=240)
    run_ranks(1, train, common + one_rank + [
        f"log.dir={tmp_path}/cp1", f"checkpoint.dir={tmp_path}/cp1/ckpt",
        f"checkpoint.load={tmp_path}/cp2/ckpt", "train.exit_interval=6"], timeout_s=120)
    ref, cp2_run, cp1_run = (records_by_iteration(tmp_path / d) for d in ("ref", "cp2", "cp1"))
    assert sorted(cp2_run) == [3, 4] and sorted(cp1_run) == [5, 6]
    for it, rec in {**cp2_run, **cp1_run}.items():
        assert rec["consumed_samples"] == ref[it]["consumed_samples"]
        assert rec["loss"] == pytest.approx(ref[it]["loss"], rel=1e-4), it
        assert rec["grad_norm"] == pytest.approx(ref[it]["grad_norm"], rel=1e-4), it
    got = records_by_iteration(tmp_path / "cp2", "eval_loss")[4]
    want = records_by_iteration(tmp_path / "ref", "eval_loss")[4]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-4)
    assert (got["eval_accuracy"], got["eval_samples"]) == (want["eval_accuracy"],
                                                           want["eval_samples"])


def _cp_eval_step(rank: int, world: int) -> dict:
    """The default forward step in evaluation under CP 2 vs the whole sequence."""
    torch.manual_seed(0)
    vocab, seq = 11, 16  # CP chunks of 4: rank 0 holds 0-3 and 12-15, rank 1 holds 4-11
    lm = LanguageModel(vocab, hidden_size=16, num_layers=1, num_heads=2, max_seq_len=seq)
    model = MimoModel({}, lm, {}, {}).eval()
    tokens = torch.randint(1, vocab, (5, seq))
    with torch.no_grad():
        whole_logits = lm(lm.embed_tokens(tokens))
    labels = whole_logits.argmax(-1)
    labels[1, 6] = (labels[1, 6] + 1) % vocab  # sample 1 wrong at one of CP rank 1's positions
    loss_mask = torch.zeros(5, seq)
    loss_mask[:, 2:15] = 1
    loss_mask[2:4] = 0
    loss_mask[2:4, 5:10] = 1  # samples 2, 3 scored on CP rank 1 only: none on rank 0
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "index": torch.tensor([0, 1, 2, 3, -1])}  # sample 4 pads the evaluation batch
    want = language_loss_step(model, batch, whole_logits)
    lm.set_context_parallel(dist.group.WORLD)
    with torch.no_grad():
        got = default_forward_step(model, batch, {})
    loss = got[0].clone()
    dist.all_reduce(loss)
    as_floats = lambda out: {"tokens": float(out[1]),  # noqa: E731
                             **{k: float(v) for k, v in out[2].items()}}
    return {"loss": (float(loss), float(want[0])), "got": as_floats(got),
            "want": as_floats(want)}


def test_cp_evaluation_step_counts_whole_samples():
    """Exact match, per-kind counts and tokens of a CP rank's step are the whole sequence's.

    The engine runs reach eval/train accuracy 0 in a few iterations, so this checks the
    wiring of :func:`context_parallel_counts` into the step with a right sample.
    """
    for res in run_ranks(2, _cp_eval_step, timeout_s=120):
        got, want = res["loss"]
        assert abs(got - want) <= 1e-5 * want
        assert res["got"] == res["want"], res
        assert res["want"]["correct"] == res["want"]["correct_text"] == 3.0, res["want"]


def test_cp_bridge_names_a_placeholder_count_that_does_not_match_the_rows():
    """An encoder leader routing rows by placeholder refuses a miscounted slice in one line."""
    from mimotron.pipeline.communicator import MultiModulePipelineCommunicator
    from mimotron.pipeline.edges import build_edges

    layout = check_layout(load_config(DIGITS, BASE + noncolocated({}, {}, {"context": 2})))
    edges = build_edges(layout, {"vision": "image", "audio": "audio"})
    comm = MultiModulePipelineCommunicator(layout, 0, 8, edges, {}, torch.device("cpu"))
    rows, pid = 3, 7
    tokens = torch.zeros(8, SEQ, dtype=torch.long)
    tokens[0, 5:5 + rows] = pid
    tokens[1, 20:20 + rows - 1] = pid  # one placeholder short
    mask = torch.zeros(8, dtype=torch.bool)
    mask[:2] = True
    with pytest.raises(ValueError, match=r"hold 5 placeholder tokens \(id 7\) for 2 encoder "
                                         r"outputs of 3 rows each") as err:
        comm._forward_sends(0, torch.zeros(2, rows, HIDDEN), mask, (tokens, pid, None))
    assert "\n" not in str(err.value)
