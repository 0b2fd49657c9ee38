"""``mimotron export --format peft``: a run's LoRA adapters as a PEFT adapter folder.

``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT saves them
(``base_model.model.<layer>.lora_A.weight``, ``lora_B``), naming the layers as the
``transformers`` class of the run's folder names them, so
``PeftModel.from_pretrained(base, OUT_DIR)`` puts them on the base model the user
already has. What else trained in full (LLaVA's projector in the stage-2 recipe) goes in
as PEFT's ``modules_to_save``. (The other exports merge the adapters:
:mod:`mimotron.checkpoint.lora_merge`.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mimotron.checkpoint.export import read_full_model
from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.files import read_manifest, resolve_checkpoint
from mimotron.checkpoint.hf_export import check_hf_folder, family_of, hf_paths, set_file_modes
from mimotron.checkpoint.load import read_metadata
from mimotron.checkpoint.lora_merge import lora_tables
from mimotron.checkpoint.state import OPTIMIZER
from mimotron.checkpoint.vlm_export import joined_weight_map, vlm_folder
from mimotron.config.hf_folder import read_hf_config
from mimotron.models.lora import is_lora_parameter
from mimotron.names import LANGUAGE, module_prefix

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "export_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"


def _base_folder(run_config: Mapping[str, Any]) -> tuple[Path, str | None]:
    """``(the folder, its vision module or None)`` the adapters go onto: the run's one
    vision-language folder, or its language model's."""
    found = vlm_folder(run_config)
    if found is not None:
        return found
    path = hf_paths(run_config).get(LANGUAGE)
    if path is None:
        raise ValueError("export --format peft needs a language model loaded from a Hugging "
                         "Face folder (modules.language.hf_path or hf_path): PEFT adapters "
                         "go onto that folder's transformers model")
    return check_hf_folder(path, LANGUAGE), None


def _memory_names(folder: Path, vision: str | None) -> list[str]:
    """The parameter names of the folder's ``transformers`` model as it holds them in
    memory (built on the meta device: nothing allocated, no weight read)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    auto = (transformers.AutoModelForImageTextToText if vision is not None
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(config)
    return [n for n, _ in model.named_parameters()]


def _hf_names(folder: Path, vision: str | None, names: list[str]) -> dict[str, str]:
    """mimotron's names (inside ``MimoModel``) -> the in-memory ``transformers`` model's."""
    config = read_hf_config(folder)
    memory = _memory_names(folder, vision)
    if vision is not None:
        weight_map = joined_weight_map(config, memory)
    else:
        weight_map = family_of(config, f"modules.language.hf_path={str(folder)!r}").weight_map
    out = {}
    for name in names:
        if name.startswith("language_model."):
            local = name[len("language_model."):]
        elif vision is not None and name.startswith(module_prefix(vision)):
            local = name[len(module_prefix(vision)):]
        else:
            raise ValueError(f"export --format peft: {name} trained in a module that is not "
                             f"in the folder {str(folder)!r}; export with --format mimotron")
        out[name] = weight_map.to_hf(local)
        if out[name] not in memory:
            raise ValueError(f"export --format peft: {name} maps to {out[name]}, which the "
                             f"folder's transformers model does not have")
    return out


def export_peft(checkpoint: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """``mimotron export --format peft``: the run's adapters as a PEFT adapter folder.

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        out_dir: the output folder (created): new, empty, or a previous export's own.

    Returns:
        ``{"adapter": OUT_DIR}``.

    Raises:
        ValueError: a run without adapters, or whose base is not a Hugging Face folder.
        CheckpointError: missing, incomplete or corrupted (names the file).
    """
    target = ExportFolder(out_dir)
    found: dict[str, Any] = {}

    def check(meta: dict[str, Any]) -> None:
        tables = lora_tables(meta["config"])
        if len(tables) != 1:
            raise ValueError(f"export --format peft needs one module with adapters "
                             f"(modules.<m>.lora.rank > 0); this run has {sorted(tables)}")
        found["module"], found["table"] = next(iter(tables.items()))
        found["folder"], found["vision"] = _base_folder(meta["config"])
        target.check(meta["config"])

    tensors, meta = read_full_model(checkpoint, check_meta=check, base=False)
    adapters = {n: t for n, t in tensors.items() if is_lora_parameter(n)}
    saved = _trained_in_full(checkpoint)
    names = _hf_names(found["folder"], found["vision"],
                      [f"{n.rsplit('.', 1)[0]}.weight" for n in adapters] + sorted(saved))
    weights, targets = {}, set()
    for name, tensor in adapters.items():
        layer, kind = name.rsplit(".", 1)
        path = names[f"{layer}.weight"][:-len(".weight")]
        targets.add(path)
        weights[f"base_model.model.{path}.{'lora_A' if kind == 'lora_a' else 'lora_B'}.weight"] \
            = tensor.contiguous()
    for name in saved:
        weights[f"base_model.model.{names[name]}"] = tensors[name].contiguous()
    table = found["table"]
    config = {"peft_type": "LORA", "r": int(table["rank"]), "lora_alpha": table["alpha"],
              "lora_dropout": table["dropout"], "target_modules": sorted(targets),
              "bias": "none", "base_model_name_or_path": str(found["folder"]),
              "modules_to_save": sorted({names[n].rsplit(".", 1)[0] for n in saved}) or None,
              "task_type": None, "inference_mode": True, "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False}
    written = [target.file(ADAPTER_CONFIG), target.file(ADAPTER_FILE)]
    written[0].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(written[1]), metadata={"format": "pt",
                                                  "iteration": str(meta["iteration"])})
    set_file_modes(written)
    target.finish()
    return {"adapter": target.root}


def _trained_in_full(checkpoint: str | Path) -> set[str]:
    """The parameters (names inside ``MimoModel``) that trained without adapters: those
    with optimizer state in the checkpoint and not an adapter's (a projector, Qwen-VL's
    patch mergers, a whole module)."""
    path = resolve_checkpoint(checkpoint)
    keys = read_metadata(path, read_manifest(path)).state_dict_metadata
    out = set()
    for key in keys:
        if not key.startswith(OPTIMIZER) or ".state." not in key:
            continue
        module, rest = key[len(OPTIMIZER):].split(".state.", 1)
        name = rest.rsplit(".", 1)[0]  # drop the state's own key (exp_avg, step, ...)
        if not is_lora_parameter(name):
            out.add(module_prefix(module) + name)
    return out
