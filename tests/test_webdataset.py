"""LLaVA data as WebDataset tar shards: the samples, training and faults of the JSONL.

* shards written from a JSONL file (:func:`write_shards`) load exactly its samples
  (tokens, labels, pixels, log-mels, ids, lengths), named as a folder, one ``.tar``
  list, a glob or a brace range;
* a run on the shards trains exactly like the same run on the JSONL (losses, gradient
  norms and token counts of every iteration, bitwise);
* a corrupt shard or sample is one clear line: a file that is not a tar names the shard;
  a shard cut short keeps the samples before the cut and reports the rest as one bad
  sample; a sample with a broken image member or no ``.json`` is a bad sample naming its
  shard and key (skippable).
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from mimotron.config.shard_paths import shard_paths
from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.webdataset import write_shards
from mimotron.forked_ranks import run_groups
from tests.common import ONE_RANK, train_steps
from tests.hf_data import llava_dataset, llava_env, write_jsonl

NUM_ITERS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing and a media root holding the four good samples' files."""
    return llava_env(tmp_path_factory.mktemp("webdataset"))


def twelve(env) -> list[dict]:
    """The four samples (image, audio, both, text) three times, each with its own id."""
    return [{**s, "id": f"{s['id']}-{k}"} for k in range(3) for s in env["samples"]]


def test_shards_load_the_samples_of_the_equivalent_jsonl(env, tmp_path):
    samples = twelve(env)
    jsonl = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", samples))
    shards = write_shards(samples, env["root"], tmp_path / "shards", samples_per_shard=5)
    assert [s.name for s in shards] == ["shard-000000.tar", "shard-000001.tar",
                                        "shard-000002.tar"]  # fmt: skip
    folder = tmp_path / "shards"
    names = [folder, folder / "*.tar", f"{folder}/shard-{{000000..000002}}.tar"]
    assert all(shard_paths(name) == shards for name in names)
    with pytest.raises(ValueError, match="shard-000003.tar"):
        shard_paths(f"{folder}/shard-{{000000..000003}}.tar")
    tar = llava_dataset(env, f"{folder}/shard-{{000000..000002}}.tar")
    assert len(tar) == len(jsonl) == 12 and tar.num_skipped == 0
    assert tar.lengths.tolist() == jsonl.lengths.tolist()
    for i in range(12):
        a, b = jsonl.load(i), tar.load(i)
        assert (a["sample_id"], a["kind"], a["length"]) == (b["sample_id"], b["kind"],
                                                            b["length"])  # fmt: skip
        for key in ("tokens", "labels", "loss_mask", "image", "audio"):
            assert (a[key] is None and b[key] is None) or torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The exported digits task (48 samples) as JSONL and as 4 shards, its tokenizer."""
    base = tmp_path_factory.mktemp("webdataset_train")
    path = write_llava_task(base / "data", num_samples=48, seed=3)
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    write_shards(samples, path.parent, base / "shards", samples_per_shard=12)
    tokenizer = train_bpe_tokenizer(conversation_texts(path), base / "tok", vocab_size=300)
    return {"jsonl": path, "shards": base / "shards", "tokenizer": tokenizer, "base": base}


def test_shards_train_like_the_equivalent_jsonl(task):
    def overrides(path: Path, run: str) -> list[str]:
        return ["data.dataset='llava'", f"data.path='{path}'",
                f"data.tokenizer='{task['tokenizer']}'", "data.seq_length=96",
                "modules.vision.in_channels=3", "optimizer.lr=3e-3", *ONE_RANK,
                f"log.dir='{task['base'] / run}'"]  # fmt: skip

    (jsonl,), (tar,) = run_groups(
        [(1, train_steps, (overrides(task[kind], kind), NUM_ITERS), {})
         for kind in ("jsonl", "shards")], timeout_s=240)  # fmt: skip
    assert jsonl == tar  # (loss, grad norm, skipped, loss tokens) per iteration, bitwise
    assert jsonl[-1][0] < jsonl[0][0] and all(step[3] > 0 for step in jsonl)


def _cut(shard: Path, keep: float) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[:int(len(data) * keep)])


def test_a_corrupt_shard_or_sample_is_one_clear_line(env, tmp_path):
    samples = twelve(env)
    # A sample whose image member is a PNG cut in half, and one without a .json member.
    broken = tmp_path / "broken"
    (broken / "img").mkdir(parents=True)
    png = (env["root"] / "img" / "a.png").read_bytes()
    (broken / "img" / "cut.png").write_bytes(png[:len(png) // 2])
    cut_image = {**samples[0], "id": "cut-image", "image": "img/cut.png"}
    (broken / "img" / "a.png").write_bytes(png)
    bad = write_shards([samples[0], cut_image, samples[3]], broken, tmp_path / "bad")
    with tarfile.open(bad[0], "a") as archive:  # an image member with no conversation
        info = tarfile.TarInfo("orphan.png")
        info.size = len(png)
        archive.addfile(info, io.BytesIO(png))
    with pytest.raises(ValueError, match=r"shard-000000.tar key '000000001' \(sample id "
                                         r"'cut-image'\): image file .*shard-000000.tar:"
                                         r"000000001.png' is unreadable") as info:  # fmt: skip
        llava_dataset(env, tmp_path / "bad")
    assert "\n" not in str(info.value)
    skipping = llava_dataset(env, tmp_path / "bad", skip_bad_samples=True)
    assert skipping.num_skipped == 2 and len(skipping) == 2
    assert "no .json member with key 'orphan'" in skipping.bad_samples[1].reason

    # A shard cut short: the samples before the cut stay, the rest is one bad sample.
    write_shards(samples, env["root"], tmp_path / "cut", samples_per_shard=6)
    _cut(tmp_path / "cut" / "shard-000001.tar", 0.6)
    with pytest.raises(ValueError, match=r"shard-000001.tar after key .*unreadable") as info:
        llava_dataset(env, tmp_path / "cut")
    assert "\n" not in str(info.value)
    kept = llava_dataset(env, tmp_path / "cut", skip_bad_samples=True)
    assert kept.num_skipped == 1 and 6 < len(kept) < 12
    assert [kept.load(i)["sample_id"] for i in range(6)] == [s["id"] for s in samples[:6]]

    # Not a tar at all: the whole shard, named, even when skipping.
    (tmp_path / "cut" / "shard-000002.tar").write_bytes(b"not a tar file" * 64)
    with pytest.raises(ValueError, match=r"shard-000002.tar' is not a readable tar file"
                       ) as info:  # fmt: skip
        llava_dataset(env, tmp_path / "cut", skip_bad_samples=True)
    assert "\n" not in str(info.value)
