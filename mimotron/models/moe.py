"""Mixture-of-experts feed-forward block: router, stacked experts, dispatcher, aux losses.

:class:`MoEFeedForward` replaces a decoder layer's SwiGLU ``mlp``. For the ``T`` tokens
``x[t]`` of a ``[B, S, hidden]`` input it computes

    ``y[t] = Σ_j w[t, j] · expert_{e[t, j]}(x[t])  (+ g(x[t]) · shared(x[t]))``

where the router (``router.weight``, a bias-free ``Linear(hidden, num_experts)``) scores
every expert, the ``top_k`` best experts ``e[t, :]`` are kept with their scores
``w[t, :]``, optionally renormalised to sum to one (Mixtral, Qwen3-MoE's
``norm_topk_prob``), and ``g`` is Qwen2-MoE's optional ``sigmoid(shared_expert_gate(x))``
(1 without a gate). Scores are ``softmax`` (Mixtral, Qwen) or ``sigmoid`` (DeepSeek-V3
style) of the router logits, in fp32. Routing is **dropless**: every (token, choice) pair
is computed, there is no capacity factor, so results never depend on the layout.

The experts are :class:`GroupedExperts`, three stacked parameters with the expert index
as dim 0. Who computes which expert is the *dispatcher*'s business: a plain attribute
(not a submodule) holding :class:`LocalDispatcher` by default (all experts on this rank);
expert parallelism swaps in its own dispatcher (``mimotron.parallel.expert_parallel``)
and shards the three parameters ``Shard(0)`` over the expert-parallel mesh axis.

Auxiliary losses — the mechanism
--------------------------------
Both losses are defined **per sample** (one row of the ``[B, S, hidden]`` input, all its
``S`` positions) and per MoE layer, so they do not depend on how samples are split into
micro-batches or over data-parallel replicas:

* load balancing (Switch / Mixtral form): ``aux_b = E · Σ_e f_e · P_e`` with
  ``f_e = (choices of expert e among the sample's S·k choices) / (S·k)`` and
  ``P_e`` the mean over the sample's tokens of the scores normalised to sum to one per
  token (the softmax itself for ``softmax`` routing). A perfectly balanced router gives 1.
* router z-loss (ST-MoE): ``z_b = mean_t logsumexp(logits[t])²``.

The training objective is the cross-entropy's, extended by these terms weighted like the
cross-entropy by the sample's loss-token count ``n_b`` (``loss_mask`` sum):

    ``objective = (CE_sum + Σ_b n_b · Σ_layers (aux_coeff · aux_b + z_coeff · z_b))
    / global_loss_tokens``

The aux terms never travel to the loss: each MoE layer injects their gradient at its own
output with an autograd function (:class:`_InjectAuxGrad`, Megatron's
``MoEAuxLossAutoScaler`` idea) whose forward is the identity and whose backward also
returns ``weight_b · coeff`` for the losses. The per-sample weights
``n_b · loss_scale / global_loss_tokens`` are set on the layers before each micro-batch's
forward (:func:`set_aux_loss_weights`, called by the schedule) and captured by the
autograd graph, so they are right under 1F1B interleaving and on a pipeline stage that
never sees the loss. Without weights (inference, a model used outside the engine) no
gradient is injected; the losses are still measured.

Each layer also accumulates, in training mode, detached statistics for the metrics
(tokens per expert, summed aux / z-loss and their sample count); :func:`pop_moe_stats`
takes and resets them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

# The options, their checks and a module config's options live in modules without
# torch.nn (the launcher's config checks read them); re-exported here, where the blocks
# they describe are built.
from mimotron.config.moe_config import moe_options as moe_options
from mimotron.config.moe_options import ROUTER_SCORES as ROUTER_SCORES
from mimotron.config.moe_options import MoEOptions as MoEOptions
from mimotron.config.moe_options import RouterScore as RouterScore
from mimotron.config.moe_options import check_layer_freq as check_layer_freq
from mimotron.config.moe_options import check_moe_options as check_moe_options
from mimotron.config.schema import default_ffn_hidden_size
from mimotron.host_sync import EXPERT_COUNTS, to_host
from mimotron.models.blocks import SwiGLU, residual_init_std


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: ``to_local()`` for a DTensor (expert-parallel shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked, expert index first.

    Parameters: ``w1`` ``[E, F, H]`` (gate), ``w3`` ``[E, F, H]`` (up), ``w2``
    ``[E, H, F]`` (down). Under expert parallelism they are DTensors sharded ``Shard(0)``
    and this rank computes its local experts only. Init (:mod:`mimotron.models.init`,
    on the FULL shape): ``w1``/``w3`` normal with std ``1/sqrt(H)`` like a Linear's, ``w2``
    with the depth-scaled residual std.

    Args:
        num_experts: experts (all ranks together).
        hidden_size: model width ``H``.
        ffn_hidden_size: expert width ``F``.
        num_layers: depth of the whole stack (init of ``w2``).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 num_layers: int = 1) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        # Read by init_parameters_: one std per stacked parameter.
        self.init_stds = {"w1": hidden_size**-0.5, "w3": hidden_size**-0.5,
                          "w2": residual_init_std(num_layers)}

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Apply local expert ``i`` to the ``counts[i]`` consecutive rows of ``x`` it owns.

        Args:
            x: ``[N, H]`` rows grouped by local expert in ascending order.
            counts: rows per local expert; ``len(counts)`` is the local expert count and
                ``sum(counts) == N``.

        Returns:
            ``[N, H]``, row ``r`` the output of its expert on ``x[r]``.
        """
        w1, w3, w2 = (local_tensor(w) for w in (self.w1, self.w3, self.w2))
        if len(counts) != w1.shape[0] or sum(counts) != x.shape[0]:
            raise ValueError(f"counts={counts} do not fit {w1.shape[0]} local experts and "
                             f"{x.shape[0]} rows")
        outs = []
        for i, rows in enumerate(torch.split(x, counts)):
            # Every expert runs, even on zero rows, so its parameters always join the graph.
            hidden = F.silu(rows @ w1[i].t()) * (rows @ w3[i].t())
            outs.append(hidden @ w2[i].t())
        return torch.cat(outs) if outs else x.new_zeros(x.shape)


