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

import json
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mimotron.models.blocks as blocks_module
from mimotron.config import load_config
from mimotron.models.attention import Documents, plan_attention
from mimotron.models.blocks import Attention, apply_rope, rope_cache
from mimotron.models.language import LanguageModel, language_loss
from mimotron.models.mimo import MimoModel
from mimotron.parallel.context_parallel import load_balanced_positions
from mimotron.parallel.layout import plan_layout
from mimotron.runtime import init_runtime
from mimotron.testing import run_ranks
from mimotron.training.language_step import context_parallel_counts, language_loss_step
from mimotron.training.loop import run_training
from mimotron.training.step import default_forward_step, train_step_mimo
from tests import common as common_module
from tests.common import BASE, DIGITS, coloc, engine_run, noncolocated
from tests.reference import ReferenceRun, reference_run
from tests.test_packing import _packed_reference
from tests.test_parity import (
    assert_module_norms_match,
    assert_steps_match,
    assert_weights_match,
    checked_modules,
)

NUM_ITERS = 10
PARITY = ["train.iters=10"]
SEQ = 64  # data.seq_length of configs/digits.toml
HIDDEN = 64  # modules.language.hidden_size in tests.common.SMALL_MODEL
SP = ["modules.language.parallel.sequence_parallel=true"]

CASES = {
    # Fan-in: vision DP 2 feeds a language DP 1 x CP 2 (5 ranks).
    "vision-dp2|language-cp2": noncolocated({"data": 2}, {}, {"context": 2}),
    # Fan-out: vision and audio DP 1 feed a language DP 2 x CP 2 (6 ranks, dp x cp = 4).
    "language-dp2cp2": noncolocated({}, {}, {"data": 2, "context": 2}),
    "language-cp2tp2-sp": noncolocated({}, {}, {"context": 2, "tensor": 2}) + SP,
    "language-cp2pp2-zero": noncolocated({}, {}, {"context": 2, "pipeline": 2})
    + ["modules.language.parallel.shard_optimizer=true"],
    # CP 4: chunks of 8 positions; each rank's two chunks read 16 to 64 keys.
    "language-cp4": noncolocated({}, {}, {"context": 4}),
}


def cp_engine_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """:func:`engine_run`, also recording attention's local keys, encoder rows and sends."""
    local_keys: list[int] = []
    encoded_rows: list[int] = []
    sends: list[tuple[int, tuple[int, ...]]] = []
    gather, exchange = blocks_module.gather_kv, common_module.exchange
    encode = MimoModel.encode

    def recording_encode(self, name, batch):  # noqa: ANN001, ANN202
        out = encode(self, name, batch)
        encoded_rows.append(out.shape[0] * out.shape[1])
        return out

    def recording_gather(k, v, group, dim):  # noqa: ANN001, ANN202
        local_keys.append(k.shape[dim])
        return gather(k, v, group, dim)

    def recording_exchange(out: list, *args: object) -> list:
        sends.extend((peer, tuple(t.shape)) for peer, t in out)
        return exchange(out, *args)

    # This forked rank only. engine_run installs its own counting wrapper around
    # tests.common.exchange, so ours goes below it.
    rejections: list[str] = []
    train_step = common_module.train_step

    def custom_step_first(run):  # noqa: ANN001, ANN202
        if not rejections:  # A custom forward step is refused before any collective.
            try:
                train_step_mimo(_custom_forward_step, run.train_data_iterator, run.model,
                                run.optimizer, run.schedulers, run.global_state,
                                run.communicator, infra=run.infra)
                rejections.append("accepted")
            except ValueError as exc:
                rejections.append(str(exc))
        return train_step(run)

    blocks_module.gather_kv = recording_gather
    common_module.exchange = recording_exchange
    common_module.train_step = custom_step_first
    MimoModel.encode = recording_encode
    result = engine_run(rank, world, overrides, num_iters)
    return {**result, "local_keys": local_keys, "sends": sends, "encoded_rows": encoded_rows,
            "rejections": rejections}


def _custom_forward_step(model, batch, embeddings):  # noqa: ANN001, ANN202
    """The built-in step plus an auxiliary metric: its sum would be CP rank 0's only."""
    loss_sum, num_tokens, metrics = default_forward_step(model, batch, embeddings)
    return loss_sum, num_tokens, {**metrics, "lm_loss": torch.stack([loss_sum.detach(),
                                                                      num_tokens])}


