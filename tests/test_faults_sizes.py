"""Fault injection: sizes, counts and files that passed ``plan`` and failed (or hung) later.

* item 1: ``config.json`` values of the wrong type or range passed; ten million layers
  hung ``plan``; a model no device holds was allocated;
* item 2: more local ranks than cores started without a word; ``plan`` printed a row
  per rank of a million-rank layout;
* item 3: ``train.pg_timeout_s = 1e308`` passed and overflowed in the ranks;
* item 4: truncated safetensors and chat templates with syntax errors failed after launch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mimotron.cli.main import main
from mimotron.config import load_config
from mimotron.config.limits import FORCE_LOCAL_RANKS_ENV, check_local_ranks, max_local_ranks
from tests.common import DIGITS, ONE_RANK, SMALL_MODEL, colocated

LLAMA = {"model_type": "llama", "vocab_size": 40, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


def _folder(root: Path, **changes: Any) -> Path:
    """A language hf_path folder holding only ``config.json`` (validation reads no more)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return root


def _over(folder: Path, **sizes: int) -> list[str]:
    """Overrides naming ``folder``; ``sizes``: language keys configs/digits.toml sets, with
    the folder's values (a differing one would contradict config.json)."""
    keys = [f"modules.language.{k}={v}" for k, v in sizes.items()]
    return [*SMALL_MODEL, *ONE_RANK, f"modules.language.hf_path='{folder}'", *keys]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _plan(overrides: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(["plan", str(DIGITS), *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- item 1: config.json types and ranges; model size -------------------------------


@pytest.mark.parametrize(("key", "value", "valid"), [
    ("num_attention_heads", "4", "an integer in"),
    ("hidden_size", 128.5, "an integer in"),
    ("hidden_size", 1e6, "an integer in"),
    ("rms_norm_eps", float("nan"), "a finite number > 0"),
    ("num_key_value_heads", 0, "an integer in"),
    ("num_key_value_heads", 3, "a divisor of num_attention_heads=4"),
    ("num_attention_heads", 5, "a divisor of hidden_size=64"),
    ("vocab_size", True, "an integer in"),
])
def test_item1_config_json_values_are_typed_and_range_checked(tmp_path, capsys, key, value,
                                                               valid):
    """Item 1: ``"128"``, ``128.5``, NaN, zero kv heads passed ``plan``; now one line
    naming the file, the key, the value and what is valid."""
    folder = _folder(tmp_path / "lm", **{key: value})
    with pytest.raises(ValueError, match=rf"config\.json: {key}=.* is invalid: expected {valid}"):
        load_config(DIGITS, _over(folder))
    code, _, err = _plan(_over(folder), capsys)
    line = _one_line(err)
    assert code == 2 and str(folder / "config.json") in line and key in line


def test_item1_ten_million_layers_refused_before_anything_is_built(tmp_path, capsys,
                                                                   monkeypatch):
    """Item 1: ``num_hidden_layers = 10000000`` hung ``plan`` (meta build of every layer)
    and spun ``train``; now refused by the analytic parameter count, in one line."""
    folder = _folder(tmp_path / "lm", num_hidden_layers=10_000_000, hidden_size=4096,
                     intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8)
    over = _over(folder, hidden_size=4096, num_layers=10_000_000, num_heads=32)
    with pytest.raises(ValueError, match=r"modules\.language: about .* parameters need .* TiB"):
        load_config(DIGITS, over)

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr("mimotron.models.build.build_module", never)
    code, _, err = _plan(over, capsys)
    assert code == 2 and "TiB" in _one_line(err)
    code = main(["train", str(DIGITS), *over])
    assert code == 2 and "no device holds" in _one_line(capsys.readouterr().err)


def test_item1_a_toy_model_too_large_for_any_device_is_refused(capsys):
    """Item 1: ``hidden_size = 1e6`` tried a 4 TB allocation; the toy sizes are bounded
    the same way, and more than 1e13 parameters in all is refused even when split."""
    big = [*SMALL_MODEL, *ONE_RANK, "modules.language.hidden_size=1000000"]
    with pytest.raises(ValueError, match=r"modules\.language: .*no device holds more than 16"):
        load_config(DIGITS, big)
    # 1.2e13 parameters over 800 ranks: each holds 240 GB, the whole is still too much.
    split = [*SMALL_MODEL, *ONE_RANK, "modules.language.hidden_size=100000",
             "modules.language.num_layers=100", "modules.language.parallel.tensor=8",
             "modules.language.parallel.pipeline=100"]
    with pytest.raises(ValueError, match=r"more than the 1e\+13"):
        load_config(DIGITS, split)
    code = main(["train", str(DIGITS), *big])
    assert code == 2 and "TiB" in _one_line(capsys.readouterr().err)


# ---- item 2: local ranks; plan output ------------------------------------------------


def test_item2_more_ranks_than_cores_warns_and_far_more_is_refused(capsys, monkeypatch):
    """Item 2: 19 local processes on 2 cores started without a word; now a warning line,
    and past max(64, 4 x cores) a refusal unless MIMOTRON_FORCE_LOCAL_RANKS=1."""
    monkeypatch.delenv(FORCE_LOCAL_RANKS_ENV, raising=False)
    check_local_ranks(16, launched=True, cores=2)
    assert "16 local ranks on 2 cores" in _one_line(capsys.readouterr().err)
    check_local_ranks(2, launched=True, cores=2)
    assert capsys.readouterr().err == ""
    assert max_local_ranks(2) == 64 and max_local_ranks(32) == 128
    with pytest.raises(ValueError, match=rf"needs 65 ranks.*{FORCE_LOCAL_RANKS_ENV}=1"):
        check_local_ranks(65, launched=True, cores=2)
    check_local_ranks(10**6, launched=False, cores=2)  # torchrun: not mimotron's launch
    monkeypatch.setenv(FORCE_LOCAL_RANKS_ENV, "1")
    check_local_ranks(65, launched=True, cores=2)
    assert "warning" in capsys.readouterr().err


def test_item2_train_refuses_before_starting_any_rank(capsys, monkeypatch):
    """Item 2: ``train`` with a layout of 1024 ranks exits 2 in one line, launching
    nothing (the launcher is replaced by a tripwire)."""
    monkeypatch.delenv(FORCE_LOCAL_RANKS_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def tripwire(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("ranks were launched")

    monkeypatch.setattr("mimotron.cli.train._launch", tripwire)
    over = [*SMALL_MODEL, *colocated(1024), "train.global_batch_size=1024",
            "train.micro_batch_size=1024"]
    assert main(["train", str(DIGITS), *over]) == 2
    assert "MIMOTRON_FORCE_LOCAL_RANKS=1" in _one_line(capsys.readouterr().err)


def test_item2_plan_summarises_a_large_rank_map(capsys):
    """Item 2: ``plan`` printed a row per rank; past 64 ranks each module shows its first
    and last ranks and a count of those left out."""
    over = [*SMALL_MODEL, *colocated(4096), "train.global_batch_size=4096",
            "train.micro_batch_size=4096"]
    code, out, err = _plan(over, capsys)
    assert code == 0, err
    assert len(out.splitlines()) < 80, out
    assert "(4,092 ranks not shown)" in out and "4095  vision" in out


# ---- item 3: timeouts ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1e308", "2147484", "1e10"])
def test_item3_timeouts_must_fit_torch_milliseconds(capsys, value):
    """Item 3: ``train.pg_timeout_s = 1e308`` passed ``plan`` and raised OverflowError in
    the ranks; now one line naming the key."""
    over = [*SMALL_MODEL, *ONE_RANK, f"train.pg_timeout_s={value}"]
    with pytest.raises(ValueError, match=r"train\.pg_timeout_s=.* expected a number <= "
                                         r"2147483\.647"):
        load_config(DIGITS, over)
    code, _, err = _plan(over, capsys)
    assert code == 2 and "train.pg_timeout_s" in _one_line(err)
    load_config(DIGITS, [*SMALL_MODEL, *ONE_RANK, "train.pg_timeout_s=2147483.647"])


# ---- item 4: weight files and chat templates ------------------------------------------


def _weights(folder: Path) -> Path:
    file = folder / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(40, 64)}, str(file))
    return file


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])


def _garbage_header(file: Path) -> None:
    file.write_bytes(struct.pack("<Q", 5) + b"{oops" + b"\0" * 64)


def _huge_length(file: Path) -> None:
    file.write_bytes(struct.pack("<Q", 2**60) + b"{}")


def _bad_offsets(file: Path) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})
    file.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 8)


