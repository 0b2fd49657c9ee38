"""LLaVA-format data for Qwen2.5-VL / Qwen3-VL folders: images at native resolution.

A tiny Qwen2.5-VL and a tiny Qwen3-VL folder are written here (transformers' config
classes at tests/qwen_vl.py's sizes, random weights, ``save_pretrained``), with a
locally trained tokenizer given Qwen's ``<|vision_start|>``, ``<|image_pad|>``,
``<|vision_end|>``, ``<|video_pad|>`` (the config's ids point at them) and the family's
image processor; the data are PNGs of different sizes (one past ``max_pixels``, one
non-square, one below ``min_pixels``) in LLaVA conversations. The run's config is loaded
as a user's would be.

Each collated (and packed) batch is checked against transformers, which shares no code
with the data path: the token rows equal the conversation's text with each image's
``<|image_pad|>`` repeated by its grid (what ``Qwen2_5_VLProcessor`` does) tokenised by
transformers' tokenizer, so the placeholder runs equal ``image_tokens``; grids and patch
rows equal the image processor's ``image_grid_thw`` and ``pixel_values``; positions equal
the model's ``get_rope_index`` (packed rows: :func:`mrope_positions` with ``doc_ids``,
tested equal to it in tests/test_mrope.py). The index's lengths, read from the images'
headers, equal the loaded samples'. Trained by the engine (one process; vision | language
on two ranks), the data give the losses, gradient norms and weights of transformers'
model in a plain loop (:func:`tests.hf_vlm.hf_reference_run`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mimotron.config import load_config
from mimotron.data import build_datasets, collate, slice_batch
from mimotron.data.bpe import CHATML_TEMPLATE, train_bpe_tokenizer
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.mrope_positions import MRopeRule, mrope_positions
from mimotron.data.packing import collate_packed
from mimotron.data.run_data import build_tokenizer
from tests.hf_data import write_jsonl, write_png
from tests.hf_vlm import hf_reference_run, run_layouts
from tests.qwen_vl import FAMILIES, QWEN_FAMILY, write_llava_config

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

PATCH, MERGE, TEMPORAL = 2, 2, 2
MIN_PIXELS, MAX_PIXELS = 64, 1024  # 4 to 64 tokens per image
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
SENTENCES = ["what digit is in this picture", "the digit is seven", "describe the image",
             "a cat sits on a mat", "you are a helpful assistant", "what is two plus two",
             "four", "two pictures side by side"] * 4
# (name, width, height): within the bounds; past max_pixels (resized); non-square; below
# min_pixels (enlarged).
IMAGES = [("a", 20, 12), ("b", 90, 70), ("c", 37, 9), ("d", 3, 5)]


def _turns(question: str, answer: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


SAMPLES = [
    {"id": "s0", "image": "a.png", "conversations": _turns("<image>\nwhat digit is in this "
                                                           "picture", "the digit is seven")},
    {"id": "s1", "conversations": _turns("what is two plus two", "four")},
    {"id": "s2", "image": "b.png", "conversations": _turns("describe the image <image>",
                                                           "a cat sits on a mat")},
    {"id": "s3", "image": "c.png", "conversations": [
        {"from": "system", "value": "you are a helpful assistant"},
        *_turns("<image> describe the image", "two pictures")]},
    {"id": "s4", "image": "d.png", "conversations": _turns("<image>", "four")},
]
MULTI = [{"id": "m0", "image": ["a.png", "c.png"],
          "conversations": _turns("<image> and <image>: two pictures", "side by side")},
         {"id": "m1", "conversations": _turns("describe the image", "the digit is seven")},
         {"id": "m2", "image": ["d.png"], "conversations": _turns("<image>", "four")}]


def _tokenizer(root: Path) -> Any:
    """A locally trained tokenizer with Qwen's vision tokens as special tokens."""
    folder = train_bpe_tokenizer(SENTENCES, root / "tok", vocab_size=300,
                                 chat_template=CHATML_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    return tokenizer


def _save_folder(path: Path, tokenizer: Any, family: str) -> Any:
    """A tiny random folder of ``family`` (tests/qwen_vl.py's sizes) whose config ids are
    the tokenizer's; its model."""
    ids = dict(zip(QWEN_TOKENS, tokenizer.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    prefix, text, vision = FAMILIES[family]
    assert (vision["patch_size"], vision["spatial_merge_size"],
            vision["temporal_patch_size"]) == (PATCH, MERGE, TEMPORAL)
    config = getattr(transformers, f"{prefix}Config")(
        text_config={**text, "vocab_size": -(-len(tokenizer) // 64) * 64},
        vision_config=dict(vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    model.model.visual.set_attn_implementation("eager")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # The folder's own bounds are wider: the run's max_pixels below narrows them.
    transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
        min_pixels=MIN_PIXELS, max_pixels=16 * MAX_PIXELS).save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = _tokenizer(root)
    folder = root / "qwen"
    model = _save_folder(folder, tokenizer, request.param)
    for k, (name, width, height) in enumerate(IMAGES):
        write_png(root / "img" / f"{name}.png", height, width, seed=k)
    data = write_jsonl(root / "data.jsonl", SAMPLES)
    multi = write_jsonl(root / "multi.jsonl", MULTI)
    return {"root": root, "folder": folder, "model": model,
            "config": write_llava_config(root, folder, data, "single", max_pixels=MAX_PIXELS),
            "multi": write_llava_config(root, folder, multi, "multi", max_images=2,
                                        max_pixels=MAX_PIXELS),
            "tokenizer": transformers.AutoTokenizer.from_pretrained(str(folder)),
            "processor": transformers.Qwen2VLImageProcessorPil.from_pretrained(
                folder, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})}


def _dataset(config: Path, *overrides: str) -> Any:
    cfg = load_config(config, list(overrides))
    tokenizer = build_tokenizer(cfg)
    train, _ = build_datasets(cfg, tokenizer)
    return cfg, tokenizer, train.dataset


def _reference(qwen: dict, sample: dict) -> dict[str, Any]:
    """transformers' ids, grids and pixel values of one LLaVA sample: the conversation
    rendered with each image as Qwen's text, each ``<|image_pad|>`` repeated by its
    image's grid (as ``Qwen2_5_VLProcessor`` does), tokenised by transformers."""
    files = sample.get("image") or []
    files = [files] if isinstance(files, str) else files
    images = [PIL.open(qwen["root"] / "img" / f).convert("RGB") for f in files]
    out = qwen["processor"](images=images, return_tensors="pt") if images else {}
    grids = out["image_grid_thw"] if images else torch.zeros(0, 3, dtype=torch.long)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    messages = [{"role": roles[t["from"]], "content": t["value"].replace("<image>", VISION_TEXT)}
                for t in sample["conversations"]]
    text = qwen["tokenizer"].apply_chat_template(messages, tokenize=False)
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * (int(g.prod()) // MERGE**2) + piece
                                   for g, piece in zip(grids, pieces[1:], strict=True))
    ids = qwen["tokenizer"](expanded, add_special_tokens=False)["input_ids"]
    return {"ids": torch.tensor(ids), "grids": grids,
            "pixels": out["pixel_values"] if images else None}


def _hf_positions(qwen: dict, tokens: torch.Tensor, lengths: list[int], grids: torch.Tensor
                  ) -> torch.Tensor:
    """``[B, 3, S]`` positions of transformers' ``get_rope_index`` (padding 0)."""
    mask = (torch.arange(tokens.shape[1]) < torch.tensor(lengths)[:, None]).long()
    types = (tokens == qwen["model"].config.image_token_id).long() * mask
    with torch.no_grad():
        positions, _ = qwen["model"].model.get_rope_index(
            tokens, mm_token_type_ids=types, image_grid_thw=grids if len(grids) else None,
            attention_mask=mask)
    return positions.transpose(0, 1)


def _check_runs(tokens: torch.Tensor, ids: dict[str, int], counts: list[int]) -> None:
    """The row's image runs: vision_start, ``counts[k]`` image pads, vision_end."""
    pad = (tokens == ids["<|image_pad|>"]).long()
    starts = torch.nonzero(pad.diff(prepend=torch.zeros(1, dtype=torch.long)) == 1).flatten()
    ends = torch.nonzero(pad.diff(append=torch.zeros(1, dtype=torch.long)) == -1).flatten()
    assert (ends - starts + 1).tolist() == counts
    assert all(tokens[s - 1] == ids["<|vision_start|>"] for s in starts.tolist())
    assert all(tokens[e + 1] == ids["<|vision_end|>"] for e in ends.tolist())


def test_batch_equals_transformers(qwen: dict) -> None:
    cfg, tokenizer, dataset = _dataset(qwen["config"])
    folder_ids = json.loads((qwen["folder"] / "config.json").read_text())
    # <|image_pad|> is the image placeholder: the config's id, no token added.
    assert tokenizer.placeholder_id("image") == folder_ids["image_token_id"]
    assert tokenizer.num_added == 0
    assert dataset.image_shape == (MAX_PIXELS // PATCH**2, 3 * TEMPORAL * PATCH**2)
    samples = [dataset.load(i) for i in range(len(dataset))]
    batch = collate(samples, cfg.data.seq_length, dataset.pad_id, dataset.image_shape,
                    dataset.audio_shape)
    refs = [_reference(qwen, s) for s in SAMPLES]
    ids = dict(zip(QWEN_TOKENS, qwen["tokenizer"].convert_tokens_to_ids(QWEN_TOKENS),
                   strict=True))
    lengths = [len(r["ids"]) for r in refs]
    assert list(dataset.lengths) == lengths  # the index's lengths, from headers only
    for i, ref in enumerate(refs):
        assert torch.equal(batch["tokens"][i, :lengths[i]], ref["ids"]), SAMPLES[i]["id"]
        assert not batch["loss_mask"][i, lengths[i]:].any()
        has = len(ref["grids"]) == 1
        assert bool(batch["has_image"][i]) == has
        counts = [int(g.prod()) // MERGE**2 for g in ref["grids"]]
        _check_runs(batch["tokens"][i], ids, counts)
        assert int(batch["image_tokens"][i]) == sum(counts)
        assert batch["image_grid"][i].tolist() == (ref["grids"][0].tolist() if has else [0] * 3)
        rows = int(ref["grids"].prod(-1).sum())
        if has:
            torch.testing.assert_close(batch["image"][i, :rows], ref["pixels"], rtol=0, atol=0)
        assert not batch["image"][i, rows:].any()
    # The sizes do differ, and the big image filled max_pixels (resized, not refused).
    assert sorted(batch["image_tokens"].tolist()) == sorted([0, *[
        int(r["grids"][0].prod()) // MERGE**2 for r in refs if len(r["grids"])]])
    assert int(batch["image_tokens"][2]) > (MAX_PIXELS // (PATCH * MERGE)**2) // 2
    grids = torch.cat([r["grids"] for r in refs])
    hf = _hf_positions(qwen, batch["tokens"], lengths, grids)
    assert torch.equal(batch["position_ids"], hf)
    # A DP slice keeps every key aligned.
    part = slice_batch(batch, 2, 4)
    assert torch.equal(part["image_grid"], batch["image_grid"][2:4])
    assert torch.equal(part["position_ids"], batch["position_ids"][2:4])


def test_packed_rows(qwen: dict) -> None:
    """Rows of several documents: positions restart per document, grids follow the row's
    images in document order, as the image and its mask do."""
    cfg, _, dataset = _dataset(qwen["config"], "data.seq_length=256")
    samples = [dataset.load(i) for i in range(len(dataset))]
    rows = [[samples[0], samples[1], samples[3]], [samples[2], samples[4]]]
    batch = collate_packed(rows, 256, dataset.pad_id, dataset.image_shape, dataset.audio_shape)
    refs = [_reference(qwen, s) for s in SAMPLES]
    order = [[0, 1, 3], [2, 4]]
    grids = torch.cat([refs[k]["grids"] for row in order for k in row])
    rule = MRopeRule.from_hf_config(qwen["model"].config.to_dict())
    want, _ = mrope_positions(batch["tokens"], rule, grids, doc_ids=batch["doc_ids"])
    assert torch.equal(batch["position_ids"], want.transpose(0, 1))
    assert batch["image_grid"].shape == (2, 2, 3) and batch["image_tokens"].shape == (2, 2)
    for r, row in enumerate(order):
        row_grids = torch.cat([refs[k]["grids"] for k in row])
        n = len(row_grids)
        assert batch["has_image"][r].tolist() == [True] * n + [False] * (2 - n)
        assert torch.equal(batch["image_grid"][r, :n], row_grids)
        assert batch["image_tokens"][r, :n].tolist() == [int(g.prod()) // MERGE**2
                                                         for g in row_grids]
        assert not batch["image_grid"][r, n:].any()
        pixels = torch.cat([refs[k]["pixels"] for k in row if refs[k]["pixels"] is not None])
        got = torch.cat([batch["image"][r, j, :int(g.prod())] for j, g in enumerate(row_grids)])
        torch.testing.assert_close(got, pixels, rtol=0, atol=0)
        # Each document's positions are its own: those of the sample alone.
        for d, k in enumerate(row):
            at = batch["doc_ids"][r] == d
            assert torch.equal(batch["position_ids"][r][:, at], samples[k]["position_ids"])
        assert not batch["position_ids"][r][:, batch["doc_ids"][r] < 0].any()


def test_several_images_per_sample(qwen: dict) -> None:
    cfg, _, dataset = _dataset(qwen["multi"])
    samples = [dataset.load(i) for i in range(len(dataset))]
    batch = collate(samples, cfg.data.seq_length, dataset.pad_id, dataset.image_shape,
                    dataset.audio_shape)
    refs = [_reference(qwen, s) for s in MULTI]
    lengths = [len(r["ids"]) for r in refs]
    assert batch["image_grid"].shape == (3, 2, 3) and batch["image"].shape[:2] == (3, 2)
    for i, ref in enumerate(refs):
        n = len(ref["grids"])
        assert torch.equal(batch["tokens"][i, :lengths[i]], ref["ids"])
        assert batch["has_image"][i].tolist() == [True] * n + [False] * (2 - n)
        assert torch.equal(batch["image_grid"][i, :n], ref["grids"])
        assert batch["image_tokens"][i].tolist() == [int(g.prod()) // MERGE**2
                                                     for g in ref["grids"]] + [0] * (2 - n)
        if n:
            got = torch.cat([batch["image"][i, j, :int(g.prod())]
                             for j, g in enumerate(ref["grids"])])
            torch.testing.assert_close(got, ref["pixels"], rtol=0, atol=0)
    grids = torch.cat([r["grids"] for r in refs])
    assert torch.equal(batch["position_ids"], _hf_positions(qwen, batch["tokens"], lengths,
                                                            grids))


def test_ranks_load_their_parts(qwen: dict) -> None:
    """An image rank decodes the patches, a text rank tokenises: both know the grids."""
    cfg, _, dataset = _dataset(qwen["config"])
    full = collate([dataset.load(i) for i in range(len(dataset))], cfg.data.seq_length,
                   dataset.pad_id, dataset.image_shape, dataset.audio_shape)
    for parts, keep in ((["image"], ("image", "has_image", "image_grid", "image_tokens")),
                        (["text"], ("tokens", "labels", "loss_mask", "has_image",
                                    "image_grid", "image_tokens", "position_ids"))):
        dataset.restrict_loading(parts)
        batch = collate([dataset.load(i) for i in range(len(dataset))], cfg.data.seq_length,
                        dataset.pad_id, dataset.image_shape, dataset.audio_shape)
        for key in keep:
            assert torch.equal(batch[key], full[key]), (parts, key)
        assert not batch["image" if parts == ["text"] else "tokens"].any()
    dataset.restrict_loading(["text", "image"])


def test_refused_samples_are_named(qwen: dict, tmp_path: Path) -> None:
    """An image whose tokens alone exceed seq_length, or the wrong tokenizer, is one line."""
    root = qwen["root"]
    data = write_jsonl(tmp_path / "short.jsonl", [SAMPLES[1], SAMPLES[2]])
    config = write_llava_config(root, qwen["folder"], data, "short", seq_length=40,
                                max_pixels=MAX_PIXELS)
    with pytest.raises(ValueError) as err:
        _dataset(config, f"data.index_dir='{tmp_path / 'index'}'")
    message = str(err.value)
    assert "\n" not in message and "'s2'" in message and "line 2" in message
    assert "vision tokens" in message and "data.seq_length=40" in message
    with pytest.raises(ValueError, match="not a special token") as err:
        HFTokenizer(qwen["folder"], ["image"], placeholder_ids={"image": 40})
    assert "\n" not in str(err.value)


def test_training_equals_a_plain_loop_on_transformers(qwen: dict, tmp_path: Path) -> None:
    """The data feed the engine: one process, and vision | language on two ranks (an image
    rank that never tokenises, a text rank that never decodes), 3 iterations at a real
    learning rate equal transformers' model in a plain loop on the same samples."""
    config = write_llava_config(qwen["root"], qwen["folder"],
                                write_jsonl(tmp_path / "train.jsonl", SAMPLES * 4), "train",
                                max_pixels=MAX_PIXELS, train_iters=3)
    ref = hf_reference_run(config, 3, family=QWEN_FAMILY)
    run_layouts(config, ref, {"one process": (1, []), "vision | language": (
        2, ["modules.language.parallel.rank_offset=1"])}, 3)


def test_an_image_changed_after_the_check(qwen: dict, tmp_path: Path) -> None:
    """Another size on disk than the check read: an error naming the sample, or with
    data.skip_bad_samples a sample without image or loss (its recorded length kept)."""
    import shutil

    shutil.copytree(qwen["root"] / "img", tmp_path / "img")
    data = write_jsonl(tmp_path / "data.jsonl", SAMPLES)
    config = write_llava_config(tmp_path, qwen["folder"], data, "changed",
                                max_pixels=MAX_PIXELS)
    _, _, dataset = _dataset(config)
    write_png(tmp_path / "img" / "a.png", 40, 40, seed=9)  # was 20 x 12
    with pytest.raises(ValueError, match=r"line 1 \(sample id 's0'\).*an image file changed"):
        dataset.load(0)
    _, _, skipping = _dataset(config, "data.skip_bad_samples=true")
    sample = skipping.load(0)
    assert sample["tokens"].numel() == int(skipping.lengths[0])
    assert not sample["has_image"] and not sample["loss_mask"].any()
    assert not sample["image_grid"].any() and int(sample["image_tokens"]) == 0
    assert skipping.num_skipped == 1
