"""Evaluation: forward-only schedule over the validation split, all ranks in lock-step.

``eval_accuracy`` is the exact match of greedily generated answers. It is computed in
one teacher-forced pass: greedy decoding reproduces the answer exactly iff, at every
answer position (the final ``<eos>`` included), the argmax of the logits given the
correct prefix is the correct next token — by induction, each greedy step then sees the
correct prefix. So "every masked argmax correct" *is* greedy exact match, at the cost of
one forward pass, with any layout (``tests/test_evaluate.py`` checks it against real
token-by-token generation).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mimotron import host_sync
from mimotron.names import LANGUAGE
from mimotron.pipeline.schedules import (
    MicrobatchOutput,
    StepContext,
    Transport,
    rank_actions,
    run_schedule,
)
from mimotron.training.data_provider import Microbatch, microbatches_to_device
from mimotron.training.infra import MimoModelInfra
from mimotron.training.language_step import (
    ForwardStepFunc,
    LanguageStep,
    check_forward_step,
    input_kinds,
)
from mimotron.training.step import autocast_factory, local_output_sums


def evaluate(
    forward_step_func: ForwardStepFunc | LanguageStep,
    steps: Iterator[list[Microbatch]],
    model: nn.Module,
    communicator: Transport,
    infra: MimoModelInfra,
    precision: str,
    device: torch.device,
    encoder_batching: bool = False,
) -> dict[str, float]:
    """Token-weighted eval loss and exact-match accuracy over ``steps``.

    Returns:
        ``{"eval_loss": ..., "eval_accuracy": ..., "eval_samples": ...}`` on every rank,
        and ``eval_accuracy_<kind>`` for each modality (samples whose input holds it) and
        ``text`` (samples with no media) that the validation split holds.

    With ``encoder_batching`` (``train.encoder_batching``, colocated layouts) each
    encoder runs each evaluation step's micro-batches in one forward.

    Raises:
        ValueError: a custom ``forward_step_func`` with a context-parallel language model.
    """
    check_forward_step(forward_step_func, infra.layout.modules[LANGUAGE].parallel.context)
    was_training = model.training
    model.eval()
    kinds = input_kinds(model)
    totals = torch.zeros(4 + 2 * len(kinds), dtype=torch.float64, device=device)
    for host_microbatches in steps:
        microbatches = microbatches_to_device(host_microbatches, device)
        ctx = StepContext(
            model=model, layout=infra.layout, rank=infra.rank, microbatches=microbatches,
            language=LanguageStep.of(forward_step_func), transport=communicator,
            forward_only=True, encoder_batching=encoder_batching,
            autocast=autocast_factory(precision, device))
        plan = rank_actions(infra.layout, infra.rank, len(microbatches), pipelined=False,
                         forward_only=True)
        outputs = run_schedule(ctx, plan)
        totals += torch.cat([local_output_sums(outputs, infra.is_loss_leader,
                                               infra.is_loss_partial, device),
                             _kind_sums(outputs, kinds, infra, device)])
    model.train(was_training)
    dist.all_reduce(totals)  # one world reduction for the whole evaluation
    sums = host_sync.to_host(totals, host_sync.EVAL_SUMS)
    loss_sum, tokens, correct, samples = sums[:4]
    metrics = {"eval_loss": loss_sum / max(tokens, 1.0),
               "eval_accuracy": correct / max(samples, 1.0), "eval_samples": samples}
    for i, kind in enumerate(kinds):
        kind_correct, kind_samples = sums[4 + 2 * i: 6 + 2 * i]
        if kind_samples:  # a kind the validation split does not hold has no accuracy
            metrics[f"eval_accuracy_{kind}"] = kind_correct / kind_samples
    return metrics


def _kind_sums(outputs: list[MicrobatchOutput], kinds: list[str], infra: MimoModelInfra,
               device: torch.device) -> torch.Tensor:
    """This rank's ``[correct, samples]`` per input kind (zeros off the loss leaders)."""
    vec = torch.zeros(2 * len(kinds), dtype=torch.float64, device=device)
    zero = torch.zeros((), device=device)
    if infra.is_loss_leader:
        for out in outputs:
            for i, kind in enumerate(kinds):  # a custom forward step may report none
                vec[2 * i] += out.metrics.get(f"correct_{kind}", zero).double()
                vec[2 * i + 1] += out.metrics.get(f"samples_{kind}", zero).double()
    return vec


@torch.no_grad()
def greedy_generate(model: nn.Module, batch: dict[str, torch.Tensor], prompt_len: int,
                    max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Token-by-token greedy decoding on one process holding every module.

    Used to check the one-pass exact-match metric; training never calls it.

    Args:
        model: a full ``MimoModel``.
        batch: one collated sample batch whose prompts all have length ``prompt_len``.
        prompt_len: tokens before the answer.
        max_new_tokens: generation limit.
        eos_id: stop token.

    Returns:
        The generated ids per sample (without the eos).
    """
    embeds = {m: model.encode(m, batch) for m in model.modality_submodules}
    present = {m: batch[f"has_{model.modality_of[m]}"] for m in embeds}
    tokens = batch["tokens"][:, :prompt_len].clone()
    lm = model.language_model
    done = torch.zeros(tokens.shape[0], dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(tokens.shape[0])]
    for _ in range(max_new_tokens):
        hidden = model.merge_embeddings(tokens, lm.embed_tokens(tokens), embeds, present)
        nxt = lm(hidden)[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == eos_id:
                    done[i] = True
                else:
                    out[i].append(t)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if bool(done.all()):
            break
    return out
