"""config.json -> constructor arguments of the Hugging Face families, without the models.

Config validation (:mod:`mimotron.config.hf_resolve`, run by :mod:`mimotron.config.validation`
in the launcher of ``mimotron train`` before any rank starts) reads a folder's family and
sizes from its ``config.json``; the models are built later, on the ranks. So the readers
live here, importing no ``torch.nn``, no DTensor and no model module, and the model files
(:mod:`~mimotron.models.hf.llama`, :mod:`~mimotron.models.hf.clip`,
:mod:`~mimotron.models.hf.whisper`) call them:

* :class:`LlamaFamilySpec` (Llama, Qwen2, Qwen3 and their MoE variants, and the language
  models of Qwen2.5-VL and Qwen3-VL with their 3-D rotary positions) reads a decoder's
  config into the keyword arguments of :class:`~mimotron.models.language.LanguageModel`.
  Anything that would change the function and that mimotron does not implement
  (sliding-window attention, an activation other than SiLU, RoPE types other than
  default / linear / llama3, attention dropout) is a ``ValueError`` naming the key.
* :func:`clip_tower_args`, :func:`siglip_tower_args` and :func:`whisper_tower_args` read
  an encoder's config into its tower's constructor arguments; :func:`used_layers` is the
  number of layers a vision tower runs for LLaVA's ``vision_feature_layer``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mimotron.config.hf_folder import read_keys, reject_set, select_config
from mimotron.config.moe_options import MoEOptions
from mimotron.config.rope_scaling import validate_rope_scaling
from mimotron.config.schema import ModuleConfig

__all__ = ["ACTIVATION_NAMES", "SUPPORTED_MODEL_TYPES", "VL_MODEL_TYPES", "LlamaFamilySpec",
           "check_activation", "clip_tower_args", "siglip_tower_args", "text_part",
           "used_layers", "whisper_tower_args"]

ACTIVATION_NAMES: tuple[str, ...] = ("gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new")
"""The encoder MLP activations, as ``transformers`` spells them
(:data:`mimotron.models.hf.layers.ACTIVATIONS` implements each)."""

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")
# transformers' config defaults for keys a config.json may omit (None = derived).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "attention_bias": False},
    # Mixture-of-experts variants: the same decoders with an MoE block as the MLP.
    "qwen2_moe": {"num_key_value_heads": 16, "head_dim": None, "max_position_embeddings": 32768,
                  "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "norm_topk_prob": False, "decoder_sparse_step": 1},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768,
                  "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1},
    # The language models of Qwen2.5-VL (a Qwen2 decoder) and Qwen3-VL (a Qwen3 one),
    # with 3-D rotary positions (M-RoPE).
    "qwen2_5_vl_text": {"num_key_value_heads": 8, "head_dim": None,
                        "max_position_embeddings": 32768, "rope_theta": 1e6,
                        "mrope_section": (16, 24, 24)},
    "qwen3_vl_text": {"num_key_value_heads": 32, "head_dim": 128,
                      "max_position_embeddings": 128000, "attention_bias": False,
                      "rope_theta": 5e5, "mrope_section": (24, 20, 20)},
}
_MOE_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = tuple(_DEFAULTS)
VL_MODEL_TYPES: dict[str, str] = {"qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text"}
"""Full vision-language configs whose language model :class:`LlamaFamilySpec` reads
(their ``text_config``) -> that part's ``model_type``."""

_VISION_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
}

_WHISPER_DEFAULTS = {
    "d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6, "encoder_ffn_dim": 1536,
    "num_mel_bins": 80, "max_source_positions": 1500, "activation_function": "gelu",
}


