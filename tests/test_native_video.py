"""Videos at native resolution (Qwen2.5-VL / Qwen3-VL): decoding, sampling, patches, text,
positions and the LLaVA data path, against transformers.

transformers' video processors import ``torchvision`` (not installed) at module level, but
the functions read here are plain torch / numpy: ``sample_frames`` (the sampling rule) and
``patchify`` (the video patch layout). :func:`_hf_video_classes` imports the two modules
with an empty stand-in module for ``torchvision`` during the import only, so the
reference is transformers' own code. The processors' ``replace_video_token`` (the text of
a video, Qwen3-VL's timestamps) and ``_calculate_timestamps`` run unbound on a namespace
holding what they read; ``read_video_pyav`` decodes the reference frames and metadata;
``get_rope_index`` of each family's model gives the reference positions.

Test videos are made here: an ``mpeg4`` ``.mp4`` encoded by PyAV, and folders of PNGs.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mimotron.config import load_config
from mimotron.config.sample_keys import READ_KEYS, VIDEO_KEYS
from mimotron.data import build_datasets, collate
from mimotron.data.bpe import CHATML_TEMPLATE, train_bpe_tokenizer
from mimotron.data.llava_file import SampleError
from mimotron.data.native_images import NativeImageProcessor
from mimotron.data.native_video import (
    NativeVideoProcessor,
    VideoMeta,
    decode_frames,
    video_metadata,
)
from mimotron.data.run_data import build_tokenizer
from mimotron.data.sample_keys import LLAVA_LAYOUT, MESSAGES_LAYOUT, check_sample_keys
from tests.hf_data import write_jsonl, write_png
from tests.hf_vlm import hf_reference_run, run_layouts
from tests.qwen_vl import FAMILIES, QWEN_VIDEO_FAMILY, write_llava_config
from tests.reference import packed_rows

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")

PATCH, MERGE, TEMPORAL = 2, 2, 2
MIN_PIXELS, MAX_PIXELS = 64, 1024  # 4 to 64 merged tokens per item, 256 patch rows
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CLASSES = {"qwen2_5_vl": ("qwen2_vl", "Qwen2VLVideoProcessor", "Qwen2_5_VLProcessor"),
           "qwen3_vl": ("qwen3_vl", "Qwen3VLVideoProcessor", "Qwen3VLProcessor")}


# ---- helpers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_video() -> dict[str, Any]:
    """transformers' video processor classes of both families (module docstring)."""
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    # The modules the video files import first, imported for real before the stand-in.
    for module in ("image_utils", "image_processing_utils", "video_processing_utils",
                   "video_utils", "processing_utils"):
        importlib.import_module(f"transformers.{module}")
    stand_in = {n: types.ModuleType(n) for n in names}
    for parent, child in zip(names, names[1:], strict=False):
        setattr(stand_in[parent], child.rpartition(".")[2], stand_in[child])
    with pytest.MonkeyPatch.context() as patch:
        for name, module in stand_in.items():
            patch.setitem(sys.modules, name, module)
        return {family: getattr(importlib.import_module(
            f"transformers.models.{folder}.video_processing_{folder}"), cls)
            for family, (folder, cls, _) in CLASSES.items()}


def _hf_indices(hf_video: dict, family: str, total: int, fps: float, config: dict) -> list[int]:
    """transformers' ``sample_frames`` of a video, its instance values from ``config`` over
    the class defaults (Qwen2.5-VL's class has no fps: 2, as documented)."""
    cls = hf_video[family]
    keys = ("fps", "num_frames", "min_frames", "max_frames", "temporal_patch_size")
    values = {k: config.get(k, getattr(cls, k, None)) for k in keys}
    values["fps"] = 2 if values["fps"] is None and values["num_frames"] is None else values["fps"]
    metadata = transformers.video_utils.VideoMetadata(total_num_frames=total, fps=fps)
    # The processor calls it with its instance's fps and num_frames.
    return [int(i) for i in cls.sample_frames(types.SimpleNamespace(**values), metadata,
                                              fps=values["fps"], num_frames=values["num_frames"])]