@cache
def _reference() -> ReferenceRun:
    """The plain loop, shared by every unpacked case (CP does not change the model or data)."""
    return reference_run(tuple(PARITY), NUM_ITERS)


def _check_bridge_rows(results: list[dict], overrides: list[str]) -> None:
    """Each encoder leader sent every output row exactly once, split over the CP ranks.

    The pieces are ``[n, H]`` rows (not ``[N, T, H]`` blocks), several CP ranks receive rows,
    and the rows sent add up to the rows encoded (the language side's merge checks that
    each CP rank got exactly the rows of its own placeholders).
    """
    layout = plan_layout(load_config(DIGITS, BASE + overrides))
    language = layout.modules["language"]
    first_stage = {language.rank_at(tp=0, cp=r, dp=d, pp=0)
                   for r in range(language.parallel.context)
                   for d in range(language.parallel.data)}
    received = dict.fromkeys(first_stage, 0)
    for rank, res in enumerate(results):
        if layout.roles(rank)[0].module == "language":
            continue
        sent = 0
        for peer, shape in res["sends"]:
            if peer in first_stage:
                assert len(shape) == 2 and shape[-1] == HIDDEN, shape
                received[peer] += shape[0]
                sent += shape[0]
        assert sent == sum(res["encoded_rows"]) > 0, f"rank {rank}"
    # Rows go to several CP ranks (at CP 4 a rank whose chunks hold no placeholder
    # receives none: the demo's media placeholders come first in a sample).
    assert sum(n > 0 for n in received.values()) >= 2, received


