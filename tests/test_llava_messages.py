"""The ``messages`` layout of LLaMA-Factory and ms-swift, read as-is wherever LLaVA data is.

A sample ``{"messages": [{"role": "user", "content": "<image>hi"}, ...], "images": [...],
"audios": [...]}`` is the LLaVA sample ``{"conversations": [{"from": "human", "value":
"<image>hi"}, ...], "image": [...], "audio": ...}``. The tests convert LLaVA samples to the
messages layout here (their own few lines, not the loader's) and check:

* the same tokens, labels, loss masks, pixels, log-mels, ids and lengths (tensor-equal
  ``collate`` batches) as the LLaVA layout, from JSONL and from a JSON list, with one and
  two images per sample; from tar shards too;
* the errors: both layouts in one sample, unknown roles, a content that is not a string
  (a list of typed parts named as such), placeholders not matching the files, too many
  images or audio clips, keys no reader takes (``videos``, a turn's ``loss``; accepted
  when ``data.ignore_keys`` lists them): one line naming the file, line, sample id and
  the ``messages[k].role`` / ``messages[k].content`` at fault;
* a 1-rank training run gives the losses of the same data in the LLaVA layout, bitwise.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mimotron.config import load_config
from mimotron.config.sample_keys import READ_KEYS, SAMPLE_KEYS, TURN_KEYS
from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.collate import collate
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.sample_keys import LLAVA_LAYOUT, MESSAGES_LAYOUT
from mimotron.data.webdataset import write_shards
from mimotron.forked_ranks import run_groups
from tests.common import DIGITS, ONE_RANK, SMALL_MODEL, train_steps
from tests.hf_data import llava_dataset, llava_env, write_jsonl, write_png

ROLE_OF = {"human": "user", "gpt": "assistant", "system": "system"}
NUM_ITERS = 3


def as_messages(sample: dict[str, Any]) -> dict[str, Any]:
    """The LLaVA sample ``sample`` in the messages layout (images always a list)."""
    out: dict[str, Any] = {"messages": [{"role": ROLE_OF[t["from"]], "content": t["value"]}
                                        for t in sample["conversations"]]}  # fmt: skip
    if "id" in sample:
        out["id"] = sample["id"]
    if "image" in sample:
        image = sample["image"]
        out["images"] = [image] if isinstance(image, str) else list(image)
    if "audio" in sample:
        out["audios"] = [sample["audio"]]
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing, the four good samples (image, audio, both, text) and a
    fifth with two images."""
    env = llava_env(tmp_path_factory.mktemp("llava_messages"))
    write_png(env["root"] / "img" / "c.png", 20, 26, seed=7)
    env["two_images"] = {"id": "s4", "image": ["img/c.png", "img/a.png"], "conversations": [
        {"from": "human", "value": "<image> and <image>: which is larger"},
        {"from": "gpt", "value": "the first"}]}  # fmt: skip
    return env


