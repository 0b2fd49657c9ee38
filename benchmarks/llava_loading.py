"""LLaVA loading: samples/s with 0 vs N loader workers, and how long a step waits.

Generates PNG (or JPEG) images and a LLaVA JSONL file in a temporary folder, trains a
small BPE tokenizer, and reads the training stream micro-batch by micro-batch through
:class:`~mimotron.data.prefetch.PrefetchingReader` with CLIP ViT-L/14 preprocessing
(224 pixels):

* ``sync`` - ``num_workers=0``: every image is decoded on the training thread;
* ``workers`` - ``num_workers=N``: decoding runs ahead on N threads.

Repetitions alternate the order (A B, B A, ...). Figures: samples/s of each side, their
ratio, and ``step_wait_fraction``: the share of a simulated step (a sleep as long as
one synchronous micro-batch load, standing in for compute that releases the GIL) spent
waiting for samples with N workers (the goal: near 0, "a step never waits for
decoding"). Run: ``python -m benchmarks.llava_loading [--workers 4] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CaseResult, Figure, Options, interleave, ratio_figure, summarize  # noqa: E402
from mimotron.data.bpe import train_bpe_tokenizer  # noqa: E402
from mimotron.data.hf_tokenizer import HFTokenizer  # noqa: E402
from mimotron.data.llava import LlavaDataset, LlavaTask  # noqa: E402
from mimotron.data.media import ImageProcessor  # noqa: E402
from mimotron.data.prefetch import PrefetchingReader  # noqa: E402

MICRO_BATCH = 8


def write_images(root: Path, count: int, size: tuple[int, int], fmt: str) -> list[str]:
    """``count`` smooth-gradient-plus-noise images (photo-like compressibility)."""
    from PIL import Image

    height, width = size
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    names = []
    for i in range(count):
        base = (np.stack([xx * (i + 1), yy * (i + 2), xx + yy], axis=-1) % 256).astype(np.float64)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        name = f"img/{i:05d}.{fmt}"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / name, quality=90) if fmt == "jpg" else (
            Image.fromarray(pixels).save(root / name))
        names.append(name)
    return names


def build_task(root: Path, num_images: int, size: tuple[int, int], fmt: str) -> LlavaTask:
    """A LLaVA task of ``num_images`` image samples with CLIP-L preprocessing."""
    names = write_images(root, num_images, size, fmt)
    lines = [json.dumps({"id": f"s{i}", "image": n, "conversations": [
        {"from": "human", "value": "<image>\ndescribe the picture"},
        {"from": "gpt", "value": f"picture number {i}"}]}) for i, n in enumerate(names)]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    tok_dir = train_bpe_tokenizer(["describe the picture", "picture number 12345"] * 8,
                                  root / "tokenizer")  # fmt: skip
    dataset = LlavaDataset(root / "data.jsonl", root, HFTokenizer(tok_dir, ("image",)), 640,
                           {"image": 576}, image_processor=ImageProcessor())  # fmt: skip
    return LlavaTask(dataset, range(len(dataset)))


def read_steps(task: LlavaTask, num_workers: int, num_microbatches: int,
               compute_s: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(samples/s, wait fraction) reading ``num_microbatches`` micro-batches in order."""
    with PrefetchingReader(task.stream(seed=1), num_workers=num_workers) as reader:
        begin = time.perf_counter()
        for k in range(num_microbatches):
            reader.samples(k * MICRO_BATCH, MICRO_BATCH)
            if compute_s:
                time.sleep(compute_s)  # a step's compute: releases the GIL like torch ops
        elapsed = time.perf_counter() - begin
        waited = reader.wait_seconds if num_workers else elapsed - compute_s * num_microbatches
    return num_microbatches * MICRO_BATCH / elapsed, waited / elapsed


def run_case(opts: Options, num_workers: int = 4, fmt: str = "png") -> CaseResult:
    """Both sides, interleaved; figures as in the module docstring."""
    num_images = 32 if opts.tiny else 256
    size = (120, 160) if opts.tiny else (480, 640)
    steps = 4 if opts.tiny else (16 if opts.quick else 32)
    result = CaseResult("llava_loading")
    with tempfile.TemporaryDirectory() as tmp:
        task = build_task(Path(tmp), num_images, size, fmt)
        runs = interleave(opts.reps, {
            "sync": lambda: read_steps(task, 0, steps)[0],
            "workers": lambda: read_steps(task, num_workers, steps)[0],
        })  # fmt: skip
        compute_s = MICRO_BATCH / statistics.median(runs["sync"])
        waits = [read_steps(task, num_workers, steps, compute_s)[1] for _ in range(opts.reps)]
    result.figures += [
        Figure("samples_per_s_sync", statistics.median(runs["sync"]),
               spread=(min(runs["sync"]), max(runs["sync"]))),
        Figure("samples_per_s_workers", statistics.median(runs["workers"]),
               spread=(min(runs["workers"]), max(runs["workers"])),
               detail=f"{num_workers} workers"),
        ratio_figure("loading_speedup", runs["workers"], runs["sync"]),
        Figure("step_wait_fraction", statistics.median(waits), spread=(min(waits), max(waits)),
               detail=f"step compute {compute_s * 1e3:.0f} ms per micro-batch of {MICRO_BATCH}"),
    ]  # fmt: skip
    result.measurements = {"sync": summarize(runs["sync"]), "workers": summarize(runs["workers"]),
                           "wait_fraction": summarize(waits), "num_workers": num_workers,
                           "images": f"{num_images} {fmt} {size[1]}x{size[0]}",
                           "cpus": os.cpu_count()}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="loader threads of the B side")
    p.add_argument("--format", choices=("png", "jpg"), default="png")
    p.add_argument("--quick", action="store_true", help="fewer micro-batches per repetition")
    p.add_argument("--size", choices=("tiny", "default"), default="default")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="OUT", help="write the figures and measurements here")
    args = p.parse_args(argv)
    opts = Options(quick=args.quick, size=args.size, reps=args.reps)
    result = run_case(opts, args.workers, args.format)
    for f in result.figures:
        spread = f" [{f.spread[0]:.2f}-{f.spread[1]:.2f}]" if f.spread else ""
        print(f"{f.name:24s} {f.value:10.2f}{spread}  {f.detail}")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2))


if __name__ == "__main__":
    main()
