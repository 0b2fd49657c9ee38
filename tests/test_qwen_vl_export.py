"""A Qwen2.5-VL / Qwen3-VL run written back as one folder of its class, loaded by transformers.

Tiny random folders (:func:`tests.qwen_vl.save_qwen_folder`) in the layouts users have:
Qwen2.5-VL as the hub holds it (``model.*`` + ``visual.*``, the text keys at the top of
``config.json``; also with a tied head) and moved (``model.language_model.*`` +
``model.visual.*``, stored in bfloat16), Qwen3-VL as transformers 5 saves it; each with a
tokenizer holding Qwen's vision tokens at the config's ids (chat template included) and
the image processor. mimotron's parts are built from the folder
(:class:`~mimotron.models.hf.qwen_vl.QwenVLModel`), every parameter is moved as training
would move it, and the run's tensors (``MimoModel`` names, the vocabulary padded as for
tensor parallelism; in two cases with two rows training added) go through
:func:`~mimotron.checkpoint.vlm_export.write_vlm_folder`. transformers' own
``...ForConditionalGeneration`` must load the export with no missing or unexpected keys,
hold every parameter of ours, and compute the same logits on a batch with two images of
different sizes (fp32, 1e-5). The original's tensor names and dtypes, its other files
and its ``config.json`` (but the vocabulary size, where the folder holds it) are checked
too; the run's image placeholder is the folder's ``<|image_pad|>``.

End to end: ``mimotron train`` of a Qwen3-VL folder (5 iterations, native mock data),
then ``mimotron export --format hf``: transformers loads the folder, every parameter the
checkpoint's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import save_file

from mimotron.checkpoint.export import read_full_model
from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.state import VOCAB_SIZE_UNPADDED
from mimotron.checkpoint.vlm_export import vlm_folder, write_vlm_folder
from mimotron.cli.main import main as cli_main
from mimotron.data.bpe import CHATML_SPECIALS, CHATML_TEMPLATE
from mimotron.models.hf.qwen_vl import QwenVLModel
from tests.hf_data import folder_tensors
from tests.qwen_vl import (
    FAMILIES,
    MERGE,
    PATCH,
    TEMPORAL,
    VEND,
    VIDEO,
    VSTART,
    decoder_name,
    qwen_hf_name,
    save_qwen_folder,
)

transformers = pytest.importorskip("transformers")

IMAGE_ID = 120  # the folders' image_token_id
CHAR_IMAGE_ID = 3  # end to end: the character tokenizer's <image>, which the mock data places
VOCAB = FAMILIES["qwen2_5_vl"][1]["vocab_size"]
PADDED = VOCAB + 64  # the run's rows: padded for tensor parallelism
WORDS = ("what", "digit", "is", "this", "the", "a", "seven", "three", "picture")
GRIDS = ((1, 4, 6), (1, 2, 2))  # two images of different sizes (patches), one not square
ENCODER, LANGUAGE_MODEL = "modality_submodules.vision.encoder.", "language_model."


class Case(NamedTuple):
    family: str
    layout: str  # "hub" (model.* + visual.*, text keys at config.json's top) or "moved"
    dtype: torch.dtype  # the folder's floats
    tied: bool  # the head tied to the embedding (no lm_head stored)
    tokenizer: bool  # the run's data.tokenizer is the folder
    added: int = 0  # vocabulary rows training added (the real vocabulary grew)


CASES = {
    "qwen2_5_vl-hub": Case("qwen2_5_vl", "hub", torch.float32, False, False),
    "qwen2_5_vl-hub-tied-grown": Case("qwen2_5_vl", "hub", torch.float32, True, True, added=2),
    "qwen2_5_vl-moved-bf16": Case("qwen2_5_vl", "moved", torch.bfloat16, False, True),
    "qwen3_vl-moved-grown": Case("qwen3_vl", "moved", torch.float32, False, True, added=2),
}


def _save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer with ChatML's control tokens and template and Qwen's vision
    tokens at the ids the folder's config.json names (``<|image_pad|>`` = its
    ``image_token_id``), as a Qwen-VL folder ships one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [*CHATML_SPECIALS, "<unk>", *WORDS]
    words += [f"w{i}" for i in range(len(words), IMAGE_ID)]
    vision = {"<|image_pad|>": IMAGE_ID, "<|video_pad|>": VIDEO, "<|vision_start|>": VSTART,
              "<|vision_end|>": VEND}
    vocab = {w: i for i, w in enumerate(words)} | vision
    assert sorted(vocab.values()) == list(range(len(vocab)))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=CHATML_SPECIALS[0], eos_token=CHATML_SPECIALS[-1],
        unk_token="<unk>", additional_special_tokens=[CHATML_SPECIALS[1], *vision])
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)


def _relayout(name: str, layout: str) -> str:
    """A transformers-5 tensor name in the hub layout or the moved one."""
    if layout == "hub":
        for moved, hub in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(moved):
                return hub + name[len(moved):]
        return name
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.visual.",
                                                          "model.language_model.")):
        return "model.language_model." + name[len("model."):]
    return name


def _folder(root: Path, family: str, layout: str, dtype: torch.dtype, tied: bool) -> Path:
    """A folder of ``family`` in ``layout``, its floats stored as ``dtype``, the head tied."""
    folder = root / "folder"
    save_qwen_folder(folder, family, IMAGE_ID)
    _save_tokenizer(folder)
    tensors = folder_tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    if tied:  # as Qwen2.5-VL-3B: no lm_head stored, tied on load
        del tensors["lm_head.weight"]
        config["tie_word_embeddings"] = True
    if layout == "hub":  # the Qwen2.5-VL hub's config.json: no text_config
        text = config.pop("text_config")
        config.update({k: v for k, v in text.items() if k != "model_type"})
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {_relayout(n, layout): t.to(dtype) for n, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _trained(folder: Path, dtype: torch.dtype) -> QwenVLModel:
    """mimotron's model of the folder, every parameter moved (values ``dtype`` holds)."""
    model = QwenVLModel.from_folder(folder)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
            param.copy_(param.to(dtype))  # the export stores the folder's dtype
    return model


