"""Faults in the sample index and in WebDataset shards.

Each test builds its files in ``tmp_path`` (tests/hf_data.py: PNG/WAV/JSONL writers and a
locally trained tokenizer; shards by :func:`write_shards` or crafted with ``tarfile``);
nothing is downloaded.

* a shard or data file changed in place (other content, or the same size with its
  modification time put back) is checked again; a sample edited after the check (between
  the index and a load) is skipped and named with ``skip_bad_samples``, one line naming
  file and line otherwise;
* a damaged index folder (``rows.npy`` cut short, ``index.json`` gone) is rebuilt and
  replaced, not an error on every later run;
* the index's chunks come back in submission order even when they finish out of order
  (forced: the first chunk waits for every other one);
* a member ``<key>.0.json`` (a multi-dot extension) is its sample's conversation;
* a GNU sparse member, a member name that is not UTF-8 and a hard-linked image are one
  line naming shard and member (or, for the link, read through its target);
* a brace range naming too many shards is refused before it is expanded.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from mimotron.config.shard_paths import MAX_BRACE_NAMES, shard_paths
from mimotron.data.llava import LlavaDataset
from mimotron.data.sample_index import ChunkResult, map_chunks
from mimotron.data.webdataset import split_name, write_shards
from tests.hf_data import counting_checks, llava_dataset, llava_env, write_jsonl


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing and a media root holding the four good samples' files."""
    return llava_env(tmp_path_factory.mktemp("faults_index"))


dataset = llava_dataset




def edit_in_place(path: Path, old: bytes, new: bytes, keep_mtime: bool) -> None:
    """Replace ``old`` by ``new`` (same length) in ``path``; optionally put back its mtime."""
    assert len(old) == len(new)
    stat = path.stat()
    data = path.read_bytes()
    assert data.count(old) == 1, old
    path.write_bytes(data.replace(old, new))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert path.stat().st_size == stat.st_size


def answers(data: LlavaDataset) -> list[str]:
    return [data.load(i)["answer"] for i in range(len(data))]


# ---- a file changed after its index was built ------------------------------------------
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["touched", "same_mtime"])
def test_a_shard_rewritten_in_place_is_checked_again(env, tmp_path, keep_mtime):
    samples = [{**s, "id": f"{s['id']}-{k}"} for k in range(2) for s in env["samples"]]
    write_shards(samples, env["root"], tmp_path / "shards", samples_per_shard=3)
    index = tmp_path / "index"
    first = dataset(env, tmp_path / "shards", index)
    assert answers(first).count("a cat sits on a mat") == 2  # in shards 1 and 2
    shard = tmp_path / "shards" / "shard-000001.tar"
    edit_in_place(shard, b"a cat sits on a mat", b"a dog sits on a rug", keep_mtime)
    with counting_checks() as checked:
        second = dataset(env, tmp_path / "shards", index)
    assert len(checked) == 8, "a shard changed in place must be checked again"
    assert answers(second).count("a cat sits on a mat") == 1
    assert answers(second)[3] == "a dog sits on a rug"
    with counting_checks() as checked:
        dataset(env, tmp_path / "shards", index)
    assert checked == []