def _hf_video_text(family: str, grid: list[int], metadata: Any) -> str:
    """The family processor's ``replace_video_token`` of one video, run unbound on what it
    reads; Qwen2.5-VL's pads inside the chat template's ``<|vision_start|>`` /
    ``<|vision_end|>`` (Qwen3-VL's processor drops that wrapper and writes its own)."""
    processor_class = getattr(transformers, CLASSES[family][2])
    timestamps = getattr(processor_class, "_calculate_timestamps", None)
    stub = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=MERGE, temporal_patch_size=TEMPORAL),
        video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=timestamps and partial(timestamps, None))
    text = processor_class.replace_video_token(
        stub, {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}, 0)
    return f"<|vision_start|>{text}<|vision_end|>" if family == "qwen2_5_vl" else text


def _images(root: Path) -> NativeImageProcessor:
    transformers.Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE,
                                          temporal_patch_size=TEMPORAL).save_pretrained(root)
    return NativeImageProcessor.from_pretrained(root, PATCH, MERGE, TEMPORAL, MAX_PIXELS,
                                                MIN_PIXELS)


def _frames(count: int, height: int, width: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def write_mp4(path: Path, frames: list[np.ndarray], fps: int) -> Path:
    """An mpeg4 ``.mp4`` of ``frames`` (RGB uint8) at ``fps``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_frame_folder(folder: Path, frames: list[np.ndarray]) -> Path:
    """One PNG per frame, named so that their order is the name order."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, frame in enumerate(frames):
        PIL.fromarray(frame).save(folder / f"frame_{k:03d}.png")
    return folder


# ---- decoding and sampling ---------------------------------------------------------------


def test_metadata_of_a_file_and_a_folder(tmp_path: Path) -> None:
    clip = write_mp4(tmp_path / "clip.mp4", _frames(10, 24, 32, 0), fps=5)
    meta = video_metadata(clip, folder_fps=2.0)
    ref = transformers.video_utils.read_video_pyav(str(clip), sample_indices_fn=lambda
                                                   metadata, **_: np.arange(1))[1]
    assert meta == VideoMeta(ref.total_num_frames, ref.fps, ref.width, ref.height)
    assert meta == VideoMeta(10, 5.0, 32, 24)
    folder = write_frame_folder(tmp_path / "frames", _frames(6, 14, 20, 1))
    (folder / "notes.txt").write_text("not a frame")  # neither a frame nor counted
    assert video_metadata(folder, folder_fps=3.0) == VideoMeta(6, 3.0, 20, 14)
    # Decoding gives PyAV's frames as transformers' reader does, and the folder's in order.
    ours = decode_frames(clip, [0, 3, 3, 9])
    ref_frames, _ = transformers.video_utils.read_video_pyav(
        str(clip), sample_indices_fn=lambda metadata, **_: np.array([0, 3, 9]))
    for got, want in zip(ours, [ref_frames[0], ref_frames[1], ref_frames[1], ref_frames[2]],
                         strict=True):
        assert np.array_equal(np.asarray(got), want)
    assert np.array_equal(np.asarray(decode_frames(folder, [4])[0]),
                          np.asarray(PIL.open(folder / "frame_004.png")))


# (frames, the video's fps, the folder's values): the rate's rounding, the float step of
# Qwen2.5-VL's sampling (30 frames at 26 of 30 fps: 27 indices), min_frames past the
# video, max_frames, a fixed num_frames, sampling off.
SAMPLING_CASES = [(30, 24.0, {}), (300, 30.0, {}), (17, 1.0, {}), (5, 2.0, {}),
                  (30, 30.0, {"fps": 26}), (49, 1.0, {"fps": 0.9}), (1000, 10.0,
                  {"max_frames": 16}), (7, 25.0, {"min_frames": 6}), (40, 8.0, {"fps": 3.5}),
                  (30, 24.0, {"num_frames": 7, "fps": None}),
                  (30, 24.0, {"num_frames": 40, "fps": None})]


@pytest.mark.parametrize("family", list(CLASSES))
def test_sampling_equals_transformers(tmp_path: Path, hf_video: dict, family: str) -> None:
    images = _images(tmp_path)
    for total, fps, config in SAMPLING_CASES:
        sampling = NativeVideoProcessor(images, family, config).sampling
        try:
            want = _hf_indices(hf_video, family, total, fps, config)
        except ValueError:  # transformers cannot sample it (Qwen2.5-VL: 40 of 30 frames)
            with pytest.raises(ValueError, match=f"has {total} frame"):
                sampling.indices(VideoMeta(total, fps, 32, 24))
            continue
        assert sampling.indices(VideoMeta(total, fps, 32, 24)) == want, (total, fps, config)
    assert NativeVideoProcessor(images, family, {"do_sample_frames": False}).sampling.indices(
        VideoMeta(9, 30.0, 8, 8)) == list(range(9))
    # transformers' sampling cannot take one frame into Qwen2.5-VL's temporal pairs.
    if family == "qwen2_5_vl":
        with pytest.raises(ValueError, match="has 1 frame.*takes 0") as err:
            NativeVideoProcessor(images, family, {}).plan(VideoMeta(1, 30.0, 32, 24))
        assert "\n" not in str(err.value)


def test_unreadable_and_empty_videos_are_one_line(tmp_path: Path) -> None:
    with av.open(str(tmp_path / "empty.mp4"), "w") as container:  # a header, no frame
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height = 32, 24
        container.start_encoding()
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    (tmp_path / "none").mkdir()
    for name, why in (("empty.mp4", "no video stream"), ("junk.mp4", "is unreadable"),
                      ("none", "holds no frame images")):
        with pytest.raises(ValueError, match=why) as err:
            video_metadata(tmp_path / name, 2.0)
        assert "\n" not in str(err.value) and name in str(err.value)
    # A video whose frames cannot fit the slots even at min_pixels.
    images = _images(tmp_path)
    with pytest.raises(ValueError, match="raise max_pixels") as err:
        NativeVideoProcessor(images, "qwen3_vl", {"num_frames": 100, "fps": None}).plan(
            VideoMeta(100, 2.0, 32, 24))
    assert "\n" not in str(err.value)


# ---- pixels ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(CLASSES))
def test_identical_frame_pairs_are_the_image_processor_of_each_frame(tmp_path: Path,
                                                                      family: str) -> None:
    """Frames ``a a b b c c`` (36 x 20, resized): temporal step ``k`` holds exactly the image
    processor's ``pixel_values`` of frame ``k`` at the video's per-frame bound."""
    images = _images(tmp_path)
    distinct = _frames(3, 20, 36, 2)
    folder = write_frame_folder(tmp_path / "pairs", [f for f in distinct for _ in range(2)])
    video = NativeVideoProcessor.from_folder(tmp_path, images, family)
    plan = video.plan_file(folder)
    bound = max(MAX_PIXELS * TEMPORAL // 6, MIN_PIXELS)  # the contract's per-frame bound
    assert plan.max_frame_pixels == bound
    patches = video(folder, plan)
    t, h, w = plan.grid
    assert t == 3 and patches.shape == (t * h * w, 3 * TEMPORAL * PATCH**2)
    assert h * w * PATCH**2 <= bound and t * h * w <= images.max_patches
    ref = transformers.Qwen2VLImageProcessorPil.from_pretrained(
        tmp_path, size={"shortest_edge": MIN_PIXELS, "longest_edge": bound})
    for k, frame in enumerate(distinct):
        want = ref(images=[PIL.fromarray(frame)], return_tensors="pt")
        assert want["image_grid_thw"][0].tolist() == [1, h, w]
        torch.testing.assert_close(patches[k * h * w:(k + 1) * h * w], want["pixel_values"],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", list(CLASSES))
def test_distinct_frames_take_the_video_processor_layout(tmp_path: Path, hf_video: dict,
                                                         family: str) -> None:
    """Four different frames already at their target size (no resize): the rows equal
    transformers' video ``patchify`` of the normalised frames, and an odd frame count is
    padded with the last frame as it pads."""
    images = _images(tmp_path)
    # Qwen3-VL pads three frames with the last; Qwen2.5-VL samples pairs, so it gets four.
    frames = _frames(3 if family == "qwen3_vl" else 4, 8, 12, 3)
    video = NativeVideoProcessor(images, family, {})
    plan = video.plan(VideoMeta(len(frames), 2.0, 12, 8))
    assert plan.grid == (2, 4, 6)
    assert plan.padded_indices == ([0, 1, 2, 2] if family == "qwen3_vl" else [0, 1, 2, 3])
    ours = video.patches([PIL.fromarray(frames[i]) for i in plan.padded_indices], plan)
    config = images.hf
    pixels = np.stack([frames[i] for i in plan.padded_indices]).astype(np.float32)
    normalised = (pixels * np.float32(config.rescale_factor) - np.float32(config.image_mean)
                  ) / np.float32(config.image_std)
    stacked = torch.from_numpy(normalised).permute(0, 3, 1, 2)[None]  # [1, T, C, H, W]
    want, *grid = hf_video[family].patchify(None, stacked, PATCH, MERGE, TEMPORAL)
    assert tuple(grid) == plan.grid
    torch.testing.assert_close(ours, want[0], rtol=0, atol=1e-5)


def test_counts_from_the_header_equal_the_loaded_video(tmp_path: Path, hf_video: dict) -> None:
    images = _images(tmp_path)
    clip = write_mp4(tmp_path / "clip.mp4", _frames(10, 24, 32, 5), fps=5)
    for family in CLASSES:
        video = NativeVideoProcessor(images, family, {})
        plan = video.plan_file(clip)
        _, meta = transformers.video_utils.read_video_pyav(
            str(clip), sample_indices_fn=lambda metadata, family=family, **_: np.array(
                _hf_indices(hf_video, family, metadata.total_num_frames, metadata.fps, {})))
        assert list(plan.indices) == list(meta.frames_indices)
        assert plan.sampled_fps == pytest.approx(meta.sampled_fps)
        patches = video(clip, plan)
        assert patches.shape[0] == int(np.prod(plan.grid)) <= images.max_patches
        assert video.tokens(plan) == patches.shape[0] // MERGE**2


# ---- text --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(CLASSES))
def test_video_text_equals_the_processor(tmp_path: Path, family: str) -> None:
    images = _images(tmp_path)
    for total, fps in ((10, 5.0), (31, 7.0), (3, 2.0)):
        video = NativeVideoProcessor(images, family, {})
        plan = video.plan(VideoMeta(total, fps, 32, 24))
        ours = video.text(plan, "<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
        pieces = ours.split("<|video_pad|>")
        ours = pieces[0] + "".join("<|video_pad|>" * n + p
                                   for n, p in zip(video.runs(plan), pieces[1:], strict=True))
        metadata = transformers.video_utils.VideoMetadata(
            total_num_frames=total, fps=fps, frames_indices=list(plan.indices))
        assert ours == _hf_video_text(family, list(plan.grid), metadata), (total, fps)
    if family == "qwen3_vl":  # timestamps are really there, one per temporal step
        assert ours.count(" seconds>") == plan.grid[0] == 2 and "<1.0 seconds>" in ours


def test_video_keys_are_read_with_a_native_module_only() -> None:
    assert (LLAVA_LAYOUT.video, MESSAGES_LAYOUT.video) == VIDEO_KEYS
    assert not set(VIDEO_KEYS) & READ_KEYS  # a run without a native module may ignore them
    llava = {"id": "v", "video": "a.mp4", "conversations": []}
    messages = {"videos": ["a.mp4"], "messages": []}
    check_sample_keys(llava, (), videos=True)
    check_sample_keys(messages, (), videos=True)
    for raw in (llava, messages):
        with pytest.raises(SampleError, match="is not read by the loader"):
            check_sample_keys(raw, ())
    with pytest.raises(SampleError, match="sample key 'video' is not read"):
        check_sample_keys({"video": "a.mp4", "messages": []}, (), videos=True)


# ---- the LLaVA data path -----------------------------------------------------------------


def _turns(question: str, answer: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


SAMPLES = [
    {"id": "both", "image": "a.png", "video": "pairs",
     "conversations": _turns("<image> then <video> what moves", "the digit")},
    {"messages": [{"role": "user", "content": "<video> and <image> describe"},
                  {"role": "assistant", "content": "a cat"}],
     "videos": ["clip.mp4"], "images": ["a.png"]},
    {"id": "video only", "video": ["clip.mp4"], "conversations": _turns("<video>", "four")},
    {"id": "text", "conversations": _turns("what is two plus two", "four")},
]


def _save_folder(path: Path, family: str) -> tuple[Any, Any]:
    """A tiny random folder of ``family`` whose config ids are its tokenizer's; the model."""
    folder = train_bpe_tokenizer(["what moves", "the digit is seven", "describe a cat",
                                  "what is two plus two", "four seconds"] * 4,
                                 path.parent / f"tok_{family}", vocab_size=300,
                                 chat_template=CHATML_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = dict(zip(QWEN_TOKENS, tokenizer.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    prefix, text, vision = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(
        text_config={**text, "vocab_size": -(-len(tokenizer) // 64) * 64},
        vision_config=dict(vision), image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # off the constant initial values (zero biases, unit norms)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE,
                                          temporal_patch_size=TEMPORAL, min_pixels=MIN_PIXELS,
                                          max_pixels=16 * MAX_PIXELS).save_pretrained(path)
    return model, tokenizer


_VIDEO_RUN = {"max_pixels": MAX_PIXELS, "media": "media", "seq_length": 256, "max_images": 2}


@pytest.fixture(scope="module", params=list(CLASSES))
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(request.param)
    model, tokenizer = _save_folder(root / "qwen", request.param)
    write_png(root / "media" / "a.png", 12, 20, seed=0)
    pairs = _frames(2, 12, 20, 6)
    write_frame_folder(root / "media" / "pairs", [f for f in pairs for _ in range(2)])
    # 6 frames at 10 fps: min_frames takes 4, so 6.7 sampled frames per second.
    write_mp4(root / "media" / "clip.mp4", _frames(6, 24, 32, 7), fps=10)
    return {"root": root, "family": request.param, "model": model, "tokenizer": tokenizer,
            "config": write_llava_config(root, root / "qwen", write_jsonl(
                root / "data.jsonl", SAMPLES), "run", **_VIDEO_RUN), "pairs": pairs}


def _dataset(config: Path, *overrides: str) -> Any:
    cfg = load_config(config, list(overrides))
    train, _ = build_datasets(cfg, build_tokenizer(cfg))
    return cfg, train.dataset


def _video_reference(qwen: dict, hf_video: dict, file: str) -> tuple[str, list, Any]:
    """transformers' text, grid and metadata of one video of the data (``pairs``: a frame
    folder at the sampling rate, 2 frames per second; ``clip.mp4``: PyAV's header)."""
    family, media = qwen["family"], qwen["root"] / "media"
    if file == "pairs":
        metadata = transformers.video_utils.VideoMetadata(total_num_frames=4, fps=2.0,
                                                          width=20, height=12)
    else:
        _, metadata = transformers.video_utils.read_video_pyav(
            str(media / file), sample_indices_fn=lambda metadata, **_: np.arange(1))
    metadata.frames_indices = _hf_indices(hf_video, family, metadata.total_num_frames,
                                          metadata.fps, {})
    steps = -(-len(metadata.frames_indices) // TEMPORAL)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    bound = max(MAX_PIXELS * TEMPORAL // (steps * TEMPORAL), MIN_PIXELS)
    height, width = smart_resize(metadata.height, metadata.width, PATCH * MERGE, MIN_PIXELS,
                                 bound)
    grid = [steps, height // PATCH, width // PATCH]
    return _hf_video_text(family, grid, metadata), grid, metadata


def _reference(qwen: dict, hf_video: dict, sample: dict) -> dict[str, Any]:
    """transformers' true ids, grids and seconds of one sample (images as in
    tests/test_native_data.py, videos by the processors' replacement)."""
    turns = sample.get("conversations") or sample["messages"]
    roles = {"human": "user", "gpt": "assistant"}
    messages = [{"role": roles.get(t.get("from"), t.get("role")),
                 "content": t.get("value", t.get("content"))} for t in turns]
    images = sample.get("image") or sample.get("images") or []
    videos = sample.get("video") or sample.get("videos") or []
    videos = [videos] if isinstance(videos, str) else videos
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(
        qwen["root"] / "qwen", size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    image_out = processor(images=[PIL.open(qwen["root"] / "media" / f).convert("RGB")
                                  for f in ([images] if isinstance(images, str) else images)],
                          return_tensors="pt") if images else None
    refs = [_video_reference(qwen, hf_video, v) for v in videos]
    video_texts = iter(r[0] for r in refs)
    image_tokens = "<|image_pad|>" * (int(image_out["image_grid_thw"][0].prod()) // MERGE**2
                                      ) if images else ""
    for m in messages:
        pieces = m["content"].replace(
            "<image>", f"<|vision_start|>{image_tokens}<|vision_end|>").split("<video>")
        m["content"] = pieces[0] + "".join(next(video_texts) + p for p in pieces[1:])
    text = qwen["tokenizer"].apply_chat_template(messages, tokenize=False)
    ids = qwen["tokenizer"](text, add_special_tokens=False)["input_ids"]
    return {"ids": torch.tensor(ids), "image_out": image_out,
            "video_grids": torch.tensor([r[1] for r in refs], dtype=torch.long).reshape(-1, 3),
            "seconds": [TEMPORAL / r[2].sampled_fps for r in refs]}


def test_samples_with_an_image_and_a_video(qwen: dict, hf_video: dict) -> None:
    """A LLaVA sample (image, then a frame folder), a messages sample (mp4, then image), a
    video alone and text alone: ids, items, grids, slots and positions."""
    cfg, dataset = _dataset(qwen["config"])
    config = qwen["model"].config
    samples = [dataset.load(i) for i in range(len(dataset))]
    batch = collate(samples, cfg.data.seq_length, dataset.pad_id, dataset.image_shape,
                    dataset.audio_shape)
    assert batch["image"].shape == (4, 2, MAX_PIXELS // PATCH**2, 3 * TEMPORAL * PATCH**2)
    seconds = []
    for i, sample in enumerate(SAMPLES):
        ref = _reference(qwen, hf_video, sample)
        seconds += ref["seconds"]
        true, n = ref["ids"], len(ref["ids"])
        assert int(dataset.lengths[i]) == n  # the check's length, from headers only
        # The engine's ids: every video placeholder written as the image placeholder.
        engine = true.masked_fill(true == config.video_token_id, config.image_token_id)
        assert torch.equal(batch["tokens"][i, :n], engine), i
        assert not (batch["tokens"] == config.video_token_id).any()
        assert not batch["loss_mask"][i, :n - 1][engine[1:] == config.image_token_id].any()
        # Items in text order: grids, tokens, flags.
        kinds = [k[1:-1] for t in (sample.get("conversations") or sample["messages"])
                 for k in re.findall("<image>|<video>", t.get("value", t.get("content")))]
        image_grids = ref["image_out"]["image_grid_thw"] if ref["image_out"] else None
        picks = {"image": iter([] if image_grids is None else image_grids),
                 "video": iter(ref["video_grids"])}
        grids = [next(picks[k]).tolist() for k in kinds]
        assert batch["image_grid"][i].tolist() == grids + [[0, 0, 0]] * (2 - len(grids))
        assert batch["image_tokens"][i].tolist() == [
            t * h * w // MERGE**2 for t, h, w in grids] + [0] * (2 - len(grids))
        assert batch["has_image"][i].tolist() == [True] * len(kinds) + [False] * (2 - len(kinds))
        if "image" in kinds:  # the image's slot: the processor's pixel values
            j = kinds.index("image")
            rows = int(image_grids[0].prod())
            torch.testing.assert_close(batch["image"][i, j, :rows],
                                       ref["image_out"]["pixel_values"], rtol=0, atol=0)
            assert not batch["image"][i, j, rows:].any()
        # Positions: get_rope_index of the true ids.
        types_ = (true == config.image_token_id).long() + 2 * (true == config.video_token_id)
        extra = ({"second_per_grid_ts": torch.tensor(ref["seconds"], dtype=torch.float32)}
                 if qwen["family"] == "qwen2_5_vl" and ref["seconds"] else {})
        with torch.no_grad():
            want, _ = qwen["model"].model.get_rope_index(
                true[None], mm_token_type_ids=types_[None], image_grid_thw=image_grids,
                video_grid_thw=ref["video_grids"] if len(ref["video_grids"]) else None,
                **extra)
        assert torch.equal(batch["position_ids"][i, :, :n], want[:, 0]), i
    assert min(seconds) < 1 == max(seconds)  # the mp4's steps are not 1 s apart: time counts
    # The frame folder of identical pairs: each temporal step is the image processor's
    # pixel values of its frame, at the contract's per-frame bound.
    t, h, w = batch["image_grid"][0, 1].tolist()
    ref = transformers.Qwen2VLImageProcessorPil.from_pretrained(
        qwen["root"] / "qwen", size={"shortest_edge": MIN_PIXELS,
                                     "longest_edge": max(MAX_PIXELS // t, MIN_PIXELS)})
    for k, frame in enumerate(qwen["pairs"]):
        want = ref(images=[PIL.fromarray(frame)], return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(batch["image"][0, 1, k * h * w:(k + 1) * h * w], want,
                                   rtol=0, atol=0)
    assert not batch["image"][0, 1, t * h * w:].any()


def test_ranks_load_their_parts(qwen: dict) -> None:
    """An image rank decodes the videos without tokenising; a text rank knows their grids
    and positions without decoding."""
    cfg, dataset = _dataset(qwen["config"])
    full = collate([dataset.load(i) for i in range(len(dataset))], cfg.data.seq_length,
                   dataset.pad_id, dataset.image_shape, dataset.audio_shape)
    for parts, keys in ((["image"], ("image", "has_image", "image_grid", "image_tokens")),
                        (["text"], ("tokens", "has_image", "image_grid", "position_ids"))):
        dataset.restrict_loading(parts)
        batch = collate([dataset.load(i) for i in range(len(dataset))], cfg.data.seq_length,
                        dataset.pad_id, dataset.image_shape, dataset.audio_shape)
        for key in keys:
            assert torch.equal(batch[key], full[key]), (parts, key)


def test_bad_videos_are_named_at_the_check(qwen: dict, tmp_path: Path) -> None:
    (qwen["root"] / "media" / "empty").mkdir(exist_ok=True)
    bad = [SAMPLES[3], SAMPLES[2], {"id": "no frames", "video": "empty",
                        "conversations": _turns("<video>", "four")},
           {"id": "two", "video": "pairs", "conversations": _turns("<video> <video>", "four")}]
    config = write_llava_config(qwen["root"], qwen["root"] / "qwen",
                                write_jsonl(tmp_path / "bad.jsonl", bad), "bad", **_VIDEO_RUN)
    with pytest.raises(ValueError) as err:
        _dataset(config, f"data.index_dir='{tmp_path / 'index'}'")
    message = str(err.value)
    assert "\n" not in message and "'no frames'" in message and "empty" in message
    assert "holds no frame images" in message
    _, dataset = _dataset(config, f"data.index_dir='{tmp_path / 'skip'}'",
                          "data.skip_bad_samples=true")
    reasons = [b.reason for b in dataset.bad_samples]
    assert len(dataset) == 2 and len(reasons) == 2
    assert "2 <video> placeholder(s) in the conversation but 1 video file(s)" in reasons[1]


def test_training_with_videos_equals_a_plain_loop_on_transformers(qwen: dict) -> None:
    """Images and videos from the data file through the engine: 10 iterations at a real
    learning rate, split (vision | language TP 2) and colocated (vision DP 2 with
    language TP 2), equal transformers' model in a plain loop on the same samples
    (losses, grad norms, final weights)."""
    root = Path(str(qwen["root"]))
    config = write_llava_config(root, root / "qwen", write_jsonl(
        root / "train.jsonl", SAMPLES * 3), "train", **_VIDEO_RUN, train_iters=10)
    config.write_text(config.read_text().replace("global_batch_size = 2\nmicro_batch_size = 1",
                                                 "global_batch_size = 4\nmicro_batch_size = 2"))
    ref = hf_reference_run(config, 10, family=QWEN_VIDEO_FAMILY)
    assert ref.losses[-1] < ref.losses[0], ref.losses
    run_layouts(config, ref, {
        "vision | language TP 2": (3, ["modules.language.parallel.tensor=2",
                                       "modules.language.parallel.rank_offset=1"]),
        "colocated vision DP 2, language TP 2": (2, [
            "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2"])}, 10)


def test_packed_rows_under_context_parallelism_equal_transformers(qwen: dict) -> None:
    """Packed rows of images, videos and text (positions restarting per document) into a
    language model split by context parallelism, 10 iterations: transformers' model on
    the same samples, each alone (documents of a packed row attend only within)."""
    root = Path(str(qwen["root"]))
    config = write_llava_config(root, root / "qwen", write_jsonl(
        root / "packed.jsonl", SAMPLES * 4), "packed", **{**_VIDEO_RUN, "max_images": 4},
        packing=True, train_iters=10)
    cfg = load_config(config)
    task, _ = build_datasets(cfg, build_tokenizer(cfg))
    rows = packed_rows(task, task.stream(cfg.train.seed), cfg.train.global_batch_size)()
    assert max(len(row) for row in rows) > 1, rows  # documents share rows
    ref = hf_reference_run(config, 10, family=QWEN_VIDEO_FAMILY, packed=True)
    run_layouts(config, ref, {"vision | language CP 2": (3, [
        "modules.language.parallel.context=2", "modules.language.parallel.rank_offset=1"])}, 10)