class Dispatcher(Protocol):
    """Computes ``Σ_j weights[t, j] · expert_{expert_ids[t, j]}(x[t])`` for every token."""

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        """``x`` ``[T, H]``, ``expert_ids``/``weights`` ``[T, k]`` -> ``[T, H]``."""
        ...


def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
            ) -> torch.Tensor:
    """Undo the sort by expert and sum each token's ``k`` outputs with their weights.

    Args:
        expert_out: ``[T·k, H]`` outputs in sorted (by expert) order.
        order: ``[T·k]`` the sort permutation of the flattened ``[T, k]`` choices.
        weights: ``[T, k]`` routing weights.

    Returns:
        ``[T, H]``.
    """
    num_tokens, k = weights.shape
    unsorted = torch.empty_like(expert_out).index_copy(0, order, expert_out)
    unsorted = unsorted.view(num_tokens, k, -1)
    return (unsorted * weights.unsqueeze(-1).to(unsorted.dtype)).sum(dim=1)


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Group the flattened ``[T, k]`` choices by expert.

    Returns:
        ``(order, token_of_row, counts)``: the stable sort permutation ``[T·k]``, the
        token index of every sorted row, and rows per expert (host list, one sync).
    """
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = to_host(expert_counts(flat, num_experts), EXPERT_COUNTS, total=flat.numel())
    return order, order // expert_ids.shape[1], counts


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Choices per expert, ``[num_experts]`` int64: ``bincount`` with a fixed size.

    ``torch.bincount`` sizes its output by the largest id, a read of the device value
    on an accelerator (and an unknowable shape in the fake-device dry run); ids are
    below ``num_experts``, so a scatter-add into ``num_experts`` slots counts the same.

    Args:
        expert_ids: expert ids in ``[0, num_experts)``, any shape.
        num_experts: number of experts.
    """
    flat = expert_ids.reshape(-1)
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


class LocalDispatcher:
    """Dispatcher with every expert on this rank: sort, one grouped call, unsort, sum."""

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        """See :class:`Dispatcher`."""
        order, token_of_row, counts = sort_by_expert(expert_ids, experts.num_experts)
        return combine(experts(x[token_of_row], counts), order, weights)


