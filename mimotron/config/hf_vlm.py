"""One Hugging Face vision-language folder as mimotron's modules (LLaVA).

A user fine-tuning a vision-language model has one folder, ``llava-1.5-7b-hf`` say: a
``config.json`` of ``model_type`` ``llava`` holding a ``vision_config`` and a
``text_config``, one set of safetensors, the processor and the tokenizer. mimotron
splits it into two modules, each with its own ``[modules.<m>.parallel]`` table:

* ``vision`` (kind ``vit``): the vision tower **with its projector**
  (``multi_modal_projector``), both loaded from the folder;
* ``language`` (kind ``language``): the decoder and its head.

A config names the folder once, at the top (``hf_path = "..."``,
:func:`expand_vlm_modules`), or per module (``modules.<m>.hf_path``, the same folder for
both). Either way a module of kind ``k`` whose folder holds a VLM reads only its *part*:
:func:`vlm_part_config` gives that part's config as a standalone folder of its family
would hold it (with ``transformers``' defaults for the keys the VLM's ``config.json``
leaves out), so every family reader, estimate and check works on it unchanged, and
:func:`vlm_module_options` gives the keys the VLM fixes for the vision module (feature
layer, selection strategy, projector width). The weights are read from the folder under
the part's prefix (:mod:`mimotron.models.hf.vlm_weights`).

Model-free (no ``torch.nn``): config validation runs this in the launcher.
"""

from __future__ import annotations

from typing import Any

from mimotron.config.hf_specs import text_part

__all__ = ["NATIVE_MODEL_TYPES", "VLM_MODEL_TYPES", "VLM_MODULES", "expand_vlm_modules",
           "is_native_config", "is_vlm_config", "vlm_module_options", "vlm_part_config"]

NATIVE_MODEL_TYPES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")
"""The vision-language families whose images keep their native resolution
(:mod:`mimotron.config.native_vision`)."""
VLM_MODEL_TYPES: tuple[str, ...] = ("llava", *NATIVE_MODEL_TYPES)
"""The ``model_type`` values of the vision-language folders mimotron splits into modules."""

VLM_MODULES: dict[str, str] = {"vision": "vit", "language": "language"}
"""Module name -> kind of the modules a top-level ``hf_path`` creates."""

# transformers' LlamaConfig defaults: a llava-hf config.json's text_config lists only
# what differs from them (llava-1.5-7b-hf gives no hidden_size). tests/test_hf_vlm_config.py
# checks this table against transformers.LlamaConfig().
LLAMA_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
# transformers' Qwen2Config / Qwen3Config defaults (Qwen1.5-7B / Qwen3-8B sizes): a
# config.json written by transformers 4 leaves out the keys equal to them. Checked
# against transformers like the table above.
QWEN2_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
QWEN3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": LLAMA_TEXT_DEFAULTS, "qwen2": QWEN2_TEXT_DEFAULTS, "qwen3": QWEN3_TEXT_DEFAULTS}
"""A ``text_config``'s family -> the defaults of the keys it may leave out."""
# LlavaConfig's defaults for its own keys.
LLAVA_DEFAULTS: dict[str, Any] = {
    "image_token_index": 32000, "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
}
_VISION_TYPES = ("clip_vision_model", "siglip_vision_model")
_QWEN_IMAGE_TOKEN_ID = 151655  # both Qwen-VL configs' default image_token_id


