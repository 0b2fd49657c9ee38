"""Pretrained weights are checked as they load: dtype, finiteness and damaged files.

Every way weights come in is covered: a Hugging Face folder for one module
(``load_hf_weights``, alone and under ``setup_mimo`` with TP), a ``mimotron export``
folder and a mimotron checkpoint as ``checkpoint.pretrained``, and a checkpoint as
``checkpoint.load`` (a resume). A NaN, an integer tensor or a damaged header is refused
with one line naming the file and the tensor, and where only one rank reads the bad
values every rank raises the same error instead of the others waiting in a collective.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mimotron.checkpoint import CheckpointError, export_checkpoint
from mimotron.checkpoint.files import MANIFEST, file_digest
from mimotron.checkpoint.pretrained import _check_export_tensors
from mimotron.checkpoint.safe_metadata import load_metadata
from mimotron.checkpoint.save import save_checkpoint
from mimotron.config import load_config
from mimotron.config.hf_files import open_safetensors, read_safetensors
from mimotron.forked_ranks import run_ranks
from mimotron.models.hf.llama import build_hf_language_model
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE, DIGITS, ONE_RANK, coloc

# The language model's first attention query weight: [64, 64], column-parallel under TP
# (rank 1 of 2 holds rows 32..63).
WQ = "layers.0.attn.wq.weight"
POISONED_ROW = 40  # only rank 1 of a TP-2 language reads it
TP2 = coloc({"data": 2}, {"data": 2}, {"tensor": 2, "data": 1})


def _poison(value: torch.Tensor) -> torch.Tensor:
    """``value`` with two NaN and one +inf in row :data:`POISONED_ROW`."""
    out = value.clone()
    out[POISONED_ROW, 0] = out[POISONED_ROW, 1] = float("nan")
    out[POISONED_ROW, 2] = float("inf")
    return out


def _rewrite(file: Path, name: str, change: Any) -> None:
    """Rewrite one tensor of a safetensors file, keeping the others and the metadata."""
    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file), metadata=metadata)


# ---- damaged files ----------------------------------------------------------------------


def _damage(file: Path, how: str) -> None:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    if how == "length":  # the 8-byte header length: past the end of the file
        file.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    elif how == "json":  # the header's JSON: its closing brace is gone
        header = raw[8:8 + length].rstrip(b" ")
        file.write_bytes(raw[:8] + header[:-1] + b" " * (length - len(header) + 1)
                         + raw[8 + length:])
    else:  # truncated: the last tensor's data is cut short
        file.write_bytes(raw[:-10])


@pytest.mark.parametrize("how", ["length", "json", "truncated"])
def test_a_damaged_safetensors_file_is_named(tmp_path, how):
    file = tmp_path / "weights.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(file))
    _damage(file, how)
    for read in (lambda: open_safetensors(file).__enter__(), lambda: read_safetensors(file)):
        with pytest.raises(ValueError) as info:
            read()
        message = str(info.value)
        assert message.startswith(f"{file} is not a valid safetensors file: ")
        assert "\n" not in message


# ---- a Hugging Face folder --------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )).save_pretrained(folder)
    return folder


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


HF_WQ = "model.layers.0.self_attn.q_proj.weight"


def test_hf_folder_holding_nan_is_refused_naming_file_tensor_and_counts(llama_dir, tmp_path):
    folder = _copy_folder(llama_dir, tmp_path / "nan")
    _rewrite(folder / "model.safetensors", HF_WQ, _poison)
    with pytest.raises(ValueError) as info:
        build_hf_language_model(folder)
    assert str(info.value).endswith(
        f"\n  {folder / 'model.safetensors'}: tensor {HF_WQ} holds 2 NaN and 1 infinite "
        "values (of 4096 read)")


def test_hf_folder_with_an_integer_tensor_is_refused_float_dtypes_are_cast(
        llama_dir, tmp_path):
    folder = _copy_folder(llama_dir, tmp_path / "int")
    _rewrite(folder / "model.safetensors", HF_WQ, lambda t: (t * 100).to(torch.int64))
    with pytest.raises(ValueError) as info:
        build_hf_language_model(folder)
    assert (f"wrong dtypes: {folder / 'model.safetensors'}: tensor {HF_WQ} has dtype I64, "
            "but it loads into a float32 parameter, which needs a 16-, 32- or 64-bit "
            "floating-point dtype") in str(info.value)
    # A bf16 tensor loads into the fp32 parameter, cast (as transformers casts).
    half = _copy_folder(llama_dir, tmp_path / "bf16")
    _rewrite(half / "model.safetensors", HF_WQ, lambda t: t.to(torch.bfloat16))
    model = build_hf_language_model(half)
    want = load_file(str(llama_dir / "model.safetensors"))[HF_WQ].to(torch.bfloat16)
    assert torch.equal(model.layers["0"].attn.wq.weight, want.float())


def test_hf_folder_with_a_damaged_header_is_named(llama_dir, tmp_path):
    folder = _copy_folder(llama_dir, tmp_path / "damaged")
    _damage(folder / "model.safetensors", "json")
    with pytest.raises(ValueError, match=r"^.*model\.safetensors is not a valid safetensors "):
        build_hf_language_model(folder)


def _hf_setup(rank: int, world: int, overrides: list[str]) -> str:
    """Set up a run and return its error (every rank must raise one)."""
    try:
        setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_nan_read_by_one_tp_rank_fails_every_rank_alike(llama_dir, tmp_path):
    """Rank 1 alone reads the poisoned row; rank 0 must not go on into a collective."""
    folder = _copy_folder(llama_dir, tmp_path / "tp")
    _rewrite(folder / "model.safetensors", HF_WQ, _poison)
    overrides = [*TP2, f"modules.language.hf_path='{folder}'",
                 "modules.language.hidden_size=64", f"log.dir={tmp_path / 'run'}"]
    got = run_ranks(2, _hf_setup, overrides, timeout_s=120)
    assert got[0] == got[1] == (
        f"modules.language: hf_path {str(folder)!r} holds weights that are not finite:\n  "
        f"{folder / 'model.safetensors'}: tensor {HF_WQ} holds 2 NaN and 1 infinite values "
        "(of 2048 read)")


# ---- a mimotron checkpoint and export ---------------------------------------------------


def _save_two(rank: int, world: int, overrides: list[str], clean: Path, poisoned: Path
              ) -> None:
    """The same fresh model saved twice: as built, and with NaN/inf in the query weight."""
    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    args = (run.model, run.optimizer, run.schedulers, run.global_state, run.infra)
    save_checkpoint(clean, *args).wait()
    weight = run.model.language_model.layers["0"].attn.wq.weight
    with torch.no_grad():
        weight.copy_(_poison(weight))
    save_checkpoint(poisoned, *args).wait()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    paths = {"clean": root / "clean", "poisoned": root / "poisoned"}
    run_ranks(1, _save_two, [*ONE_RANK, f"log.dir={root / 'run'}"], paths["clean"],
              paths["poisoned"], timeout_s=120)
    export_checkpoint(paths["clean"], root / "export")
    paths["export"] = root / "export"
    return paths


def _pretrained(rank: int, world: int, overrides: list[str]) -> str:
    """Set up a run from ``checkpoint.pretrained`` (or a resume); return its error."""
    try:
        setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    except (CheckpointError, ValueError) as exc:
        return str(exc)
    return "no error"


def test_export_holding_nan_is_refused_naming_file_tensor_and_counts(saved, tmp_path):
    export = _copy_folder(saved["export"], tmp_path / "export")
    _rewrite(export / "language.safetensors", WQ, _poison)
    got = run_ranks(1, _pretrained, [*ONE_RANK, f"checkpoint.pretrained={export}",
                                     f"log.dir={tmp_path / 'run'}"], timeout_s=120)
    assert got[0] == (f"cannot load {export}:\n  {export / 'language.safetensors'}: tensor "
                      f"{WQ} holds 2 NaN and 1 infinite values (of 4096 read)")


def test_export_with_an_integer_tensor_is_refused(saved, tmp_path):
    export = _copy_folder(saved["export"], tmp_path / "export")
    _rewrite(export / "language.safetensors", WQ, lambda t: (t * 100).to(torch.int32))
    got = run_ranks(1, _pretrained, [*ONE_RANK, f"checkpoint.pretrained={export}",
                                     f"log.dir={tmp_path / 'run'}"], timeout_s=120)
    assert got[0] == (f"cannot load {export}:\n  rank 0: {export / 'language.safetensors'}: "
                      f"tensor {WQ} has dtype I32, but it loads into a float32 parameter, "
                      "which needs a 16-, 32- or 64-bit floating-point dtype")


@pytest.mark.parametrize("how", ["length", "json", "truncated"])
def test_export_with_a_damaged_header_is_named(saved, tmp_path, how):
    """Found from the header before any rank starts (the launcher's check), and by the
    ranks' own reading of the export when the file is damaged after that."""
    export = _copy_folder(saved["export"], tmp_path / "export")
    file = export / "language.safetensors"
    _damage(file, how)
    got = run_ranks(1, _pretrained, [*ONE_RANK, f"checkpoint.pretrained={export}",
                                     f"log.dir={tmp_path / 'run'}"], timeout_s=120)
    assert got[0].startswith(f"checkpoint.pretrained={str(export)!r} is invalid: {file} is "
                             "not a valid safetensors file: ")
    assert "\n" not in got[0]
    targets = {"model.language_model." + WQ: torch.empty(64, 64),
               "model.modality_submodules.vision.encoder.final_norm.weight": torch.empty(32)}
    problems = _check_export_tensors(export, targets)
    assert len(problems) == 1 and problems[0].startswith(
        f"{file} is not a valid safetensors file: ")


def test_checkpoint_holding_nan_is_refused_as_pretrained_and_on_resume(saved, tmp_path):
    """Saved from one rank, read by two (language TP 2): only rank 1 reads the NaN row."""
    key = "model.language_model." + WQ
    for source in (["checkpoint.pretrained=" + str(saved["poisoned"])],
                   ["checkpoint.load=" + str(saved["poisoned"])]):
        got = run_ranks(2, _pretrained, [*TP2, *source, f"log.dir={tmp_path / 'run'}"],
                        timeout_s=120)
        assert got[0] == got[1] == (
            f"cannot load {saved['poisoned'] / 'iter_0000000'}:\n  rank 1: "
            f"{saved['poisoned'] / 'iter_0000000'}: tensor {key} holds 2 NaN and 1 "
            "infinite values (of 2048 read)")
    # The same model without the NaN loads.
    clean = run_ranks(1, _pretrained, [*ONE_RANK, f"checkpoint.pretrained={saved['clean']}",
                                       f"log.dir={tmp_path / 'clean'}"], timeout_s=120)
    assert clean == ["no error"]


def test_checkpoint_saved_in_an_integer_dtype_is_refused_before_reading(saved, tmp_path):
    """A (crafted) checkpoint whose metadata says int32 for a float parameter."""
    root = tmp_path / "crafted"
    shutil.copytree(saved["clean"], root)
    folder, key = root / "iter_0000000", "model.language_model." + WQ
    metadata = load_metadata(folder / ".metadata")
    metadata.state_dict_metadata[key].properties.dtype = torch.int32
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][".metadata"] = file_digest(folder / ".metadata")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    got = run_ranks(1, _pretrained, [*ONE_RANK, f"checkpoint.pretrained={root}",
                                     f"log.dir={tmp_path / 'run'}"], timeout_s=120)
    assert got[0] == (f"cannot load {folder}:\n  {folder}: tensor {key} has dtype int32, but "
                      "it loads into a float32 parameter, which needs a 16-, 32- or 64-bit "
                      "floating-point dtype")
