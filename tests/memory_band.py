"""What the memory-estimate tests share: the band an estimate is held to against the
fake-device tracker, and shallow copies of the config-only Hugging Face folders
(``tests/data/hf_configs``) at real widths with fewer layers."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "data" / "hf_configs"
BAND = (0.85, 1.15)


def shallow_folder(src: Path, dst: Path, layers: dict[str, int]) -> str:
    """A copy of a config-only folder with fewer layers (keys of ``layers``, nested in
    ``vision_config`` for CLIP)."""
    dst.mkdir()
    for file in src.iterdir():
        config = json.loads(file.read_text())
        if file.name == "config.json":
            (config.get("vision_config") or config).update(layers)
        (dst / file.name).write_text(json.dumps(config))
    return str(dst)
