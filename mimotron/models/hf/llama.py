"""Llama / Qwen2 / Qwen3 decoders from a local Hugging Face folder.

:class:`~mimotron.config.hf_specs.LlamaFamilySpec` (in the model-free
:mod:`~mimotron.config.hf_specs`, re-exported here) reads a ``config.json`` dict into the
keyword arguments of :class:`~mimotron.models.language.LanguageModel`, which then
computes exactly what ``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` compute for the same config (tests/test_hf_language.py). Anything in
the config that would change the function and that mimotron does not implement
(sliding-window attention, an activation other than SiLU, RoPE types other than default /
linear / llama3, attention dropout) is a ``ValueError`` naming the key, never silently
dropped.

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
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from mimotron.config.hf_folder import read_hf_config, tensor_files
from mimotron.config.hf_specs import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from mimotron.config.hf_specs import LlamaFamilySpec
from mimotron.models.hf.weights import WeightMap, check_checkpoint, load_hf_weights
from mimotron.models.language import LanguageModel
from mimotron.parallel.tensor_parallel import apply_tensor_parallel, mark_tensor_partial_params

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

# Qwen2.5-VL / Qwen3-VL folders hold the vision tower next to the decoder: not ours here.
_VISUAL = r"(model\.)?visual\."


_MOVED = "model.language_model."


def under_language_model(weight_map: WeightMap, ignored: tuple[str, ...]) -> WeightMap:
    """A decoder's map with its ``model.*`` names moved under ``model.language_model.``
    (the head stays ``lm_head.*``): how transformers 5 holds the decoder of a
    vision-language model in memory, and how some of those folders store it.

    Args:
        weight_map: the decoder's own map (names at the root).
        ignored: the patterns of the folder's other parts (full names).
    """
    def moved(hf: str) -> str:  # model.layers.{i}. -> model.language_model.layers.{i}.
        return _MOVED + hf[len("model."):] if hf.startswith("model.") else hf
    return WeightMap(rules=tuple((o, moved(h)) for o, h in weight_map.rules),
                     stacked=tuple((o, moved(h)) for o, h in weight_map.stacked),
                     reshaped=weight_map.reshaped, ignored=ignored)


def holds_moved_decoder(names: Iterable[str]) -> bool:
    """Whether a folder's tensor names put the decoder under ``model.language_model.``
    (:func:`under_language_model`), rather than in the layout of the decoder's own folder."""
    return any(n.startswith(_MOVED) for n in names)


QWEN_VL_WEIGHTS = under_language_model(LLAMA_WEIGHTS, (_VISUAL,))
"""The decoder of a Qwen2.5-VL / Qwen3-VL folder as transformers 5 saves it (and the
Qwen3-VL hub holds it): ``model.language_model.*`` and ``lm_head.*``."""

QWEN_VL_HUB_WEIGHTS = dataclasses.replace(LLAMA_WEIGHTS,
                                          ignored=(*LLAMA_WEIGHTS.ignored, _VISUAL))
"""The decoder of a Qwen2.5-VL hub folder: ``model.*`` and ``lm_head.*`` (the names
transformers' ``Qwen2VLForConditionalGeneration`` conversion moves on load)."""


def qwen_vl_weight_map(names: Iterable[str]) -> WeightMap:
    """The decoder's map in a Qwen2.5-VL / Qwen3-VL folder, by the layout its names use.

    Args:
        names: the folder's tensor names
            (:func:`~mimotron.config.hf_folder.tensor_files`).

    Returns:
        :data:`QWEN_VL_WEIGHTS` where any name is under ``model.language_model.``, else
        :data:`QWEN_VL_HUB_WEIGHTS`.
    """
    return QWEN_VL_WEIGHTS if holds_moved_decoder(names) else QWEN_VL_HUB_WEIGHTS


def decoder_weight_map(path: str | Path, spec: LlamaFamilySpec) -> WeightMap:
    """The decoder's map in folder ``path``: :data:`LLAMA_WEIGHTS`, or for the language
    model of a Qwen2.5-VL / Qwen3-VL folder :func:`qwen_vl_weight_map` of its names.

    Raises:
        ValueError: as :func:`~mimotron.config.hf_folder.tensor_files`.
    """
    if spec.mrope_section is None:
        return LLAMA_WEIGHTS
    return qwen_vl_weight_map(tensor_files(path))


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


def check_llama_folder(path: str | Path, spec: LlamaFamilySpec | None = None,
                       weight_map: WeightMap | None = None) -> LlamaFamilySpec:
    """Check a folder's config and tensor names/shapes (headers only); return its spec.

    ``weight_map``: where the decoder sits in the folder (``None``: :data:`LLAMA_WEIGHTS`,
    a decoder's own folder; a vision-language folder's part:
    :func:`~mimotron.models.hf.vlm_weights.part_weight_map`).

    Raises:
        ValueError: missing folder or files, unsupported config, or tensors that are
            missing, unexpected or mis-shaped (all named in one message).
    """
    spec = spec or LlamaFamilySpec.from_hf_config(read_hf_config(path))
    weight_map = weight_map or LLAMA_WEIGHTS
    shapes, optional = expected_hf_tensors(spec)
    files = tensor_files(path)
    prefix = weight_map.choose_prefix(files)
    check_checkpoint(files, {_named(weight_map, prefix, n): s for n, s in shapes.items()},
                     optional={_named(weight_map, prefix, n) for n in optional},
                     known=weight_map.is_ignored, where=f"hf_path {str(path)!r}")
    return spec


def _named(weight_map: WeightMap, prefix: str, hf_name: str) -> str:
    """A decoder folder's tensor name as ``weight_map`` places it under ``prefix``."""
    if weight_map is LLAMA_WEIGHTS:
        return hf_name
    ours = LLAMA_WEIGHTS.from_hf(hf_name)
    assert ours is not None, hf_name
    return prefix + weight_map.to_hf(ours)


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
    spec = spec or LlamaFamilySpec.from_hf_config(read_hf_config(path))
    weight_map = decoder_weight_map(path, spec)
    check_llama_folder(path, spec, weight_map)
    load_hf_weights(module, path, weight_map)
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
    spec = LlamaFamilySpec.from_hf_config(read_hf_config(path))
    check_llama_folder(path, spec, decoder_weight_map(path, spec))
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
