"""Training on LLaVA-format data: the digits task exported as JSONL + PNG + WAV, a BPE
tokenizer trained locally, the toy encoders (``vit``, ``audio``), 1 and 2 ranks.

Everything is generated into a temporary folder: :func:`write_llava_task` writes the
data, :func:`train_bpe_tokenizer` the Hugging Face tokenizer folder.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest

from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.forked_ranks import run_groups
from tests.common import BASE, DIGITS, ONE_RANK, coloc, colocated, noncolocated, train_steps

NUM_ITERS = 4


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The exported task (48 samples) and its tokenizer; overrides that select them."""
    base = tmp_path_factory.mktemp("llava_train")
    path = write_llava_task(base / "data", num_samples=48, seed=3)
    tokenizer = train_bpe_tokenizer(conversation_texts(path), base / "tok", vocab_size=300)
    overrides = [
        "data.dataset='llava'", f"data.path='{path}'", f"data.tokenizer='{tokenizer}'",
        "data.seq_length=96", "modules.vision.in_channels=3", "optimizer.lr=3e-3",
    ]  # fmt: skip
    return {"path": path, "base": base, "overrides": overrides}


def test_llava_training_is_finite_decreasing_and_layout_independent(llava):
    """Loss falls on 1 rank; DP 2 and encoders DP 2 + language TP 2 train on the same batches."""
    over = llava["overrides"]
    # The three runs are independent: side by side. Hetero: encoders DP 2, the language
    # model TP 2 on the same two ranks.
    hetero = coloc({"data": 2}, {"data": 2}, {"data": 1, "tensor": 2})
    (one,), dp2, hetero = run_groups(
        [(world, train_steps, ([*over, *layout], NUM_ITERS), {})
         for world, layout in ((1, ONE_RANK), (2, colocated(2)), (2, hetero))],
        timeout_s=240)
    losses = [s[0] for s in one]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    for result in (dp2[0], hetero[0]):
        # Same samples in the same global batches: same token counts and losses.
        assert [s[3] for s in result] == [s[3] for s in one]
        assert [s[0] for s in result] == pytest.approx(losses, rel=1e-5, abs=1e-5)


