"""Several images per LLaVA sample (``data.max_images_per_sample``): data, checks, training.

The data is the digits/DTMF task exported as LLaVA JSONL + PNG + WAV (as in
``tests/test_llava_training.py``), with every other image sample given a second image
and a second ``<image>``: samples hold 0, 1 or 2 images. With ``max_images_per_sample =
2`` a batch carries ``image`` ``[B, 2, 3, 8, 8]`` and ``has_image`` ``[B, 2]``; the k-th
``<image>`` of a conversation takes the k-th file of its list.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tests.reference as reference
from mimotron.config import load_config
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data import collate
from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.llava_check import open_image
from mimotron.data.packing import collate_packed, pack_rows
from mimotron.forked_ranks import run_groups
from mimotron.models.build import build_mimo_model
from mimotron.training.language_step import input_kind_counts
from tests.common import BASE, DIGITS, ONE_RANK, coloc, colocated, engine_run
from tests.hf_data import collate_kwargs, llava_setup
from tests.parity import assert_steps_match, assert_weights_match

MAX_IMAGES = 2
NUM_ITERS = 4


def _add_second_images(path: Path) -> Path:
    """Give every other image sample of a written task a second image (another sample's
    file) and a second ``<image>`` right after its first."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    pictures = [r["image"] for r in records if "image" in r]
    for k, record in enumerate(r for r in records if "image" in r):
        if k % 2 == 0:
            second = pictures[(pictures.index(record["image"]) + 1) % len(pictures)]
            record["image"] = [record["image"], second]
            turn = record["conversations"][0]
            turn["value"] = turn["value"].replace("<image>", "<image>\n<image>", 1)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The task with 0, 1 and 2 images per sample; overrides selecting it (K = 2)."""
    base = tmp_path_factory.mktemp("llava_multi")
    path = _add_second_images(write_llava_task(base / "data", num_samples=40, seed=5))
    tokenizer = train_bpe_tokenizer(conversation_texts(path), base / "tok", vocab_size=300)
    data = ["data.dataset='llava'", f"data.path='{path}'", f"data.tokenizer='{tokenizer}'",
            "data.seq_length=128", "modules.vision.in_channels=3", "optimizer.lr=3e-3",
            f"data.index_dir='{base / 'index'}'"]
    return {"path": path, "base": base, "data": data,
            "overrides": [*data, f"data.max_images_per_sample={MAX_IMAGES}"]}


def _files(task: object, index: int) -> list[Path]:
    """The image files sample ``index`` of the task lists, in order (from its JSON)."""
    return list(task.dataset.record(int(task.indices[index])).images)


def _decoded(task: object, file: Path) -> torch.Tensor:
    processor = task.dataset.image_processor
    return processor(open_image(file, processor))


def test_images_fill_their_placeholders_in_order(multi):
    """A collated batch holds each sample's images in list order, zeros after; merged,
    the k-th run of image placeholders of a row holds the k-th image encoded alone."""
    cfg, tokenizer, task = llava_setup(multi["overrides"])
    samples = [task.get(i) for i in range(16)]
    batch = collate(samples, task.seq_length, **collate_kwargs(task))
    assert batch["image"].shape == (16, MAX_IMAGES, *task.image_shape)
    counts = [len(_files(task, i)) for i in range(16)]
    assert sorted(set(counts)) == [0, 1, 2], counts
    assert batch["has_image"].tolist() == [[k < n for k in range(MAX_IMAGES)] for n in counts]
    for i, n in enumerate(counts):
        for k, file in enumerate(_files(task, i)):
            torch.testing.assert_close(batch["image"][i, k], _decoded(task, file))
        assert not batch["image"][i, n:].any()
    pid = tokenizer.placeholder_id("image")
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names}
    torch.manual_seed(0)
    model = build_mimo_model(cfg, padded_vocab_size(tokenizer.vocab_size), placeholders).eval()
    tokens = batch["tokens"]
    with torch.no_grad():
        embeds = {n: model.encode(n, batch) for n in model.modality_submodules}
        present = {n: model.present_mask(n, batch) for n in embeds}
        merged = model.merge_embeddings(tokens, model.language_model.embed_tokens(tokens),
                                        embeds, present)
    two = 0
    for i, n in enumerate(counts):
        at = merged[i][tokens[i] == pid].reshape(n, -1 if n else 0, merged.shape[-1])
        alone = [_decoded(task, f) for f in _files(task, i)]
        for k, image in enumerate(alone):
            one = {"image": image[None], "has_image": torch.tensor([True])}
            with torch.no_grad():
                torch.testing.assert_close(at[k], model.encode("vision", one)[0],
                                           rtol=1e-5, atol=1e-6)
        if n == 2:
            two += 1
            assert not torch.allclose(alone[0], alone[1]), "a sample's two images are equal"
    assert two >= 2


def test_index_counts_every_image_and_ranks_decode_only_their_media(multi, monkeypatch):
    """The index's length of a sample expands every image's placeholders; a rank loading
    the text alone decodes no image but knows each sample's image count; a rank loading
    the images alone gets them all."""
    cfg, tokenizer, task = llava_setup(multi["overrides"])
    pid = tokenizer.placeholder_id("image")
    tokens_per_image = cfg.modules["vision"].num_output_tokens
    samples = [task.get(i) for i in range(12)]
    for i, sample in enumerate(samples):
        n = len(_files(task, i))
        assert task.length_of(i) == sample["tokens"].numel() == sample["length"]
        assert int((sample["tokens"] == pid).sum()) == n * tokens_per_image
    decoded: list[object] = []
    import mimotron.data.llava_check as llava_check

    counted = llava_check.open_image
    monkeypatch.setattr(llava_check, "open_image",
                        lambda *a, **k: decoded.append(a[0]) or counted(*a, **k))
    task.dataset.restrict_loading({"text", "audio"})
    text_only = [task.get(i) for i in range(12)]
    assert decoded == [], "a rank without the vision tower decoded images"
    task.dataset.restrict_loading({"image"})
    images_only = [task.get(i) for i in range(12)]
    assert len(decoded) == sum(len(_files(task, i)) for i in range(12))
    for full, text, image in zip(samples, text_only, images_only, strict=True):
        assert text["image"] is None and image["tokens"].numel() == 0
        assert torch.equal(text["has_image"], full["has_image"])
        assert torch.equal(image["has_image"], full["has_image"])
        if full["image"] is not None:
            assert torch.equal(image["image"], full["image"])


def test_packed_rows_hold_every_image_of_every_document(multi):
    """Packed, a row's mask counts all its documents' images and lists them in document
    order, each document's in its own order."""
    _, _, task = llava_setup([*multi["overrides"], "data.packing=true"])
    rows, _ = pack_rows(task.stream(0).samples, 0, 6, task.seq_length)
    batch = collate_packed(rows, task.seq_length, **collate_kwargs(task))
    want = [[f for doc in row for f in _files(task, doc["index"])] for row in rows]
    assert batch["image"].shape[1] == max(len(w) for w in want) >= 3
    assert batch["has_image"].sum(1).tolist() == [len(w) for w in want]
    for i, files in enumerate(want):
        for k, file in enumerate(files):
            torch.testing.assert_close(batch["image"][i, k], _decoded(task, file))
    assert any(len(_files(task, d["index"])) == 2 for row in rows for d in row)


