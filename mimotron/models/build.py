"""Build modules and ``MimoModel`` from a :class:`~mimotron.config.MimoConfig`.

Every module is initialised with :func:`init_parameters_` under the prefix it has inside
``MimoModel`` (``modality_submodules.<name>.`` or ``language_model.``), so a module built
alone, or one pipeline stage of it, holds exactly the values of the full model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mimotron.config.hf_folder import read_hf_config, tensor_files
from mimotron.config.hf_resolve import hf_family, language_spec, tower_kwargs
from mimotron.config.hf_vlm import is_vlm_config
from mimotron.config.moe_config import moe_options
from mimotron.config.schema import MimoConfig, ModuleConfig
from mimotron.config.vocab_size import model_vocab_size
from mimotron.models.encoders import AudioEncoder, ModalitySubmodule, Projector, VisionEncoder
from mimotron.models.hf.clip import ClipVisionTower, SiglipVisionTower
from mimotron.models.hf.llama import LLAMA_WEIGHTS, check_llama_folder
from mimotron.models.hf.qwen_vl import QWEN_VL_TOWERS
from mimotron.models.hf.vlm_weights import part_weight_map, projector_weight_map
from mimotron.models.hf.weights import load_hf_weights
from mimotron.models.hf.whisper import WhisperEncoderTower
from mimotron.models.init import init_parameters_
from mimotron.models.language import LanguageModel
from mimotron.models.lora import attach_lora
from mimotron.models.mimo import MimoModel
from mimotron.models.native_vision import NativeVisionSubmodule
from mimotron.names import LANGUAGE
from mimotron.names import module_prefix as parameter_prefix


def module_prefix(cfg: MimoConfig, name: str) -> str:
    """The prefix of module ``name``'s parameter names inside ``MimoModel``.

    Args:
        cfg: run config.
        name: module name.

    Returns:
        ``"language_model."`` or ``"modality_submodules.<name>."``.
    """
    _module_cfg(cfg, name)
    return parameter_prefix(name)


def _module_cfg(cfg: MimoConfig, name: str) -> ModuleConfig:
    if name not in cfg.modules:
        raise ValueError(f"unknown module {name!r}; the config has {sorted(cfg.modules)}")
    return cfg.modules[name]


def _construct(
    cfg: MimoConfig,
    name: str,
    vocab_size: int,
    layer_ids: list[int] | None,
    pre_process: bool,
    post_process: bool,
) -> nn.Module:
    """Instantiate module ``name`` (uninitialised values) on the current default device."""
    mod = _module_cfg(cfg, name)
    stage = {"layer_ids": layer_ids, "pre_process": pre_process, "post_process": post_process}
    if mod.hf_path:
        return _construct_hf(cfg, name, vocab_size, stage)
    common = {
        "hidden_size": mod.hidden_size,
        "num_layers": mod.num_layers,
        "num_heads": mod.num_heads,
        "ffn_hidden_size": mod.ffn_hidden_size,
    }
    if mod.is_language:
        return LanguageModel(vocab_size, max_seq_len=cfg.data.seq_length, moe=moe_options(mod),
                             **common, **stage)
    if mod.kind == "vit":
        encoder: nn.Module = VisionEncoder(
            image_size=mod.image_size,
            patch_size=mod.patch_size,
            in_channels=mod.in_channels,
            **common,
            **stage,
        )
    elif mod.kind == "audio":
        encoder = AudioEncoder(
            num_freq_bins=mod.num_freq_bins,
            num_frames=mod.num_frames,
            num_audio_tokens=mod.num_audio_tokens,
            **common,
            **stage,
        )
    else:
        raise ValueError(f"modules.{name}.kind={mod.kind!r} cannot be built by mimotron.models")
    return ModalitySubmodule(encoder, _projector(cfg, mod, mod.hidden_size, post_process))


def _projector(cfg: MimoConfig, mod: ModuleConfig, width: int, post_process: bool
               ) -> Projector | None:
    if LANGUAGE not in cfg.modules:
        raise ValueError("an encoder's projector needs the 'language' module's hidden size")
    lm_hidden = cfg.modules[LANGUAGE].hidden_size
    return Projector(width, lm_hidden, mod.projector_hidden_size) if post_process else None


def _construct_hf(cfg: MimoConfig, name: str, vocab_size: int, stage: dict) -> nn.Module:
    """A Hugging Face family module (weights not loaded) with mimotron's projector."""
    mod = cfg.modules[name]
    if mod.is_language:
        spec = language_spec(mod).replace(vocab_size=model_vocab_size(cfg, vocab_size))
        if spec.moe is not None:  # MoE layout from config.json, loss weights from ours
            spec = spec.replace(moe=dataclasses.replace(
                spec.moe, aux_loss_coeff=mod.moe_aux_loss_coeff,
                z_loss_coeff=mod.moe_z_loss_coeff))
        return LanguageModel(**spec.model_kwargs(cfg.data.seq_length), **stage)
    kwargs = tower_kwargs(mod)
    if mod.hf_native is not None:  # Qwen-VL: the tower ends in its own merger
        tower_cls = QWEN_VL_TOWERS[hf_family(mod)]
        return NativeVisionSubmodule(tower_cls(**kwargs, **stage), mod.hf_native.max_tokens)
    if mod.kind == "audio":
        encoder: nn.Module = WhisperEncoderTower(**kwargs, **stage)
        stacked = mod.downsample_mode == "stack"
        width = mod.hidden_size * (mod.downsample_factor if stacked else 1)
    else:
        tower = ClipVisionTower if hf_family(mod) == "clip" else SiglipVisionTower
        encoder = tower(**kwargs, **stage)
        width = mod.hidden_size
    return ModalitySubmodule(encoder, _projector(cfg, mod, width, stage["post_process"]))


