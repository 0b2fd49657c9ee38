"""LLaVA start-up at real size: the sample check once, cached, and what a rank holds.

Generates a LLaVA JSONL file of ``--samples`` conversations (default 200 000; a few
small PNG images and WAV tones reused by every sample, text that differs per sample), a
second one of ``--small`` samples (default 50 000), and a BPE tokenizer, then measures:

* ``check_first``: the data set-up ``mimotron train`` does in its launcher before any
  rank starts (:func:`~mimotron.data.run_data.check_data`: every sample checked into
  the index, in forked processes on every core), wall and CPU seconds (all processes);
* ``rank_setup_cached``: one rank's data set-up once the index exists (a fresh process:
  tokenizer, index read, train/validation split, 64 samples loaded), wall seconds, and
  its memory above the same process without data for both file sizes: private
  (``rank_data_anon_mb``, what must not grow with the file) and mapped from files
  (``rank_data_file_mb``: the memory-mapped index, page cache shared by a node's ranks);
* ``whole_file_held_mb``: what a rank held before the index existed (the whole file
  read, decoded and parsed), for comparison;
* ``launch_first`` / ``launch_cached`` (unless ``--skip-launch``): ``mimotron train`` of
  the digits model on its 4 ranks (vision | audio | language DP 2) for one iteration:
  seconds from the command to its first training record and to its exit, and the CPU
  seconds of all its processes, without the index (large file only) and with it (both
  sizes: the difference is what the file's size still costs). On a shared machine the
  wall time depends on the other jobs; the CPU seconds hardly do.

Run: ``python -m benchmarks.llava_startup [--samples N] [--small N] [--dir DIR]
[--json OUT] [--skip-launch]``. The figures depend on the machine's cores and load (the
JSON records both).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DIGITS = REPO / "configs" / "digits.toml"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PROMPTS = {"image": "<image>\nwhich digit is this", "audio": "<audio>\nwhich key was pressed",
           "both": "<image><audio>\nadd the digit and the key"}  # fmt: skip
NUM_IMAGES, NUM_TONES = 16, 8


def write_media(root: Path) -> None:
    """``NUM_IMAGES`` 8x8 PNGs and ``NUM_TONES`` 0.12 s WAV tones, reused by every sample."""
    import wave

    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True, exist_ok=True)
    (root / "wav").mkdir(parents=True, exist_ok=True)
    for i in range(NUM_IMAGES):
        pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "img" / f"{i}.png")
    for i in range(NUM_TONES):
        t = np.arange(1920) / 16000
        pcm = (0.5 * np.sin(2 * np.pi * (400 + 60 * i) * t) * 32767).astype("<i2")
        with wave.open(str(root / "wav" / f"{i}.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(16000)
            f.writeframes(pcm.tobytes())


def sample(index: int) -> dict[str, Any]:
    """Sample ``index``: its kind and words follow from the index alone."""
    kind = ("image", "audio", "both", "text")[index % 4]
    a, b = (index // 4) % 10, (index // 40) % 10
    out: dict[str, Any] = {"id": f"s{index:07d}"}
    if kind in ("image", "both"):
        out["image"] = f"img/{index % NUM_IMAGES}.png"
    if kind in ("audio", "both"):
        out["audio"] = f"wav/{index % NUM_TONES}.wav"
    human = PROMPTS.get(kind, f"{WORDS[a]} plus {WORDS[b]}")
    answer = f"{WORDS[a]} plus {WORDS[b]} is {a + b}" if kind != "image" else WORDS[a]
    out["conversations"] = [{"from": "human", "value": human},
                            {"from": "gpt", "value": f"{answer} (sample {index})"}]
    return out


def write_data(folder: Path, sizes: list[int]) -> dict[int, Path]:
    """The media, the tokenizer and one JSONL file per size (kept when already there)."""
    from mimotron.data.bpe import train_bpe_tokenizer

    data = folder / "data"
    if not (data / "wav" / f"{NUM_TONES - 1}.wav").is_file():
        write_media(data)
    if not (folder / "tokenizer" / "tokenizer.json").is_file():
        corpus = [*PROMPTS.values(), *WORDS, *(f"{w} plus {v} is {n}" for w in WORDS
                                              for v in WORDS for n in range(19))]
        train_bpe_tokenizer(corpus * 2, folder / "tokenizer", vocab_size=400)
    files = {}
    for size in sizes:
        path = data / f"llava_{size}.jsonl"
        if not path.is_file():
            with open(path, "w") as f:
                for i in range(size):
                    f.write(json.dumps(sample(i)) + "\n")
        files[size] = path
    return files


def overrides(folder: Path, path: Path, run: str) -> list[str]:
    return ["data.dataset='llava'", f"data.path='{path}'",
            f"data.tokenizer='{folder / 'tokenizer'}'", "data.seq_length=96",
            "modules.vision.in_channels=3", f"log.dir='{folder / run}'"]  # fmt: skip


# ---- measurements in fresh processes ------------------------------------------------------
def child_check(args: list[str]) -> dict[str, Any]:
    """The launcher's data set-up (every sample checked into the index)."""
    from mimotron.config import load_config
    from mimotron.data.run_data import check_data

    cfg = load_config(DIGITS, args)
    cpu = _cpu_seconds()
    begin = time.perf_counter()
    check_data(cfg)
    return {"wall_s": time.perf_counter() - begin, "check_cpu_s": _cpu_seconds() - cpu}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the check's processes)."""
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def child_rank(args: list[str], with_data: bool) -> dict[str, Any]:
    """One rank's data set-up from the index (or only the tokenizer): time and memory."""
    from mimotron.config import load_config
    from mimotron.data.run_data import build_llava_tasks, build_tokenizer

    cfg = load_config(DIGITS, args)
    begin = time.perf_counter()
    tokenizer = build_tokenizer(cfg)
    out: dict[str, Any] = {}
    if with_data:
        train, _ = build_llava_tasks(cfg, tokenizer)
        stream = train.stream(cfg.train.seed)
        stream.samples(0, 64)
        out["num_train"] = len(train)
    out["wall_s"] = time.perf_counter() - begin
    for name, field in (("rss_mb", "VmRSS"), ("anon_mb", "RssAnon"), ("file_mb", "RssFile")):
        out[name] = _status_kb(field) / 1024
    return out