def test_a_data_file_edited_with_its_size_and_mtime_kept_is_checked_again(env, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", env["samples"])
    index = tmp_path / "index"
    dataset(env, path, index)
    # Same length, still valid, but now a placeholder in an assistant turn: a bad sample.
    edit_in_place(path, b"the digit is seven", b"<image> <image> xy", keep_mtime=True)
    with counting_checks() as checked, pytest.raises(ValueError, match=r"d.jsonl line 1 "
                                                     r"\(sample id 's0'\)"):  # fmt: skip
        dataset(env, path, index)
    assert checked == ["line 1", "line 2", "line 3", "line 4"]


def test_a_sample_edited_after_the_check_is_skipped_and_named(env, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", env["samples"])
    skipping = dataset(env, path, tmp_path / "index", skip_bad_samples=True)
    strict = dataset(env, path, tmp_path / "index")
    # Edited between the index and the load (mid-run): same bytes count, valid JSON.
    edit_in_place(path, b"the digit is seven", b"<image> <image> xy", keep_mtime=False)
    sample = skipping.load(0)
    assert not sample["loss_mask"].any() and sample["length"] == int(skipping.lengths[0])
    assert [b.location for b in skipping.load_failures] == ["line 1"]
    assert "changed after the check" in skipping.load_failures[0].reason
    with pytest.raises(ValueError, match=r"d.jsonl line 1 \(sample id .*changed after the "
                                         r"check") as info:  # fmt: skip
        strict.load(0)
    assert "\n" not in str(info.value)
    assert skipping.load(3)["loss_mask"].any()  # the samples not edited still load


def test_a_shard_member_edited_after_the_check_is_skipped_and_named(env, tmp_path):
    write_shards(env["samples"], env["root"], tmp_path / "shards")
    data = dataset(env, tmp_path / "shards", tmp_path / "index", skip_bad_samples=True)
    edit_in_place(tmp_path / "shards" / "shard-000000.tar", b"the digit is seven",
                  b"<image> <image> xy", keep_mtime=True)  # fmt: skip
    assert not data.load(0)["loss_mask"].any()
    assert [b.location for b in data.load_failures] == ["shard-000000.tar key '000000000'"]


# ---- a damaged index folder -------------------------------------------------------------
@pytest.mark.parametrize("damage", ["rows_cut", "meta_gone"])
def test_a_damaged_index_is_rebuilt_and_replaced(env, tmp_path, damage):
    path = write_jsonl(tmp_path / "d.jsonl", env["samples"])
    index = tmp_path / "index"
    first = dataset(env, path, index)
    folder, lengths = first.index.folder, first.lengths.tolist()
    del first  # its memory map of rows.npy is about to be cut
    if damage == "rows_cut":
        rows = folder / "rows.npy"
        rows.write_bytes(rows.read_bytes()[:-40])
    else:
        (folder / "index.json").unlink()
    for run, expected in enumerate((4, 0)):  # rebuilt and kept: the next run reuses it
        with counting_checks() as checked:
            again = dataset(env, path, index)
        assert len(checked) == expected, run
        assert again.index.folder == folder and len(again) == 4
        assert again.lengths.tolist() == lengths
    assert sorted(p.name for p in index.iterdir()) == [folder.name]  # nothing left over


# ---- chunk order ------------------------------------------------------------------------
def test_index_chunks_come_back_in_submission_order_when_they_finish_out_of_order():
    """Chunk 0 waits until every other chunk is done (a semaphore, no timing): it
    finishes last in whichever process takes it, yet its result comes first."""
    chunks = list(range(6))
    done = mp.get_context("fork").Semaphore(0)

    def check(chunk: int) -> ChunkResult:
        if chunk == 0:
            for _ in chunks[1:]:
                assert done.acquire(timeout=60), "the other chunks did not finish"
        else:
            done.release()
        return ChunkResult(np.full(1, chunk), [f"k{chunk}"], [], chunk + 1)

    results = map_chunks(check, chunks, num_processes=2)
    assert [r.rows.tolist() for r in results] == [[c] for c in chunks]
    assert [r.num_seen for r in results] == [c + 1 for c in chunks]


# ---- member names and types -------------------------------------------------------------
def add_member(archive: tarfile.TarFile, name: str, data: bytes = b"", **fields) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for field, value in fields.items():
        setattr(info, field, value)
    archive.addfile(info, io.BytesIO(data) if data else None)


def conversation(env, sample: int = 0) -> bytes:
    s = env["samples"][sample]
    return json.dumps({"id": s["id"], "conversations": s["conversations"]}).encode()


def test_a_multi_dot_json_member_is_the_samples_conversation(env, tmp_path):
    assert split_name("a/b.0.json") == ("a/b", "0.json")
    assert split_name("c.tar.d/e.seg.PNG") == ("c.tar.d/e", "seg.png")
    png = (env["root"] / "img" / "a.png").read_bytes()
    shard = tmp_path / "multi.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as archive:
        add_member(archive, "d/k.0.json", conversation(env))
        add_member(archive, "d/k.png", png)
    data = dataset(env, shard)
    assert len(data) == 1 and data.num_skipped == 0
    sample = data.load(0)
    assert sample["sample_id"] == "s0" and sample["has_image"] and sample["image"].any()


def sparse_member(name: str, data: bytes, claimed: int) -> bytes:
    """A GNU sparse member's header (one map entry covering ``data``) claiming
    ``claimed`` bytes, and its data blocks (``tarfile`` reads these, cannot write them)."""
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)  # sparse map: offset 0,
    header[398:410] = tarfile.itn(len(data), 12, tarfile.GNU_FORMAT)  # ... len(data) bytes
    header[483:495] = tarfile.itn(claimed, 12, tarfile.GNU_FORMAT)  # the real size
    header[148:155] = b"%06o\0" % tarfile.calc_chksums(bytes(header))[0]
    return bytes(header) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def test_a_sparse_member_claiming_a_terabyte_is_one_line_naming_it(env, tmp_path):
    shard = tmp_path / "sparse.tar"
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as archive:
        raw = sparse_member("k.json", conversation(env, 3), 10**12)
        archive.fileobj.write(raw)
        archive.offset += len(raw)
        add_member(archive, "t.json", conversation(env, 3))
    with pytest.raises(ValueError, match=r"sparse.tar key 'k' .*sparse.tar:k.json.* sparse "
                                         r"member .*1000000000000 bytes") as info:  # fmt: skip
        dataset(env, shard)
    assert "\n" not in str(info.value)
    kept = dataset(env, shard, skip_bad_samples=True)
    assert len(kept) == 1 and kept.num_skipped == 1


def test_a_member_name_that_is_not_utf8_is_one_line_naming_its_bytes(env, tmp_path):
    shard = tmp_path / "names.tar"
    png = (env["root"] / "img" / "a.png").read_bytes()
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as archive:  # fmt: skip
        add_member(archive, "k\udcff.json", conversation(env))
        add_member(archive, "k\udcff.png", png)
        add_member(archive, "t.json", conversation(env, 3))
    with pytest.raises(ValueError) as info:
        dataset(env, shard)
    message = str(info.value)
    assert "names.tar" in message and r"b'k\xff.json'" in message and "UTF-8" in message
    assert "\n" not in message and message.isprintable()
    kept = dataset(env, shard, skip_bad_samples=True)
    assert len(kept) == 1 and kept.load(0)["sample_id"] == "s3"


def test_a_hard_linked_image_member_is_read_through_its_target(env, tmp_path):
    png = (env["root"] / "img" / "a.png").read_bytes()
    shard = tmp_path / "links.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as archive:
        add_member(archive, "a.json", conversation(env))
        add_member(archive, "a.png", png)
        add_member(archive, "k.json", conversation(env))
        add_member(archive, "k.png", type=tarfile.LNKTYPE, linkname="a.png")
        add_member(archive, "m.json", conversation(env))
        add_member(archive, "m.png", type=tarfile.LNKTYPE, linkname="missing.png")
    kept = dataset(env, shard, skip_bad_samples=True)
    assert len(kept) == 2 and kept.num_skipped == 1
    first, linked = kept.load(0), kept.load(1)
    assert linked["has_image"] and (linked["image"] == first["image"]).all()
    assert first["image"].any()
    reason = kept.bad_samples[0].reason
    assert "links.tar:m.png" in reason and "hard link to 'missing.png'" in reason


# ---- brace ranges -----------------------------------------------------------------------
def test_a_brace_range_naming_too_many_shards_is_refused_before_expanding(tmp_path):
    pattern = f"{tmp_path}/shard-{{000000..999999999}}.tar"
    with pytest.raises(ValueError, match=r"names 1000000000 shards .* at most 100000") as info:
        shard_paths(pattern)
    assert pattern in str(info.value) and "\n" not in str(info.value)
    two = f"{tmp_path}/{{a,b}}/s-{{0..99999}}.tar"  # 200 000 in all
    with pytest.raises(ValueError, match=r"names 200000 shards"):
        shard_paths(two)
    nested = f"{tmp_path}/{{x{{0..99999}},y{{0..99999}}}}.tar"
    with pytest.raises(ValueError, match=r"at most 100000"):
        shard_paths(nested)
    assert MAX_BRACE_NAMES == 100_000
    (tmp_path / "s-1.tar").write_bytes(b"")
    with pytest.raises(ValueError, match="s-0.tar"):  # within the bound: checked as before
        shard_paths(f"{tmp_path}/s-{{0..1}}.tar")
