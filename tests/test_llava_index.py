"""The LLaVA sample index: checked once, kept, reused, shared by the ranks of a run.

* a second start over the same data reads the index and checks nothing (the checks are
  counted by a spy on :meth:`SampleChecker.check_many`); a JSON list is read from its
  converted copy;
* a changed file (size or modification time) or check setting is checked again; a
  setting the check does not depend on (skip_bad_samples) is not;
* a refused check leaves no index (a fixed media file is seen next time); a kept one
  with bad samples refuses a non-skipping run alike, without checking;
* a rank holds neither the file nor its parse: building from the index and loading a
  few samples allocates far less than the file's size, and reads only their bytes;
* the ranks of a run check once (rank 0) and share rank 0's one-line error;
* a check split over forked processes gives the index one process gives.

Files come from tests/hf_data.py (a locally trained tokenizer, PNG/WAV, JSONL).
"""

from __future__ import annotations

import json
import os
import tracemalloc
from unittest import mock

import numpy as np
import pytest
import torch

import mimotron.data.llava_source as llava_source
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava import LlavaDataset
from mimotron.data.media import AudioFeatures, ImageProcessor
from mimotron.forked_ranks import run_ranks
from tests.hf_data import NUM_TOKENS, counting_checks, llava_dataset, llava_env, write_jsonl

