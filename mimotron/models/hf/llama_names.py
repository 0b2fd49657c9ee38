"""Parameter names of a Llama-family decoder: Hugging Face <-> mimotron, both ways.

Ours are :class:`~mimotron.models.language.LanguageModel`'s names, local to the
language model (inside ``MimoModel`` they carry the ``language_model.`` prefix); layers
keep their global index in both, so the mapping is the same for every pipeline stage.

=======================================================  =================================
Hugging Face (``LlamaForCausalLM``, ``Qwen2/3ForCausalLM``)  mimotron
=======================================================  =================================
``model.embed_tokens.weight``                            ``embed.weight``
``model.layers.{i}.input_layernorm.weight``              ``layers.{i}.attn_norm.weight``
``model.layers.{i}.self_attn.{q,k,v,o}_proj.{w,b}``      ``layers.{i}.attn.w{q,k,v,o}.{w,b}``
``model.layers.{i}.self_attn.{q,k}_norm.weight``         ``layers.{i}.attn.{q,k}_norm.weight``
``model.layers.{i}.post_attention_layernorm.weight``     ``layers.{i}.mlp_norm.weight``
``model.layers.{i}.mlp.gate_proj.{w,b}``                 ``layers.{i}.mlp.w1.{w,b}``
``model.layers.{i}.mlp.up_proj.{w,b}``                   ``layers.{i}.mlp.w3.{w,b}``
``model.layers.{i}.mlp.down_proj.{w,b}``                 ``layers.{i}.mlp.w2.{w,b}``
``model.norm.weight``                                    ``final_norm.weight``
``lm_head.weight``                                       ``output.weight``
=======================================================  =================================
"""

from __future__ import annotations

import re

# Module paths inside one layer: ours -> Hugging Face's.
_LAYER_OURS_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp_norm": "post_attention_layernorm",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w3": "mlp.up_proj",
    "mlp.w2": "mlp.down_proj",
}
_TOP_OURS_TO_HF = {"embed": "model.embed_tokens", "final_norm": "model.norm", "output": "lm_head"}
_LAYER_HF_TO_OURS = {hf: ours for ours, hf in _LAYER_OURS_TO_HF.items()}
_TOP_HF_TO_OURS = {hf: ours for ours, hf in _TOP_OURS_TO_HF.items()}

_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP = re.compile(r"(.+)\.(weight|bias)")

# Tensors some Hugging Face checkpoints store that are not weights (older Llama
# conversions saved the RoPE frequencies); transformers skips them on load, and so do we.
_NOT_WEIGHTS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def ours_to_hf(name: str) -> str:
    """The Hugging Face tensor name of one of our language-model parameter names.

    Args:
        name: e.g. ``layers.3.attn.wq.weight`` (without the ``language_model.`` prefix).

    Returns:
        e.g. ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: if ``name`` is not a Llama-family decoder parameter.
    """
    layer = _OURS_LAYER.fullmatch(name)
    if layer and layer.group(2) in _LAYER_OURS_TO_HF:
        idx, path, kind = layer.groups()
        return f"model.layers.{idx}.{_LAYER_OURS_TO_HF[path]}.{kind}"
    top = _TOP.fullmatch(name)
    if not layer and top and top.group(1) in _TOP_OURS_TO_HF:
        return f"{_TOP_OURS_TO_HF[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"parameter {name!r} has no Hugging Face Llama-family name")


def hf_to_ours(name: str) -> str:
    """Our language-model parameter name of a Hugging Face tensor name.

    Args:
        name: e.g. ``model.layers.3.mlp.gate_proj.weight``.

    Returns:
        e.g. ``layers.3.mlp.w1.weight``.

    Raises:
        ValueError: if ``name`` is not a Llama-family decoder weight.
    """
    layer = _HF_LAYER.fullmatch(name)
    if layer and layer.group(2) in _LAYER_HF_TO_OURS:
        idx, path, kind = layer.groups()
        return f"layers.{idx}.{_LAYER_HF_TO_OURS[path]}.{kind}"
    top = _TOP.fullmatch(name)
    if not layer and top and top.group(1) in _TOP_HF_TO_OURS:
        return f"{_TOP_HF_TO_OURS[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"tensor {name!r} is not a Hugging Face Llama-family decoder weight")


def is_not_a_weight(name: str) -> bool:
    """Whether a checkpoint tensor is a known non-weight (skipped, not 'unexpected')."""
    return bool(_NOT_WEIGHTS.fullmatch(name))
