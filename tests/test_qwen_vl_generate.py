"""A Qwen2.5-VL run: trained from its one folder, exported back, generating like transformers.

The demo's assets at a small size (:mod:`mimotron.demo.qwen_assets`: a tiny
``Qwen2_5_VLForConditionalGeneration`` folder with its processor and a local tokenizer,
digits of four sizes in LLaVA format) train for a few iterations with ``mimotron train``
(vision | language on 2 ranks), then:

* ``mimotron export --format hf`` writes one folder that ``transformers`` loads with no
  missing or unexpected keys, whose logits equal mimotron's on a prompt with an image;
* ``mimotron``'s greedy generation on an image of each size gives the tokens of
  ``transformers``' ``generate``, whose inputs the family's own processor builds from
  the chat template (an independent prompt: vision tokens, expansion, 3-D positions).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mimotron.cli.main import main as cli_main
from mimotron.data.mrope_positions import decode_positions
from mimotron.demo.qwen_assets import write_qwen_assets
from mimotron.generate.decode import Generator, Sampling
from mimotron.generate.native_prompt import encode_native_prompt
from mimotron.models.kv_cache import KVCache

transformers = pytest.importorskip("transformers")

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_qwen.toml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_generate")
    assets = root / "assets"
    write_qwen_assets(assets, num_samples=64)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    overrides = [f"hf_path='{assets / 'model'}'", f"data.path='{assets / 'data' / 'data.jsonl'}'",
                 f"log.dir='{root / 'run'}'", "train.iters=4", "checkpoint.interval=4",
                 "scheduler.warmup_iters=1", "train.global_batch_size=8",
                 "train.micro_batch_size=4", "data.num_workers=0", "eval.interval=1000"]
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", str(CONFIG), *overrides],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint, out = root / "run" / "checkpoints", root / "export"
    assert cli_main(["export", "--format", "hf", str(checkpoint), str(out)]) == 0
    images = sorted((assets / "data" / "images").glob("*.png"))
    return {"checkpoint": checkpoint, "export": out, "images": images}


def _hf_inputs(folder: Path, image: Path | None) -> dict[str, torch.Tensor]:
    """transformers' own prompt: the chat template, then the image processor's patches and
    the ``<|image_pad|>`` expansion ``Qwen2_5_VLProcessor`` makes (written out here: the
    processor class also loads a video processor, which needs torchvision)."""
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = ("<|vision_start|><|image_pad|><|vision_end|>\n" if image else "") + (
        "which digit is this" if image else "two plus three")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    out: dict[str, torch.Tensor] = {}
    if image:
        processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(folder)
        out = dict(processor(images=[Image.open(image).convert("RGB")], return_tensors="pt"))
        tokens = int(out["image_grid_thw"].prod()) // processor.merge_size**2
        chat = chat.replace("<|image_pad|>", "<|image_pad|>" * tokens)
    out["input_ids"] = torch.tensor([tokenizer(chat, add_special_tokens=False)["input_ids"]])
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out["mm_token_type_ids"] = (out["input_ids"] == image_id).long()  # the processor's
    return out


@pytest.mark.parametrize("which", ["8", "16", "24", "32", "text"])
def test_greedy_tokens_equal_transformers_generate(trained: dict, which: str) -> None:
    from PIL import Image

    model = transformers.AutoModelForImageTextToText.from_pretrained(
        trained["export"], dtype=torch.float32).eval()
    image = None
    if which != "text":  # the first data image of that side
        image = next(p for p in trained["images"] if Image.open(p).size[0] == int(which))
    inputs = _hf_inputs(trained["export"], image)
    want = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs[
        "input_ids"].shape[1]:].tolist()
    ours = Generator.from_path(trained["checkpoint"]).generate(
        "which digit is this" if image else "two plus three", [image] if image else [],
        sampling=Sampling(max_new_tokens=6))
    assert ours.prompt_tokens == inputs["input_ids"].shape[1]
    end = model.generation_config.eos_token_id
    ends = set(end if isinstance(end, list) else [end])
    got = ours.token_ids + ([want[len(ours.token_ids)]] if len(want) > len(ours.token_ids)
                            and want[len(ours.token_ids)] in ends else [])
    assert got == want[:len(got)] and len(got) == len(want), (got, want)


def test_the_export_loads_with_no_missing_keys_and_equal_logits(trained: dict) -> None:
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        trained["export"], dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    image = trained["images"][0]
    inputs = _hf_inputs(trained["export"], image)
    with torch.no_grad():
        want = model.eval()(**inputs).logits[0]
        loaded = Generator.from_path(trained["checkpoint"]).loaded
        prompt = encode_native_prompt(loaded, "vision", "which digit is this", [image])
        assert prompt.prompt.tokens == inputs["input_ids"][0].tolist()
        got = loaded.model.language_model(prompt.hidden, **prompt.forward_args)[0]
    err = float((got[:, :want.shape[-1]] - want).norm() / want.norm())
    assert err <= 1e-5, err


@pytest.mark.parametrize("side", [8, 24])
def test_cached_decoding_gives_the_logits_of_the_whole_sequence(trained: dict, side: int
                                                                ) -> None:
    """A reply fed token by token through the KV cache (each at the text position after
    the prompt, ``decode_positions`` of its ``rope_deltas``) scores as transformers scores
    prompt + reply in one forward (its own 3-D positions for the whole sequence)."""
    from PIL import Image

    model = transformers.AutoModelForImageTextToText.from_pretrained(
        trained["export"], dtype=torch.float32).eval()
    image = next(p for p in trained["images"] if Image.open(p).size[0] == side)
    inputs = _hf_inputs(trained["export"], image)
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained["export"])
    reply = tokenizer("seven plus three is ten", add_special_tokens=False)["input_ids"]
    whole = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([reply])], 1)}
    whole["attention_mask"] = torch.ones_like(whole["input_ids"])
    whole["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"],
                                                         (0, len(reply)))
    with torch.no_grad():
        want = model(**whole).logits[0, -len(reply) - 1:]
        loaded = Generator.from_path(trained["checkpoint"]).loaded
        prompt = encode_native_prompt(loaded, "vision", "which digit is this", [image])
        assert prompt.rope_deltas.item() != 0 or side == 8  # a 3 x 3-token image: shifted
        lm = loaded.model.language_model
        cache = KVCache(len(prompt.prompt.tokens) + len(reply))
        got = [lm(prompt.hidden, cache=cache, **prompt.forward_args)[0, -1]]
        for token in reply:
            positions = decode_positions(prompt.rope_deltas, cache.length, 1)
            got.append(lm(lm.embed_tokens(torch.tensor([[token]])), cache=cache,
                          position_ids=positions)[0, -1])
    got_logits = torch.stack(got)[:, :want.shape[-1]]
    err = float((got_logits - want).norm() / want.norm())
    assert err <= 1e-5, err


def test_greedy_tokens_with_a_video_equal_transformers_generate(trained: dict,
                                                                tmp_path: Path) -> None:
    """A folder of four frames (one digit image each, same size) as a video: the prompt's
    video positions (seconds per temporal step) and the decode positions after them give
    the tokens of ``transformers``' ``generate`` on the video inputs its processor would
    make (the text written out as :func:`_hf_inputs` does; the patches are ours, tested
    equal to the family's video processor in ``tests/test_native_video.py``)."""
    from PIL import Image

    from mimotron.data.native_images import NativeImageProcessor
    from mimotron.data.native_video import NativeVideoProcessor

    frames = tmp_path / "frames"
    frames.mkdir()
    same = [p for p in trained["images"] if Image.open(p).size[0] == 16][:4]
    for k, path in enumerate(same):
        Image.open(path).save(frames / f"{k:02d}.png")
    export = trained["export"]
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        export, dtype=torch.float32).eval()
    generator = Generator.from_path(trained["checkpoint"])
    images = NativeImageProcessor.from_vision(
        export, generator.loaded.cfg.modules["vision"].hf_native)
    video = NativeVideoProcessor.from_folder(export, images, "qwen2_5_vl")
    plan = video.plan_file(frames)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|>\nwhich digit "
                                     "is this"}], tokenize=False, add_generation_prompt=True)
    chat = chat.replace("<|video_pad|>", "<|video_pad|>" * video.tokens(plan))
    ids = torch.tensor([tokenizer(chat, add_special_tokens=False)["input_ids"]])
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values_videos": video(frames, plan),
              "video_grid_thw": torch.tensor([plan.grid]),
              "second_per_grid_ts": torch.tensor([plan.seconds_per_step]),
              "mm_token_type_ids": (ids == video_id).long() * 2}
    # Two temporal steps 1 s apart (2 frames per step at 2 frames per second), placed
    # tokens_per_second positions apart, not 1 as an image's steps would be.
    assert plan.grid[0] == 2 and model.config.vision_config.tokens_per_second != 1
    want = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    ours = generator.generate("which digit is this", sampling=Sampling(max_new_tokens=6),
                              videos=[frames])
    assert ours.prompt_tokens == ids.shape[1]
    end = model.generation_config.eos_token_id
    ends = set(end if isinstance(end, list) else [end])
    got = ours.token_ids + ([want[len(ours.token_ids)]] if len(want) > len(ours.token_ids)
                            and want[len(ours.token_ids)] in ends else [])
    assert got == want[:len(got)] and len(got) == len(want), (got, want)
    # The reply fed through the KV cache scores as transformers scores the whole sequence.
    reply = tokenizer("seven plus three is ten", add_special_tokens=False)["input_ids"]
    whole = {**inputs, "input_ids": torch.cat([ids, torch.tensor([reply])], 1)}
    whole["attention_mask"] = torch.ones_like(whole["input_ids"])
    whole["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"],
                                                         (0, len(reply)))
    with torch.no_grad():
        want_logits = model(**whole).logits[0, -len(reply) - 1:]
        loaded = generator.loaded
        prompt = encode_native_prompt(loaded, "vision", "which digit is this", [], [frames])
        lm = loaded.model.language_model
        cache = KVCache(len(prompt.prompt.tokens) + len(reply))
        got_logits = [lm(prompt.hidden, cache=cache, **prompt.forward_args)[0, -1]]
        for token in reply:
            positions = decode_positions(prompt.rope_deltas, cache.length, 1)
            got_logits.append(lm(lm.embed_tokens(torch.tensor([[token]])), cache=cache,
                                 position_ids=positions)[0, -1])
    stacked = torch.stack(got_logits)[:, :want_logits.shape[-1]]
    err = float((stacked - want_logits).norm() / want_logits.norm())
    assert err <= 1e-5, err