def child_whole(args: list[str]) -> dict[str, Any]:
    """What a rank held before the index: the whole file read, decoded and parsed."""
    from mimotron.config import load_config

    path = Path(load_config(DIGITS, args).data.path)
    before = _status_kb("VmRSS")
    text = path.read_bytes().decode("utf-8")
    samples = [json.loads(line) for line in text.split("\n") if line.strip()]
    return {"num": len(samples), "held_mb": (_status_kb("VmRSS") - before) / 1024}


def _status_kb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return float("nan")


def run_child(kind: str, args: list[str]) -> dict[str, Any]:
    """Run a ``child_*`` measurement in a fresh interpreter; its JSON, plus CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.llava_startup", "--child", kind,
                           "--", *args], cwd=REPO, capture_output=True, text=True,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"child {kind} failed: {proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = time.perf_counter() - begin
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out


def launch(folder: Path, path: Path, run: str) -> dict[str, float]:
    """``mimotron train`` for one iteration on the config's 4 ranks: seconds from the
    command to its first training record (the first step done), and to its exit; the
    CPU seconds of the launcher, its check processes and the ranks together (what a
    machine's free cores divide: the wall time does not go below it / cores)."""
    args = [*overrides(folder, path, run), "train.iters=1", "log.interval=1",
            "train.overwrite=true", "checkpoint.load=none", "eval.interval=1000",
            "eval.iters=1", "log.progress=false", "train.global_batch_size=8",
            "train.micro_batch_size=4", "scheduler.warmup_iters=0"]
    metrics = folder / run / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # the previous launch's records are not this one's
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mimotron", "train", str(DIGITS), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    first = None
    while proc.poll() is None:  # a benchmark polls; the first record marks the first step
        if first is None and metrics.is_file() and '"loss"' in metrics.read_text():
            first = time.perf_counter() - begin
        time.sleep(0.05)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"mimotron train failed: {err[-2000:]}")
    end = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process waited for
    cpu_s = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    return {"first_step_s": end if first is None else first, "exit_s": end, "cpu_s": cpu_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--small", type=int, default=50_000)
    parser.add_argument("--dir", type=Path, default=None, help="keep the files here")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-launch", action="store_true")
    parser.add_argument("--child", default="")
    args, rest = parser.parse_known_args(argv)
    if args.child:
        rest = rest[1:] if rest[:1] == ["--"] else rest
        kind = args.child
        result = (child_check(rest) if kind == "check" else child_whole(rest)
                  if kind == "whole" else child_rank(rest, kind == "rank"))
        print(json.dumps(result))
        return 0
    folder = args.dir or Path(tempfile.mkdtemp(prefix="llava_startup_"))
    sizes = sorted({args.small, args.samples})
    files = write_data(folder, sizes)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                              "load_avg": os.getloadavg()[0], "sizes": {}}  # fmt: skip
    for size in sizes:
        run = f"run_{size}"
        shutil.rmtree(folder / run, ignore_errors=True)
        over = overrides(folder, files[size], run)
        entry: dict[str, Any] = {"file_mb": files[size].stat().st_size / 2**20}
        entry["check_first"] = run_child("check", over)
        entry["rank_no_data"] = run_child("tokenizer", over)
        entry["rank_setup_cached"] = run_child("rank", over)
        for name in ("rss_mb", "anon_mb", "file_mb"):  # the data's part: above no data
            entry[f"rank_data_{name}"] = (entry["rank_setup_cached"][name]
                                          - entry["rank_no_data"][name])  # fmt: skip
        entry["whole_file_held_mb"] = run_child("whole", over)["held_mb"]
        if not args.skip_launch:
            if size == args.samples:
                shutil.rmtree(folder / run, ignore_errors=True)  # no index: the first run
                entry["launch_first"] = launch(folder, files[size], run)
            entry["launch_cached"] = launch(folder, files[size], run)
        report["sizes"][size] = entry
        _print(size, entry)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _print(size: int, e: dict[str, Any]) -> None:
    check = e["check_first"]
    print(f"{size} samples ({e['file_mb']:.1f} MB): check {check['wall_s']:.1f} s wall, "
          f"{check['check_cpu_s']:.0f} CPU-s ({check['check_cpu_s'] / size * 1e3:.2f} "
          "ms/sample); "
          f"rank set-up from the index {e['rank_setup_cached']['wall_s']:.2f} s, "
          f"data memory {e['rank_data_anon_mb']:.1f} MB private + "
          f"{e['rank_data_file_mb']:.1f} MB mapped (RSS {e['rank_setup_cached']['rss_mb']:.0f} "
          f"MB vs {e['rank_no_data']['rss_mb']:.0f} MB without data)", flush=True)  # fmt: skip
    print(f"  the whole file read and parsed (what each rank held before): "
          f"{e['whole_file_held_mb']:.0f} MB", flush=True)
    for name, what in (("launch_first", "no index yet"), ("launch_cached", "with the index")):
        if name in e:
            print(f"  mimotron train, 4 ranks ({what}): first step after "
                  f"{e[name]['first_step_s']:.1f} s, exit after {e[name]['exit_s']:.1f} s, "
                  f"{e[name]['cpu_s']:.0f} CPU-s in all processes", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