def route(logits: torch.Tensor, top_k: int, score: str, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores, top-k weights and expert ids of router logits (fp32).

    Args:
        logits: ``[T, E]`` router logits.
        top_k: experts per token.
        score: ``softmax`` or ``sigmoid``.
        norm_topk: renormalise the kept weights to sum to one per token.

    Returns:
        ``(scores [T, E], weights [T, k], expert_ids [T, k])``.
    """
    # At least fp32 (bf16 logits would make the top-k ties and weights noisy).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()
    weights, expert_ids = scores.topk(top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return scores, weights, expert_ids


def load_balancing_loss(scores: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample Switch/Mixtral aux loss ``E · Σ_e f_e · P_e`` (module docstring).

    Args:
        scores: ``[B, S, E]`` router scores.
        expert_ids: ``[B, S, k]`` chosen experts.

    Returns:
        ``[B]`` fp32.
    """
    num_experts = scores.shape[-1]
    probs = scores / scores.sum(dim=-1, keepdim=True)
    p_mean = probs.mean(dim=1)  # [B, E]
    one_hot = F.one_hot(expert_ids, num_experts).to(scores.dtype)  # [B, S, k, E]
    frac = one_hot.sum(dim=(1, 2)) / (expert_ids.shape[1] * expert_ids.shape[2])
    return num_experts * (frac * p_mean).sum(dim=-1)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample ST-MoE z-loss ``mean_t logsumexp(logits[t])²``: ``[B, S, E]`` -> ``[B]``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits, dim=-1).pow(2).mean(dim=1)


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``out``; backward adds ``d objective / d aux = weights`` for ``aux``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weights)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (weights,) = ctx.saved_tensors
        return grad, weights, None


@dataclass
class MoEStats:
    """Detached training statistics of one MoE layer since the last :func:`pop_moe_stats`."""

    tokens_per_expert: torch.Tensor | None = None
    aux_sum: float | torch.Tensor = 0.0
    z_sum: float | torch.Tensor = 0.0
    num_samples: int = 0


class MoEFeedForward(nn.Module):
    """Routed experts (+ optional shared experts) in place of a SwiGLU ``mlp``.

    Args:
        hidden_size: model width.
        num_experts: routed experts ``E`` (>= 1).
        top_k: experts per token (1 <= top_k <= E).
        ffn_hidden_size: width of each routed expert (0 = the SwiGLU default).
        num_layers: depth of the whole stack (init of the down projections).
        num_shared_experts: 0, or the width multiple of one always-on SwiGLU
            (``num_shared_experts · ffn_hidden_size`` wide, DeepSeek's fused form).
        shared_ffn_hidden_size: explicit width of the shared expert (0 = as above);
            Qwen2-MoE's ``shared_expert_intermediate_size``.
        shared_expert_gate: multiply the shared output by ``sigmoid(Linear(hidden, 1))``
            (Qwen2-MoE).
        router_score: ``softmax`` or ``sigmoid``.
        norm_topk_prob: renormalise the top-k weights to sum to one.
        aux_loss_coeff: weight of the load-balancing loss in the objective.
        z_loss_coeff: weight of the router z-loss (0 = not computed).

    Raises:
        ValueError: on inconsistent sizes or an unknown router score (field named).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 ffn_hidden_size: int = 0, num_layers: int = 1, *,
                 num_shared_experts: int = 0, shared_ffn_hidden_size: int = 0,
                 shared_expert_gate: bool = False, router_score: str = "softmax",
                 norm_topk_prob: bool = True, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0) -> None:
        super().__init__()
        check_moe_options(num_experts, top_k, router_score, num_shared_experts)
        width = ffn_hidden_size or default_ffn_hidden_size(hidden_size)
        self.num_experts, self.top_k = num_experts, top_k
        self.router_score, self.norm_topk_prob = router_score, norm_topk_prob
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden_size, width, num_layers)
        shared_width = shared_ffn_hidden_size or num_shared_experts * width
        self.shared_experts = (SwiGLU(hidden_size, shared_width, num_layers)
                               if shared_width else None)
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False)
                                   if shared_expert_gate and shared_width else None)
        self.dispatcher: Dispatcher = LocalDispatcher()
        # Per-sample objective weights of the next forward (set_aux_loss_weights).
        self.aux_weights: torch.Tensor | None = None
        self.stats = MoEStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route ``[B, S, hidden]`` (or ``[T, hidden]``, one sample) through the experts."""
        squeeze = x.dim() == 2
        x3 = x.unsqueeze(0) if squeeze else x
        batch, seq, hidden = x3.shape
        flat = x3.reshape(batch * seq, hidden)
        logits = self.router(flat)
        scores, weights, expert_ids = route(logits, self.top_k, self.router_score,
                                            self.norm_topk_prob)
        out = self.dispatcher(flat, expert_ids, weights.to(flat.dtype), self.experts)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        out = self._aux_losses(out, logits.view(batch, seq, -1), scores.view(batch, seq, -1),
                               expert_ids.view(batch, seq, -1))
        out = out.view(batch, seq, hidden)
        return out.squeeze(0) if squeeze else out

    def _aux_losses(self, out: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor,
                    expert_ids: torch.Tensor) -> torch.Tensor:
        """Measure the aux losses; inject their gradient when weights are set."""
        aux = load_balancing_loss(scores, expert_ids)
        z = router_z_loss(logits) if self.z_loss_coeff else None
        if self.training:
            self._record(aux, z, expert_ids)
        weights, self.aux_weights = self.aux_weights, None
        if weights is None or not torch.is_grad_enabled():
            return out
        weights = weights.to(device=aux.device, dtype=aux.dtype)
        total = self.aux_loss_coeff * aux
        if z is not None:
            total = total + self.z_loss_coeff * z
        return _InjectAuxGrad.apply(out, total, weights)

    @torch.no_grad()
    def _record(self, aux: torch.Tensor, z: torch.Tensor | None, expert_ids: torch.Tensor
                ) -> None:
        counts = expert_counts(expert_ids, self.num_experts)
        st = self.stats
        st.tokens_per_expert = counts if st.tokens_per_expert is None \
            else st.tokens_per_expert + counts
        st.aux_sum = st.aux_sum + aux.detach().sum()
        if z is not None:
            st.z_sum = st.z_sum + z.detach().sum()
        st.num_samples += aux.shape[0]