def _run_tensors(model: QwenVLModel) -> dict[str, torch.Tensor]:
    """The run's full model as ``read_full_model`` gives it: ``MimoModel`` names, the
    vocabulary tables padded with rows the real vocabulary never uses."""
    gen = torch.Generator().manual_seed(2)
    tensors = {ENCODER + n: p.detach().clone() for n, p in model.visual.named_parameters()}
    for name, param in model.language_model.named_parameters(remove_duplicate=False):
        value = param.detach().clone()
        if name in ("embed.weight", "output.weight"):
            pad = torch.randn(PADDED - value.shape[0], value.shape[1], generator=gen)
            value = torch.cat([value, pad])
        tensors[LANGUAGE_MODEL + name] = value
    return tensors


def _export(folder: Path, out: Path, tensors: dict[str, torch.Tensor], tokenizer: bool,
            vocab: int = VOCAB) -> None:
    """:func:`write_vlm_folder` as ``export_hf`` calls it, for a run of ``folder``."""
    run = {"modules": {"vision": {"kind": "vit", "hf_path": str(folder)},
                       "language": {"kind": "language", "hf_path": str(folder)}},
           "data": {"tokenizer": str(folder)} if tokenizer else {}}
    found = vlm_folder(run)
    assert found == (folder, "vision")
    target = ExportFolder(out)
    target.check(run)
    written = write_vlm_folder(tensors, {"config": run, "iteration": 7,
                                         VOCAB_SIZE_UNPADDED: vocab}, target, *found)
    assert written == {"model": out}
    target.finish()


