"""The language side of a step: merge embeddings, run the language model, sum the loss.

A :class:`LanguageStep` is the one object the schedule asks for everything that touches
the language model's inputs and loss; it holds the forward step function (the user's or
:func:`default_forward_step`). Where the language model is one pipeline stage the
schedule calls :meth:`LanguageStep.forward_step`, which runs that function whole; with
language ``pipeline > 1`` the first stage calls :meth:`LanguageStep.first_stage_input`
and the last stage :meth:`LanguageStep.loss` — the built-in split of
``default_forward_step`` (a custom forward step cannot be split).

It also keeps the auxiliary metrics the forward step returns in training mode (every
metric besides ``correct`` and ``samples``) until the loop takes them with
:meth:`LanguageStep.pop_aux` for the metrics record. :class:`GlobalTokenCount` is the
loss's divisor: the step starts its reduction, the schedule reads it where first needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mimotron import host_sync
from mimotron.data.balance import balanced_items, in_item_order, is_balanced
from mimotron.host_sync import host_copy
from mimotron.models.attention import document_args
from mimotron.models.language import language_loss
from mimotron.models.native_vision import native_context_embeddings, native_embeddings
from mimotron.names import LANGUAGE
from mimotron.parallel.tensor_parallel import vocab_parallel_loss

# (loss sum, loss tokens, metrics) of one micro-batch.
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
# (model, language batch, embeddings by module) -> LossOutput
ForwardStepFunc = Callable[..., LossOutput]

# Forward-step metrics that become train_accuracy rather than auxiliary losses.
ACCURACY_KEYS = ("correct", "samples")


class GlobalTokenCount:
    """Loss tokens of the whole global batch, reduced over the world in the background.

    Each language DP replica's leader contributes its slice's count; encoder-only ranks
    contribute zero but still join, so they can scale their gradients identically. This
    reduction cannot join the optimizer's: the loss is divided by the count before
    backward. It is started before the schedule and waited for on first use (the
    language model's last stage, at its first backward or MoE forward; every other rank
    after its schedule), so no rank waits for the others to reach it before its first
    forward: the encoders start at once. The value is the same float either way.

    Args:
        microbatches: the step's micro-batches on this rank.
        leader: whether this rank is a loss leader (``MimoModelInfra.is_loss_leader``).
        device: where the count is reduced.
    """

    def __init__(self, microbatches: list[dict[str, dict[str, torch.Tensor]]], leader: bool,
                 device: torch.device) -> None:
        local = 0.0
        if leader:
            local = sum(mb[LANGUAGE]["loss_mask"].sum() for mb in microbatches)
        self._count = torch.as_tensor(local, dtype=torch.float64, device=device).reshape(1)
        self._work = dist.all_reduce(self._count, async_op=True)
        self._value: float | None = None

    def value(self) -> float:
        """The world's count (waits for the reduction once; one host sync)."""
        if self._value is None:
            self._work.wait()
            self._value = float(host_sync.item(self._count, host_sync.TOKEN_COUNT))
        return self._value


