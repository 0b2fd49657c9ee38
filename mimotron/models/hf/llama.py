"""Llama / Qwen2 / Qwen3 decoders from a local Hugging Face folder.

:class:`LlamaFamilySpec` reads a ``config.json`` dict into the keyword arguments of
:class:`~mimotron.models.language.LanguageModel`, which then computes exactly what
``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
compute for the same config (tests/test_hf_language.py). Anything in the config that
would change the function and that mimotron does not implement (sliding-window
attention, an activation other than SiLU, RoPE types other than default / linear /
llama3, attention dropout) is a ``ValueError`` naming the key, never silently dropped.

``LLAMA_WEIGHTS`` maps the names (one :class:`~mimotron.models.hf.weights.WeightMap`
for all three model types). :func:`load_llama_weights` checks the folder against the
whole model, then fills a built model (one pipeline stage, plain or already TP-sharded)
from the folder's safetensors through the shared
:func:`~mimotron.models.hf.weights.load_hf_weights`, reading only what it holds;
:func:`build_hf_language_model` does build, shard and load in the order that never
materialises more than a rank holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from mimotron.models.hf.folder import read_hf_config, tensor_files
from mimotron.models.hf.weights import WeightMap, check_checkpoint, load_hf_weights
from mimotron.models.language import LanguageModel
from mimotron.models.moe import MoEOptions
from mimotron.models.rope_scaling import validate_rope_scaling
from mimotron.parallel.tensor_parallel import apply_tensor_parallel, mark_tensor_partial_params

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
}
_MOE_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = tuple(_DEFAULTS)

# Our names are LanguageModel's, local to the language model (inside MimoModel they
# carry the "language_model." prefix); layers keep their global index in both, so the
# mapping is the same for every pipeline stage. Llama, Qwen2 and Qwen3 share it.
LLAMA_WEIGHTS = WeightMap(
    rules=(
        ("embed.", "model.embed_tokens."),
        ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
        ("layers.{i}.attn.wq.", "model.layers.{i}.self_attn.q_proj."),
        ("layers.{i}.attn.wk.", "model.layers.{i}.self_attn.k_proj."),
        ("layers.{i}.attn.wv.", "model.layers.{i}.self_attn.v_proj."),
        ("layers.{i}.attn.wo.", "model.layers.{i}.self_attn.o_proj."),
        ("layers.{i}.attn.q_norm.", "model.layers.{i}.self_attn.q_norm."),
        ("layers.{i}.attn.k_norm.", "model.layers.{i}.self_attn.k_norm."),
        ("layers.{i}.mlp_norm.", "model.layers.{i}.post_attention_layernorm."),
        ("layers.{i}.mlp.w1.", "model.layers.{i}.mlp.gate_proj."),
        ("layers.{i}.mlp.w3.", "model.layers.{i}.mlp.up_proj."),
        ("layers.{i}.mlp.w2.", "model.layers.{i}.mlp.down_proj."),
        ("layers.{i}.mlp.router.", "model.layers.{i}.mlp.gate."),
        ("layers.{i}.mlp.shared_experts.w1.", "model.layers.{i}.mlp.shared_expert.gate_proj."),
        ("layers.{i}.mlp.shared_experts.w3.", "model.layers.{i}.mlp.shared_expert.up_proj."),
        ("layers.{i}.mlp.shared_experts.w2.", "model.layers.{i}.mlp.shared_expert.down_proj."),
        ("layers.{i}.mlp.shared_expert_gate.", "model.layers.{i}.mlp.shared_expert_gate."),
        # Per-expert checkpoint tensors (stacked below); this rule only recognises them.
        ("layers.{i}.mlp.experts.", "model.layers.{i}.mlp.experts."),
        ("final_norm.", "model.norm."),
        ("output.", "lm_head."),
    ),
    stacked=(
        ("layers.{i}.mlp.experts.w1", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"),
        ("layers.{i}.mlp.experts.w3", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
        ("layers.{i}.mlp.experts.w2", "model.layers.{i}.mlp.experts.{e}.down_proj.weight"),
    ),
    # Older Llama conversions saved the RoPE frequencies; transformers skips them on
    # load, and so do we.
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",),
)


@dataclass(frozen=True)
class LlamaFamilySpec:
    """The architecture of a Llama-family decoder, as :class:`LanguageModel` needs it.

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

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LlamaFamilySpec:
        """Read a Hugging Face ``config.json`` dict.

        Both config formats are read: ``rope_parameters`` (transformers 5) and the
        older top-level ``rope_theta`` plus ``rope_scaling``.

        Args:
            config: the parsed ``config.json``.

        Returns:
            The spec.

        Raises:
            ValueError: unknown ``model_type``, a missing size, or a feature mimotron
                does not implement; the message names the key.
        """
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
        theta, scaling = _rope(config, int(get("max_position_embeddings")))
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v biases and never an output bias (Qwen2-MoE: qkv_bias).
            qkv_bias=True if model_type == "qwen2" else bool(get("qkv_bias", False))
            if model_type == "qwen2_moe" else attention_bias,
            out_bias=False if model_type in ("qwen2", "qwen2_moe") else attention_bias,
            mlp_bias=bool(get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings")),
            moe=_moe(model_type, get, int(config["num_hidden_layers"])),
        )

    def model_kwargs(self, max_seq_len: int | None = None) -> dict[str, Any]:
        """Keyword arguments of :class:`LanguageModel` for the whole model.

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


def _rope(config: dict[str, Any], max_positions: int) -> tuple[float, dict]:
    """``(rope_theta, scaling dict)`` from either config format."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json {key} is nested per layer type; only one RoPE for "
                         "all layers is supported")
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    scaling = validate_rope_scaling(params, where=f"config.json {key}")
    if scaling["rope_type"] == "llama3":
        # transformers' fallback when the checkpoint does not store it.
        scaling.setdefault("original_max_position_embeddings", max_positions)
    return theta, scaling


