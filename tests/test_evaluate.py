"""The one-pass exact-match metric (and its breakdown by input kind) equals greedy generation."""

from __future__ import annotations

import torch

from mimotron.config import load_config
from mimotron.data import build_datasets
from mimotron.data.collate import collate
from mimotron.forked_ranks import run_ranks
from mimotron.runtime import init_runtime
from mimotron.training.evaluate import greedy_generate
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import default_forward_step
from tests.common import BASE, DIGITS
from tests.common import colocated as _colocated

NUM_SAMPLES = 48


def _compare(rank: int, world: int) -> tuple[list[bool], list[bool], list[dict], list[dict]]:
    cfg = load_config(DIGITS, BASE + _colocated(1) + ["optimizer.lr=5e-3"])
    run = setup_mimo(cfg, init_runtime())
    # Train a little so that some answers are right and some are wrong.
    for _ in range(60):
        train_step_mimo(default_forward_step, run.train_data_iterator, run.model, run.optimizer,
                        run.schedulers, run.global_state, run.communicator,
                        infra=run.infra)
    model, tok = run.model.eval(), run.tokenizer
    _, valid = build_datasets(cfg, tok)
    one_pass, generated, counted, expected = [], [], [], []
    for i in range(NUM_SAMPLES):
        sample = valid.get(i)
        batch = collate([sample], cfg.data.seq_length, pad_id=tok.pad_id)
        with torch.no_grad():
            _, _, metrics = default_forward_step(model, batch, {
                m: model.encode(m, batch) for m in model.modality_submodules})
        one_pass.append(bool(metrics["correct"]))
        prompt_len = int(sample["loss_mask"].nonzero()[0])  # first scored position = '='
        ids = greedy_generate(model, batch, prompt_len + 1, 40, tok.eos_id)[0]
        generated.append(tok.decode(ids) == sample["answer"])
        has = {kind: bool(batch[f"has_{kind}"][0]) for kind in ("image", "audio")}
        has["text"] = not any(has.values())
        counted.append({k: int(v) for k, v in metrics.items() if k.endswith(tuple(has))})
        expected.append({**{f"samples_{k}": int(v) for k, v in has.items()},
                         **{f"correct_{k}": int(v and generated[-1]) for k, v in has.items()}})
    return one_pass, generated, counted, expected


def test_one_pass_exact_match_equals_greedy_generation():
    one_pass, generated, counted, expected = run_ranks(1, _compare, timeout_s=180)[0]
    assert one_pass == generated
    # The eval breakdown by input kind counts each sample under every modality it holds.
    assert counted == expected
    # Both outcomes occur, so the comparison is not vacuous.
    assert any(one_pass) and not all(one_pass)