def _check_run(results: list[dict], ref: ReferenceRun, overrides: list[str]) -> None:
    assert_steps_match(results, ref)
    assert_module_norms_match(results, ref, checked_modules(overrides))
    assert_weights_match(results, ref)
    context = load_config(DIGITS, BASE + overrides).modules["language"].parallel.context
    for res in results:  # every rank refused the custom forward step, naming the field
        assert res["rejections"] == [res["rejections"][0]], res["rejections"]
        assert "forward_step_func" in res["rejections"][0], res["rejections"][0]
        assert f"modules.language.parallel.context={context}" in res["rejections"][0]
    keys = {k for res in results for k in res["local_keys"]}
    assert keys == {SEQ // context}, keys  # every attention held S / c positions
    _check_bridge_rows(results, overrides)


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matches_plain_loop(name):
    overrides = PARITY + CASES[name]
    world = plan_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = run_ranks(world, cp_engine_run, overrides, NUM_ITERS, timeout_s=300)
    _check_run(results, _reference(), overrides)


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
    world = plan_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = run_ranks(world, cp_engine_run, overrides, NUM_ITERS, timeout_s=300)
    _check_run(results, _packed_reference(), overrides)


def _dense_core(doc_ids: torch.Tensor | None):
    """An attention core over whole rows with the mask written out here: causal, and
    within one document for packed rows (RoPE by the model's own function)."""
    def core(q, k, v, rope=None, plan=None):
        cos, sin = (t[:, None, :] for t in rope)  # [S, 1, d/2] for [B, S, h, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        seq = q.shape[1]
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        group = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = allowed if allowed.dim() == 2 else allowed[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    return core


def _attention_rows(rank: int, world: int, packed: bool) -> dict:
    """CP attention on this rank's positions (the engine's plan and kernel) vs attention
    over the whole rows with a dense mask written in the test (same weights and input)."""
    torch.manual_seed(0)
    seq, hidden = 16, 32
    attn = Attention(hidden, num_heads=4, causal=True, num_kv_heads=2)
    x = torch.randn(2, seq, hidden)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    cos, sin = rope_cache(seq, attn.head_dim)
    full_x = x.clone().requires_grad_(True)
    with mock.patch.object(attn, "core", _dense_core(doc_ids if packed else None)):
        full = attn(full_x, (cos, sin))
    full.square().sum().backward()
    pos = load_balanced_positions(seq, world, rank)
    attn.context_parallel_group = dist.group.WORLD
    local_x = x[:, pos].clone().requires_grad_(True)
    docs = Documents.from_doc_ids(doc_ids) if packed else Documents.whole(2, seq)
    local = attn(local_x, (cos[pos], sin[pos]), plan_attention(docs, x.device, world, rank))
    local.square().sum().backward()
    return {"out_err": float((local - full[:, pos]).abs().max()),
            "grad_err": float((local_x.grad - full_x.grad[:, pos]).abs().max()),
            "scale": float(full.abs().max())}


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_cp_attention_equals_rows_of_full_attention(packed, world):
    """Outputs and input gradients (through the K/V gather's backward) match, per rank.

    CP 4 cuts the 16 positions into chunks of 2, so documents span several chunks.
    """
    for res in run_ranks(world, _attention_rows, packed, timeout_s=120):
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
        plan_layout(load_config(DIGITS, BASE + overrides))


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
    from mimotron.parallel.memory import activation_bytes

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
    from mimotron.parallel.memory import estimate_memory

    def language_optimizer(language: dict) -> int:
        cfg = load_config(DIGITS, BASE + noncolocated({}, {}, language) + [
            "modules.language.parallel.shard_optimizer=true"])
        estimates = estimate_memory(cfg, plan_layout(cfg), 64)
        return max(e.optimizer for per_rank in estimates.values() for e in per_rank
                   if e.module == "language")

    assert language_optimizer({"context": 2}) * 2 == language_optimizer({})
    assert language_optimizer({"context": 2, "data": 2}) * 4 == language_optimizer({})


def test_checkpoint_layout_description_names_the_cp_degree():
    """A resume message tells a CP 2 layout from a DP 1 one on the same ranks."""
    from dataclasses import asdict

    from mimotron.checkpoint.state import describe_layout

    def described(language: dict) -> str:
        layout = plan_layout(load_config(DIGITS, BASE + noncolocated({}, {}, language)))
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


def _train(rank: int, world: int, overrides: list[str]) -> None:
    run_training(load_config(DIGITS, overrides), init_runtime())


def _records(log_dir: Path, key: str = "loss") -> dict[int, dict]:
    lines = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in lines if key in r}


def test_checkpoints_resume_across_context_parallel_degrees(tmp_path):
    """CP 1 -> CP 2 (language ZeRO over dp x cp) -> CP 1, following the one-process run.

    The CP 2 run also evaluates (iteration 4): eval loss and accuracy as one process's.
    """
    common = [*BASE, "train.iters=6", "log.interval=1", "log.progress=false",
              "checkpoint.load=auto", "eval.iters=1", "eval.interval=4"]
    one_rank = coloc({"data": 1}, {"data": 1}, {"data": 1})
    cp2 = noncolocated({}, {}, {"context": 2}) + [
        "modules.language.parallel.shard_optimizer=true"]
    run_ranks(1, _train, common + one_rank + [
        f"log.dir={tmp_path}/ref", f"checkpoint.dir={tmp_path}/ref/ckpt",
        "checkpoint.interval=2", "train.exit_interval=6"], timeout_s=120)
    run_ranks(4, _train, common + cp2 + [
        f"log.dir={tmp_path}/cp2", f"checkpoint.dir={tmp_path}/cp2/ckpt",
        f"checkpoint.load={tmp_path}/ref/ckpt/iter_0000002", "checkpoint.interval=2",
        "train.exit_interval=4"], timeout_s=240)
    run_ranks(1, _train, common + one_rank + [
        f"log.dir={tmp_path}/cp1", f"checkpoint.dir={tmp_path}/cp1/ckpt",
        f"checkpoint.load={tmp_path}/cp2/ckpt", "train.exit_interval=6"], timeout_s=120)
    ref, cp2_run, cp1_run = (_records(tmp_path / d) for d in ("ref", "cp2", "cp1"))
    assert sorted(cp2_run) == [3, 4] and sorted(cp1_run) == [5, 6]
    for it, rec in {**cp2_run, **cp1_run}.items():
        assert rec["consumed_samples"] == ref[it]["consumed_samples"]
        assert rec["loss"] == pytest.approx(ref[it]["loss"], rel=1e-4), it
        assert rec["grad_norm"] == pytest.approx(ref[it]["grad_norm"], rel=1e-4), it
    got, want = _records(tmp_path / "cp2", "eval_loss")[4], _records(tmp_path / "ref",
                                                                      "eval_loss")[4]
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

    layout = plan_layout(load_config(DIGITS, BASE + noncolocated({}, {}, {"context": 2})))
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
        comm._forward_sends(0, torch.zeros(2, rows, HIDDEN), mask, (tokens, pid))
    assert "\n" not in str(err.value)