@dataclass(frozen=True)
class LlamaFamilySpec:
    """The architecture of a Llama-family decoder, as
    :class:`~mimotron.models.language.LanguageModel` needs it.

    Attributes:
        model_type: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size: sizes (``intermediate_size`` is the SwiGLU width).
        norm_eps: RMSNorm epsilon (``rms_norm_eps``).
        rope_theta: RoPE base.
        rope_scaling: ``{"rope_type": ..., <parameters>}`` (see
            :mod:`mimotron.models.rope_scaling`).
        qkv_bias, out_bias, mlp_bias: which projections carry biases.
        qk_norm: per-head q/k RMSNorm (Qwen3).
        tie_word_embeddings: the head shares the embedding matrix.
        max_position_embeddings: the config's context length (the default
            ``max_seq_len``).
        moe: the mixture-of-experts layers (Qwen2-MoE / Qwen3-MoE), ``None`` = dense.
        mrope_section: 3-D rotary positions (Qwen2.5-VL / Qwen3-VL): frequencies per
            axis (temporal, height, width); ``None`` = 1-D RoPE.
        mrope_interleaved: Qwen3-VL's interleaved M-RoPE layout.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(hash=False)
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe: MoEOptions | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LlamaFamilySpec:
        """Read a Hugging Face ``config.json`` dict.

        Both config formats are read: ``rope_parameters`` (transformers 5) and the
        older top-level ``rope_theta`` plus ``rope_scaling``. A full ``qwen2_5_vl`` /
        ``qwen3_vl`` config gives its ``text_config`` (an older Qwen2.5-VL one holds
        the text keys at the top level).

        Args:
            config: the parsed ``config.json``.

        Returns:
            The spec.

        Raises:
            ValueError: unknown ``model_type``, a missing size, or a feature mimotron
                does not implement; the message names the key.
        """
        config = text_part(config)
        model_type = config.get("model_type")
        if model_type not in _DEFAULTS:
            raise ValueError(
                f"config.json model_type={model_type!r} is not a supported decoder; "
                f"expected one of {list(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ValueError(f"config.json (model_type {model_type!r}) lacks {missing}")
        _refuse_unsupported(config)
        defaults = _DEFAULTS[model_type]

        def get(key: str, default: Any = None) -> Any:
            value = config.get(key)
            return defaults.get(key, default) if value is None else value

        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        attention_bias = bool(get("attention_bias", False))
        theta, scaling = _rope(config, int(get("max_position_embeddings")),
                               float(get("rope_theta", 10000.0)))
        mrope = "mrope_section" in defaults
        # M-RoPE's keys ride in the RoPE parameters; the frequencies are the default's.
        # Qwen3-VL's layout is interleaved whatever mrope_interleaved says (transformers).
        section = scaling.pop("mrope_section", None) if mrope else None
        if mrope:
            scaling.pop("mrope_interleaved", None)
        # transformers' Qwen2.5-VL attention ignores a head_dim key.
        head_dim = (hidden // heads if model_type == "qwen2_5_vl_text"
                    else int(get("head_dim") or hidden // heads))
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v biases and never an output bias (Qwen2-MoE: qkv_bias).
            qkv_bias=True if model_type in ("qwen2", "qwen2_5_vl_text")
            else bool(get("qkv_bias", False)) if model_type == "qwen2_moe" else attention_bias,
            out_bias=False if model_type in ("qwen2", "qwen2_moe", "qwen2_5_vl_text")
            else attention_bias,
            mlp_bias=bool(get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings")),
            moe=_moe(model_type, get, int(config["num_hidden_layers"])),
            mrope_section=tuple(section or defaults["mrope_section"]) if mrope else None,
            mrope_interleaved=model_type == "qwen3_vl_text",
        )

    def model_kwargs(self, max_seq_len: int | None = None) -> dict[str, Any]:
        """Keyword arguments of :class:`~mimotron.models.language.LanguageModel` for the
        whole model.

        Add ``layer_ids``, ``pre_process`` and ``post_process`` for one pipeline stage.

        Args:
            max_seq_len: longest sequence to accept (``None`` = the config's
                ``max_position_embeddings``).
        """
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "ffn_hidden_size": self.intermediate_size,
            "max_seq_len": max_seq_len or self.max_position_embeddings,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "qkv_bias": self.qkv_bias,
            "out_bias": self.out_bias,
            "qk_norm": self.qk_norm,
            "mlp_bias": self.mlp_bias,
            "norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "moe": self.moe,
            **({} if self.mrope_section is None else {
                "mrope_section": self.mrope_section,
                "mrope_interleaved": self.mrope_interleaved}),
        }

    def replace(self, **changes: Any) -> LlamaFamilySpec:
        """A copy with some fields changed (e.g. a resized ``vocab_size``)."""
        return dataclasses.replace(self, **changes)


def _moe(model_type: str, get: Any, num_layers: int) -> MoEOptions | None:
    """Qwen2-MoE / Qwen3-MoE's MoE block as :class:`MoEOptions` (``None``: dense).

    Layer ``i`` is sparse when it is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0`` (transformers' rule); routing is softmax, top-k, and
    ``norm_topk_prob`` renormalisation; Qwen2-MoE adds one gated shared expert.
    """
    if model_type not in _MOE_TYPES:
        return None
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    num_experts = int(get("num_local_experts") or get("num_experts"))
    if num_experts == 0:
        return None
    step, dense = int(get("decoder_sparse_step")), set(get("mlp_only_layers", []) or [])
    shared = int(get("shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe" else 0
    return MoEOptions(
        num_experts=num_experts, top_k=int(get("num_experts_per_tok")),
        ffn_hidden_size=int(get("moe_intermediate_size")), shared_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0, router_score="softmax",
        norm_topk_prob=bool(get("norm_topk_prob")),
        layer_freq=tuple(int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)))


def _refuse_unsupported(config: dict[str, Any]) -> None:
    """Raise on config features that change the function and are not implemented."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported; expected 'silu'")
    if config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true is not supported (sliding-window "
                         "attention); expected false")
    types = sorted(set(config.get("layer_types") or []) - {"full_attention"})
    if types:
        raise ValueError(f"config.json layer_types holds {types}; only 'full_attention' layers "
                         "are supported")
    dropout = float(config.get("attention_dropout") or 0.0)
    if dropout:
        raise ValueError(f"config.json attention_dropout={dropout} is not supported (mimotron's "
                         "attention has no dropout); expected 0.0")


