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
