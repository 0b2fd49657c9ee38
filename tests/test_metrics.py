"""metrics.jsonl: contract fields, and values that agree with each other and the engine.

One 3-rank non-colocated run (vision | audio | language) through ``train_mimo`` with
profiling on two ranks feeds most checks; the console and divergence checks are cheap.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mimotron.config import load_config
from mimotron.data import build_datasets
from mimotron.data.tokenizer import CharTokenizer
from mimotron.estimate.flops import model_flops_per_iteration
from mimotron.forked_ranks import RankError, run_ranks
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_mimo
from mimotron.training.metrics import MetricsWriter, format_summary
from mimotron.training.step import default_forward_step
from tests.common import ONE_RANK, SMALL_MODEL

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
CONTRACT = ("iteration", "loss", "grad_norm", "lr", "loss_scale", "skipped", "num_zeros",
            "consumed_samples", "tokens_per_second", "step_time_s")
TINY = [
    *SMALL_MODEL,
    "modules.vision.optimizer.lr=5e-4", "eval.interval=1000", "eval.iters=1",
]
SPLIT = [
    "modules.vision.parallel.data=1", "modules.vision.parallel.rank_offset=0",
    "modules.audio.parallel.data=1", "modules.audio.parallel.rank_offset=1",
    "modules.language.parallel.data=1", "modules.language.parallel.rank_offset=2",
]
ITERS = 4


def _train(rank: int, world: int, overrides: list[str], forward_step=default_forward_step
           ) -> dict:
    cfg = load_config(DIGITS, TINY + overrides)
    run = setup_mimo(cfg, init_runtime())
    summary = train_mimo(forward_step, run.model, run.optimizer, run.schedulers,
                         run.train_data_iterator, run.valid_data_iterator, run.global_state,
                         run.infra, run.communicator)
    lm = run.model.language_model
    summary["vocab_size"] = None if lm is None else lm.vocab_size
    return summary


def _records(log_dir: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "eval_loss" in r]


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("split")
    overrides = SPLIT + [f"train.iters={ITERS}", f"log.dir={log_dir}", "log.interval=1",
                         "profile.enabled=true", "profile.start=2", "profile.end=2",
                         "profile.ranks=[0,2]"]
    summaries = run_ranks(3, _train, overrides, timeout_s=240)
    return load_config(DIGITS, TINY + overrides), log_dir, summaries


def test_every_contract_field_and_an_eval_line(split_run):
    _, log_dir, _ = split_run
    train, evals = _records(log_dir)
    assert [r["iteration"] for r in train] == list(range(1, ITERS + 1))
    for rec in train:
        assert all(k in rec for k in CONTRACT), sorted(set(CONTRACT) - set(rec))
        assert rec["skipped"] is False and rec["skipped_iters"] == 0 and rec["nan_iters"] == 0
        assert rec["loss_scale"] == 1.0
        assert rec["loss_scale_per_module"] == {"audio": 1.0, "language": 1.0, "vision": 1.0}
        assert rec["consumed_samples"] == rec["iteration"] * 16
    assert len(evals) == 1 and evals[0]["iteration"] == ITERS
    assert {"eval_loss", "eval_accuracy"} <= set(evals[0])
    kinds = {k for k in evals[0] if k.startswith("eval_accuracy_")}
    assert kinds and kinds <= {"eval_accuracy_image", "eval_accuracy_audio", "eval_accuracy_text"}
    assert all(0.0 <= evals[0][k] <= 1.0 for k in kinds)


def test_throughput_and_lr_agree_with_step_time_and_scheduler(split_run):
    cfg, log_dir, _ = split_run
    for rec in _records(log_dir)[0]:
        tokens = cfg.train.global_batch_size * cfg.data.seq_length
        assert rec["tokens_per_second"] == pytest.approx(tokens / rec["step_time_s"], rel=1e-12)
        assert rec["samples_per_second"] == pytest.approx(16 / rec["step_time_s"], rel=1e-12)
        assert set(rec["lr"]) == {"vision", "audio", "language"}
        for module, lr in rec["lr"].items():
            opt, sched = cfg.effective_optimizer(module), cfg.effective_scheduler(module)
            ref = OptimizerParamScheduler(
                _Groups(), opt.lr, opt.min_lr, sched.warmup_iters, cfg.train.iters,
                sched.decay_style)
            assert lr == pytest.approx(ref.get_lr(rec["iteration"]), rel=1e-12), module
    assert _records(log_dir)[0][1]["lr"]["vision"] == pytest.approx(5e-4)


class _Groups:
    param_groups = [{"lr": 0.0}]


def test_flops_memory_and_module_times(split_run):
    cfg, log_dir, summaries = split_run
    vocab = summaries[2]["vocab_size"]
    train_task, _ = build_datasets(cfg, CharTokenizer())
    stream = train_task.stream(cfg.train.seed)
    for rec in _records(log_dir)[0]:
        samples = stream.samples((rec["iteration"] - 1) * 16, 16)
        present = {"vision": sum(s["image"] is not None for s in samples),
                   "audio": sum(s["audio"] is not None for s in samples)}
        want = model_flops_per_iteration(cfg, vocab, present)
        assert rec["model_flops_per_module"] == pytest.approx(want, rel=1e-12)
        assert rec["model_flops_per_iteration"] == pytest.approx(sum(want.values()), rel=1e-12)
        assert rec["tflops_per_second_per_rank"] == pytest.approx(
            rec["model_flops_per_iteration"] / rec["step_time_s"] / 3 / 1e12, rel=1e-9)
        assert "mfu" not in rec  # The CPU's peak is unknown.
        per_rank = rec["peak_memory_bytes_per_rank"]
        assert len(per_rank) == 3 and rec["peak_memory_bytes"] == max(per_rank) > 0
        for module in ("vision", "audio", "language"):
            t = rec["module_time_s"][module]
            assert t["forward"] > 0 and t["backward"] > 0 and t["communication"] > 0
            assert t["forward"] + t["backward"] < rec["step_time_s"]
        assert {"data", "forward-backward", "optimizer"} <= set(rec["time_s"])
    assert summaries[0]["tokens_per_second"] > 0 and summaries[0]["eval"] == summaries[2]["eval"]


def test_profiler_writes_a_chrome_trace_per_chosen_rank(split_run):
    _, log_dir, _ = split_run
    traces = sorted(p.name for p in (log_dir / "profile").iterdir())
    assert traces == ["rank0_iter2-2.json", "rank2_iter2-2.json"]
    trace = json.loads((log_dir / "profile" / "rank2_iter2-2.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "mimotron/iteration 2" in names and "aten::mm" in names


def _nan_step(model, batch, embeddings):
    loss_sum, num_tokens, metrics = default_forward_step(model, batch, embeddings)
    return loss_sum * float("nan"), num_tokens, metrics


def test_nan_loss_stops_after_max_skipped_with_a_clear_message(tmp_path):
    overrides = [f"log.dir={tmp_path}", "train.iters=10", "train.max_skipped=2", "log.interval=1",
                 *ONE_RANK]
    with pytest.raises(RankError, match=r"training diverged at iteration 2: 2 consecutive "
                                        r"iterations .* train.max_skipped=2"):
        run_ranks(1, _train, overrides, _nan_step, timeout_s=120)
    train, _ = _records(tmp_path)
    assert [(r["skipped"], r["nan_iters"], r["grad_norm"]) for r in train] == [
        (True, 1, None), (True, 2, None)]


def test_console_progress_bar_eta_and_summary(tmp_path, capsys):
    writer = MetricsWriter(tmp_path, total_iters=10)
    writer._tty = True  # As if attached to a terminal.
    writer.console({"iteration": 4, "loss": 1.5, "grad_norm": 0.5, "lr": {"a": 1e-3},
                    "tokens_per_second": 2000.0, "step_time_s": 10.0}, elapsed_s=40.0)
    summary = {"iteration": 10, "wall_time_s": 100.0, "loss": 0.25,
               "eval": {"eval_loss": 0.3, "eval_accuracy": 0.9, "eval_samples": 5},
               "tokens_per_second": 1000.0, "samples_per_second": 10.0, "step_time_s": 0.1,
               "peak_memory_bytes": 3 * 2**20, "skipped_iters": 1, "nan_iters": 0}
    print(format_summary(summary))
    writer.close()
    out = capsys.readouterr().out
    assert out.startswith("[############") and "ETA 1m00s" in out and "2.0k tok/s" in out
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines()[2:-1]
                if "  " in line)
    assert rows["iterations"] == "10" and rows["final loss"] == "0.2500"
    assert rows["eval_accuracy"] == "0.9000" and "eval_samples" not in rows
    assert rows["peak memory"].startswith("3.0 MiB") and rows["skipped / NaN"] == "1 / 0"
    assert rows["throughput"].startswith("1.0k tok/s, 10.0 samples/s, 100 ms/it")


def test_tensorboard_gets_nested_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, total_iters=2, tensorboard=True, progress=False)
    writer.write({"iteration": 1, "loss": 2.0, "lr": {"vision": 1e-3}, "skipped": False,
                  "grad_norm": None, "peak_memory_bytes_per_rank": [1, 2],
                  "module_time_s": {"vision": {"forward": 0.5}}, "num_zeros": float("nan")})
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "lr/vision", "module_time_s/vision/forward"]
    assert acc.Scalars("module_time_s/vision/forward")[0].value == 0.5


def test_resume_drops_lines_logged_after_the_checkpoint(tmp_path):
    from mimotron.training.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, 10, progress=False)
    for it in (1, 2, 3, 4):
        w.write({"iteration": it, "loss": 1.0 / it})
    w.write({"iteration": 4, "eval_loss": 0.5})
    w.close()
    # The run crashed after iteration 4; its last checkpoint was iteration 2.
    w = MetricsWriter(tmp_path, 10, progress=False, append=True, resumed_at=2)
    w.write({"iteration": 3, "loss": 0.3})
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2, 3]
    assert lines[-1]["loss"] == 0.3


def _capturing_train(rank: int, world: int, overrides: list[str]) -> dict:
    """Train with a forward step that records each training micro-batch's sums.

    It also reports ``lm_loss`` (a ``[sum, count]`` pair) and ``calls`` (a scalar), and
    makes iteration 3's loss NaN (micro-batches 5 and 6: two per iteration), so that
    iteration is skipped.
    """
    seen: list[tuple[float, float, float, float]] = []

    def step(model, batch, embeddings):
        loss_sum, num_tokens, metrics = default_forward_step(model, batch, embeddings)
        if not model.training:
            return loss_sum, num_tokens, metrics
        seen.append((float(loss_sum), float(num_tokens), float(metrics["correct"]),
                     float(metrics["samples"])))
        metrics = {**metrics, "lm_loss": torch.stack([loss_sum.detach(), num_tokens]),
                   "calls": torch.tensor(1.0)}
        nan = float("nan") if len(seen) in (5, 6) else 1.0
        return loss_sum * nan, num_tokens, metrics

    summary = _train(rank, world, overrides, step)
    summary["seen"] = seen
    return summary


def test_logged_loss_is_the_interval_mean_beside_the_last_value(tmp_path, capfd):
    overrides = [f"log.dir={tmp_path}", "train.iters=4", "log.interval=2", *ONE_RANK]
    (summary,) = run_ranks(1, _capturing_train, overrides, timeout_s=180)
    seen = summary["seen"]
    assert len(seen) == 8  # 4 iterations x 2 micro-batches.
    # Per iteration: (loss_sum, tokens, correct, samples), summed over its micro-batches.
    its = [[sum(x) for x in zip(*seen[2 * i:2 * i + 2], strict=True)] for i in range(4)]
    train, _ = _records(tmp_path)
    assert [r["iteration"] for r in train] == [2, 4]
    first, second = train
    assert first["loss"] == pytest.approx((its[0][0] + its[1][0]) / (its[0][1] + its[1][1]))
    assert first["loss_last"] == pytest.approx(its[1][0] / its[1][1])
    assert first["train_accuracy"] == pytest.approx(
        (its[0][2] + its[1][2]) / (its[0][3] + its[1][3]))
    assert first["train_accuracy_last"] == pytest.approx(its[1][2] / its[1][3])
    assert first["lm_loss"] == pytest.approx(first["loss"])
    assert first["lm_loss_last"] == pytest.approx(first["loss_last"])
    assert first["calls"] == first["calls_last"] == 2.0  # Per iteration, not per interval.
    assert (first["interval_iters"], first["interval_skipped_iters"]) == (2, 0)
    # Iteration 3 (NaN loss) is skipped: the mean is iteration 4's alone.
    assert second["loss"] == pytest.approx(its[3][0] / its[3][1])
    assert second["loss_last"] == pytest.approx(its[3][0] / its[3][1])
    assert second["lm_loss"] == pytest.approx(second["loss"]) and second["calls"] == 2.0
    assert second["train_accuracy"] == pytest.approx(its[3][2] / its[3][3])
    assert (second["interval_iters"], second["interval_skipped_iters"]) == (2, 1)
    assert (second["skipped_iters"], second["nan_iters"]) == (1, 1)
    assert second["skipped"] is False
    # The console line shows the interval mean.
    lines = [x for x in capfd.readouterr().out.splitlines() if x.startswith("iter ")]
    assert [re.search(r"loss (\S+)", x).group(1) for x in lines] == [
        f"{first['loss']:.4f}", f"{second['loss']:.4f}"]