def _rewrite(multi: dict, name: str, edit: object) -> str:
    """The data file's samples of at most one image, line 2 replaced by
    ``edit(line 2's record)``."""
    lines = [x for x in multi["path"].read_text().splitlines()
             if not isinstance(json.loads(x).get("image"), list)]
    lines[1] = json.dumps(edit(json.loads(lines[1])))
    out = multi["path"].parent / name
    out.write_text("\n".join(lines) + "\n")
    return str(out)


def _with_images(record: dict, files: list[str], placeholders: int) -> dict:
    text = "<image>" * placeholders + "\nwhich digits are these"
    return record | {"id": "many-2", "image": files,
                     "conversations": [{"from": "human", "value": text},
                                       record["conversations"][1]]}


@pytest.mark.parametrize("files,placeholders,limit,message", [
    (2, 2, 1, "2 image files and <image> placeholders: more than "
              "data.max_images_per_sample=1 (raise data.max_images_per_sample to at least 2"),
    (3, 3, 2, "3 image files and <image> placeholders: more than "
              "data.max_images_per_sample=2 (raise data.max_images_per_sample to at least 3"),
    (2, 1, 2, "1 <image> placeholder(s) in the conversation but 2 image file(s)"),
])
def test_check_refuses_too_many_images_or_a_count_mismatch(multi, files, placeholders, limit,
                                                           message):
    """One line naming the file, line, sample id, both counts and the key to raise."""
    pictures = sorted(p.relative_to(multi["path"].parent).as_posix()
                      for p in (multi["path"].parent / "images").glob("*.png"))[:files]
    path = _rewrite(multi, f"bad-{files}-{placeholders}-{limit}.jsonl",
                    lambda r: _with_images(r, pictures, placeholders))
    with pytest.raises(ValueError) as err:
        llava_setup([*multi["data"], f"data.path='{path}'", f"data.max_images_per_sample={limit}"])
    line = str(err.value)
    assert "\n" not in line and "line 2" in line and "'many-2'" in line, line
    assert message in line, line


