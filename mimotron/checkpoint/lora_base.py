"""Adapter-only checkpoints: a LoRA module's frozen base stays in its folder.

A module with ``[modules.<m>.lora]`` whose weights come from its Hugging Face folder
(``hf_path``, and no ``checkpoint.pretrained`` run) never changes its base: the folder
holds it, and every build reads it from there. Its checkpoint entries are then the
adapters only (and their optimizer state), which makes a LoRA checkpoint of a 7B model
megabytes instead of gigabytes. The base is recorded instead by its folder and a
fingerprint (:func:`folder_fingerprint`), and a resume against another base is one line
naming both (:func:`check_base`), where loading adapters onto it would silently train
something else.

``MimoModel.adapters_only`` names those modules' parameter prefixes (set where the model
is built); :func:`~mimotron.checkpoint.state.model_state` leaves their base out of what
is saved and loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mimotron.checkpoint.lora_merge import lora_tables
from mimotron.config.hf_folder import tensor_files
from mimotron.config.lora import base_in_folder
from mimotron.names import module_prefix

__all__ = ["BASE_KEY", "adapters_only_prefixes", "base_record", "check_base",
           "check_folder_bases", "folder_fingerprint", "with_base"]

BASE_KEY = "lora_base"
"""Key of the checkpoint's ``meta``: ``{module: {"folder": ..., "fingerprint": ...}}``."""
_SAMPLED = 256  # bytes hashed at each end of every tensor's data


def adapters_only_prefixes(cfg: Any) -> tuple[str, ...]:
    """The ``MimoModel`` parameter prefixes of the modules that checkpoint adapters only
    (:func:`~mimotron.config.lora.base_in_folder`)."""
    return tuple(module_prefix(n) for n in cfg.modules if base_in_folder(cfg, n))


def folder_fingerprint(folder: str | Path) -> str:
    """A digest of a folder's weights: each safetensors file's name, size and header
    (every tensor's name, dtype, shape and offsets), and the first and last
    :data:`_SAMPLED` bytes of every tensor's data.

    Cheap at any size (a few hundred small reads, no full read), and it changes with a
    re-saved, re-cast or re-shaped checkpoint and with one whose tensors were trained
    (a trained tensor changes throughout, its ends included); a change confined to the
    middle of a tensor passes unseen.
    """
    digest = hashlib.sha256()
    for file in sorted(set(tensor_files(folder).values())):
        with open(file, "rb") as handle:
            head_len = int.from_bytes(handle.read(8), "little")
            header = handle.read(head_len)
            digest.update(json.dumps([file.name, file.stat().st_size]).encode())
            digest.update(len(header).to_bytes(8, "little") + header)
            entries = json.loads(header)
            for name in sorted(n for n in entries if n != "__metadata__"):
                begin, end = (8 + head_len + o for o in entries[name]["data_offsets"])
                for start in sorted({begin, max(begin, end - _SAMPLED)}):
                    handle.seek(start)
                    digest.update(handle.read(min(_SAMPLED, end - start)))
    return digest.hexdigest()[:16]


def base_record(cfg: Any) -> dict[str, dict[str, str]]:
    """``{module: {"folder", "fingerprint"}}`` of the modules that checkpoint adapters only."""
    return {n: {"folder": str(cfg.modules[n].hf_path),
                "fingerprint": folder_fingerprint(cfg.modules[n].hf_path)}
            for n in cfg.modules if base_in_folder(cfg, n)}


def check_base(meta: Mapping[str, Any], cfg: Any, path: str | Path) -> None:
    """Refuse adapters saved on another base than this run's (one line naming both).

    Args:
        meta: the checkpoint's ``meta``.
        cfg: this run's config.
        path: the checkpoint, for the message.

    Raises:
        ValueError: a module's ``[lora]`` table (rank, alpha, targets) differs from the
            one the checkpoint was trained with, its base folder differs in content
            (fingerprint) from the one the adapters were trained on, or one side keeps
            its base and the other not.
    """
    _check_tables(meta, cfg, path)
    saved = meta.get(BASE_KEY) or {}
    here = base_record(cfg)
    for name in sorted(set(saved) | set(here)):
        then, now = saved.get(name), here.get(name)
        if then is None or now is None:
            what = ("holds the whole module" if then is None
                    else "holds only its adapters, for the base in "
                    f"{then['folder']!r}")
            raise ValueError(f"checkpoint {path}: module {name!r} {what}, but this run "
                             f"{'trains adapters on its folder' if now else 'does not'}; "
                             "resume with the config that wrote it")
        if then["fingerprint"] != now["fingerprint"]:
            raise ValueError(
                f"checkpoint {path}: module {name!r}'s adapters were trained on the base in "
                f"{then['folder']!r} (fingerprint {then['fingerprint']}), but "
                f"modules.{name}.hf_path={now['folder']!r} holds another (fingerprint "
                f"{now['fingerprint']}); point hf_path at the base they were trained on")


def _check_tables(meta: Mapping[str, Any], cfg: Any, path: str | Path) -> None:
    """Adapters resume only under the table that shaped and scaled them."""
    saved_modules = (meta.get("config") or {}).get("modules") or {}
    for name, mod in cfg.modules.items():
        then = (saved_modules.get(name) or {}).get("lora") or {"rank": 0}
        now = {"rank": mod.lora.rank, "alpha": mod.lora.alpha, "targets": list(mod.lora.targets)}
        if not then.get("rank") and not now["rank"]:
            continue
        then = {k: then.get(k) for k in now}
        if then != now:
            raise ValueError(f"checkpoint {path}: modules.{name}.lora was {then} when it was "
                             f"saved, and is {now} now; adapters resume only under the table "
                             "they were trained with")


def check_folder_bases(record: Mapping[str, Any] | None, where: str) -> None:
    """Refuse to put saved adapters on a folder whose base changed since (exports,
    ``generate``): each recorded module's folder must still hold its fingerprint.

    Raises:
        ValueError: one line naming the folder and both fingerprints.
    """
    for name, saved in (record or {}).items():
        now = folder_fingerprint(saved["folder"])
        if now != saved["fingerprint"]:
            raise ValueError(f"{where}: module {name!r}'s adapters were trained on the base in "
                             f"{saved['folder']!r} (fingerprint {saved['fingerprint']}), which "
                             f"now holds another (fingerprint {now})")


def with_base(tensors: Mapping[str, Any], run_config: Mapping[str, Any],
              record: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's full-shape model tensors with the base of every module that
    checkpointed its adapters only read back from its folder, as training built it (one
    process; the exports read this). ``record``: the checkpoint's :data:`BASE_KEY`, which
    the folders must still match (:func:`check_folder_bases`)."""
    from mimotron.config.load import config_from_dict
    from mimotron.config.vocab_size import padded_vocab_size
    from mimotron.data.run_data import build_tokenizer
    from mimotron.models.build import build_module

    out = dict(tensors)
    if not lora_tables(run_config):
        return out  # no adapters: the run config is not even rebuilt
    cfg = config_from_dict(dict(run_config))
    names = [n for n in cfg.modules if base_in_folder(cfg, n)]
    if not names:
        return out
    check_folder_bases(record, "export")
    vocab = padded_vocab_size(build_tokenizer(cfg).vocab_size)  # as training sized it
    for name in names:
        part = build_module(cfg, name, vocab)  # reads the folder
        prefix = module_prefix(name)
        for key, value in part.state_dict().items():
            out.setdefault(prefix + key, value)
    return out