def text_part(config: dict[str, Any]) -> dict[str, Any]:
    """A decoder's config: ``config`` itself, or a full VL config's text part.

    Tied where either the full config or its ``text_config`` says so (transformers 5
    reads the outer one; older saves kept it in ``text_config``).
    """
    text_type = VL_MODEL_TYPES.get(config.get("model_type"))  # type: ignore[arg-type]
    if text_type is None:
        return config
    sub = config.get("text_config")
    text = dict(sub) if isinstance(sub, dict) else {
        k: v for k, v in config.items() if k not in ("vision_config", "text_config")}
    text["model_type"] = text_type
    if config.get("tie_word_embeddings") is not None and sub is not None:
        text["tie_word_embeddings"] = (bool(config["tie_word_embeddings"])
                                       or bool(text.get("tie_word_embeddings")))
    return text


def _rope(config: dict[str, Any], max_positions: int, default_theta: float = 10000.0
          ) -> tuple[float, dict]:
    """``(rope_theta, scaling dict)`` from either config format (M-RoPE's legacy
    ``"type": "mrope"`` is the default RoPE, as transformers reads it)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json {key} is nested per layer type; only one RoPE for "
                         "all layers is supported")
    if (params.get("rope_type") or params.get("type")) == "mrope":
        params.pop("type", None)
        params["rope_type"] = "default"
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or default_theta)
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    scaling = validate_rope_scaling(params, where=f"config.json {key}")
    if scaling["rope_type"] == "llama3":
        # transformers' fallback when the checkpoint does not store it.
        scaling.setdefault("original_max_position_embeddings", max_positions)
    return theta, scaling

def check_activation(key: str, name: str) -> str:
    """Return ``name`` if it is a supported activation, else raise ``ValueError``.

    Args:
        key: the config key it came from (named in the error).
        name: activation name as ``transformers`` spells it.

    Returns:
        ``name``.

    Raises:
        ValueError: unsupported activation.
    """
    if name not in ACTIVATION_NAMES:
        raise ValueError(f"{key}={name!r} is not supported; expected one of "
                         f"{sorted(ACTIVATION_NAMES)}")
    return name


def mlp_matrices(mod: ModuleConfig) -> int:
    """Weight matrices of one layer's MLP: 2 for a Hugging Face encoder (CLIP, SigLIP,
    Whisper: ``fc1``, ``fc2``), 3 for the SwiGLU of the built-in modules and decoders."""
    return 2 if mod.is_encoder and mod.hf_path else 3


def used_layers(num_hidden_layers: int, vision_feature_layer: int) -> int:
    """Layers a tower runs to produce hidden state ``vision_feature_layer``.

    Hidden state ``k`` (``transformers``' ``hidden_states[k]``) is the output of the first
    ``k`` layers; negative ``k`` counts from ``num_hidden_layers + 1``.

    Args:
        num_hidden_layers: layers of the checkpoint's tower.
        vision_feature_layer: LLaVA's feature layer index.

    Returns:
        The number of layers to build, at least 1.

    Raises:
        ValueError: the index selects no layer or is out of range.
    """
    if isinstance(vision_feature_layer, bool) or not isinstance(vision_feature_layer, int):
        raise ValueError(f"vision_feature_layer={vision_feature_layer!r} is not supported; "
                         "expected one integer layer index")
    used = vision_feature_layer + (num_hidden_layers + 1 if vision_feature_layer < 0 else 0)
    if not 1 <= used <= num_hidden_layers:
        raise ValueError(
            f"vision_feature_layer={vision_feature_layer} is invalid for {num_hidden_layers} "
            f"layers: expected 1..{num_hidden_layers} or -{num_hidden_layers}..-1"
        )
    return used


def _vision_args(config: dict[str, Any], own: str, full: str, defaults: dict[str, Any]
                 ) -> dict[str, Any]:
    sub = select_config(config, (own,), (full,), "vision_config")
    reject_set(sub, ("attention_dropout",), "expected 0.0 (the towers have no dropout)")
    args = read_keys(sub, {**_VISION_DEFAULTS, **defaults})
    check_activation("hidden_act", args["hidden_act"])
    return args


def clip_tower_args(config: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of :class:`~mimotron.models.hf.clip.ClipVisionTower` from a
    ``CLIPVisionConfig`` or ``CLIPConfig`` dict.

    Raises:
        ValueError: another model type, or an option the tower does not implement.
    """
    return _vision_args(config, "clip_vision_model", "clip",
                        {"patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5})


def siglip_tower_args(config: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of :class:`~mimotron.models.hf.clip.SiglipVisionTower` from a
    ``SiglipVisionConfig`` or ``SiglipConfig`` dict.

    Raises:
        ValueError: another model type, or an option the tower does not implement.
    """
    return _vision_args(config, "siglip_vision_model", "siglip",
                        {"patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                         "layer_norm_eps": 1e-6})


def whisper_tower_args(config: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of :class:`~mimotron.models.hf.whisper.WhisperEncoderTower`
    from a ``WhisperConfig`` dict (``model_type="whisper"``).

    Raises:
        ValueError: another model type, or an option the encoder does not implement.
    """
    sub = select_config(config, ("whisper",), (), "")
    reject_set(sub, ("dropout", "attention_dropout", "activation_dropout",
                     "encoder_layerdrop"), "expected 0.0 (the encoder has no dropout)")
    args = read_keys(sub, _WHISPER_DEFAULTS)
    check_activation("activation_function", args["activation_function"])
    return args