def expected_hf_tensors(spec: LlamaFamilySpec) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Full shapes of every Hugging Face tensor of the model, and the optional names.

    Built from a full :class:`LanguageModel` on the meta device (no memory).

    Returns:
        ``({hf name: full shape}, optional names)``; ``lm_head.weight`` is optional
        when the embeddings are tied (some checkpoints store it, some do not).
    """
    with torch.device("meta"):
        full = LanguageModel(**spec.model_kwargs(max_seq_len=1))
    shapes = {hf: shape for n, p in full.named_parameters()
              for hf, shape in LLAMA_WEIGHTS.hf_shapes(n, tuple(p.shape)).items()}
    optional = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    return shapes, optional


def check_llama_folder(path: str | Path, spec: LlamaFamilySpec | None = None) -> LlamaFamilySpec:
    """Check a folder's config and tensor names/shapes (headers only); return its spec.

    Raises:
        ValueError: missing folder or files, unsupported config, or tensors that are
            missing, unexpected or mis-shaped (all named in one message).
    """
    spec = spec or LlamaFamilySpec.from_hf_config(read_hf_config(path))
    shapes, optional = expected_hf_tensors(spec)
    check_checkpoint(tensor_files(path), shapes, optional=optional,
                     known=LLAMA_WEIGHTS.is_ignored, where=f"hf_path {str(path)!r}")
    return spec


def load_llama_weights(
    module: LanguageModel, path: str | Path, spec: LlamaFamilySpec | None = None
) -> LlamaFamilySpec:
    """Fill ``module`` (a stage of the model, plain or TP-sharded) from a HF folder.

    The folder is checked as a whole first (:func:`check_llama_folder`); then only the
    tensors of ``module``'s parameters are read, and of a TP-sharded parameter only this
    rank's slice.

    Args:
        module: built with ``spec.model_kwargs()`` (any ``layer_ids`` /
            ``pre_process`` / ``post_process``), on a real device.
        path: the local Hugging Face folder.
        spec: the folder's spec if already read.

    Returns:
        The spec.

    Raises:
        ValueError: a bad folder or checkpoint, or a module whose parameters do not
            match the checkpoint (not built from its config).
    """
    spec = check_llama_folder(path, spec)
    load_hf_weights(module, path, LLAMA_WEIGHTS)
    return spec


def build_hf_language_model(
    path: str | Path,
    *,
    layer_ids: list[int] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    max_seq_len: int | None = None,
    tp_mesh: DeviceMesh | None = None,
    device: torch.device | str = "cpu",
) -> LanguageModel:
    """Build one stage of a HF decoder, shard it, and load its weights.

    Order: check the folder (headers only) -> build on the meta device -> apply the TP
    plan (still meta) -> allocate this rank's shards on ``device`` -> read them. No
    rank ever allocates or reads more than it holds.

    Args:
        path: the local Hugging Face folder.
        layer_ids: global layers of this stage (``None`` = all).
        pre_process: hold the embedding (first stage).
        post_process: hold the final norm and head (last stage).
        max_seq_len: longest sequence (``None`` = the config's context length).
        tp_mesh: 1-D tensor-parallel mesh, or ``None`` for no TP.
        device: where the parameters live.

    Returns:
        The loaded :class:`LanguageModel`.

    Raises:
        ValueError: as :func:`load_llama_weights`, or a TP degree that does not divide
            the vocabulary or the (key/value) head counts.
    """
    spec = check_llama_folder(path)
    with torch.device("meta"):
        module = LanguageModel(**spec.model_kwargs(max_seq_len), layer_ids=layer_ids,
                               pre_process=pre_process, post_process=post_process)
    if tp_mesh is not None:
        apply_tensor_parallel(module, tp_mesh, is_language=True)
    module.to_empty(device=device)
    if tp_mesh is not None:
        mark_tensor_partial_params(module, sequence_parallel=False)  # to_empty dropped them
    if spec.tie_word_embeddings:
        module.tie_weights()  # to_empty allocates each reference separately
    load_llama_weights(module, path, spec)
    return module