@pytest.mark.parametrize(("damage", "why"), [
    (_truncate, "truncated"), (_garbage_header, "header is not JSON"),
    (_huge_length, "the header claims"), (_bad_offsets, "needs 16 bytes"),
])
def test_item4_malformed_safetensors_are_named_before_launch(tmp_path, capsys, damage, why):
    """Item 4: a truncated or malformed safetensors file failed in every rank with the
    library's message; now ``plan`` (and ``train``, by the same check) names the file."""
    folder = _folder(tmp_path / "lm")
    file = _weights(folder)
    damage(file)
    code, _, err = _plan(_over(folder), capsys)
    line = _one_line(err)
    assert code == 2 and f"{file} is not a valid safetensors file" in line and why in line


def test_item4_a_sound_safetensors_file_passes(tmp_path):
    """Item 4 (control): the header check accepts what safetensors writes."""
    from mimotron.config.hf_folder import check_weight_files

    _weights(_folder(tmp_path / "lm"))
    check_weight_files(tmp_path / "lm")


def test_item4_chat_template_syntax_error_names_the_file(tmp_path):
    """Item 4: a chat template with a syntax error failed at the first rendered sample,
    in every rank; now the tokenizer (built before launch) names the file and line."""
    from mimotron.data.hf_tokenizer import HFTokenizer
    from tests.hf_data import make_tokenizer

    folder = make_tokenizer(tmp_path / "tok",
                            chat_template="{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ValueError, match=r"tok/(chat_template\.jinja|tokenizer_config\.json): "
                                         r"the chat template does not compile: .*line 2"):
        HFTokenizer(folder)
    good = make_tokenizer(tmp_path / "good")
    HFTokenizer(good)  # the shipped template compiles
