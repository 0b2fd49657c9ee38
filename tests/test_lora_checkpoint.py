"""Adapter-only checkpoints of a LoRA module whose base stays in its folder.

The LLaVA stage-2 LoRA recipe of ``tests/test_lora.py`` on its tiny folder, colocated
vision DP 2 + language TP 2 (the adapters are DTensors there): the checkpoint's language
entries are the adapters and their optimizer state only; 3 + 3 iterations resumed equal
6 straight, every logged field; a resume against a folder holding another base is one
line naming both; the folder fingerprint sees a changed byte and not a copy.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mimotron.checkpoint import read_full_model
from mimotron.checkpoint.files import read_manifest
from mimotron.checkpoint.load import read_metadata
from mimotron.checkpoint.lora_base import BASE_KEY, folder_fingerprint
from mimotron.forked_ranks import RankError, run_ranks
from mimotron.models.lora import is_lora_parameter
from tests.hf_vlm import save_llava_folder, write_config, write_image_data
from tests.parity import train, training_records

pytest.importorskip("transformers")

RECIPE = ["modules.vision.freeze='encoder'", "modules.language.lora.rank=4",
          "modules.language.lora.alpha=8.0", "optimizer.lr=2e-2",
          "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2",
          "log.interval=1", "log.progress=false", "checkpoint.load=auto"]
FIELDS = ("iteration", "loss", "grad_norm", "lr", "consumed_samples")


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava_lora_ckpt")
    folder = save_llava_folder(root)
    data = write_image_data(root / "data")
    return {"root": root, "folder": folder, "data": data,
            "config": write_config(root, folder, data, iters=6)}


def _run(config: Path, log_dir: Path, extra: list[str]) -> None:
    run_ranks(2, train, [*RECIPE, f"log.dir='{log_dir}'",
                         f"checkpoint.dir='{log_dir / 'ckpt'}'", *extra],
              timeout_s=240, config=config)


@pytest.fixture(scope="module")
def straight(llava: dict[str, Path]) -> dict[str, object]:
    log_dir = llava["root"] / "straight"
    _run(llava["config"], log_dir, ["checkpoint.interval=6"])
    return {"records": training_records(log_dir, FIELDS), "ckpt": log_dir / "ckpt"}


def test_the_checkpoint_holds_the_adapters_and_names_the_base(straight: dict, llava: dict
                                                              ) -> None:
    tensors, meta = read_full_model(straight["ckpt"], base=False)
    language = [n for n in tensors if n.startswith("language_model.")]
    assert language and all(is_lora_parameter(n) for n in language)
    assert any(n.startswith("modality_submodules.vision.projector.") for n in tensors)
    assert meta[BASE_KEY] == {"language": {"folder": str(llava["folder"]),
                                           "fingerprint": folder_fingerprint(llava["folder"])}}
    # The exports read the base back from the folder (the merged ones need it).
    full, _ = read_full_model(straight["ckpt"])
    assert "language_model.embed.weight" in full and set(tensors) < set(full)


def test_resume_of_adapters_is_bitwise_exact(straight: dict, llava: dict, tmp_path: Path
                                             ) -> None:
    _run(llava["config"], tmp_path, ["checkpoint.interval=3", "train.exit_interval=3"])
    assert len(training_records(tmp_path, FIELDS)) == 3
    _run(llava["config"], tmp_path, ["checkpoint.interval=3"])
    got = training_records(tmp_path, FIELDS)
    assert [r["iteration"] for r in got] == list(range(1, 7))
    assert got == straight["records"]  # bitwise: losses, grad norms, lr, data position


def _changed_copy(folder: Path, target: Path) -> Path:
    """``folder`` copied with one weight of the language model nudged."""
    shutil.copytree(folder, target)
    file = target / "model.safetensors"
    tensors = load_file(str(file))
    name = next(n for n in sorted(tensors) if "layers.0.self_attn.q_proj.weight" in n)
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(file), metadata={"format": "pt"})
    return target


def test_a_fingerprint_sees_a_changed_weight_and_not_a_copy(llava: dict, tmp_path: Path
                                                            ) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(llava["folder"], copy)
    assert folder_fingerprint(copy) == folder_fingerprint(llava["folder"])
    changed = _changed_copy(llava["folder"], tmp_path / "changed")
    assert folder_fingerprint(changed) != folder_fingerprint(llava["folder"])


def test_resume_against_another_base_is_one_line(straight: dict, llava: dict, tmp_path: Path
                                                 ) -> None:
    other = _changed_copy(llava["folder"], tmp_path / "other")
    config = tmp_path / "other.toml"
    config.write_text(llava["config"].read_text().replace(str(llava["folder"]), str(other)))
    log_dir = tmp_path / "run"
    before = {f.name: f.read_bytes() for f in sorted((straight["ckpt"] / "iter_0000006").iterdir())}
    with pytest.raises(RankError) as err:
        run_ranks(2, train, [*RECIPE, "train.iters=8", f"log.dir='{log_dir}'",
                             f"checkpoint.load='{straight['ckpt']}'"],
                  timeout_s=240, config=config)
    message = str(err.value)
    assert f"trained on the base in {str(llava['folder'])!r}" in message, message
    assert f"modules.language.hf_path={str(other)!r} holds another" in message, message
    after = {f.name: f.read_bytes() for f in sorted((straight["ckpt"] / "iter_0000006").iterdir())}
    assert after == before  # nothing saved is touched


def test_the_checkpoint_is_smaller_than_a_full_one_by_the_base(straight: dict, llava: dict,
                                                               tmp_path: Path) -> None:
    """The same run with the language model trained in full: its checkpoint holds the
    language weights and two Adam moments (12 bytes a parameter) where the LoRA one holds
    the adapters'."""
    _run(llava["config"], tmp_path, ["checkpoint.interval=6", "modules.language.lora.rank=0"])
    stored, files, count = {}, {}, {}
    for label, root in (("adapters", straight["ckpt"]), ("full", tmp_path / "ckpt")):
        path = root / "iter_0000006"
        saved = read_metadata(path, read_manifest(path)).state_dict_metadata
        stored[label] = sum(math.prod(m.size) * m.properties.dtype.itemsize
                            for m in saved.values() if isinstance(m, TensorStorageMetadata))
        files[label] = sum(f.stat().st_size for f in path.iterdir())
        tensors, _ = read_full_model(root, base=False)
        count[label] = sum(t.numel() for n, t in tensors.items() if n.startswith("language_model."))
    # fp32 weights and two Adam moments: 12 bytes a parameter (and a step count each).
    difference = 12 * (count["full"] - count["adapters"])
    assert stored["full"] - stored["adapters"] == pytest.approx(difference, rel=1e-3), stored
    print(f"checkpoint tensors: {stored['adapters']} bytes with adapters only, "
          f"{stored['full']} trained in full ({count['adapters']} vs {count['full']} language "
          f"parameters; files {files['adapters']} vs {files['full']} bytes)")