BAD = {"id": "bad", "image": "img/missing.png", "conversations": [
    {"from": "human", "value": "<image> what is this"}, {"from": "gpt", "value": "seven"}]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing and a media root holding the four good samples' files."""
    return llava_env(tmp_path_factory.mktemp("llava_index"))


dataset = llava_dataset




def assert_same_samples(a: LlavaDataset, b: LlavaDataset) -> None:
    assert len(a) == len(b) and np.array_equal(a.lengths, b.lengths)
    for i in range(len(a)):
        x, y = a.load(i), b.load(i)
        assert x["sample_id"] == y["sample_id"] and x["length"] == y["length"]
        for key in ("tokens", "labels", "loss_mask", "image", "audio"):
            assert (x[key] is None and y[key] is None) or torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_a_second_start_reads_the_index_and_checks_nothing(env, tmp_path, kind):
    samples = env["samples"]
    path = (write_jsonl(tmp_path / "d.jsonl", samples) if kind == "jsonl" else
            tmp_path / "d.json")  # fmt: skip
    if kind == "json":
        path.write_text(json.dumps(samples, indent=2))
    with counting_checks() as checked:
        first = dataset(env, path, tmp_path / "index")
    assert checked == (["line 1", "line 2", "line 3", "line 4"] if kind == "jsonl" else
                       ["item 0", "item 1", "item 2", "item 3"])  # fmt: skip
    with counting_checks() as checked:
        second = dataset(env, path, tmp_path / "index")
    assert checked == [] and second.index.folder == first.index.folder
    assert second.lengths.tolist() == [int(x) for x in first.lengths] and all(second.lengths > 0)
    if kind == "json":  # read from the index's one-item-per-line copy, not the list
        assert second.source.data_file == second.index.folder / "samples.jsonl"
    assert_same_samples(first, second)
    assert_same_samples(first, dataset(env, path, None))  # a private index: the same


def test_a_changed_file_or_check_setting_is_checked_again(env, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", env["samples"])
    index = tmp_path / "index"
    dataset(env, path, index)
    with counting_checks() as checked:
        dataset(env, path, index, skip_bad_samples=True)  # not a setting of the check
    assert checked == []
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, touched
    with counting_checks() as checked:
        dataset(env, path, index)
    assert len(checked) == 4
    with counting_checks() as checked:
        dataset(env, path, index, seq_length=95)
    assert len(checked) == 4
    write_jsonl(path, [*env["samples"], env["samples"][0]])
    with counting_checks() as checked:
        grown = dataset(env, path, index)
    assert len(checked) == 5 and len(grown) == 5
    assert len(list(index.glob("*/index.json"))) == 4


def test_a_refused_check_is_not_kept_and_a_kept_index_refuses_alike(env, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [*env["samples"][:2], BAD, env["samples"][3]])
    index = tmp_path / "index"
    with pytest.raises(ValueError, match=r"d.jsonl line 3 \(sample id 'bad'\): .*missing.png"
                       ) as refused:  # fmt: skip
        dataset(env, path, index)
    assert not list(index.glob("*/index.json")), "a refused check must not be kept"
    skipping = dataset(env, path, index, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 3
    with counting_checks() as checked, pytest.raises(ValueError) as again:
        dataset(env, path, index)
    assert checked == [] and str(again.value) == str(refused.value)


def test_a_rank_holds_neither_the_file_nor_its_parse(env, tmp_path):
    """~5 MB of JSONL (each line carries 40 kB of metadata): building from the index and
    loading 4 samples allocates well under a tenth of it and reads only their lines."""
    text = env["samples"][3]
    lines = [{**text, "id": f"t{k}", "meta": f"{k:05d}" + "x" * 40_000} for k in range(120)]
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    index = tmp_path / "index"
    dataset(env, path, index, ignore_keys=("meta",))  # the check, once
    read: list[int] = []
    original = llava_source.read_jsonl_sample

    def spy(file, offset, size, converted=False, crc=None):
        read.append(size)
        return original(file, offset, size, converted, crc)

    tracemalloc.start()
    try:
        with counting_checks() as checked, \
                mock.patch.object(llava_source, "read_jsonl_sample", spy):
            data = dataset(env, path, index, ignore_keys=("meta",))
            loaded = [data.load(i)["sample_id"] for i in (0, 7, 50, 119)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert checked == [] and loaded == ["t0", "t7", "t50", "t119"]
    assert peak < size / 10, f"{peak} bytes allocated for a {size}-byte file"
    assert len(read) == 4 and sum(read) < 4 * 41_000


def _rank_builds(rank: int, world: int, env_paths: dict, good: str, bad: str,
                 index: str) -> tuple:  # fmt: skip
    """One rank of a run: build the good file's dataset, then the bad one's."""
    del world
    env = {"tokenizer": HFTokenizer(env_paths["tok"]), "root": env_paths["root"],
           "images": ImageProcessor.from_pretrained(env_paths["clip"]),
           "audio": AudioFeatures(env_paths["whisper"])}  # fmt: skip
    with counting_checks() as checked:
        data = dataset(env, good, index)
        error = ""
        try:
            dataset(env, bad, index)
        except ValueError as exc:
            error = str(exc)
    return len(checked), len(data), [int(x) for x in data.lengths], error


def test_the_ranks_of_a_run_check_once_and_share_the_error(env, tmp_path):
    """Two ranks, no launcher check before: rank 0 checks each file, rank 1 waits and reads
    its index, or raises rank 0's one-line error (a refused index is never written)."""
    good = write_jsonl(tmp_path / "good.jsonl", env["samples"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [env["samples"][0], BAD])
    base = env["base"]
    paths = {"tok": base / "tok", "root": env["root"], "clip": base / "clip",
             "whisper": base / "whisper"}  # fmt: skip
    first, second = run_ranks(2, _rank_builds, paths, str(good), str(bad),
                              str(tmp_path / "index"), timeout_s=120)  # fmt: skip
    assert (first[0], second[0]) == (4 + 2, 0)
    assert first[1:3] == second[1:3] and second[1] == 4
    assert first[3] == second[3] and "bad.jsonl line 2 (sample id 'bad')" in first[3]
    assert "\n" not in first[3]


def test_a_check_in_forked_processes_equals_one_process(env, tmp_path, monkeypatch):
    # 13 samples in chunks of 3 lines: 5 chunks over 2 processes; the bad one in chunk 3.
    samples = [{**s, "id": f"{s['id']}-{k}"} for k in range(3) for s in env["samples"]]
    samples.insert(7, BAD)
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    monkeypatch.setattr(llava_source, "_LINES_PER_CHUNK", 3)
    one, two = (dataset(env, path, tmp_path / f"index{n}", skip_bad_samples=True,
                        num_check_processes=n) for n in (1, 2))  # fmt: skip
    assert np.array_equal(np.asarray(one.index.rows), np.asarray(two.index.rows))
    assert one.bad_samples == two.bad_samples and one.bad_samples[0].location == "line 8"
    assert len(two) == 12 and two.index.num_total == 13
    assert_same_samples(one, two)


@pytest.mark.parametrize("template", ["generation", "trim"])
def test_the_index_holds_what_one_sample_at_a_time_gives(env, tmp_path, template):
    # The check tokenises a chunk as one batch; each kept sample's length must be what
    # the one-sample path (SampleChecker.length: encode_conversation) gives and each bad
    # one its reason, with a template marking replies itself and with a located one
    # that changes contents (trim).
    from mimotron.data.bpe import CHATML_TEMPLATE
    from mimotron.data.llava_check import RawItem
    from tests.hf_data import make_tokenizer

    chat = CHATML_TEMPLATE
    if template == "trim":
        chat = chat.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        chat = chat.replace("message['content'] +", "(message['content'] | trim) +")
    assert ("{% generation %}" in chat) == (template == "generation") != ("trim" in chat)
    tok = HFTokenizer(make_tokenizer(tmp_path / "tok", chat))
    no_reply = {"id": "x", "conversations": [{"from": "human", "value": "hi"}]}
    long = {"id": "y", "conversations": [{"from": "human", "value": "seven " * 100},
                                         {"from": "gpt", "value": " nine "}]}  # fmt: skip
    samples = [*env["samples"], no_reply, long, *env["samples"][::-1], BAD]
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    data = LlavaDataset(path, env["root"], tok, 96, NUM_TOKENS, env["images"], env["audio"],
                        skip_bad_samples=True, index_dir=tmp_path / "index")  # fmt: skip
    kept = [s["id"] for s in samples if s["id"] not in ("x", "y", "bad")]
    assert [r.sample_id for r in data.records] == kept
    assert data.lengths.tolist() == [data.checker.length(r.messages) for r in data.records]
    assert [b.location for b in data.bad_samples] == ["line 5", "line 6", "line 11"]
    for bad, sample in zip(data.bad_samples[:2], (no_reply, long), strict=True):
        with pytest.raises(ValueError) as one:
            data.checker.length(data.checker.parse(RawItem(bad.location, sample)).messages)
        assert bad.reason == str(one.value)
