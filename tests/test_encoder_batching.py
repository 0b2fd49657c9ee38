"""Colocated encoder batching (``train.encoder_batching``) trains like the plain loop.

Each parity case trains 12 fp32 iterations (lr 3e-3, clipping at 0.5) through the real
engine with batching on, on forked gloo ranks, and compares with
:func:`tests.reference.reference_run` (one process, whole global batch, no engine code):
losses, global and per-module grad norms at 1e-4 relative, final weights at 1e-4
relative L2, replicas bitwise equal. The layouts are the colocated classes the
validator accepts: one rank; DP 2 with micro-batches of 4 (encoder slices with no sample
of their modality, evidence checked) under ``train.overlap_grad_reduce`` with tiny
buckets (the encoders' buckets launch from the single encoder backward); TP 2 for every
module; language CP 2 x DP 2 fed by vision DP 4 and audio TP 2 x DP 2 (the CP bridge);
DP 2 with a frozen vision encoder (no encoder backward).

On vs off: one launch trains with batching on, then off, on the same ranks; losses and
grad norms agree to 1e-5 relative in fp32 (not bitwise: the encoder matmuls change
shape; 1e-2 in bf16), the evaluation loss likewise, and the encoder ran once per step
with batching (vs once per micro-batch). Cases: DP 2 with 4 micro-batches, packed rows
(items per row differ between micro-batches and are padded to concatenate), bf16, and
an MoE language model (aux loss in the language model only: same losses on and off).
Non-colocated layouts and fp16 refuse the key; ``mimotron plan``'s activation estimate
of an encoder grows by the number of micro-batches, and it says so.
"""

from __future__ import annotations

import pytest
import torch

from mimotron.config import load_config
from mimotron.estimate.memory import activation_bytes
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.layout import check_layout
from mimotron.pipeline.encoder_batching import BatchedEncoders, concat_encoder_inputs
from mimotron.runtime import init_runtime
from mimotron.training.evaluate import evaluate
from mimotron.training.language_step import LanguageStep
from mimotron.training.loop import setup_mimo
from mimotron.training.step import default_forward_step
from tests.common import BASE, DIGITS, coloc, colocated, engine_run, noncolocated, train_step
from tests.parity import engine_results, run_against_plain_loop

ON = ["train.encoder_batching=true"]
SMALL_MB = ["train.micro_batch_size=4"]  # 4 micro-batches; DP slices of 1-2 samples
ITERS = 12
OVERLAP = ["train.overlap_grad_reduce=true", "train.grad_bucket_mb=0.01"]
TP2 = {"tensor": 2, "data": 1}

# name: (layout, overrides shared with the reference)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "coloc-dp1": (colocated(1), []),
    "coloc-dp2-mb4-overlap": (colocated(2) + OVERLAP, SMALL_MB),
    "coloc-tp2-mb4": (coloc(TP2, TP2, TP2), SMALL_MB),
    "coloc-vision-dp4-audio-tp2dp2-language-cp2dp2": (
        coloc({"data": 4}, {"tensor": 2, "data": 2}, {"context": 2, "data": 2}), []),
    "coloc-dp2-frozen-vision": (colocated(2), ["modules.vision.freeze=true"]),
}


def counted_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """:func:`engine_run`, counting the reducer's early launches and empty encoder pieces."""
    launches: list[tuple[int, int]] = []
    empty_pieces = [0]
    finish, rows = GradSync.finish, BatchedEncoders.rows

    def counting_finish(self: GradSync) -> None:
        launches.append((self.num_launched_early, len(self.buckets)))
        finish(self)

    def counting_rows(self: BatchedEncoders, name: str, k: int) -> torch.Tensor:
        piece = rows(self, name, k)
        empty_pieces[0] += int(piece.shape[0] == 0)
        return piece

    GradSync.finish = counting_finish  # this forked rank only
    BatchedEncoders.rows = counting_rows
    return {**engine_run(rank, world, overrides, num_iters), "launches": launches,
            "empty_pieces": empty_pieces[0]}


@pytest.mark.parametrize("name", list(CASES))
def test_encoder_batching_matches_plain_loop(name: str) -> None:
    layout, extra = CASES[name]
    # 12 iterations: the empty-piece path first runs in iteration 11 of the mb4 cases.
    results = run_against_plain_loop(layout + ON, extra, run=counted_run, num_iters=ITERS)
    if "mb4" in name:  # the empty-slice path ran: a micro-batch's piece with no row
        assert sum(r["empty_pieces"] for r in results) > 0
    if OVERLAP[0] in layout + extra:
        for rank, res in enumerate(results):
            assert len(res["launches"]) == ITERS, rank
            # Every bucket (language and encoders) launched from a gradient hook: the
            # encoders' gradients landed after arming, in the one encoder backward.
            assert all(early == n > 3 for early, n in res["launches"]), (rank, res["launches"])