def _start_cli(args: list[str], cwd: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-m", "mimotron", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_cli(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)  # A hang guard only.
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cli(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    return _finish_cli(_start_cli(args, cwd))


def _with_bad_sample(llava, name: str) -> str:
    """A copy of the data file whose line 3 names an image that does not exist."""
    lines = llava["path"].read_text().splitlines()
    bad = json.loads(lines[2]) | {"id": "broken-3", "image": "images/missing.png"}
    bad["conversations"][0]["value"] = "<image>" + bad["conversations"][0]["value"].replace(
        "<image>", "")
    lines[2] = json.dumps(bad)
    out = llava["path"].parent / name
    out.write_text("\n".join(lines) + "\n")
    return str(out)


def test_bad_sample_is_one_line_naming_id_and_line_before_launch(llava, tmp_path):
    """Without skipping, plan and a 2-rank train stop with exit 2 before any rank starts."""
    path = _with_bad_sample(llava, "bad.jsonl")
    over = [*BASE, *llava["overrides"], f"data.path='{path}'", *colocated(2),
            f"log.dir='{tmp_path / 'run'}'"]  # fmt: skip
    # Both commands at once: each is a fresh interpreter that stops in its checks.
    started = [_start_cli([command, str(DIGITS), *over], str(tmp_path))
               for command in ("plan", "train")]
    for proc in map(_finish_cli, started):
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "line 3" in lines[0] and "broken-3" in lines[0] and "not found" in lines[0]
    assert not (tmp_path / "run").exists()  # No rank ran.


def test_skipped_bad_sample_is_counted_in_metrics_and_banner(llava, tmp_path):
    """With data.skip_bad_samples the run trains and every record says 1 sample skipped."""
    path = _with_bad_sample(llava, "bad_skip.jsonl")
    run_dir = tmp_path / "run"
    over = [*BASE, *llava["overrides"], f"data.path='{path}'", *ONE_RANK,
            "data.skip_bad_samples=true", "data.num_workers=2", "train.iters=2",
            "log.interval=1", f"log.dir='{run_dir}'"]  # fmt: skip
    proc = _cli(["train", str(DIGITS), *over], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r and "eval_loss" not in r]
    assert len(train) == 2 and all(r["skipped_samples"] == 1 for r in train)
    assert "1 bad sample(s)" in proc.stdout + proc.stderr


def _first_batches(rank: int, world: int, overrides: list[str], num_steps: int) -> list:
    from mimotron.config import load_config
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo

    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    try:
        return [next(run.train_data_iterator) for _ in range(num_steps)]
    finally:
        if run.data_reader is not None:
            run.data_reader.close()


def test_background_workers_give_the_same_batches(llava):
    """data.num_workers=3 loads ahead on threads; the batches equal the synchronous ones."""
    import torch

    base = [*llava["overrides"], *ONE_RANK]
    (sync,), (ahead,) = run_groups(  # Independent one-rank runs: side by side.
        [(1, _first_batches, (overrides, 3), {})
         for overrides in (base, [*base, "data.num_workers=3"])], timeout_s=240)
    for a, b in zip(sync, ahead, strict=True):
        for mb_a, mb_b in zip(a, b, strict=True):
            for module in mb_a:
                for key, value in mb_a[module].items():
                    assert torch.equal(value, mb_b[module][key]), (module, key)


def test_encoder_ranks_of_a_context_parallel_bridge_load_the_tokens(llava):
    """Into a CP language model the encoders' last stages route rows by placeholder
    position, so with ``restrict_to_rank`` they load the tokens (not the other media)."""
    from mimotron.config import load_config
    from mimotron.data.run_data import build_llava_tasks, build_tokenizer, restrict_to_rank
    from mimotron.parallel.layout import check_layout
    from tests.common import noncolocated

    cfg = load_config(DIGITS, [*BASE, *llava["overrides"], *noncolocated({}, {}, {"context": 2})])
    layout = check_layout(cfg)
    task, _ = build_llava_tasks(cfg, build_tokenizer(cfg))
    for rank, want in enumerate([{"text", "image"}, {"text", "audio"}, {"text"}, {"text"}]):
        restrict_to_rank(task, cfg, layout, rank)
        assert task.dataset.load_parts == want, rank
        assert task.dataset.load(0)["tokens"].numel() > 0, rank


COLOCATED_TP2 = coloc({"data": 4}, {"data": 4}, {"data": 2, "tensor": 2})
DECODE_CASES = {  # layout and balancing -> world size, loader threads
    "colocated vision DP 4, language DP 2 x PP 2": (
        coloc({"data": 4}, {"data": 4}, {"data": 2, "pipeline": 2}), 4, 0),
    "colocated TP 2, items dealt by cost": (
        [*COLOCATED_TP2, "data.balance_encoders=true"], 4, 2),
    "colocated TP 2, tokens balanced": ([*COLOCATED_TP2, "data.balance_tokens=true"], 4, 0),
    "split, items dealt by cost and tokens balanced": (
        [*noncolocated({"data": 2}, {}, {"data": 1}), "data.balance_encoders=true",
         "data.balance_tokens=true"], 4, 0),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_a_rank_decodes_only_the_images_it_encodes(llava, monkeypatch, case):
    """Each rank decodes exactly the images of its vision batch (one image per sample
    here): by position where its modules slice a micro-batch differently, and after the
    step's samples are read where the items are dealt by cost or the samples permuted by
    length (a second read, on the loader threads where there are any). Its batches are
    bit for bit those of a rank decoding everything it reads, which decodes more."""
    import torch

    import mimotron.data.llava_check as llava_check
    from mimotron.config import load_config
    from mimotron.data.prefetch import PrefetchingReader
    from mimotron.data.run_data import build_llava_tasks, build_tokenizer, restrict_to_rank
    from mimotron.parallel.layout import check_layout
    from mimotron.training.loop import train_steps

    layout_over, world, num_workers = DECODE_CASES[case]
    cfg = load_config(DIGITS, [*BASE, *llava["overrides"], *layout_over])
    layout = check_layout(cfg)
    decoded: list[object] = []
    opened = llava_check.open_image
    monkeypatch.setattr(llava_check, "open_image",
                        lambda *a, **k: decoded.append(a[0]) or opened(*a, **k))
    vision_ranks = [r for r in range(world) if "vision" in {x.module for x in layout.roles(r)}]
    for rank in vision_ranks:
        task, _ = build_llava_tasks(cfg, build_tokenizer(cfg))
        restrict_to_rank(task, cfg, layout, rank)
        assert task.parts_at is not None
        decoded.clear()
        stream = task.stream(cfg.train.seed)
        with PrefetchingReader(stream, num_workers, depth=1) as reader:
            (step,) = itertools.islice(train_steps(cfg, layout, rank, task, stream, 0,
                                                   reader if num_workers else None), 1)
        images = sum(int(mb["vision"]["has_image"].sum()) for mb in step)
        assert len(decoded) == images > 0, (rank, len(decoded), images)
        task.parts_at = None  # every image of the samples read decoded
        decoded.clear()
        (full,) = itertools.islice(train_steps(cfg, layout, rank, task,
                                               task.stream(cfg.train.seed), 0), 1)
        assert len(decoded) > images, (rank, len(decoded), images)
        for mb, want in zip(step, full, strict=True):
            for module, batch in want.items():
                assert batch.keys() == mb[module].keys(), (rank, module)
                for key, value in batch.items():
                    if module == "vision" or key not in ("image", "audio"):  # unread: zeros
                        assert torch.equal(mb[module][key], value), (rank, module, key)


def test_an_image_failing_in_the_second_read_trains_nothing_of_its_sample(llava, monkeypatch):
    """Items dealt by cost (colocated vision DP 4, language TP 2 x DP 2), every image
    failing to decode after the check, with data.skip_bad_samples: a sample whose image
    a rank decodes in its second read has its loss mask zeroed there, as a whole read
    zeroes it. (A language row whose image another rank decodes keeps its mask: the
    language side never decodes it, as on split layouts.)"""
    import torch

    import mimotron.data.llava_check as llava_check
    from mimotron.config import load_config
    from mimotron.data.run_data import build_llava_tasks, build_tokenizer, restrict_to_rank
    from mimotron.parallel.layout import check_layout
    from mimotron.training.loop import train_steps

    cfg = load_config(DIGITS, [*BASE, *llava["overrides"], *COLOCATED_TP2,
                               "data.balance_encoders=true", "data.skip_bad_samples=true"])
    layout = check_layout(cfg)

    def broken(*args, **kwargs):
        raise OSError("truncated file")

    for rank in (0, 3):
        task, _ = build_llava_tasks(cfg, build_tokenizer(cfg))  # checked: every image reads
        restrict_to_rank(task, cfg, layout, rank)
        monkeypatch.setattr(llava_check, "open_image", broken)  # then the files break
        replica = {r.module: r.dp for r in layout.roles(rank)}["vision"]
        (step,) = itertools.islice(train_steps(cfg, layout, rank, task,
                                               task.stream(cfg.train.seed), 0), 1)
        mine = others = 0
        for mb in step:
            language = mb["language"]
            owner = language["image_owner"]
            for row in range(owner.shape[0]):
                trained = bool(language["loss_mask"][row].any())
                if int(owner[row]) == replica:
                    assert not trained, (rank, row)
                    mine += 1
                elif int(owner[row]) >= 0:
                    others += trained
        assert mine > 0 and others > 0, (rank, mine, others)
        assert torch.all(mb["vision"]["image"] == 0)
        monkeypatch.undo()