def test_config_key_is_checked_and_one_keeps_the_flag_format(multi):
    """0 is refused; above 1 is for LLaVA data only; 1 (the default) refuses a second
    image and keeps ``has_image`` a ``[B]`` flag."""
    for value, extra in ((0, multi["data"]), (2, [])):
        with pytest.raises(ValueError, match=f"data.max_images_per_sample={value} is invalid"):
            load_config(DIGITS, [*BASE, *extra, f"data.max_images_per_sample={value}"])
    _, _, task = llava_setup([*multi["data"], "data.skip_bad_samples=true"])
    assert task.num_skipped == sum(isinstance(json.loads(x).get("image"), list)
                                   for x in multi["path"].read_text().splitlines()) >= 5
    assert "data.max_images_per_sample=1" in task.dataset.bad_samples[0].reason
    batch = collate([task.get(i) for i in range(4)], task.seq_length, **collate_kwargs(task))
    assert batch["has_image"].dim() == 1 and batch["image"].dim() == 4


def test_collate_refuses_a_mix_of_flags_and_masks():
    """A batch's samples agree on K (a flag sample among mask samples is an error), and a
    sample's images match its mask's count."""
    mask = torch.tensor([True, False])
    two = {"tokens": torch.ones(3, dtype=torch.long), "labels": torch.ones(3, dtype=torch.long),
           "loss_mask": torch.ones(3), "image": torch.zeros(1, 1, 8, 8), "has_image": mask,
           "audio": None, "index": 0}
    flag = two | {"image": torch.zeros(1, 8, 8), "has_image": True, "index": 1}
    with pytest.raises(ValueError, match="samples disagree on how many image items"):
        collate([two, flag], 4)
    with pytest.raises(ValueError, match=r"expected \(2, 1, 8, 8\)"):
        collate([two | {"has_image": torch.tensor([True, True])}], 4)
    batch = collate([two, two | {"image": None, "has_image": torch.tensor([False, False])}], 4)
    assert batch["has_image"].tolist() == [[True, False], [False, False]]


def test_evaluation_counts_a_sample_with_images_once():
    """The eval breakdown's ``samples_image`` counts samples (any of their K items)."""
    model = torch.nn.Module()
    model.modality_of = {"vision": "image"}
    batch = {"has_image": torch.tensor([[True, True], [True, False], [False, False]])}
    valid = torch.tensor([True, True, True])
    out = input_kind_counts(model, batch, torch.tensor([True, False, True]), valid)
    assert (int(out["samples_image"]), int(out["correct_image"])) == (2, 1)
    assert (int(out["samples_text"]), int(out["correct_text"])) == (1, 1)


def _reference_batch(task: object, stream: object, k: int, gbs: int) -> dict:
    """Global batch ``k`` built here, without ``collate``: texts padded, each sample's
    images in its first slots."""
    samples = stream.samples(k * gbs, gbs)
    seq = task.seq_length
    batch = {"tokens": torch.full((gbs, seq), task.pad_id), "labels": torch.full(
        (gbs, seq), task.pad_id), "loss_mask": torch.zeros(gbs, seq),
        "image": torch.zeros(gbs, MAX_IMAGES, *task.image_shape),
        "has_image": torch.zeros(gbs, MAX_IMAGES, dtype=torch.bool),
        "audio": torch.zeros(gbs, *task.audio_shape), "has_audio": torch.zeros(gbs, dtype=bool)}
    for i, s in enumerate(samples):
        n = s["tokens"].numel()
        for key in ("tokens", "labels", "loss_mask"):
            batch[key][i, :n] = s[key]
        files = _files(task, s["index"])
        for j, file in enumerate(files):
            batch["image"][i, j] = _decoded(task, file)
        batch["has_image"][i, :len(files)] = True
        if s["audio"] is not None:
            batch["audio"][i], batch["has_audio"][i] = s["audio"], True
    return batch


