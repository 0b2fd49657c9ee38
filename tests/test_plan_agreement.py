"""``mimotron plan`` accepts exactly the configs ``mimotron train`` starts.

Each layout of :data:`CASES` goes through both commands in this process:

* ``plan``: the real command (``main(["plan", ...])``), accepted when it exits 0;
* ``train``: the real command up to the launch (config, layout, local ranks, data, run
  lock and run directory), then, in place of the ranks, every rank's own set-up
  (``setup_mimo``: grids, model, tensor-parallel plan, optimizer, schedulers, data) on
  the ``fake`` backend and a fake accelerator (:func:`mimotron.dryrun.dry_run`), and one
  training step of some ranks. Accepted when nothing refused it.

A check that only one side applies makes the verdicts differ; a refused layout must be
refused by both with the same line. The layouts hold a valid and an invalid case for each
rule the rank set-up used to apply after launch (:mod:`mimotron.config.setup_rules`), an invalid
one for each parallelism's own rule the set-up relies on (context, expert, virtual
pipeline, FSDP, tensor, placement, data-parallel feeding, batch, encoder batching) and
some of the validator's own (:mod:`mimotron.config.validation`); ``expected`` pins each verdict,
so a rule that disappears from both sides fails too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mimotron.cli import train as train_cli
from mimotron.cli.main import DEBUG_ENV, main
from mimotron.dryrun import dry_run
from tests.common import BASE, DIGITS, coloc, colocated, noncolocated, par

MOE = ["modules.language.num_experts=4", "modules.language.top_k=2"]
ALL_FROZEN = [f"modules.{m}.freeze=true" for m in ("vision", "audio", "language")]
# name: (overrides, expected verdict, ranks that run one training step if accepted)
CASES: dict[str, tuple[list[str], bool, list[int]]] = {
    # Accepted: ZeRO-1 with TP 2 and sequence parallelism, every module TP 2 x DP 2.
    "zero1-tp2-sp": (coloc(*[{"tensor": 2, "data": 2}] * 3)
                     + par("language", shard_optimizer="true", sequence_parallel="true"),
                     True, []),
    # Accepted: MoE with EP 2 under fp16 (a positive loss-scale floor) and a linear
    # weight-decay schedule.
    "moe-ep2-fp16-wd-linear": (colocated(2) + par("language", expert=2) + MOE + [
        "train.precision=fp16", "optimizer.min_loss_scale=0.5",
        "scheduler.start_weight_decay=0.0", "scheduler.end_weight_decay=0.1",
        "scheduler.weight_decay_style='linear'"], True, [0]),
    # Accepted: a frozen encoder, interleaved language model with CP, profiling rank 4.
    "frozen-vision-vp2-cp2": (noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2,
                                                    "context": 2})
                              + ["modules.vision.freeze=true", "modules.language.num_layers=4",
                                 "profile.enabled=true", "profile.ranks=[4]"], True, []),
    # Refused by the rank set-up before (now by the validator, the same line on both).
    "all-frozen": (colocated(1) + ALL_FROZEN, False, [0]),
    "weight-decay-moves-constant": (colocated(1) + ["scheduler.start_weight_decay=0.1"],
                                    False, [0]),
    "fp16-loss-scale-floor-0": (colocated(1) + ["train.precision=fp16",
                                                "optimizer.min_loss_scale=0.0"], False, [0]),
    "tp4-ffn-170": (noncolocated({}, {}, {"tensor": 4})
                    + ["modules.language.ffn_hidden_size=170"], False, [0, 1, 2]),
    "tp2-projector-33": (noncolocated({"tensor": 2}, {}, {})
                         + ["modules.vision.projector_hidden_size=33"], False, [0]),
    "tp3-vocab-64": (noncolocated({}, {}, {"tensor": 3})
                     + ["modules.language.hidden_size=96", "modules.language.num_heads=6",
                        "modules.language.ffn_hidden_size=255"], False, [0, 1, 2]),
    "profile-rank-outside": (colocated(1) + ["profile.enabled=true", "profile.ranks=[9]"],
                             False, [0]),
    # Refused by the validator all along.
    "sp-without-tp": (colocated(1) + par("language", sequence_parallel="true"), False, [0]),
    "vp2-odd-microbatches": (noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2})
                             + ["modules.language.num_layers=4", "train.global_batch_size=24"],
                             False, []),
    "top-k-above-experts": (colocated(1) + ["modules.language.num_experts=2",
                                            "modules.language.top_k=3"], False, []),
    "freeze-part-of-language": (colocated(1) + ["modules.language.freeze='encoder'"], False,
                                []),
    # Refused by each parallelism's own rule (context, expert, virtual pipeline, FSDP,
    # tensor, placement, batch), which the ranks' set-up relies on.
    "cp-on-an-encoder": (noncolocated({"context": 2}, {}, {}), False, []),
    "cp2-seq-98": (noncolocated({}, {}, {"context": 2}) + ["data.seq_length=98"], False, []),
    "ep3-of-4-experts": (colocated(1) + par("language", expert=3) + MOE, False, []),
    "vp2-3-layers": (noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2})
                     + ["modules.language.num_layers=3"], False, []),
    "fsdp-with-zero1": (colocated(2) + par("language", fsdp="true", shard_optimizer="true"),
                        False, []),
    "tp3-of-4-heads": (noncolocated({}, {}, {"tensor": 3}), False, []),
    "partial-overlap": (coloc({}, {}, {"pipeline": 2}), False, []),
    "dp3-feeds-dp2": (noncolocated({"data": 3}, {}, {"data": 2}), False, []),
    "micro-batch-2-dp4": (colocated(4) + ["train.micro_batch_size=2",
                                          "train.global_batch_size=8"], False, []),
    "encoder-batching-split": (noncolocated({}, {}, {}) + ["train.encoder_batching=true"],
                               False, []),
}


def _verdict(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and the error line (without the command's prefix), '' when accepted."""
    code = main(argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mimotron ")]
    line = err[-1] if code and err else ""  # the last: a warning may come before
    return code, re.sub(r"^mimotron \w+: (invalid config: )?", "", line)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_accepts_what_train_accepts(name: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, expected, step_ranks = CASES[name]
    monkeypatch.delenv(DEBUG_ENV, raising=False)  # errors as lines, as users see them

    def ranks(cfg) -> int:  # stands in for the launch: every rank's own set-up
        dry_run(cfg, steps=0, evaluate=False, checkpoint=False)
        if step_ranks:
            dry_run(cfg, step_ranks, steps=1, evaluate=False, checkpoint=False)
        return 0

    monkeypatch.setattr(train_cli, "_launch", lambda config, over, world, cfg: ranks(cfg))
    monkeypatch.setattr(train_cli, "_train_this_rank", ranks)
    args = [str(DIGITS), *BASE, *overrides]
    plan_code, plan_error = _verdict(["plan", *args, f"log.dir={tmp_path / 'plan'}"], capsys)
    train_code, train_error = _verdict(["train", *args, f"log.dir={tmp_path / 'train'}"],
                                       capsys)
    assert (plan_code == 0) == (train_code == 0), (plan_error, train_error)
    assert plan_error == train_error
    assert (plan_code == 0) is expected, plan_error
    if not expected:  # Before any rank: one line naming the problem, exit 2 on both.
        assert plan_code == train_code == 2, train_error
