"""The console: per-module learning rates, the live line a terminal redraws every
iteration, the data lines of the banner.

A terminal is a ``StringIO`` whose ``isatty`` says True; nothing sleeps and no wall time
is asserted (only which lines appear and what they say).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

from mimotron.cli.lines import LineWriter
from mimotron.config import load_config
from mimotron.runtime import init_runtime
from mimotron.training.console import compact_float, format_lrs, short_names
from mimotron.training.loop import run_training
from mimotron.training.metrics import MetricsWriter
from tests.common import BASE, DIGITS, ONE_RANK


class FakeTerminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_lrs_show_one_value_when_modules_agree_and_one_per_module_when_they_differ():
    assert short_names(["vision", "audio", "language"]) == {
        "vision": "v", "audio": "a", "language": "lm"}
    # Shared prefixes grow until unambiguous; "l..." must not read as the language model.
    assert short_names(["video", "vision", "lidar", "language"]) == {
        "video": "vid", "vision": "vis", "lidar": "li", "language": "lm"}
    assert compact_float(2e-5) == "2.0e-5" and compact_float(1.5e-3) == "1.5e-3"
    assert format_lrs({"vision": 1e-3, "audio": 1e-3, "language": 1e-3}) == "lr 1.00e-03"
    lrs = {"audio": 1e-3, "language": 2e-5, "vision": 1e-3}  # a record's (sorted) order
    assert format_lrs(lrs, ["vision", "audio", "language"]) == (
        "lr v 1.0e-3 | a 1.0e-3 | lm 2.0e-5")


def _record(iteration: int) -> dict:
    return {"iteration": iteration, "loss": 1.5, "grad_norm": 0.5,
            "lr": {"vision": 1e-3, "language": 2e-5}, "tokens_per_second": 2000.0,
            "step_time_s": 0.1}  # fmt: skip


def _bar(iteration: int) -> str:
    return f"[{'#' * 3 * iteration}{'.' * (30 - 3 * iteration)}]"  # of 10 iterations


def test_live_line_redraws_on_a_terminal_and_writes_nothing_elsewhere(tmp_path):
    terminal, log = FakeTerminal(), io.StringIO()
    for stream in (terminal, log):
        writer = MetricsWriter(tmp_path / str(id(stream)), total_iters=10, stream=stream,
                               module_order=["vision", "language"])
        writer.tick(1, 2.25, 0.5)
        writer.tick(2, 2.125, 0.25)
        writer.console(_record(3), elapsed_s=1.0)
        writer.tick(4, 1.0, 0.25)
        writer.eval_line({"iteration": 4, "eval_loss": 0.75})
        writer.close()
    full = ("iter      3/10 | loss 1.5000 | grad 0.500 | lr v 1.0e-3 | lm 2.0e-5 | 2.0k tok/s | "
            "100 ms/it | elapsed 0m01s | ETA 0m00s")
    live = [f"{_bar(1)} iter      1/10 | loss 2.2500 | 500 ms/it | ETA 0m04s",
            f"{_bar(2)} iter      2/10 | loss 2.1250 | 250 ms/it | ETA 0m02s",
            f"{_bar(4)} iter      4/10 | loss 1.0000 | 250 ms/it | ETA 0m01s"]
    # Each live line ends with "\r" (the cursor back at its start); a full line blanks it
    # first, then scrolls as before.
    assert terminal.getvalue() == (
        f"{live[0]}\r{live[1]}\r{' ' * len(live[1])}\r{_bar(3)} {full}\n"
        f"{live[2]}\r{' ' * len(live[2])}\reval @ iter 4 | eval_loss 0.7500\n")
    # Off a terminal: the same calls print exactly the record and eval lines.
    assert log.getvalue() == f"{full}\neval @ iter 4 | eval_loss 0.7500\n"


def test_line_writer_passes_a_redrawn_line_on_at_once():
    """Ranks print through LineWriter, which holds partial lines: a line ending in "\\r"
    is whole, or the live line would only appear with the next full line."""
    read_fd, write_fd = os.pipe()
    try:
        with os.fdopen(write_fd, "w", closefd=False) as raw:
            writer = LineWriter(raw)
            writer.write("[##..] iter 1/4 | loss 1.0\r")
            writer.write("partial")  # no end yet: held
            os.set_blocking(read_fd, False)
            assert os.read(read_fd, 4096) == b"[##..] iter 1/4 | loss 1.0\r"
            writer.write(" line\n")
            assert os.read(read_fd, 4096) == b"partial line\n"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_training_on_a_terminal_redraws_every_iteration_and_logs_at_intervals(tmp_path):
    """5 iterations, a record every 2 (and at the end), the language model's own lr: the
    live line for iterations 1 and 3, full lines with one lr per module for 2 and 4, one
    lr at 5 (the schedules end together at min_lr); the banner's data lines."""
    cfg = load_config(DIGITS, [*BASE, *ONE_RANK, "train.iters=5", "log.interval=2",
                               "eval.iters=1", "modules.language.optimizer.lr=1e-3",
                               f"log.dir='{tmp_path}'"])  # fmt: skip
    terminal = FakeTerminal()
    with contextlib.redirect_stdout(terminal):
        run_training(cfg, init_runtime())
    out = terminal.getvalue()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["iteration"]: r for r in records if "loss" in r}
    assert sorted(train) == [2, 4, 5]
    ticks = re.findall(r"\] iter +(\d+)/5 \| loss ([\d.]+) \| \d+ ms/it \| ETA \S+ *\r", out)
    assert [int(i) for i, _ in ticks] == [1, 3]
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"iter +(\d+)/5 \| loss [^\r\n]*"
                                                               r"tok/s[^\r\n]*\n", out)}
    assert sorted(lines) == [2, 4, 5]
    for it in (2, 4):
        lr = train[it]["lr"]
        assert lr["language"] != lr["vision"] == lr["audio"]
        assert (f"| lr v {compact_float(lr['vision'])} | a {compact_float(lr['audio'])} | "
                f"lm {compact_float(lr['language'])} |") in lines[it]
    assert f"| lr {train[5]['lr']['language']:.2e} |" in lines[5]
    banner = [x for x in out.splitlines() if x.startswith("data: ")]
    assert banner[0] == ("data: digits, train 1438 samples (synthetic), validation 359 "
                         "(synthetic); packing off")
    assert banner[1].startswith("data: kinds drawn per sample: image, audio, both, text only;"
                                " longest sample ")
    assert banner[1].endswith(" of 64 tokens (data.seq_length)")