def language_input(model: nn.Module, batch: dict[str, torch.Tensor],
                   embeddings: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """Token embeddings with every modality's embeddings merged at its placeholders.

    Under context parallelism only this rank's positions are embedded (``[B, S / c, H]``)
    and ``embeddings`` hold the ``[n_local, H]`` rows of the placeholders among them
    (:meth:`~mimotron.models.mimo.MimoModel.merge_context_embeddings`).
    """
    return language_inputs(model, batch, embeddings)[0]


def language_inputs(model: nn.Module, batch: dict[str, torch.Tensor],
                    embeddings: dict[str, torch.Tensor | None]
                    ) -> tuple[torch.Tensor, dict[str, Any]]:
    """:func:`language_input` and the language model's vision arguments besides it
    (Qwen3-VL's DeepStack features, :func:`~mimotron.models.native_vision.
    native_embeddings`; ``{}`` for every other model)."""
    tokens = batch["tokens"]
    embeds = {m: e for m, e in embeddings.items() if e is not None}
    lm = model.language_model
    positions = lm.context_positions(tokens.shape[1], tokens.device)
    # The placeholder checks count on the batch's host copies: no device sync.
    host_tokens = host_copy(batch, "tokens")
    if positions is not None:
        local = tokens[:, positions]
        held = lm.context_positions(tokens.shape[1], torch.device("cpu"))  # host copy
        host_local = local if host_tokens is tokens else host_tokens[:, held.to(
            host_tokens.device)]
        local_embeds = lm.embed_tokens(local)
        embeds, visual = native_context_embeddings(model, batch, embeds,
                                                   local_embeds.shape[-1], held)
        return model.merge_context_embeddings(local, local_embeds, embeds,
                                              host_tokens=host_local), visual
    present = {m: host_copy(batch, f"has_{model.modality_of[m]}") for m in embeds}
    token_embeds = lm.embed_tokens(tokens)
    embeds, counts, visual = native_embeddings(model, batch, embeds, token_embeds.shape[-1])
    return model.merge_embeddings(tokens, token_embeds, embeds, present,
                                  host_tokens=host_tokens, counts=counts), visual


def in_sample_order(model: nn.Module, batch: dict[str, torch.Tensor],
                    embeddings: dict[str, torch.Tensor | None]
                    ) -> dict[str, torch.Tensor | None]:
    """``embeddings`` with each module's rows in sample order, as a forward step takes them.

    Items dealt by cost (``data.balance_encoders``) arrive grouped by the replica that
    encoded them (:mod:`mimotron.data.balance`); every other module's rows are already in
    order and pass as they are.
    """
    out = dict(embeddings)
    for m, e in embeddings.items():
        modality = model.modality_of.get(m)
        if e is not None and modality is not None and is_balanced(batch, modality):
            out[m] = in_item_order(e, balanced_items(batch, modality)[0])
    return out


def language_loss_step(model: nn.Module, batch: dict[str, torch.Tensor], logits: torch.Tensor
                       ) -> LossOutput:
    """Summed token loss of the language model's (possibly vocab-sharded) logits.

    Under context parallelism ``logits`` are this rank's positions: ``loss_sum`` is
    this rank's partial sum (the step adds every CP rank's), while the token count and
    ``correct`` cover the whole sequence (:func:`context_parallel_counts`).

    Returns:
        ``(loss_sum, num_loss_tokens, {"correct": n, "samples": n})`` where ``correct``
        counts samples whose every answer token is the argmax (= exact match of greedy
        generation, see ``evaluate``); pad samples (index < 0) are not counted.
    """
    labels, loss_mask = batch["labels"], batch["loss_mask"]
    positions = model.language_model.context_positions(labels.shape[1], labels.device)
    if positions is not None:
        labels, loss_mask = labels[:, positions], loss_mask[:, positions]
    group = model.language_tp_group
    if group is not None:
        loss_sum, num_tokens, correct = vocab_parallel_loss(logits, labels, loss_mask, group)
    else:
        loss_sum, num_tokens, correct = language_loss(logits, labels, loss_mask)
    if positions is not None:
        num_tokens, correct = context_parallel_counts(
            model.language_model.context_parallel_group, batch["loss_mask"], loss_mask, correct)
    valid = batch["index"] >= 0
    metrics = {"correct": (correct & valid).sum(), "samples": valid.sum()}
    if not model.training:
        metrics.update(input_kind_counts(model, batch, correct & valid, valid))
    return loss_sum, num_tokens, metrics


def context_parallel_counts(group: dist.ProcessGroup, whole_mask: torch.Tensor,
                            local_mask: torch.Tensor, local_correct: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token count and per-sample exact match of the whole sequence, from one CP rank.

    The count comes from the whole ``[B, S]`` loss mask every CP rank keeps. A sample is
    right when no CP rank saw a wrong scored position: this rank's wrong flags (scored
    positions exist and not all are right) are summed over the CP group — one small
    collective that every CP rank of the last stage issues for every micro-batch.
    """
    local_scored = (local_mask != 0).any(dim=1)
    wrong = (local_scored & ~local_correct).to(torch.int64)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM, group=group)
    correct = (wrong == 0) & (whole_mask != 0).any(dim=1)
    return whole_mask.float().sum(), correct


def input_kinds(model: nn.Module) -> list[str]:
    """The eval accuracy breakdown's names: every modality, and ``"text"`` (none)."""
    return [*sorted(set(model.modality_of.values())), "text"]


def input_kind_counts(model: nn.Module, batch: dict[str, torch.Tensor], correct: torch.Tensor,
                      valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """``correct_<kind>`` / ``samples_<kind>`` for :func:`input_kinds` (evaluation only).

    A sample counts for every modality its input holds, and for ``text`` if it holds none:
    a task whose audio never gets heard shows up as a low ``eval_accuracy_audio``.
    """
    any_media = torch.zeros_like(valid)
    out: dict[str, torch.Tensor] = {}
    for kind in input_kinds(model)[:-1]:
        has = batch[f"has_{kind}"].bool()
        if has.dim() > 1:  # several items per row ([B, K]): a sample holding any counts
            has = has.any(dim=1)
        has = has & valid
        any_media |= has
        out[f"correct_{kind}"], out[f"samples_{kind}"] = (correct & has).sum(), has.sum()
    text = valid & ~any_media
    out["correct_text"], out["samples_text"] = (correct & text).sum(), text.sum()
    return out


def default_forward_step(model: nn.Module, batch: dict[str, torch.Tensor],
                         embeddings: dict[str, torch.Tensor | None]) -> LossOutput:
    """Merge modality embeddings into the text, run the language model, sum the loss.

    A custom ``forward_step_func`` has this signature; it runs where the language model
    is one pipeline stage (with language ``pipeline > 1`` the built-in split of this
    function, ``language_input`` / ``language_loss_step``, runs instead) and is refused
    under context parallelism (:func:`check_forward_step`).
    """
    hidden, visual = language_inputs(model, batch, embeddings)
    logits = model.language_model(hidden, **document_args(batch), **visual)
    return language_loss_step(model, batch, logits)


def check_forward_step(forward_step_func: ForwardStepFunc | LanguageStep,
                       context: int) -> None:
    """Refuse a custom forward step under context parallelism (before any collective).

    Under ``context > 1`` each CP rank's logits cover only its positions while the batch
    stays whole: a custom step written for whole sequences fails on shapes, and one built
    on :func:`default_forward_step` returns partial loss sums, whose auxiliary metrics
    the loop would take from CP rank 0 alone (silently wrong), and any extra loss term
    would count once per CP rank.

    Args:
        forward_step_func: the step function, or a ``LanguageStep`` around one.
        context: ``modules.language.parallel.context``.

    Raises:
        ValueError: ``context > 1`` with a function other than ``default_forward_step``.
    """
    func = (forward_step_func.forward_step_func if isinstance(forward_step_func, LanguageStep)
            else forward_step_func)
    if context > 1 and func is not default_forward_step:
        name = getattr(func, "__qualname__", repr(func))
        raise ValueError(
            f"forward_step_func={name} is not supported with modules.language.parallel."
            f"context={context}: context-parallel ranks hold a part of each sequence; use "
            "default_forward_step (mimotron.training.step) or context=1")


class LanguageStep:
    """Input merging, forward step and loss of the language model, for the schedule.

    Args:
        forward_step_func: ``(model, batch, embeddings) -> (loss_sum, num_tokens,
            metrics)``, run where the language model is a single stage.
    """

    def __init__(self, forward_step_func: ForwardStepFunc = default_forward_step) -> None:
        self.forward_step_func = forward_step_func
        self._aux: dict[str, list[torch.Tensor]] = {}

    @classmethod
    def of(cls, step: LanguageStep | ForwardStepFunc) -> LanguageStep:
        """``step`` itself if it is a ``LanguageStep``, else one around the function."""
        return step if isinstance(step, LanguageStep) else cls(step)

    def forward_step(self, model: nn.Module, batch: dict[str, torch.Tensor],
                     embeddings: dict[str, torch.Tensor | None]) -> LossOutput:
        """The whole language step (single-stage language model, or colocated)."""
        out = self.forward_step_func(model, batch, in_sample_order(model, batch, embeddings))
        if model.training and isinstance(out, tuple) and len(out) == 3 \
                and isinstance(out[2], dict):
            for key, value in out[2].items():
                if key not in ACCURACY_KEYS:
                    self._aux.setdefault(key, []).append(value.detach().double().flatten())
        return out

    def first_stage_input(self, model: nn.Module, batch: dict[str, torch.Tensor],
                          embeddings: dict[str, torch.Tensor | None]
                          ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The first stage's input of a pipelined language model and its vision
        arguments (:func:`language_inputs`)."""
        return language_inputs(model, batch, in_sample_order(model, batch, embeddings))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], logits: torch.Tensor
             ) -> LossOutput:
        """The last stage's loss of a pipelined language model (``language_loss_step``)."""
        return language_loss_step(model, batch, logits)

    def pop_aux(self) -> dict[str, torch.Tensor]:
        """This step's auxiliary metrics summed over its micro-batches; resets them."""
        out = {k: torch.stack(v).sum(0) for k, v in self._aux.items()}
        self._aux.clear()
        return out