def test_resume_under_another_lora_table_is_one_line(straight: dict, llava: dict,
                                                     tmp_path: Path) -> None:
    """A new alpha would rescale the trained adapters; fewer targets would drop some."""
    for change in ("modules.language.lora.alpha=16.0",
                   "modules.language.lora.targets=['attn.wq']"):
        with pytest.raises(RankError) as err:
            run_ranks(2, train, [*RECIPE, change, "train.iters=8",
                                 f"log.dir='{tmp_path / 'run'}'",
                                 f"checkpoint.load='{straight['ckpt']}'"],
                      timeout_s=240, config=llava["config"])
        assert "adapters resume only under the table they were trained with" in str(err.value)


def test_a_fingerprint_sees_one_value_changed_inside_the_file(llava: dict, tmp_path: Path
                                                              ) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(llava["folder"], copy)
    file = copy / "model.safetensors"
    tensors = load_file(str(file))
    middle = sorted(tensors)[len(tensors) // 2]
    tensors[middle] = tensors[middle].clone()
    tensors[middle].view(-1)[0] += 1.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert folder_fingerprint(copy) != folder_fingerprint(llava["folder"])


def test_exports_and_generate_refuse_a_base_that_changed(llava: dict, tmp_path: Path) -> None:
    from mimotron.generate import Generator

    folder = tmp_path / "base"
    shutil.copytree(llava["folder"], folder)
    config = tmp_path / "run.toml"
    config.write_text(llava["config"].read_text().replace(str(llava["folder"]), str(folder)))
    _run(config, tmp_path / "run", ["checkpoint.interval=2", "train.iters=2"])
    ckpt = tmp_path / "run" / "ckpt"
    read_full_model(ckpt)  # the base as trained: fine
    _changed_copy(llava["folder"], tmp_path / "changed")
    shutil.copy(tmp_path / "changed" / "model.safetensors", folder / "model.safetensors")
    for load in (lambda: read_full_model(ckpt), lambda: Generator.from_path(ckpt, device="cpu")):
        with pytest.raises(ValueError, match=r"adapters were trained on the base in .* which "
                                             r"now holds another"):
            load()


def test_a_lora_run_starts_from_a_checkpoint_trained_without_adapters(llava: dict,
                                                                      tmp_path: Path) -> None:
    """LLaVA stage 1 (full) -> stage 2 (LoRA) through checkpoint.pretrained: the adapters
    start fresh on the loaded weights, which stay as loaded; the whole model is saved."""
    _run(llava["config"], tmp_path / "full", ["checkpoint.interval=2", "train.iters=2",
                                              "modules.language.lora.rank=0"])
    _run(llava["config"], tmp_path / "lora", [
        "checkpoint.interval=2", "train.iters=2",
        f"checkpoint.pretrained='{tmp_path / 'full' / 'ckpt'}'"])
    before, _ = read_full_model(tmp_path / "full" / "ckpt")
    after, meta = read_full_model(tmp_path / "lora" / "ckpt", base=False)
    assert BASE_KEY not in meta  # its base is the pretrained run's: saved whole
    base = [n for n in after if n.startswith("language_model.") and not is_lora_parameter(n)]
    assert base and all(torch.equal(after[n], before[n]) for n in base)
    assert any(is_lora_parameter(n) for n in after)
