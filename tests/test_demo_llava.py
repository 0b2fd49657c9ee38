"""``make demo-llava``: its assets are deterministic, complete ones are kept, and
``configs/digits_llava.toml`` validates (``mimotron plan``) against them.

The assets are written with few samples (the models and tokenizer do not depend on the
sample count); no training runs here.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from mimotron.cli.main import main
from mimotron.demo.llava_assets import DEFAULT_DIR, MARKER, write_llava_assets

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_llava.toml"
NUM_SAMPLES = 16


def _digests(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding the demo assets where the config expects them."""
    work = tmp_path_factory.mktemp("demo_llava")
    assert write_llava_assets(work / DEFAULT_DIR, num_samples=NUM_SAMPLES) is True
    return work


def test_assets_are_deterministic_and_complete(assets: Path, tmp_path: Path) -> None:
    first = assets / DEFAULT_DIR
    write_llava_assets(tmp_path / "again", num_samples=NUM_SAMPLES)
    digests = _digests(first)
    assert digests == _digests(tmp_path / "again")
    for part in ("data/data.jsonl", "tokenizer/tokenizer.json", "tokenizer/chat_template.jinja",
                 "models/vision/config.json", "models/vision/model.safetensors",
                 "models/vision/preprocessor_config.json", "models/audio/model.safetensors",
                 "models/audio/preprocessor_config.json",
                 "models/language/model.safetensors", MARKER):
        assert part in digests, part
    lines = (first / "data" / "data.jsonl").read_text().splitlines()
    assert len(lines) == NUM_SAMPLES
    assert any(p.startswith("data/images/") for p in digests)
    assert any(p.startswith("data/audio/") for p in digests)
    types = {m: json.loads((first / "models" / m / "config.json").read_text())["model_type"]
             for m in ("vision", "audio", "language")}  # fmt: skip
    assert types == {"vision": "clip_vision_model", "audio": "whisper", "language": "qwen2"}


def test_complete_assets_are_kept_and_incomplete_ones_rewritten(tmp_path: Path) -> None:
    out = tmp_path / "assets"
    assert write_llava_assets(out, num_samples=4) is True
    data = out / "data" / "data.jsonl"
    data.write_text("edited\n")
    assert write_llava_assets(out, num_samples=4) is False  # complete: left alone
    assert data.read_text() == "edited\n"
    # Other arguments, or a missing marker (an interrupted run): written again.
    assert write_llava_assets(out, num_samples=5) is True
    assert len(data.read_text().splitlines()) == 5
    (out / MARKER).unlink()
    data.write_text("edited\n")
    assert write_llava_assets(out, num_samples=5) is True
    assert len(data.read_text().splitlines()) == 5
    with pytest.raises(ValueError, match=r"num_samples=1 is invalid"):
        write_llava_assets(tmp_path / "other", num_samples=1)


def test_config_plans_against_the_assets(assets: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    """The config's relative paths resolve from the working directory, as in `make`."""
    monkeypatch.chdir(assets)
    code = main(["plan", str(CONFIG)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "placement: non-colocated, world size 4" in out
    # Sizes from the folders: the language model is the Qwen2 checkpoint's.
    assert re.search(r"^language +language +[\d,]+ +1 +1 +2 ", out, re.M), out
    assert re.search(r"^vision +vit ", out, re.M) and re.search(r"^audio +audio ", out, re.M)
    assert "run directory: starts fresh in runs/digits_llava" in out
