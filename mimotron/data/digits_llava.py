"""The digits/DTMF task written to disk in LLaVA format: JSONL, PNG images, WAV tones.

:func:`write_llava_task` turns the demo task (:mod:`mimotron.data.digits`) into the files
a user with real data has: one JSONL line per sample (``{"id", "image", "audio",
"conversations"}``), the digit images as 8x8 grayscale PNGs, the DTMF key tones as 16 kHz
16-bit WAV files (Whisper's rate). Training on them goes through exactly the LLaVA path
(``data.dataset = "llava"``). The four kinds of the demo become conversations:

======  =========================================  ==============================
kind    human turn                                 assistant turn
======  =========================================  ==============================
image   ``<image>\\nwhich digit is this``            ``seven``
audio   ``<audio>\\nwhich key was pressed``          ``three``
both    ``<image><audio>\\nadd the digit and key``   ``seven plus three is ten``
text    ``two plus three``                          ``five``
======  =========================================  ==============================

Every sample is a pure function of ``(seed, index)``: the same arguments write the same
files.
"""

from __future__ import annotations

import json
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mimotron.data.digits import KINDS, load_digit_images, modality_kind_map, sample_rng
from mimotron.data.dtmf import dtmf_tone
from mimotron.data.tokenizer import MODALITIES, number_to_words

WAV_RATE = 16000
"""Sample rate of the written tones (Whisper's)."""
# Salt of the export's per-sample generators: unrelated to the training streams' salts.
_EXPORT_SALT = 0x6C6C7661
_KIND_WEIGHTS = (0.3, 0.2, 0.4, 0.1)  # image, audio, both, text: the demo's defaults
PROMPTS = {
    "image": "<image>\nwhich digit is this",
    "audio": "<audio>\nwhich key was pressed",
    "both": "<image><audio>\nadd the digit and the key",
}


def _conversation(kind: str, image_digit: int, key: int, a: int, b: int) -> tuple[str, str]:
    """``(human text, assistant text)`` of one sample."""
    if kind == "image":
        return PROMPTS["image"], number_to_words(image_digit)
    if kind == "audio":
        return PROMPTS["audio"], number_to_words(key)
    if kind == "both":
        total = number_to_words(image_digit + key)
        return PROMPTS["both"], (f"{number_to_words(image_digit)} plus "
                                 f"{number_to_words(key)} is {total}")  # fmt: skip
    return f"{number_to_words(a)} plus {number_to_words(b)}", number_to_words(a + b)


def _write_png(path: Path, image: np.ndarray) -> None:
    from PIL import Image  # Deferred: only writing media needs PIL.

    pixels = np.clip(np.rint(image * 255.0), 0, 255).astype(np.uint8)
    Image.fromarray(pixels, mode="L").save(path)


def _write_wav(path: Path, samples: np.ndarray) -> None:
    peak = max(float(np.abs(samples).max()), 1e-9)
    pcm = np.rint(samples / peak * 0.9 * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(WAV_RATE)
        f.writeframes(pcm.tobytes())


def llava_record(index: int, seed: int, modalities: Sequence[str], out_dir: Path,
                 images: np.ndarray, labels: np.ndarray) -> dict[str, Any]:  # fmt: skip
    """Write sample ``index``'s files under ``out_dir``; its JSONL record."""
    rng = sample_rng(seed, _EXPORT_SALT, index)
    kind = modality_kind_map(modalities)[KINDS[int(rng.choice(4, p=_KIND_WEIGHTS))]]
    pick, key, a, b = (int(v) for v in rng.integers(0, [len(labels), 10, 10, 10]))
    human, answer = _conversation(kind, int(labels[pick]), key, a, b)
    record: dict[str, Any] = {"id": f"digits-{index:06d}"}
    if kind in ("image", "both"):
        record["image"] = f"images/{index:06d}.png"
        _write_png(out_dir / record["image"], images[pick])
    if kind in ("audio", "both"):
        record["audio"] = f"audio/{index:06d}.wav"
        _write_wav(out_dir / record["audio"], dtmf_tone(key, rng, sample_rate=WAV_RATE))
    record["conversations"] = [{"from": "human", "value": human},
                               {"from": "gpt", "value": answer}]  # fmt: skip
    return record


def write_llava_task(out_dir: str | Path, num_samples: int, seed: int,
                     modalities: Sequence[str] = MODALITIES) -> Path:  # fmt: skip
    """Write ``num_samples`` digits/DTMF samples as a LLaVA dataset under ``out_dir``.

    Args:
        out_dir: folder to write (created): ``data.jsonl``, ``images/``, ``audio/``.
        num_samples: samples to write (>= 1).
        seed: picks each sample's kind, digits and tone.
        modalities: the modalities the model has encoders for; the other kinds are
            remapped as the demo task does (:func:`~mimotron.data.digits.modality_kind_map`).

    Returns:
        The JSONL file (``data.path``; its folder is ``data.root``).

    Raises:
        ValueError: ``num_samples`` below 1 or an unknown modality.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} is invalid: expected an integer >= 1")
    out = Path(out_dir)
    for sub in ("images", "audio"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    images, labels = load_digit_images()
    pixels, digits = images[:, 0].numpy(), labels.numpy()
    lines = [json.dumps(llava_record(i, seed, tuple(modalities), out, pixels, digits))
             for i in range(num_samples)]  # fmt: skip
    path = out / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def conversation_texts(path: str | Path) -> list[str]:
    """Every turn's text of a LLaVA JSONL file (e.g. to train a BPE tokenizer on)."""
    texts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts += [turn["value"] for turn in json.loads(line)["conversations"]]
    return texts
