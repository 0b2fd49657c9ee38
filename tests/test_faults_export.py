"""Export faults from an adversarial review: ``mimotron export`` deleting users' files.

Before the fix, ``export --format hf`` unlinked every weight file (``*.ckpt``,
``*.safetensors``, ...) in ``OUT_DIR/<module>/`` (a user's ``my_finetune.ckpt`` vanished,
exit 0), exporting into the parent of the ``hf_path`` folders deleted the pretrained
``model.safetensors`` and then failed with ``SameFileError``, and the default format
silently overwrote a file of the same name. Now export writes only into a folder it
owns (new, empty, or its own previous export listed by ``.mimotron-export.json``) and
never into a folder the run read; anything else is refused with one line before any
tensor is read.

One short run (module fixture: CLIP + Whisper + Llama folders as ``hf_path``, one rank,
2 iterations) gives the checkpoint every test exports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mimotron.checkpoint import export as export_module
from mimotron.checkpoint import export_checkpoint
from mimotron.checkpoint.export_folder import MARKER
from mimotron.cli.main import main as cli_main
from mimotron.forked_ranks import run_ranks
from tests.common import BASE, ONE_RANK
from tests.parity import train

pytest.importorskip("transformers")

from tests.hf_models import hf_overrides, save_models  # noqa: E402

MODULES = ("audio", "language", "vision")


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``models/<m>`` (the hf_path folders) and ``run/ckpt`` saved at iteration 2."""
    root = tmp_path_factory.mktemp("hf_run")
    paths = save_models(root / "models")
    run_ranks(1, train, [*BASE, *ONE_RANK, *hf_overrides(paths), "train.iters=2",
                          "eval.iters=1", "log.progress=false", "checkpoint.interval=2",
                          f"log.dir={root}/run", f"checkpoint.dir={root}/run/ckpt"],
              timeout_s=180)
    return {"models": root / "models", "ckpt": root / "run" / "ckpt"}


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run the CLI; it must exit 2 with one line holding every needle."""
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _export(ckpt: Path, out: Path, fmt: str) -> list[str]:
    return ["export", "--format", fmt, str(ckpt), str(out)]


def test_hf_export_never_deletes_a_users_file(hf_run, tmp_path, capsys, monkeypatch):
    """``my_finetune.ckpt`` in ``OUT_DIR/language/`` vanished (exit 0): now refused, one
    line naming the folder and the file, before any tensor is read or anything written."""
    out = tmp_path / "out"
    (out / "language").mkdir(parents=True)
    (out / "language" / "my_finetune.ckpt").write_bytes(b"a week of fine-tuning")
    before = _files(out)
    reads: list[Any] = []
    real = export_module._dcp_read
    monkeypatch.setattr(export_module, "_dcp_read",
                        lambda path, template: (reads.append(template), real(path, template)))
    _refused(capsys, _export(hf_run["ckpt"], out, "hf"), f"output folder {str(out)!r}",
             "language/my_finetune.ckpt")
    assert _files(out) == before
    assert len(reads) == 1  # the meta only: no tensor was read
    _refused(capsys, _export(hf_run["ckpt"], out, "mimotron"), "language/my_finetune.ckpt")
    assert _files(out) == before


def test_default_export_never_overwrites_a_file_it_did_not_write(hf_run, tmp_path, capsys):
    """The default format silently replaced ``OUT_DIR/language.safetensors``."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "language.safetensors").write_bytes(b"the user's own weights")
    (out / "notes.txt").write_text("keep me")
    _refused(capsys, _export(hf_run["ckpt"], out, "mimotron"), str(out),
             "language.safetensors", "notes.txt")
    assert _files(out) == {"language.safetensors": b"the user's own weights",
                           "notes.txt": b"keep me"}
    with pytest.raises(ValueError, match="holds files this export did not write"):
        export_checkpoint(hf_run["ckpt"], out)


def test_export_into_the_hf_folders_or_their_parent_is_refused(hf_run, tmp_path, capsys):
    """Exporting into the parent of the ``hf_path`` folders deleted the pretrained
    Whisper ``model.safetensors``, then failed with ``SameFileError``. Refused now, by
    either format, directly, through a symbolic link, or into one ``hf_path`` itself."""
    models = hf_run["models"]
    kept = _files(models)
    link = tmp_path / "link"
    link.symlink_to(models, target_is_directory=True)
    try:
        for out in (models, link):
            _refused(capsys, _export(hf_run["ckpt"], out, "hf"), f"output folder {str(out)!r}",
                     "hf_path=", "a folder the run read")
            _refused(capsys, _export(hf_run["ckpt"], out, "mimotron"), str(out))
        _refused(capsys, _export(hf_run["ckpt"], models / "audio", "mimotron"),
                 "modules.audio.hf_path=", "a folder the run read")
        assert _files(models) == kept
    finally:  # never leave the shared folders broken for the next test
        if _files(models) != kept:
            shutil.rmtree(models)
            for name, data in kept.items():
                (models / name).parent.mkdir(parents=True, exist_ok=True)
                (models / name).write_bytes(data)


def _marker(out: Path) -> list[str]:
    record = json.loads((out / MARKER).read_text())
    assert record["format"] == "mimotron-export", record
    return record["files"]


def test_re_export_replaces_only_what_its_own_export_wrote(hf_run, tmp_path, capsys):
    """A previous export (listed by its record) may be replaced, in either format; the
    files of the other format it no longer writes are removed, a user's file never."""
    out = tmp_path / "out"
    assert cli_main(_export(hf_run["ckpt"], out, "mimotron")) == 0
    assert _marker(out) == ["audio.safetensors", "config.json", "language.safetensors",
                            "vision.safetensors"]
    assert cli_main(_export(hf_run["ckpt"], out, "mimotron")) == 0  # again: replaced
    assert cli_main(_export(hf_run["ckpt"], out, "hf")) == 0
    files = _marker(out)
    assert sorted(_files(out)) == sorted([*files, MARKER])
    assert "language.safetensors" not in files and "config.json" not in files
    assert {f"{m}/model.safetensors" for m in MODULES} <= set(files)
    assert {"audio.safetensors", "vision.safetensors", "mimotron_config.json"} <= set(files)
    capsys.readouterr()
    (out / "language" / "my_notes.md").write_text("mine")
    _refused(capsys, _export(hf_run["ckpt"], out, "hf"), "language/my_notes.md")
    (out / "language" / "my_notes.md").unlink()
    assert cli_main(_export(hf_run["ckpt"], out, "mimotron")) == 0
    assert sorted(_files(out)) == sorted([*_marker(out), MARKER])
    assert not (out / "language").exists()  # its own files gone, so is its folder


@pytest.mark.parametrize("record", ["not json", '{"format": "other", "files": []}',
                                    '{"format": "mimotron-export", "files": ["../x"]}'])
def test_a_record_that_is_not_the_exporters_own_is_refused(hf_run, tmp_path, capsys, record):
    """A forged or damaged record never lets export delete outside or claim other files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(record)
    _refused(capsys, _export(hf_run["ckpt"], out, "mimotron"), str(out), MARKER)
    assert _files(out) == {MARKER: record.encode()}