def _batch() -> dict[str, torch.Tensor]:
    """One row: text, a 4 x 6 patch image, text, a 2 x 2 one, text; each image a run of
    its placeholders between the vision start and end tokens."""
    gen = torch.Generator().manual_seed(3)
    ids: list[int] = []
    for grid in GRIDS:
        ids += torch.randint(40, 100, (3,), generator=gen).tolist()
        ids += [VSTART] + [IMAGE_ID] * (grid[1] * grid[2] // MERGE**2) + [VEND]
    ids += torch.randint(40, 100, (2,), generator=gen).tolist()
    grids = torch.tensor(GRIDS)
    width = 3 * TEMPORAL * PATCH * PATCH
    return {"input_ids": torch.tensor([ids]), "image_grid_thw": grids,
            "pixel_values": torch.randn(int(grids.prod(-1).sum()), width, generator=gen)}


def _hf_name(ours: str, model: QwenVLModel) -> str:
    """transformers' in-memory name of a parameter of :class:`QwenVLModel`."""
    if ours.startswith("visual."):
        return "model.visual." + model.visual.weight_map.to_hf(ours[len("visual."):])
    return decoder_name(ours[len("language_model."):])


def _loaded(out: Path, family: str) -> tuple[Any, dict[str, Any]]:
    prefix = FAMILIES[family][0]
    model, info = getattr(transformers, f"{prefix}ForConditionalGeneration").from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    model.model.visual.set_attn_implementation("eager")
    return model.eval(), info


def _check_parameters(theirs: dict[str, torch.Tensor], ours: QwenVLModel,
                      tensors: dict[str, torch.Tensor], vocab: int) -> None:
    """transformers' every parameter is ours as trained (``QwenVLModel``'s decoder names
    are the run's); the vocabulary rows training added are the run's."""
    checked = set()
    for name, param in ours.named_parameters():
        hf = _hf_name(name, ours)
        got = theirs[hf]
        if got.shape[0] != param.shape[0]:  # a vocabulary table that grew
            assert torch.equal(got[VOCAB:], tensors[name][VOCAB:vocab]), name
            got = got[:VOCAB]
        assert torch.equal(param.detach().reshape(got.shape), got), name
        checked.add(hf)
    assert checked == set(theirs)


def _check_files(out: Path, folder: Path, case: Case) -> None:
    """config.json, the copied files and the tokenizer."""
    # The original's config, the vocabulary where it holds it (its top, or text_config).
    config, want = (json.loads((f / "config.json").read_text()) for f in (out, folder))
    (want.get("text_config") or want)["vocab_size"] = VOCAB + case.added
    assert config == want
    # The run's image placeholder is the folder's own <|image_pad|>: nothing added.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config["image_token_id"]
    assert "<image>" not in tokenizer.get_vocab() and len(tokenizer) == VEND + 1
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "preprocessor_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    assert type(processor).__name__.startswith("Qwen2VLImageProcessor")


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_the_trained_weights_and_logits(
        tmp_path: Path, case: str) -> None:
    spec = CASES[case]
    folder = _folder(tmp_path, spec.family, spec.layout, spec.dtype, spec.tied)
    ours = _trained(folder, spec.dtype)
    out, tensors = tmp_path / "export", _run_tensors(ours)
    _export(folder, out, tensors, spec.tokenizer, VOCAB + spec.added)

    # Every tensor of the original under its name and dtype; the layout kept.
    original, written = folder_tensors(folder), folder_tensors(out)
    assert set(written) == set(original)
    assert {n: t.dtype for n, t in written.items()} == {n: t.dtype for n, t in original.items()}
    assert any(n.startswith("visual." if spec.layout == "hub" else "model.visual.")
               for n in written)

    reference, info = _loaded(out, spec.family)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    _check_parameters(dict(reference.named_parameters()), ours, tensors, VOCAB + spec.added)
    _check_files(out, folder, spec)

    batch = _batch()
    with torch.no_grad():
        want = ours(**batch)
        got = reference(**batch, mm_token_type_ids=(batch["input_ids"] == IMAGE_ID).long()
                        ).logits
    assert got.shape[-1] == VOCAB + spec.added
    err = float((got[..., :VOCAB] - want).abs().max() / want.abs().max())
    assert err <= 1e-5, err


def test_a_tensor_the_folder_does_not_hold_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "qwen3_vl", "moved", torch.float32, False)
    tensors = _run_tensors(QwenVLModel.from_folder(folder))
    # A fourth tower layer: the folder's tower has three.
    tensors[ENCODER + "layers.3.attn.wo.weight"] = tensors[ENCODER + "layers.2.attn.wo.weight"]
    with pytest.raises(ValueError, match=r"^module 'model' does not match its hf_path "
                                         r"checkpoint: tensors the folder does not hold: "
                                         r"model\.visual\.blocks\.3\.attn\.proj\.weight$"):
        _export(folder, tmp_path / "export", tensors, tokenizer=False)



@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Qwen3-VL folder trained 5 iterations by ``mimotron train`` (native mock data),
    then ``mimotron export --format hf``, by the CLI."""
    root = tmp_path_factory.mktemp("qwen3_vl_run")
    folder = root / "folder"
    save_qwen_folder(folder, "qwen3_vl", CHAR_IMAGE_ID)
    config = root / "run.toml"
    config.write_text(f"""
hf_path = "{folder}"
[modules.vision]
max_pixels = 256
[data]
dataset = "mock"
seq_length = 40
mock_num_samples = 32
[train]
iters = 5
global_batch_size = 4
micro_batch_size = 4
precision = "fp32"
[optimizer]
lr = 3e-3
[eval]
interval = 1000
[checkpoint]
interval = 5
[log]
dir = "{root / 'run'}"
""")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", str(config)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint, out = root / "run" / "checkpoints", root / "export"
    assert cli_main(["export", "--format", "hf", str(checkpoint), str(out)]) == 0
    return {"folder": folder, "checkpoint": checkpoint, "out": out}


def test_a_trained_run_exports_as_one_folder_holding_its_checkpoint(
        exported: dict[str, Path]) -> None:
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        exported["out"], dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert not any(info.values()), info
    # Every parameter transformers builds is the checkpoint's (the real vocabulary's rows).
    tensors, _ = read_full_model(exported["checkpoint"])
    theirs = dict(model.named_parameters())
    for name, value in tensors.items():
        want = theirs[qwen_hf_name(name, model)]
        assert torch.equal(value[:want.shape[0]].reshape(want.shape), want), name
    assert {qwen_hf_name(n, model) for n in tensors} == set(theirs)
    # The original's names, all of them; both modules trained.
    original, written = folder_tensors(exported["folder"]), folder_tensors(exported["out"])
    assert set(written) == set(original)
    changed = {n for n in original if not torch.equal(original[n], written[n])}
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in changed)
    assert any(n.startswith("model.language_model.layers.") for n in changed)
    assert (exported["out"] / "mimotron_config.json").is_file()
