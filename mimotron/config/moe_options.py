"""Mixture-of-experts options and their checks, apart from the MoE block that uses them.

:class:`MoEOptions` says how a stack's MoE layers are built and placed; the checks
(:func:`check_moe_options`, :func:`check_layer_freq`) are the ``modules.<m>`` MoE keys'
rules. They live here, not in :mod:`mimotron.models.moe`, because the config checks
(:mod:`mimotron.config.validation`, and the Hugging Face spec readers that fill ``MoEOptions``
from a Qwen-MoE config.json) run in the launcher of ``mimotron train`` before any rank
starts, and that process must not import the ``nn`` modules (nor DTensor behind them):
this module imports nothing but the standard library. :mod:`mimotron.models.moe`
re-exports every name, so imports from there keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ROUTER_SCORES", "MoEOptions", "RouterScore", "check_layer_freq",
           "check_moe_options"]

RouterScore = Literal["softmax", "sigmoid"]
ROUTER_SCORES: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEOptions:
    """How a stack's MoE layers are built and placed (the ``modules.<m>`` MoE keys).

    :func:`mimotron.models.moe.build_moe` and :func:`~mimotron.models.moe.moe_factory`
    build the blocks these options describe.

    Attributes:
        num_experts: routed experts per MoE layer (>= 1).
        top_k: experts per token.
        ffn_hidden_size: routed expert width (0 = the SwiGLU default).
        num_shared_experts: shared expert width multiple (0 = none).
        shared_ffn_hidden_size: explicit shared expert width (0 = from the multiple).
        shared_expert_gate: Qwen2-MoE's sigmoid gate on the shared expert.
        router_score: ``softmax`` or ``sigmoid``.
        norm_topk_prob: renormalise the top-k weights.
        aux_loss_coeff: load-balancing loss weight.
        z_loss_coeff: router z-loss weight.
        layer_freq: 1 = every layer, N = layers with ``index % N == 0``, or one 0/1 per
            layer.
    """

    num_experts: int
    top_k: int = 2
    ffn_hidden_size: int = 0
    num_shared_experts: int = 0
    shared_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    router_score: str = "softmax"
    norm_topk_prob: bool = True
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    layer_freq: int | tuple[int, ...] = 1

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer ``index`` is an MoE layer."""
        if isinstance(self.layer_freq, int):
            return index % self.layer_freq == 0
        return bool(self.layer_freq[index])

    def moe_layer_ids(self, num_layers: int) -> list[int]:
        """The MoE layers' global indices in a stack of ``num_layers``."""
        return [i for i in range(num_layers) if self.is_moe_layer(i)]


def check_moe_options(num_experts: int, top_k: int, router_score: str,
                      num_shared_experts: int = 0, prefix: str = "") -> None:
    """Validate MoE sizes; one-line ``ValueError`` naming the field.

    Args:
        num_experts: routed experts (0 = dense layer, then nothing else is checked).
        top_k: experts per token.
        router_score: ``softmax`` or ``sigmoid``.
        num_shared_experts: >= 0.
        prefix: prepended to field names (``modules.language.``).
    """
    if num_experts < 0:
        raise ValueError(f"{prefix}num_experts={num_experts} is invalid: expected >= 0")
    if num_experts == 0:
        return
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{prefix}top_k={top_k} is invalid: expected 1 <= top_k <= "
                         f"num_experts={num_experts}")
    if router_score not in ROUTER_SCORES:
        raise ValueError(f"{prefix}moe_router_score={router_score!r} is invalid: expected "
                         f"one of {list(ROUTER_SCORES)}")
    if num_shared_experts < 0:
        raise ValueError(f"{prefix}num_shared_experts={num_shared_experts} is invalid: "
                         "expected >= 0")


def check_layer_freq(layer_freq: int | list[int] | tuple[int, ...], num_layers: int,
                     prefix: str = "") -> None:
    """Validate ``moe_layer_freq`` (one-line ``ValueError`` naming the field)."""
    if isinstance(layer_freq, bool) or not isinstance(layer_freq, int | list | tuple):
        raise ValueError(f"{prefix}moe_layer_freq={layer_freq!r} is invalid: expected an "
                         "integer >= 1 or a list of 0/1 per layer")
    if isinstance(layer_freq, int):
        if layer_freq < 1:
            raise ValueError(f"{prefix}moe_layer_freq={layer_freq} is invalid: expected an "
                             "integer >= 1 or a list of 0/1 per layer")
        return
    if len(layer_freq) != num_layers or any(v not in (0, 1) for v in layer_freq):
        raise ValueError(f"{prefix}moe_layer_freq={list(layer_freq)} is invalid: expected "
                         f"{num_layers} entries of 0 or 1 (one per layer)")