def _write(path: Path, samples: list[dict[str, Any]]) -> Path:
    """JSONL for ``.jsonl``, one JSON list otherwise."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, samples)
    path.write_text(json.dumps(samples, indent=1))
    return path


def _batch(data: Any) -> dict[str, torch.Tensor]:
    samples = [data.load(i) for i in range(len(data))]
    return collate(samples, data.seq_length, data.pad_id, data.image_shape, data.audio_shape)


def _assert_same_data(ours: Any, theirs: Any) -> None:
    """Same samples, ids, lengths and tensor-equal batches."""
    assert len(ours) == len(theirs) and ours.num_skipped == theirs.num_skipped == 0
    assert ours.lengths.tolist() == theirs.lengths.tolist()
    for i in range(len(ours)):
        a, b = ours.load(i), theirs.load(i)
        assert (a["sample_id"], a["kind"], a["answer"]) == (b["sample_id"], b["kind"],
                                                            b["answer"])  # fmt: skip
    batch, reference = _batch(ours), _batch(theirs)
    assert batch.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(batch[key], value), key


@pytest.mark.parametrize(("suffix", "max_images"), [(".jsonl", 1), (".json", 1),
                                                    (".jsonl", 2), (".json", 2)])  # fmt: skip
def test_messages_layout_loads_the_batches_of_the_llava_layout(env, tmp_path, suffix,
                                                               max_images):  # fmt: skip
    samples = env["samples"] + ([env["two_images"]] if max_images > 1 else [])
    llava = llava_dataset(env, _write(tmp_path / f"llava{suffix}", samples),
                          max_images=max_images)  # fmt: skip
    path = _write(tmp_path / f"messages{suffix}", [as_messages(s) for s in samples])
    assert "conversations" not in path.read_text()
    data = llava_dataset(env, path, max_images=max_images)
    _assert_same_data(data, llava)
    assert sum(bool(x) for x in data.has_image) == 2 + (max_images > 1)
    assert data.load(1)["audio"] is not None and data.load(3)["image"] is None


def test_messages_layout_in_tar_shards_loads_the_samples_of_the_llava_layout(env, tmp_path):
    samples = env["samples"]
    llava = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", samples))
    shards = write_shards([as_messages(s) for s in samples], env["root"], tmp_path / "shards")
    with tarfile.open(shards[0]) as archive:
        first = json.load(archive.extractfile(archive.getmembers()[0]))
    assert set(first) == {"id", "messages"}  # the images became the sample's members
    _assert_same_data(llava_dataset(env, tmp_path / "shards"), llava)


def _bad_cases(env: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(name, sample, error pattern) of each bad sample in the messages layout."""
    good = as_messages(env["samples"][0])  # one image, a user and an assistant turn
    user, reply = good["messages"]

    def bad(**changes: Any) -> dict[str, Any]:
        return {**good, "id": "b", **changes}

    return [
        ("both_layouts", bad(conversations=env["samples"][0]["conversations"]),
         r"holds both 'conversations' .* and 'messages' .*: expected one of them"),
        ("unknown_role", bad(messages=[user, {**reply, "role": "tool"}]),
         r"messages\[1\]\.role='tool' is invalid: expected 'user' or 'assistant'"),
        ("no_role", bad(messages=[{"content": user["content"]}, reply]),
         r"messages\[0\]\.role=None is invalid"),
        ("number_content", bad(messages=[user, {**reply, "content": 7}]),
         r"messages\[1\]\.content=7 is invalid: expected a string"),
        ("content_parts", bad(messages=[{**user, "content": [
            {"type": "image"}, {"type": "text", "text": "what digit"}]}, reply]),
         r"messages\[0\]\.content is a list of parts: expected a string"),
        ("empty", bad(messages=[]), r"'messages' is missing or empty"),
        ("no_placeholder", bad(messages=[{**user, "content": "what digit"}, reply]),
         r"0 <image> placeholder\(s\) in the conversation but 1 image file"),
        ("too_many_images", bad(images=["img/a.png", "img/b.png"], messages=[
            {**user, "content": "<image><image>"}, reply]),
         r"2 image files and <image> placeholders: more than data.max_images_per_sample=1"),
        ("two_audios", bad(images=[], audios=["wav/a.wav", "wav/b.wav"], messages=[
            {**user, "content": "<audio><audio>"}, reply]),
         r"2 audio files: at most one per sample"),
        ("images_not_paths", bad(images=[{"path": "img/a.png"}]),
         r"'images'=\[\{'path': 'img/a.png'\}\] is invalid: expected a path or a list"),
        ("outside_root", bad(images=["../x.png"]), r"images path '../x.png' resolves to .*"
                                                   r"outside data.root"),
        ("videos", bad(videos=["clips/a.mp4"]),
         r"sample key 'videos' is not read by the loader \(it reads 'id', 'images', "
         r"'audios', 'messages'\).*data.ignore_keys"),
        ("video", bad(video="clips/a.mp4"), r"sample key 'video' is not read"),
        ("llava_image_key", bad(image="img/a.png"), r"sample key 'image' is not read"),
        ("turn_key", bad(messages=[user, {**reply, "loss": 0.0}]),
         r"messages\[1\] key 'loss' is not read by the loader \(a turn's keys read are "
         r"'role', 'content'\)"),
    ]  # fmt: skip


