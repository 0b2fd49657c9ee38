"""Hugging Face folders as modules through the config: training parity and bad inputs.

Small randomly initialised ``transformers`` models (a CLIP vision tower, a Whisper
model, a Llama decoder) are saved into a temporary folder and named by
``modules.<m>.hf_path``. The engine trains them on a heterogeneous layout (vision TP 2 |
audio | language PP 2, and
vision PP 2 | audio | language TP 2) and must match the plain one-process reference loop
(tests/reference.py: full model, backward, ``clip_grad_norm_``, ``torch.optim.AdamW``)
in losses, grad norms and final weights. The Llama vocabulary (40) is smaller than the
padded model vocabulary (64), so the embedding and the untied head carry rows that are
not in the checkpoint (initialised by :mod:`mimotron.models.hf.vocab`). Bad configs are
refused by config validation / the layout plan, before any process group exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mimotron.cli.main import main
from mimotron.config import load_config
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, noncolocated
from tests.hf_models import check_against_reference, hf_overrides, save_models


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_models(tmp_path_factory.mktemp("hf"))


def test_config_reads_sizes_from_the_folders(hf_dirs: dict[str, Path]) -> None:
    cfg = load_config(DIGITS, BASE + hf_overrides(hf_dirs))
    vision, audio, lm = (cfg.modules[m] for m in ("vision", "audio", "language"))
    # vision_feature_layer -2 of 3 layers: 2 layers built; the class token is dropped.
    assert (vision.num_layers, vision.num_heads, vision.num_output_tokens) == (2, 4, 16)
    assert (audio.num_freq_bins, audio.num_frames, audio.num_output_tokens) == (129, 16, 4)
    assert (lm.num_layers, lm.ffn_hidden_size) == (2, 128)


# Encoder TP slices + a language pipeline; an encoder pipeline + vocabulary-parallel TP
# (rank 1 of the language holds rows 32..63: 32..39 from the checkpoint, the rest new).
LAYOUTS = {
    "vision-tp2|audio|language-pp2": noncolocated({"tensor": 2}, {}, {"pipeline": 2}),
    "vision-pp2|audio|language-tp2": noncolocated({"pipeline": 2}, {}, {"tensor": 2}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hf_modules_train_like_one_process(hf_dirs: dict[str, Path], layout: str) -> None:
    shared = hf_overrides(hf_dirs)
    overrides = shared + LAYOUTS[layout]
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    assert world == 5
    check_against_reference(hf_dirs, shared, overrides, world)


def test_hf_modules_interleaved_train_like_one_process(tmp_path: Path) -> None:
    """A CLIP tower, a Whisper encoder and a Llama decoder, all under interleaved 1F1B
    (PP 2 x VP 2, one layer per chunk, 4 micro-batches; the CLIP class token rides the
    ring until the last chunk drops it), match the plain loop."""
    paths = save_models(tmp_path, lm_layers=4, vision_layers=5, audio_layers=4)
    shared = hf_overrides(paths) + ["train.micro_batch_size=4", "modules.vision.num_layers=4",
                                     "modules.audio.num_layers=4",
                                     "modules.language.num_layers=4"]
    pp2vp2 = {"pipeline": 2, "virtual_pipeline": 2}
    overrides = shared + noncolocated(pp2vp2, pp2vp2, pp2vp2)
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    assert world == 6
    check_against_reference(paths, shared, overrides, world)


def _plan(overrides: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``mimotron plan`` in-process (it validates before anything is launched)."""
    code = main(["plan", str(DIGITS), *BASE, *overrides])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_reports_hf_modules(hf_dirs: dict[str, Path], capsys: pytest.CaptureFixture
                                 ) -> None:
    code, out, err = _plan(hf_overrides(hf_dirs)
                           + noncolocated({"tensor": 2}, {}, {"pipeline": 2}), capsys)
    assert code == 0, err
    # The parameter counts are the checkpoints' (vocabulary 64) plus the projectors.
    lm_params = 64 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    assert re.search(rf"^language +language +{lm_params:,} ", out, re.M), out
    assert "memory estimate per rank" in out


def test_a_config_json_is_read_once_per_load_and_once_per_plan(
        hf_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    # load_config fills the sizes in and checks the modules through one HFConfigs; the
    # module keeps what it read, so plan's layout rules, data check and estimates read
    # no file again. Counted at the file read itself.
    reads: list[str] = []
    read_text = Path.read_text

    def counting(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "config.json":
            reads.append(str(self.parent))
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", counting)
    folders = sorted(str(p) for p in hf_dirs.values())
    cfg = load_config(DIGITS, BASE + hf_overrides(hf_dirs))
    assert sorted(reads) == folders
    assert cfg.modules["language"].num_layers == 2  # the sizes came from the files
    reads.clear()
    code, _, err = _plan(hf_overrides(hf_dirs), capsys)  # a new load: read afresh, once
    assert code == 0, err
    assert sorted(reads) == folders


def test_missing_folder_is_an_error_before_launch(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=r"modules\.language.*hf_path.*not an existing"):
        load_config(DIGITS, BASE + [f"modules.language.hf_path='{missing}'"])
    code, _, err = _plan([f"modules.language.hf_path='{missing}'"], capsys)
    assert code == 2 and "never downloads" in err


def test_size_contradicting_config_json_is_an_error(hf_dirs: dict[str, Path],
                                                    capsys: pytest.CaptureFixture) -> None:
    over = hf_overrides(hf_dirs)
    with pytest.raises(ValueError, match=r"modules\.language\.hidden_size=96 contradicts "
                                         r"config\.json.*gives 64"):
        load_config(DIGITS, BASE + over + ["modules.language.hidden_size=96"])
    # Even a value equal to the toy default contradicts when the TOML sets it.
    with pytest.raises(ValueError, match=r"modules\.language\.hidden_size=128 contradicts"):
        load_config(DIGITS, BASE + over + ["modules.language.hidden_size=128"])
    code, _, err = _plan(over + ["modules.language.num_layers=3"], capsys)
    assert code == 2 and "num_layers=3 contradicts" in err


def test_tensor_not_dividing_kv_heads_is_an_error(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    paths = save_models(tmp_path, kv_heads=1)
    over = hf_overrides(paths) + noncolocated({}, {}, {"tensor": 2})
    cfg = load_config(DIGITS, BASE + over)  # the config alone is valid
    with pytest.raises(ValueError, match=r"tensor=2 is invalid.*num_kv_heads.*=1"):
        check_layout(cfg)
    code, _, err = _plan(over, capsys)
    assert code == 2 and "num_kv_heads" in err


def test_pipeline_with_tied_embeddings_is_an_error(tmp_path: Path) -> None:
    paths = save_models(tmp_path, tied=True)
    over = hf_overrides(paths) + noncolocated({}, {}, {"pipeline": 2})
    with pytest.raises(ValueError, match=r"pipeline=2 is invalid.*tie_word_embeddings"):
        check_layout(load_config(DIGITS, BASE + over))


def test_hf_only_keys_without_hf_path_are_errors() -> None:
    for item in ("modules.vision.vision_feature_layer=-1",
                 "modules.vision.vision_feature_select_strategy='full'",
                 "modules.audio.downsample_factor=2", "modules.audio.downsample_mode='stack'",
                 "modules.language.downsample_factor=2"):
        key = item.split("=")[0].rsplit(".", 1)[1]
        with pytest.raises(ValueError, match=f"{key}=.*only applies"):
            load_config(DIGITS, BASE + [item])
