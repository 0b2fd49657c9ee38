"""``mimotron export --format hf`` when ``data.tokenizer`` is the language model's own folder.

The usual case (model folders ship their tokenizer, and a LLaVA run without
``data.tokenizer`` reads the language model's folder): the export writes a ``config.json``
whose ``vocab_size`` counts the placeholders training added (base + 1 here), and the
tokenizer must not bring the folder's original ``config.json`` back over it, or
``from_pretrained`` refuses the larger embedding. The checkpoint is written by the
project's writer from a decoder grown as training grows it (no training step needed:
what matters is what the export writes around the tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mimotron.checkpoint.hf_export import VOCAB_SIZE_UNPADDED, is_tokenizer_file
from mimotron.cli.main import main as cli_main
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.models.mimo import MimoModel
from tests.hf_checkpoint import grown_language, save_qwen2_for_tokenizer, write_checkpoint
from tests.hf_data import make_tokenizer

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 folder holding its own tokenizer; vocab_size = the tokenizer's length."""
    return save_qwen2_for_tokenizer(make_tokenizer(tmp_path_factory.mktemp("qwen") / "model"),
                                    seed=0, hidden_size=32, max_positions=64, tied=False)


def test_model_folder_as_tokenizer_exports_a_loadable_folder(model_folder, tmp_path):
    original = {p.name: p.read_bytes() for p in model_folder.iterdir()}
    base = json.loads(original["config.json"])["vocab_size"]
    tokenizer = HFTokenizer(model_folder, modalities=("image",))
    vocab = tokenizer.vocab_size
    assert vocab == base + 1  # <image> grows the vocabulary past config.json's
    language = grown_language(model_folder, vocab)
    # A vit module (no hf_path) makes training add <image>; the checkpoint holds the
    # decoder only, which is all this export reads.
    run_config = {"modules": {"vision": {"kind": "vit"},
                              "language": {"kind": "language", "hf_path": str(model_folder)}},
                  "data": {"tokenizer": str(model_folder)}}
    meta = {"config": run_config, VOCAB_SIZE_UNPADDED: vocab}
    write_checkpoint(tmp_path / "ckpt", MimoModel({}, language, {}, {}), meta)
    out = tmp_path / "out"
    assert cli_main(["export", "--format", "hf", str(tmp_path / "ckpt"), str(out)]) == 0

    exported = out / "language"
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == vocab
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(exported,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = torch.arange(2 * 12).view(2, 12) * 29 % vocab
    tokens[0, 4] = tokenizer.placeholder_id("image")
    with torch.no_grad():
        want = language(language.embed_tokens(tokens))[..., :vocab]
        got = hf.eval()(tokens).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # The tokenizer as trained: placeholder included, same ids.
    loaded = transformers.AutoTokenizer.from_pretrained(exported)
    assert len(loaded) == vocab
    assert loaded.encode("<image>", add_special_tokens=False) == \
        [tokenizer.placeholder_id("image")]
    text = "the digit is seven"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    # The model folder's other files are still there; the training input is untouched.
    assert (exported / "generation_config.json").read_bytes() == \
        original["generation_config.json"]
    assert {p.name: p.read_bytes() for p in model_folder.iterdir()} == original


def test_tokenizer_files_are_recognised():
    """What the copy keeps from a tokenizer folder, and what it never takes from one."""
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                 "merges.txt", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja", "spiece.model", "qwen.tiktoken"):
        assert is_tokenizer_file(name), name
    for name in ("config.json", "generation_config.json", "preprocessor_config.json",
                 "model.safetensors", "README.md"):
        assert not is_tokenizer_file(name), name