def is_vlm_config(config: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is one of :data:`VLM_MODEL_TYPES`."""
    return config.get("model_type") in VLM_MODEL_TYPES


def is_native_config(config: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is one of :data:`NATIVE_MODEL_TYPES` (a Qwen-VL
    folder, or its vision part as :func:`vlm_part_config` gives it)."""
    model_type = str(config.get("model_type"))
    return model_type.removesuffix("_vision") in NATIVE_MODEL_TYPES


def _sub(config: dict[str, Any], key: str) -> dict[str, Any]:
    sub = config.get(key)
    if not isinstance(sub, dict):
        raise ValueError(f"config.json of model_type={config.get('model_type')!r} has no "
                         f"{key!r} table; expected the folder's {key} as a JSON object")
    return dict(sub)


def vlm_part_config(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """The config of the part of a VLM folder a module of ``kind`` takes.

    Args:
        config: the VLM folder's parsed ``config.json``.
        kind: the module's kind: ``vit`` (the vision tower) or ``language`` (the decoder).

    Returns:
        The part's config as its own family's folder would hold it: the vision tower's
        ``clip_vision_model`` / ``siglip_vision_model`` config, or the decoder's config
        with ``transformers``' Llama defaults filled in.

    Raises:
        ValueError: a kind the folder has no part for, or a missing / unsupported
            sub-config (one line naming it).
    """
    model_type = config.get("model_type")
    if model_type in NATIVE_MODEL_TYPES:
        return _native_part(config, kind)
    if kind == "vit":
        vision = _sub(config, "vision_config")
        vision.setdefault("model_type", "clip_vision_model")
        if vision["model_type"] not in _VISION_TYPES:
            raise ValueError(f"config.json vision_config.model_type={vision['model_type']!r} "
                             f"is not supported; expected one of {list(_VISION_TYPES)}")
        return vision
    if kind == "language":
        text = _sub(config, "text_config")
        text.setdefault("model_type", "llama")
        defaults = TEXT_DEFAULTS.get(text["model_type"], {})
        text = {**defaults, **{k: v for k, v in text.items() if v is not None}}
        # transformers ties the head when either config says so (LlavaConfig's rule).
        text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings")
                                           or text.get("tie_word_embeddings"))
        return text
    raise ValueError(f"a {model_type!r} folder holds a vision tower (kind 'vit') and a "
                     f"language model (kind 'language'); kind={kind!r} has no part in it")


def _native_part(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """A Qwen-VL folder's parts: the ``vision_config`` (model type ``<family>_vision``, the
    tower and its merger) and the text part (:func:`~mimotron.config.hf_specs.text_part`)."""
    model_type = str(config.get("model_type"))
    if kind == "vit":
        return {**_sub(config, "vision_config"), "model_type": f"{model_type}_vision"}
    if kind == "language":
        return text_part(config)
    raise ValueError(f"a {model_type!r} folder holds a vision tower (kind 'vit') and a "
                     f"language model (kind 'language'); kind={kind!r} has no part in it")


def vlm_module_options(config: dict[str, Any]) -> dict[str, Any]:
    """The vision module's keys a VLM folder fixes (its ``vision_feature_layer``,
    ``vision_feature_select_strategy`` and ``projector_hidden_size``).

    Args:
        config: the VLM folder's parsed ``config.json``.

    Raises:
        ValueError: a projector or feature selection mimotron does not implement (a
            list of feature layers, a projector without biases or with another
            activation), one line naming the key.
    """
    if config.get("model_type") in NATIVE_MODEL_TYPES:
        return {}  # the merger is part of the tower: nothing to select or size
    get = {**LLAVA_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    layer = get["vision_feature_layer"]
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"config.json vision_feature_layer={layer!r} is not supported; "
                         "expected one integer layer index")
    if get["projector_hidden_act"] != "gelu":
        raise ValueError(f"config.json projector_hidden_act={get['projector_hidden_act']!r} "
                         "is not supported; expected 'gelu'")
    if get["multimodal_projector_bias"] is not True:
        raise ValueError("config.json multimodal_projector_bias="
                         f"{get['multimodal_projector_bias']!r} is not supported; expected true")
    strategy = get["vision_feature_select_strategy"]
    if strategy == "default" and vlm_part_config(config, "vit")["model_type"] != _VISION_TYPES[0]:
        raise ValueError("config.json vision_feature_select_strategy='default' with a SigLIP "
                         "tower is not supported (transformers then drops the first patch "
                         "token; mimotron's SigLIP tower keeps every token); expected 'full'")
    width = vlm_part_config(config, "language").get("hidden_size")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"config.json text_config.hidden_size={width!r} is invalid: expected "
                         "a positive integer (the projector's output width)")
    return {"vision_feature_layer": layer,
            "vision_feature_select_strategy": strategy, "projector_hidden_size": width}


def image_token_index(config: dict[str, Any]) -> int:
    """The id a VLM folder's model expects at each image position."""
    if config.get("model_type") in NATIVE_MODEL_TYPES:
        value = config.get("image_token_id")
        return int(_QWEN_IMAGE_TOKEN_ID if value is None else value)
    value = config.get("image_token_index")
    return int(LLAVA_DEFAULTS["image_token_index"] if value is None else value)


def expand_vlm_modules(raw: dict[str, Any], model_type: str | None) -> None:
    """Turn a top-level ``hf_path`` into the VLM's module tables, in place.

    ``modules.vision`` (kind ``vit``) and ``modules.language`` (kind ``language``) are
    created, or completed when the config has them (their ``parallel`` tables, optimizer
    overrides, ``freeze``, ...): each gets the folder as ``hf_path``.

    Args:
        raw: the run's TOML table (overrides applied).
        model_type: the folder's ``model_type`` (``None``: no top-level ``hf_path``).

    Raises:
        ValueError: a folder that is not a VLM, or a module table that contradicts it
            (another kind or another ``hf_path``), one line naming the key.
    """
    path = raw.get("hf_path")
    if not path:
        return
    if model_type not in VLM_MODEL_TYPES:
        raise ValueError(f"hf_path={path!r} holds model_type={model_type!r}, which is not a "
                         f"vision-language model mimotron splits into modules; expected one of "
                         f"{list(VLM_MODEL_TYPES)} (give single models per module as "
                         "modules.<m>.hf_path)")
    modules = raw.setdefault("modules", {})
    if not isinstance(modules, dict):
        raise ValueError("modules is invalid: expected tables [modules.<name>]")
    for name, kind in VLM_MODULES.items():
        table = modules.setdefault(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"modules.{name} is invalid: expected a table")
        for key, value in (("kind", kind), ("hf_path", path)):
            if table.setdefault(key, value) != value:
                raise ValueError(f"modules.{name}.{key}={table[key]!r} contradicts the top-level "
                                 f"hf_path={path!r}, whose {name} part is {key} {value!r}; "
                                 "remove the key")