def load_hf_module(cfg: MimoConfig, name: str, module: nn.Module) -> nn.Module:
    """Fill a built HF module's checkpoint parameters from its ``hf_path``, in place.

    A vision-language folder (:mod:`mimotron.config.hf_vlm`) gives each module its part
    (:mod:`mimotron.models.hf.vlm_weights`), the projector included; a folder of the
    module's own holds no projector, which keeps its initialisation. A vocabulary larger
    than the checkpoint's gets its extra rows from :mod:`mimotron.models.hf.vocab`.

    Args:
        cfg: run config.
        name: module name (its ``hf_path`` is set).
        module: from :func:`build_module` / ``_construct`` (one stage, plain or TP).

    Returns:
        ``module``.

    Raises:
        ValueError: a checkpoint that does not match the module (tensors named).
    """
    mod = cfg.modules[name]
    folder_config = read_hf_config(mod.hf_path)
    # Only a vision-language folder's decoder needs the names (its layout); the loader
    # reads the headers itself.
    names = (list(tensor_files(mod.hf_path)) if mod.is_language and is_vlm_config(folder_config)
             else [])
    if mod.is_language:
        assert isinstance(module, LanguageModel)
        weight_map = part_weight_map(LLAMA_WEIGHTS, folder_config, mod.kind, names)
        spec = check_llama_folder(mod.hf_path, language_spec(mod), weight_map)
        rows = {n: spec.vocab_size for n in ("embed.weight", "output.weight")}
        load_hf_weights(module, mod.hf_path, weight_map, rows=rows, seed=cfg.train.seed)
        return module
    assert isinstance(module, (ModalitySubmodule, NativeVisionSubmodule))
    load_hf_weights(module.encoder, mod.hf_path, part_weight_map(
        module.encoder.weight_map, folder_config, mod.kind, names))
    projector_map = projector_weight_map(folder_config)
    if projector_map is not None and module.projector is not None:
        load_hf_weights(module.projector, mod.hf_path, projector_map)
    return module


