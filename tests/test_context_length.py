"""``data.seq_length`` past a Hugging Face language model's trained context: refused
without RoPE scaling, a warning of ``plan`` and ``train`` with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.config.context_length import context_length_note

ROOT = Path(__file__).resolve().parents[1]
LLAVA = str(ROOT / "configs" / "llava15_7b_8gpu.toml")  # Llama-2-7B: 4096 positions


def test_a_longer_sequence_without_rope_scaling_is_refused_in_one_line():
    assert context_length_note(load_config(LLAVA, ["data.seq_length=4096"])) is None
    with pytest.raises(ValueError) as err:
        load_config(LLAVA, ["data.seq_length=4097"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("data.seq_length=4097 is invalid: ")
    assert "max_position_embeddings=4096" in message and "data.seq_length <= 4096" in message


def test_a_longer_sequence_with_rope_scaling_is_a_warning_of_plan(tmp_path, capsys):
    from mimotron.cli.main import main

    folder = tmp_path / "llama2_7b_linear"
    shutil.copytree(ROOT / "tests" / "data" / "hf_configs" / "llama2_7b", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    overrides = [f"modules.language.hf_path={folder}", "data.seq_length=8192",
                 f"log.dir={tmp_path / 'run'}"]
    note = context_length_note(load_config(LLAVA, overrides))
    assert note == ("warning: data.seq_length=8192 exceeds the language model's "
                    "max_position_embeddings=4096; its RoPE scaling (linear) extends the "
                    "positions past what it was trained on")
    assert main(["plan", LLAVA, *overrides]) == 0
    assert capsys.readouterr().out.startswith(note)


def test_packed_rows_restart_positions_so_a_longer_row_is_a_warning():
    cfg = load_config(LLAVA, ["data.seq_length=8192", "data.packing=true"])
    note = context_length_note(cfg)
    assert note is not None and note.startswith("warning: data.seq_length=8192 exceeds")
    assert "packed document" in note
