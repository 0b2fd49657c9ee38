"""Faults the LLaVA data check, the tokenizer and the chat template must stop before launch.

Each test builds its files in ``tmp_path`` (tests/hf_data.py: PNG/JSONL writers and a
locally trained tokenizer); nothing is downloaded.

* A sample key the loader does not read (``video``) is refused, naming the key and the
  sample, unless ``data.ignore_keys`` lists it: nothing in the data is silently dropped.
* An image of extreme aspect ratio is refused from its header (the processor's resized
  size over the bound), before anything is allocated; ``skip_bad_samples`` skips it.
* A chat template that loops (almost) for ever is refused when the tokenizer is built,
  naming its folder, after a fixed number of loop iterations (no wall clock).
* A ``tokenizer.json`` that is not a tokenizers file names the file and what is missing.
* A vocabulary whose embedding and head dwarf the rest of the model is refused (unless
  ``data.allow_large_vocab``), naming the sizes.
"""

from __future__ import annotations

import io
import shutil
import tarfile

import pytest

from mimotron.config import load_config
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.media import ImageProcessor
from mimotron.data.webdataset import write_shards
from tests.common import DIGITS, SMALL_MODEL
from tests.hf_data import (
    CLIP_CONFIG,
    llava_dataset,
    llava_env,
    make_tokenizer,
    write_jsonl,
    write_png,
)

IMAGE_TURNS = [{"from": "human", "value": "<image> what digit is in this picture"},
               {"from": "gpt", "value": "the digit is seven"}]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing and a media root holding the four good samples' files."""
    return llava_env(tmp_path_factory.mktemp("faults_checks"))


dataset = llava_dataset


# ---- 1. keys the loader does not read ---------------------------------------------------
def _with_video(env, tmp_path):
    samples = [dict(s) for s in env["samples"]]
    samples[2]["video"] = "clips/a.mp4"  # line 3: trained as image + audio + text only
    return write_jsonl(tmp_path / "d.jsonl", samples)