def build_module(
    cfg: MimoConfig,
    name: str,
    vocab_size: int,
    layer_ids: list[int] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    init: bool = True,
) -> nn.Module:
    """Build and initialise one module (or one pipeline stage of it) on the CPU.

    Args:
        cfg: run config.
        name: module name (``"language"`` or an encoder such as ``"vision"``).
        vocab_size: tokenizer vocabulary size (used by the language model).
        layer_ids: global layers to hold (``None`` = all).
        pre_process: hold the input embedding (first stage).
        post_process: hold the final norm and the head / projector (last stage).
        init: run :func:`init_parameters_` (and, for an ``hf_path`` module, then load
            the checkpoint over everything but the projector); ``False`` leaves
            PyTorch's default values (for shape-only builds, e.g. under
            ``torch.device("meta")``, where init is skipped anyway).

    Returns:
        A :class:`LanguageModel` or a :class:`ModalitySubmodule`, initialised from
        ``(cfg.train.seed, parameter name inside MimoModel)`` unless ``init`` is False.

    Raises:
        ValueError: unknown module or kind, or invalid sizes.
    """
    module = _construct(cfg, name, vocab_size, layer_ids, pre_process, post_process)
    for sub in module.modules():
        if hasattr(sub, "fp32_residual"):
            sub.fp32_residual = cfg.train.fp32_residual_connection
    if not init:
        return module
    init_parameters_(module, cfg.train.seed, prefix=module_prefix(cfg, name))
    if cfg.modules[name].hf_path and not any(p.is_meta for p in module.parameters()):
        load_hf_module(cfg, name, module)
    return module


def build_mimo_model(
    cfg: MimoConfig,
    vocab_size: int,
    placeholder_ids: dict[str, int],
    modules: set[str] | None = None,
) -> MimoModel:
    """Build a ``MimoModel`` holding ``modules`` (default: every module of the config).

    Args:
        cfg: run config.
        vocab_size: tokenizer vocabulary size.
        placeholder_ids: encoder module name -> placeholder token id (all encoders).
        modules: module names this rank holds; ``None`` = all.

    Returns:
        The model, each module whole (no pipeline split) and initialised.

    Raises:
        ValueError: unknown module names or a missing placeholder id.
    """
    wanted = set(cfg.modules) if modules is None else set(modules)
    unknown = sorted(wanted - set(cfg.modules))
    if unknown:
        raise ValueError(f"unknown modules {unknown}; the config has {sorted(cfg.modules)}")
    missing = [n for n in cfg.encoder_names if n not in placeholder_ids]
    if missing:
        raise ValueError(f"placeholder_ids {placeholder_ids} lack encoder modules {missing}")
    encoders = {n: build_module(cfg, n, vocab_size) for n in cfg.encoder_names if n in wanted}
    language = build_module(cfg, LANGUAGE, vocab_size) if LANGUAGE in wanted else None
    for name, part in [*encoders.items(), (LANGUAGE, language)]:
        if part is not None and cfg.modules[name].lora.rank:
            attach_lora(part, cfg.modules[name].lora, cfg.train.seed, module_prefix(cfg, name))
    assert language is None or isinstance(language, LanguageModel)
    modality_of = {n: str(cfg.modules[n].modality) for n in cfg.encoder_names}
    return MimoModel(encoders, language, dict(placeholder_ids), modality_of)


def count_parameters(cfg: MimoConfig, name: str, vocab_size: int) -> int:
    """Number of parameters of module ``name`` (whole, unsharded), without allocating.

    Args:
        cfg: run config.
        name: module name.
        vocab_size: tokenizer vocabulary size.

    Returns:
        The parameter count (encoders include their projector).
    """
    with torch.device("meta"):
        module = _construct(cfg, name, vocab_size, None, True, True)
    return sum(p.numel() for p in module.parameters())