def test_training_matches_across_layouts_and_the_plain_loop(multi):
    """1 rank, and vision DP 2 into a language model TP 2 (colocated), train the same
    losses (1e-5) on samples of 0, 1 and 2 images; the layout matches the plain loop on
    batches built without collate (steps and weights, 1e-4)."""
    over = multi["overrides"]
    layout = coloc({"data": 2}, {"data": 2}, {"data": 1, "tensor": 2})
    (one,), split = run_groups([(1, engine_run, ([*over, *ONE_RANK], NUM_ITERS), {}),
                                (2, engine_run, ([*over, *layout], NUM_ITERS), {})],
                               timeout_s=300)
    losses = [s[0] for s in one["steps"]]
    for result in split:
        assert [s[3] for s in result["steps"]] == [s[3] for s in one["steps"]]
        assert [s[0] for s in result["steps"]] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    cfg, tokenizer, task = llava_setup(over)
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names}
    vocab = -(-tokenizer.vocab_size // reference.VOCAB_MULTIPLE) * reference.VOCAB_MULTIPLE

    def setup(overrides: object) -> tuple:  # the reference's prologue, on this data
        return cfg, task, lambda: build_mimo_model(cfg, vocab, placeholders)

    batches: list[dict] = []

    def batch_at(*args: object) -> dict:
        batches.append(_reference_batch(*args))
        return batches[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "reference_setup", setup)
        ref = reference.reference_run(tuple(over), NUM_ITERS, batch_at=batch_at)
    assert all(sorted(set(b["has_image"].sum(1).tolist())) == [0, 1, 2] for b in batches)
    assert_steps_match(split, ref)
    assert_weights_match(split, ref)


def test_packed_multi_image_training_is_layout_independent(multi):
    """Packed rows holding 2-image documents: 1 rank and DP 2 train the same losses."""
    over = [*multi["overrides"], "data.packing=true", "train.global_batch_size=8",
            "train.micro_batch_size=4"]
    (one,), dp2 = run_groups([(1, engine_run, ([*over, *ONE_RANK], NUM_ITERS), {}),
                              (2, engine_run, ([*over, *colocated(2)], NUM_ITERS), {})],
                             timeout_s=300)
    for result in dp2:
        assert [s[3] for s in result["steps"]] == [s[3] for s in one["steps"]]
        assert [s[0] for s in result["steps"]] == pytest.approx(
            [s[0] for s in one["steps"]], rel=1e-5, abs=1e-5)


def test_the_memory_estimate_holds_every_image_of_a_sample(multi):
    """The vision encoder runs up to ``max_images_per_sample`` images per sample: its
    activations in the estimate scale with it; the language model's do not."""
    from mimotron.estimate.memory import estimate_memory
    from mimotron.parallel.layout import check_layout

    def parts(overrides: list[str]) -> dict[str, int]:
        cfg = load_config(DIGITS, BASE + overrides)
        return {e.module: e.activations for per_rank in
                estimate_memory(cfg, check_layout(cfg), 64).values() for e in per_rank}

    one = parts([o for o in multi["overrides"] if "max_images_per_sample" not in o])
    two = parts(multi["overrides"])
    assert two["vision"] == 2 * one["vision"] and two["language"] == one["language"]


def test_a_placeholder_count_mismatch_with_several_images_is_a_value_error():
    from mimotron.models.mimo import MimoModel

    model = MimoModel({}, None, {"vision": 5}, {"vision": "image"})
    tokens = torch.tensor([[5, 5, 1, 1], [5, 5, 5, 1]])  # row 1: 3 placeholders, not 4
    present = torch.tensor([[True, False], [True, True]])
    embeds = torch.zeros(3, 2, 8)  # three images of 2 tokens
    with pytest.raises(ValueError, match="sample 1: 3 placeholder tokens .* expected 4 "
                                         r"\(present"):
        model._check_counts("vision", tokens == 5, embeds, present)


@pytest.mark.parametrize("k", [1, 2])
def test_a_sample_whose_json_no_longer_reads_is_skipped_with_no_media(multi, k, monkeypatch):
    """data.skip_bad_samples: a sample line edited after the check loads as padding with
    no loss and no media (its tokens hold no placeholder), and the batch merges."""
    from mimotron.data.llava_file import SampleError

    over = [*multi["data"], "data.skip_bad_samples=true", f"data.max_images_per_sample={k}"]
    cfg, tokenizer, task = llava_setup(over)
    dataset = task.dataset
    target = next(i for i in range(8) if task.get(i)["image"] is not None)
    real, record = int(task.indices[target]), dataset.record
    monkeypatch.setattr(dataset, "record", lambda i: (_ for _ in ()).throw(
        SampleError("edited")) if i == real else record(i))
    samples = [task.get(i) for i in range(8)]
    assert dataset.load_failures and not bool(torch.as_tensor(samples[target]["has_image"]).any())
    assert float(samples[target]["loss_mask"].sum()) == 0
    batch = collate(samples, task.seq_length, **collate_kwargs(task))
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    model = build_mimo_model(cfg, padded_vocab_size(tokenizer.vocab_size), placeholders).eval()
    tokens = batch["tokens"]
    with torch.no_grad():
        embeds = {n: model.encode(n, batch) for n in model.modality_submodules}
        present = {n: model.present_mask(n, batch) for n in embeds}
        model.merge_embeddings(tokens, model.language_model.embed_tokens(tokens), embeds,
                               present)


def test_generation_takes_as_many_images_as_training_and_fills_them_in_order(multi):
    """``Generator.encode`` of a prompt with two images: the k-th placeholder run holds
    the k-th file encoded alone; a third image is refused naming the key."""
    from mimotron.generate import Generator, LoadedModel

    cfg, tokenizer, task = llava_setup(multi["overrides"])
    index = next(i for i in range(16) if len(_files(task, i)) == 2)
    files = _files(task, index)
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    torch.manual_seed(0)
    model = build_mimo_model(cfg, padded_vocab_size(tokenizer.vocab_size), placeholders).eval()
    generator = Generator(LoadedModel(cfg, model, tokenizer, None, torch.device("cpu")))
    with torch.no_grad():
        prompt, hidden = generator.encode("what digits are these", files)
        tokens = torch.tensor(prompt.tokens)
        runs = hidden[0][tokens == tokenizer.placeholder_id("image")].reshape(2, -1,
                                                                            hidden.shape[-1])
        for k, file in enumerate(files):
            one = {"image": _decoded(task, file)[None], "has_image": torch.tensor([True])}
            torch.testing.assert_close(runs[k], model.encode("vision", one)[0],
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="3 --image files were given: at most 2 per prompt"):
        generator.encode("three", [*files, files[0]])


def test_the_planner_bridges_every_image_of_a_sample(multi):
    """The planner's bridge between split vision and language ranks carries every image's
    tokens: without its fixed latency, twice the bytes with two images per sample."""
    from mimotron.parallel.layout import check_layout
    from mimotron.planner.devices import DeviceSpec
    from mimotron.planner.lanes import bridge_seconds
    from mimotron.planner.terms import Links

    device = DeviceSpec("test", 1e12, 10**9, 8, intra_node_bytes_per_s=1e9,
                        inter_node_bytes_per_s=1e9, latency_s=0.0)
    split = ["modules.vision.parallel.rank_offset=0", "modules.audio.parallel.rank_offset=1",
             "modules.language.parallel.rank_offset=2"]

    def seconds(overrides: list[str]) -> float:
        cfg = load_config(DIGITS, [*BASE, *overrides, *split,
                                   "modules.audio.num_audio_tokens=1"])
        return bridge_seconds(cfg, check_layout(cfg), Links(device, None))

    one = seconds([o for o in multi["overrides"] if "max_images_per_sample" not in o])
    assert one > 0 and seconds(multi["overrides"]) == pytest.approx(2 * one)