def on_off_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """Train ``num_iters`` iterations and evaluate once, batching on then off."""
    out = {}
    for key, extra in (("on", ON), ("off", [])):
        cfg = load_config(DIGITS, BASE + overrides + extra)
        run = setup_mimo(cfg, init_runtime())
        calls = [0]
        encode = run.model.encode

        def counting_encode(name: str, batch: dict, encode=encode, calls=calls
                            ) -> torch.Tensor:
            calls[0] += 1
            return encode(name, batch)

        run.model.encode = counting_encode
        steps = []
        for _ in range(num_iters):
            loss, skipped, grad_norm, _ = train_step(run)
            steps.append((loss["loss"], grad_norm, skipped))
        train_calls = calls[0]
        metrics = evaluate(LanguageStep.of(default_forward_step), run.valid_data_iterator(),
                           run.model, run.communicator, run.infra, cfg.train.precision,
                           run.global_state.runtime.device,
                           encoder_batching=cfg.train.encoder_batching)
        out[key] = {"steps": steps, "eval": metrics, "train_calls": train_calls,
                    "num_mb": cfg.num_microbatches, "encoders": len(cfg.encoder_names)}
    return out


ON_OFF_ITERS = 4
ON_OFF_CASES = {
    "coloc-dp2-mb4": colocated(2) + SMALL_MB,
    # packed rows: items per row (K) differ between micro-batches, padded to concatenate
    "coloc-dp2-packing-mb4": colocated(2) + SMALL_MB + ["data.packing=true"],
    "coloc-dp1-bf16": colocated(1) + ["train.precision='bf16'"],
    "coloc-dp1-moe": colocated(1) + ["modules.language.num_experts=4",
                                     "modules.language.top_k=2"],
}


@pytest.mark.parametrize("name", list(ON_OFF_CASES))
def test_encoder_batching_on_off_agree(name: str) -> None:
    overrides = [f"train.iters={ON_OFF_ITERS}", "eval.iters=1", *ON_OFF_CASES[name]]
    results = engine_results(overrides, ON_OFF_ITERS, on_off_run)
    tol = 1e-2 if "bf16" in name else 1e-5  # bf16: 8 significant bits, kernels reshaped
    for rank, res in enumerate(results):
        on, off = res["on"], res["off"]
        for it, (a, b) in enumerate(zip(on["steps"], off["steps"], strict=True)):
            assert a[2] is b[2] is False
            assert a[0] == pytest.approx(b[0], rel=tol), (rank, it)
            assert a[1] == pytest.approx(b[1], rel=tol), (rank, it)
        assert on["eval"]["eval_loss"] == pytest.approx(off["eval"]["eval_loss"], rel=tol)
        assert on["eval"]["eval_samples"] == off["eval"]["eval_samples"]
        per_step = on["encoders"]
        assert on["train_calls"] == per_step * ON_OFF_ITERS, rank
        assert off["train_calls"] == per_step * ON_OFF_ITERS * on["num_mb"], rank


def test_noncolocated_layout_refuses_encoder_batching() -> None:
    cfg = load_config(DIGITS, BASE + noncolocated({}, {}, {"data": 2}) + ON)
    with pytest.raises(ValueError, match="train.encoder_batching=true is invalid: it needs "
                                         "a colocated layout"):
        check_layout(cfg)
    with pytest.raises(ValueError, match="train.encoder_batching=true is invalid with "
                                         "train.precision='fp16'"):
        check_layout(load_config(DIGITS, BASE + colocated(2) + ON + ["train.precision='fp16'"]))
    check_layout(load_config(DIGITS, BASE + colocated(2) + ON))  # accepted


def test_plan_counts_every_microbatch_of_encoder_activations() -> None:
    off = load_config(DIGITS, BASE + colocated(2) + SMALL_MB)
    on = load_config(DIGITS, BASE + colocated(2) + SMALL_MB + ON)
    assert on.num_microbatches == 4
    for name in on.encoder_names:
        assert activation_bytes(on, name) == 4 * activation_bytes(off, name) > 0
    assert activation_bytes(on, "language") == activation_bytes(off, "language")


def test_plan_prints_the_batched_encoder_activations(capsys: pytest.CaptureFixture) -> None:
    from mimotron.cli.plan import run_plan

    assert run_plan(str(DIGITS), BASE + colocated(2) + SMALL_MB + ON) == 0
    out = capsys.readouterr().out
    assert "encoder batching: each encoder runs the step's 4 micro-batches in one " in out


def test_concat_encoder_inputs_pads_packed_items() -> None:
    """Packed ``[B, K]`` masks with different K: absent items appended, order kept."""
    a = {"image": torch.arange(2.0).reshape(1, 2, 1), "has_image": torch.tensor([[True, True]])}
    b = {"image": torch.tensor([[[5.0]]]), "has_image": torch.tensor([[True]])}
    cat = concat_encoder_inputs([a, b], "image")
    assert cat["has_image"].tolist() == [[True, True], [True, False]]
    assert cat["image"][cat["has_image"]].flatten().tolist() == [0.0, 1.0, 5.0]


def test_concat_encoder_inputs_keeps_microbatch_order() -> None:
    a = {"image": torch.zeros(2, 3), "has_image": torch.tensor([True, False]),
         "tokens": torch.zeros(2, 5)}
    b = {"image": torch.ones(2, 3), "has_image": torch.tensor([True, True]),
         "tokens": torch.zeros(2, 5)}
    cat = concat_encoder_inputs([a, b], "image")
    assert sorted(cat) == ["has_image", "image"]
    assert cat["image"][:, 0].tolist() == [0, 0, 1, 1]
    assert cat["has_image"].tolist() == [True, False, True, True]