BAD_NAMES = ("both_layouts", "unknown_role", "no_role", "number_content", "content_parts",
             "empty", "no_placeholder", "too_many_images", "two_audios", "images_not_paths",
             "outside_root", "videos", "video", "llava_image_key", "turn_key")  # fmt: skip


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_messages_sample_is_one_line_naming_it(env, tmp_path, name):
    cases = {case: (bad, pattern) for case, bad, pattern in _bad_cases(env)}
    assert tuple(cases) == BAD_NAMES
    bad, pattern = cases[name]
    path = write_jsonl(tmp_path / f"{name}.jsonl", [*env["samples"][:2], bad,
                                                    env["samples"][3]])  # fmt: skip
    with pytest.raises(ValueError, match=rf"{name}.jsonl line 3 \(sample id 'b'\): "
                                         rf"{pattern}") as info:  # fmt: skip
        llava_dataset(env, path)
    assert "\n" not in str(info.value)
    skipping = llava_dataset(env, path, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 3


def test_llava_layout_still_reads_only_its_own_keys(env, tmp_path):
    sample = {**env["samples"][0], "id": "b", "images": ["img/a.png"]}
    path = write_jsonl(tmp_path / "d.jsonl", [env["samples"][1], sample])
    with pytest.raises(ValueError, match=r"line 2 \(sample id 'b'\): sample key 'images' is "
                                         r"not read by the loader \(it reads 'id', 'image', "
                                         r"'audio', 'conversations'\)"):  # fmt: skip
        llava_dataset(env, path)


def test_ignored_keys_of_a_messages_sample_are_accepted(env, tmp_path):
    samples = [as_messages(s) for s in env["samples"]]
    samples[2] = {**samples[2], "videos": ["clips/a.mp4"]}
    samples[3]["messages"][2] = {**samples[3]["messages"][2], "loss": 0.0}
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    with pytest.raises(ValueError, match="'videos' is not read"):
        llava_dataset(env, path, ignore_keys=("loss",))
    data = llava_dataset(env, path, ignore_keys=("videos", "loss"))
    _assert_same_data(data, llava_dataset(env, write_jsonl(tmp_path / "l.jsonl",
                                                           env["samples"])))  # fmt: skip


def test_layout_keys_are_the_read_keys_and_cannot_be_ignored(env, tmp_path):
    assert LLAVA_LAYOUT.sample_keys == SAMPLE_KEYS and LLAVA_LAYOUT.turn_keys == TURN_KEYS
    layout_keys = {*LLAVA_LAYOUT.sample_keys, *LLAVA_LAYOUT.turn_keys,
                   *MESSAGES_LAYOUT.sample_keys, *MESSAGES_LAYOUT.turn_keys}  # fmt: skip
    assert layout_keys == READ_KEYS
    path = write_jsonl(tmp_path / "d.jsonl", [as_messages(s) for s in env["samples"]])
    llava = [*SMALL_MODEL, "data.dataset='llava'", f"data.path='{path}'",
             f"data.tokenizer='{env['base'] / 'tok'}'", "modules.vision.in_channels=3"]
    for key in ("images", "audios", "messages", "role", "content"):
        with pytest.raises(ValueError, match=rf"data.ignore_keys=\['{key}'\] is invalid: "
                                             rf"the loader reads '{key}'"):  # fmt: skip
            load_config(DIGITS, [*llava, f"data.ignore_keys=['{key}']"])
    assert load_config(DIGITS, [*llava, "data.ignore_keys=['videos']"]).data.ignore_keys == [
        "videos"]


def test_write_shards_refuses_a_sample_in_both_layouts(env, tmp_path):
    both = {**as_messages(env["samples"][3]), "conversations": env["samples"][3]["conversations"]}
    with pytest.raises(ValueError, match=r"sample 's3' holds both 'conversations'"):
        write_shards([both], env["root"], tmp_path / "shards")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The exported digits task (48 samples) in both layouts, and its tokenizer."""
    base = tmp_path_factory.mktemp("llava_messages_train")
    path = write_llava_task(base / "data", num_samples=48, seed=3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    messages = path.parent / "messages.json"  # a JSON list, beside the media
    messages.write_text(json.dumps([as_messages(r) for r in records]))
    tokenizer = train_bpe_tokenizer(conversation_texts(path), base / "tok", vocab_size=300)
    return {"llava": path, "messages": messages, "tokenizer": tokenizer, "base": base}


def test_messages_layout_trains_like_the_llava_layout(task):
    def overrides(kind: str) -> list[str]:
        return ["data.dataset='llava'", f"data.path='{task[kind]}'",
                f"data.tokenizer='{task['tokenizer']}'", "data.seq_length=96",
                "modules.vision.in_channels=3", "optimizer.lr=3e-3", *ONE_RANK,
                f"log.dir='{task['base'] / kind}'"]  # fmt: skip

    (llava,), (messages,) = run_groups(
        [(1, train_steps, (overrides(kind), NUM_ITERS), {}) for kind in ("llava", "messages")],
        timeout_s=240)  # fmt: skip
    assert messages == llava  # (loss, grad norm, skipped, loss tokens) per iteration, bitwise
    assert all(step[3] > 0 for step in llava) and llava[-1][0] < llava[0][0]
