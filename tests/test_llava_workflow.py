"""The LLaVA recipe end to end on small local folders, as the README walks through it.

The demo's files (``make demo-llava``: LLaVA JSONL + PNG + WAV, a BPE tokenizer, CLIP /
Whisper / Qwen2 folders with random weights), 8 samples of which 6 train:

1. **stage 1**: only the projectors train (``freeze = "encoder"`` on both encoders, the
   language model frozen); the towers and the language model stay bitwise their folders'.
2. **stage 2**: a new run from stage 1's checkpoint (``checkpoint.pretrained``): it
   starts at iteration 0 with stage 1's weights, and the projectors and the language
   model train until they reproduce the captions.
3. **generate** (greedy, KV-cached) from stage 2's run directory replies to every
   training prompt with its caption.
4. **export --format hf-llava** (vision + language): ``transformers``'
   ``AutoModelForImageTextToText`` loads the folder and, greedy from the same prompt
   tokens and the processor's pixels, generates the tokens ``mimotron generate`` did.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mimotron.checkpoint.export import read_full_model
from mimotron.cli.main import main as cli_main
from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.generate import Generator, Sampling
from tests.llava_overfit import NUM_SAMPLES, overfit_toml
from tests.parity import train

STAGE1_ITERS, STAGE2_ITERS = 6, 50
TOWERS = ["modules.vision.freeze=encoder", "modules.audio.freeze=encoder"]


def _stage(config: Path, root: Path, name: str, iters: int, extra: list[str]) -> Path:
    run = root / name
    overrides = [f"name={name}", f"log.dir={run}", f"train.iters={iters}",
                 f"checkpoint.interval={iters}", f"log.interval={iters}", *extra]
    # (a later checkpoint.interval in extra wins)
    run_ranks(1, train, overrides, config, timeout_s=300)
    return run


def _tensors(run: Path) -> dict[str, torch.Tensor]:
    return read_full_model(run / "checkpoints")[0]


def test_stage1_stage2_generate_and_export_to_transformers(tmp_path: Path) -> None:
    import transformers
    from PIL import Image

    from mimotron.demo.llava_assets import write_llava_assets

    assets = tmp_path / "assets"
    write_llava_assets(assets, num_samples=NUM_SAMPLES)
    config = overfit_toml(tmp_path, assets)

    # Stage 1: projectors only (saved half way and at the end).
    stage1 = _stage(config, tmp_path, "stage1", STAGE1_ITERS,
                    [*TOWERS, "modules.language.freeze=true",
                     f"checkpoint.interval={STAGE1_ITERS // 2}"])
    half = read_full_model(stage1 / "checkpoints" / f"iter_{STAGE1_ITERS // 2:07d}")[0]
    after1 = _tensors(stage1)
    for name, value in after1.items():
        moved = not torch.equal(value, half[name])
        assert moved == (".projector." in name), name

    # Stage 2: a new run from stage 1's weights; the towers stay frozen.
    stage2 = _stage(config, tmp_path, "stage2", STAGE2_ITERS,
                    [*TOWERS, f"checkpoint.pretrained={stage1 / 'checkpoints'}"])
    records = [json.loads(x) for x in (stage2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r][-1] == STAGE2_ITERS
    after2 = _tensors(stage2)
    towers = [n for n in after2 if n.startswith("modality_submodules.")
              and ".projector." not in n]
    assert towers and all(torch.equal(after2[n], after1[n]) for n in towers)

    # Generate: every training prompt gets its caption.
    generator = Generator.from_path(stage2, device="cpu")
    data = [json.loads(x) for x in (assets / "data" / "data.jsonl").read_text().splitlines()]
    cfg = load_config(config)
    from mimotron.data.run_data import build_llava_tasks, build_tokenizer

    task, _ = build_llava_tasks(cfg, build_tokenizer(cfg))
    image_only = []
    for i in range(len(task)):
        record = data[int(task.indices[task.get(i)["index"]])]
        question = record["conversations"][0]["value"].split("\n", 1)[1]
        files = {m: [str(assets / "data" / record[m])] if m in record else []
                 for m in ("image", "audio")}
        reply = generator.generate(question, files["image"], files["audio"], Sampling())
        assert reply.text == record["conversations"][1]["value"], record
        if not files["audio"]:
            image_only.append((question, files["image"][0], reply))
    assert image_only

    # Export for transformers; its greedy tokens are mimotron's.
    out = tmp_path / "llava"
    assert cli_main(["export", "--format", "hf-llava", "--modules", "vision,language",
                     str(stage2 / "checkpoints"), str(out)]) == 0
    llava = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = transformers.AutoProcessor.from_pretrained(out, backend="pil")
    for question, image, reply in image_only:
        prompt, _ = generator.encode(question, [image], [])
        pixels = processor.image_processor(Image.open(image), return_tensors="pt")
        with torch.no_grad():
            generated = llava.generate(
                input_ids=torch.tensor([prompt.tokens]), pixel_values=pixels["pixel_values"],
                max_new_tokens=len(reply.token_ids), do_sample=False,
                pad_token_id=min(prompt.stop_ids))
        assert generated[0, len(prompt.tokens):].tolist() == reply.token_ids, question