def build_moe(options: MoEOptions, hidden_size: int, num_layers: int) -> MoEFeedForward:
    """One MoE block of ``options`` for a stack of width ``hidden_size`` and depth
    ``num_layers``."""
    return MoEFeedForward(
        hidden_size, options.num_experts, options.top_k, options.ffn_hidden_size, num_layers,
        num_shared_experts=options.num_shared_experts,
        shared_ffn_hidden_size=options.shared_ffn_hidden_size,
        shared_expert_gate=options.shared_expert_gate, router_score=options.router_score,
        norm_topk_prob=options.norm_topk_prob, aux_loss_coeff=options.aux_loss_coeff,
        z_loss_coeff=options.z_loss_coeff)


def moe_factory(options: MoEOptions, hidden_size: int, num_layers: int
                ) -> Callable[[int], MoEFeedForward | None]:
    """``make_layers``' ``mlp_factory``: an MoE block for MoE layers, else ``None``."""
    return lambda i: (build_moe(options, hidden_size, num_layers)
                      if options.is_moe_layer(i) else None)


def moe_layers(module: nn.Module) -> dict[str, MoEFeedForward]:
    """Every :class:`MoEFeedForward` inside ``module``, by qualified name."""
    return {n: m for n, m in module.named_modules() if isinstance(m, MoEFeedForward)}


def set_aux_loss_weights(module: nn.Module, weights: torch.Tensor | None) -> None:
    """Set the per-sample objective weights of the next forward of every MoE layer.

    Args:
        module: a model (part) holding MoE layers (nothing happens without any).
        weights: ``[B]`` ``d objective / d (per-sample aux term)``, i.e.
            ``n_b · loss_scale / global_loss_tokens``; ``None`` injects nothing.
    """
    for layer in moe_layers(module).values():
        layer.aux_weights = weights


def pop_moe_stats(module: nn.Module) -> dict[str, MoEStats]:
    """Take (and reset) every MoE layer's statistics, by qualified layer name."""
    out = {}
    for name, layer in moe_layers(module).items():
        out[name], layer.stats = layer.stats, MoEStats()
    return out
