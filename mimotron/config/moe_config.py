"""A module config's mixture-of-experts options: from its ``moe_*`` keys or its config.json.

Kept apart from :mod:`mimotron.models.moe` (which re-exports :func:`moe_options`) so
that the layout's rules (:mod:`mimotron.config.setup_rules`), the planner and the FLOP counts
read a module's experts without importing the MoE block's ``torch.nn`` code: the
launcher of ``mimotron train`` runs those rules before any rank starts. Not in
:mod:`mimotron.config.moe_options` because a Hugging Face decoder's options come from
its spec (:mod:`mimotron.config.hf_specs`), which itself builds :class:`MoEOptions`.
"""

from __future__ import annotations

from mimotron.config.hf_resolve import language_spec
from mimotron.config.moe_options import MoEOptions
from mimotron.config.schema import ModuleConfig

__all__ = ["moe_options"]


def moe_options(mod: ModuleConfig) -> MoEOptions | None:
    """The module's mixture-of-experts options, ``None`` for a dense module.

    From the ``moe_*`` keys, or for a language ``hf_path`` from its config.json
    (Qwen2-MoE / Qwen3-MoE).

    Args:
        mod: a module config (sizes of a Hugging Face module resolved or not).

    Returns:
        The options, or ``None`` when the module has no MoE layer.
    """
    if mod.hf_path and mod.is_language:
        return language_spec(mod).moe  # reads config.json unless resolved
    if mod.num_experts == 0:
        return None
    freq = mod.moe_layer_freq
    return MoEOptions(
        num_experts=mod.num_experts, top_k=mod.top_k,
        ffn_hidden_size=mod.moe_ffn_hidden_size or mod.ffn_hidden_size,
        num_shared_experts=mod.num_shared_experts, shared_expert_gate=mod.moe_shared_expert_gate,
        router_score=mod.moe_router_score, norm_topk_prob=mod.moe_norm_topk_prob,
        aux_loss_coeff=mod.moe_aux_loss_coeff, z_loss_coeff=mod.moe_z_loss_coeff,
        layer_freq=freq if isinstance(freq, int) else tuple(freq))