def test_unused_sample_key_is_refused_naming_key_and_line(env, tmp_path):
    path = _with_video(env, tmp_path)
    with pytest.raises(ValueError, match=r"d.jsonl line 3 \(sample id 's2'\): .*'video'.*"
                                         r"data.ignore_keys") as info:  # fmt: skip
        dataset(env, path)
    assert "\n" not in str(info.value)
    skipping = dataset(env, path, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 3


def test_ignored_keys_are_accepted_and_the_used_keys_always_are(env, tmp_path):
    path = _with_video(env, tmp_path)
    data = dataset(env, path, ignore_keys=("video",))
    assert len(data) == 4 and data.num_skipped == 0
    # id, image, audio and conversations (from / value turns): the good samples pass.
    assert len(dataset(env, write_jsonl(tmp_path / "good.jsonl", env["samples"]))) == 4


def test_an_unread_shard_member_is_refused_unless_its_extension_is_ignored(env, tmp_path):
    """A WebDataset sample's ``.mp4`` member is read by nobody: refused, naming it."""
    shard = write_shards(env["samples"][:2], env["root"], tmp_path / "shards")[0]
    with tarfile.open(shard, "a") as archive:  # a member of the last sample's key
        last = archive.getnames()[-1].partition(".")[0]
        info = tarfile.TarInfo(f"{last}.mp4")
        info.size = 4
        archive.addfile(info, io.BytesIO(b"\0\0\0\0"))
    with pytest.raises(ValueError, match=rf"shard member '{last}.mp4' is not read .*'mp4'.*"
                                         r"data.ignore_keys"):  # fmt: skip
        dataset(env, shard.parent)
    assert len(dataset(env, shard.parent, ignore_keys=("mp4",))) == 2


def test_unused_turn_key_is_refused_unless_ignored(env, tmp_path):
    samples = [dict(s) for s in env["samples"]]
    turns = [dict(t) for t in samples[3]["conversations"]]
    turns[2]["weight"] = 0.0  # a per-turn loss weight the loss would not apply
    samples[3]["conversations"] = turns
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    with pytest.raises(ValueError, match=r"line 4 \(sample id 's3'\): .*"
                                         r"conversations\[2\] key 'weight'"):  # fmt: skip
        dataset(env, path)
    assert len(dataset(env, path, ignore_keys=("weight",))) == 4


def test_ignore_keys_is_refused_for_a_key_the_loader_reads(env, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", env["samples"])
    llava = [*SMALL_MODEL, "data.dataset='llava'", f"data.path='{path}'",
             f"data.tokenizer='{env['base'] / 'tok'}'", "modules.vision.in_channels=3"]
    assert load_config(DIGITS, [*llava, "data.ignore_keys=['video']"]).data.ignore_keys == [
        "video"]
    for key in ("image", "value"):
        with pytest.raises(ValueError, match=rf"data.ignore_keys=\['{key}'\] is invalid: "
                                             rf"the loader reads '{key}'"):  # fmt: skip
            load_config(DIGITS, [*llava, f"data.ignore_keys=['{key}']"])


# ---- 2. extreme aspect ratio --------------------------------------------------------------
def test_extreme_aspect_image_is_refused_from_its_header(env, tmp_path):
    """1 x 200 000 pixels (a 1 KB PNG) would resize to 20 x 4 000 000 under shortest_edge
    20: refused with the file named, before any decode or resize."""
    write_png(env["root"] / "img" / "strip.png", 200_000, 1, seed=5)
    samples = [env["samples"][3], {"id": "strip", "image": "img/strip.png",
                                   "conversations": IMAGE_TURNS}]  # fmt: skip
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    with pytest.raises(ValueError, match=r"d.jsonl line 2 \(sample id 'strip'\): .*strip.png"
                                         r".*1 x 200000.*20 x 4000000") as info:  # fmt: skip
        dataset(env, path)
    assert "\n" not in str(info.value)
    skipping = dataset(env, path, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 1
    assert "strip.png" in skipping.bad_samples[0].reason


def test_resize_bound_is_exact_and_applied_before_resizing():
    from PIL import Image

    from mimotron.data.media import MAX_RESIZE_FACTOR

    images = ImageProcessor.from_dict(CLIP_CONFIG)  # shortest edge 20, crop 16 x 16
    assert MAX_RESIZE_FACTOR * 16 * 16 == 16384  # the bound, in resized pixels
    images.check_size(1, 40)  # resized to 20 x 800 = 16 000 pixels: within
    images.check_size(40, 1)  # (width x height) the same, lying down
    with pytest.raises(ValueError, match=r"1 x 41 pixels .* to 20 x 820 = 16400 pixels, "
                                         r"over the bound of 16384"):  # fmt: skip
        images.check_size(1, 41)
    with pytest.raises(ValueError, match=r"41 x 1 pixels .* to 820 x 20 = 16400 pixels"):
        images.check_size(41, 1)
    # A file that changed after the check is refused by the load too (a ValueError the
    # load skips with skip_bad_samples), not resized into a MemoryError.
    with pytest.raises(ValueError, match="1 x 200000 pixels"):
        images(Image.new("RGB", (1, 200_000)))
    square = ImageProcessor(size=(("height", 16), ("width", 16)), do_center_crop=False)
    square.check_size(1, 10**7)  # resized to a fixed 16 x 16: no bound needed


# ---- 3. a chat template that loops for ever -------------------------------------------------
LOOPING = ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{{ m['content'] }}{% endfor %}")
RECURSIVE = ("{% for i in range(100000) recursive %}{% if loop.depth < 3 %}"
             "{{ loop(range(100000)) }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", [LOOPING, RECURSIVE], ids=["nested", "recursive"])
def test_looping_chat_template_is_refused_naming_the_folder(tmp_path, template):
    from mimotron.data.template_check import RENDER_LOOP_LIMIT

    folder = make_tokenizer(tmp_path / "tok", chat_template=template)
    with pytest.raises(ValueError, match=rf"data.tokenizer='{folder}'.*chat template.*"
                                         rf"{RENDER_LOOP_LIMIT} loop iterations") as info:
        HFTokenizer(folder)
    assert "\n" not in str(info.value)


def test_templates_that_render_within_the_bound_are_accepted(tmp_path):
    bounded = ("{% for m in messages %}{% for i in range(1000) %}{% endfor %}"
               "{{ m['content'] }}{% endfor %}")
    HFTokenizer(make_tokenizer(tmp_path / "bounded", chat_template=bounded))
    HFTokenizer(make_tokenizer(tmp_path / "chatml"))  # the shipped ChatML template
    raising = "{{ raise_exception('only user turns') }}"  # raised per sample, as before
    HFTokenizer(make_tokenizer(tmp_path / "raising", chat_template=raising))


# ---- 4. a tokenizer.json that is not a tokenizers file -------------------------------------
@pytest.mark.parametrize("text,missing", [("{}", "'added_tokens', 'model'"),
                                          ('{"added_tokens": []}', "'model'"),
                                          ("[]", "a JSON object"),
                                          ("{not json", "not JSON")])  # fmt: skip
def test_broken_tokenizer_json_names_the_file_and_what_is_missing(tmp_path, text, missing):
    folder = tmp_path / "tok"
    shutil.copytree(make_tokenizer(tmp_path / "good"), folder)
    (folder / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError) as info:
        HFTokenizer(folder)
    message = str(info.value)
    assert str(folder / "tokenizer.json") in message and missing in message, message
    assert "\n" not in message


# ---- 5. a vocabulary that dwarfs the model ---------------------------------------------------
def test_vocabulary_dwarfing_the_model_is_refused_unless_allowed():
    from mimotron.data.vocab_check import vocabulary_check

    cfg = load_config(DIGITS, SMALL_MODEL)  # language: hidden 64, untied embedding + head
    # A 3M-entry tokenizer: 3 000 064 rows (padded) x 64 x 2 = 384 M parameters next to
    # 125 440 in the layers of the three modules.
    with pytest.raises(ValueError, match=r"vocabulary of 3000002 ids.*3000064 x 64 x 2 = "
                                         r"384008192 parameters, 3061 times the 125440 .*"
                                         r"data.allow_large_vocab=true") as info:  # fmt: skip
        vocabulary_check(cfg, 3_000_002)
    assert "\n" not in str(info.value)
    cfg.data.allow_large_vocab = True
    vocabulary_check(cfg, 3_000_002)


def test_vocabulary_rule_needs_both_the_share_and_the_absolute_size():
    from mimotron.data.vocab_check import VOCAB_ABSOLUTE_LIMIT, VOCAB_SHARE_LIMIT, vocabulary_check

    cfg = load_config(DIGITS, SMALL_MODEL)
    h = cfg.modules["language"].hidden_size
    vocabulary_check(cfg, 32_000)  # 33 x the rest, 4 M parameters: accepted
    just_under = VOCAB_ABSOLUTE_LIMIT // (2 * h) - 64  # padded to a multiple of 64
    vocabulary_check(cfg, just_under)
    with pytest.raises(ValueError, match="allow_large_vocab"):
        vocabulary_check(cfg, just_under + 128)
    big = load_config(DIGITS, ["modules.language.hidden_size=1024",
                               "modules.language.num_layers=8"])  # fmt: skip
    # 1024 wide, 8 layers (~100 M parameters): 300 000 ids (614 M parameters, over the
    # absolute bound) are within the share.
    assert VOCAB_ABSOLUTE_LIMIT < 300_032 * 1024 * 2 < VOCAB_SHARE_LIMIT * 8 * 12 * 1024**2
    vocabulary_check(big, 300_000)

