"""The independent reference every parity test compares against: a plain PyTorch loop.

One process, no ``torch.distributed``: the whole model (built from the model classes and
initialised exactly as the engine initialises it), the whole global batch in one forward
(no micro-batches), ``loss_sum / num_tokens``, ``backward``,
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` with norm/bias parameters
excluded from weight decay, and the learning-rate schedule written out below. Nothing
of the engine's schedule, bridge, gradient finalisation, optimizer or scheduler runs
here, so a bug there cannot hide in both sides of a comparison.

What it borrows from mimotron is what a user would borrow: the config file and its
resolved per-module values, the tokenizer and data API (the global sample order), and
the model classes (``build_mimo_model``). The language model's attention core is not
borrowed: :func:`reference_run` replaces it in every decoder layer with its own
(:mod:`tests.reference_attention`: RoPE positions, the causal and per-document mask of
packed rows and grouped-query attention, from the batch's ``doc_ids`` alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch

from mimotron.config import MimoConfig, load_config
from mimotron.data import CharTokenizer, build_datasets, collate
from mimotron.data.packing import collate_packed
from mimotron.models.build import build_mimo_model
from tests.common import BASE, DIGITS, module_of
from tests.reference_attention import install_reference_attention

# The language model's vocabulary is padded to a multiple of 64 (so TP can split it).
VOCAB_MULTIPLE = 64


@dataclass
class ReferenceRun:
    """Per-iteration numbers and the final weights of the plain loop.

    Attributes:
        losses: mean loss over the global batch's loss tokens, per iteration.
        grad_norms: global L2 norm of all gradients before clipping, per iteration.
        module_norms: per iteration, module -> L2 norm of its gradients after clipping.
        num_tokens: loss tokens per global batch.
        weights: parameter name (as inside ``MimoModel``) -> final value.
        initial: parameter name -> initial value.
        num_zeros: zero gradient entries before clipping, per iteration (a parameter
            without a gradient counts all its entries).
    """

    losses: list[float]
    grad_norms: list[float]
    module_norms: list[dict[str, float]]
    num_tokens: list[float]
    weights: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    num_zeros: list[int] = field(default_factory=list)


def lr_at(step: int, max_lr: float, min_lr: float, warmup: int, decay: int, style: str
          ) -> float:
    """Megatron's schedule: linear warm-up from 0, then cosine/linear/constant decay."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def _optimizer(cfg: MimoConfig, model: torch.nn.Module) -> tuple[torch.optim.AdamW, list]:
    """AdamW with two groups per trainable module (decay / no decay); group schedules."""
    groups, schedules = [], []
    for name in sorted(cfg.modules):
        if cfg.modules[name].freeze is True:
            continue
        opt, sched = cfg.effective_optimizer(name), cfg.effective_scheduler(name)
        assert opt.name == "adamw", "the reference implements AdamW only"
        assert sched.decay_style in ("cosine", "linear", "constant"), sched.decay_style
        assert sched.start_weight_decay is None and sched.end_weight_decay is None, (
            "the reference implements a constant weight decay only")
        named = [(n, p) for n, p in model.named_parameters()
                 if module_of(n) == name and p.requires_grad]
        min_lr = opt.min_lr if sched.min_lr is None else sched.min_lr
        decay_iters = sched.decay_iters or cfg.train.iters
        split = opt.expert_lr is not None or opt.expert_weight_decay is not None
        experts = [(n, p) for n, p in named if split and ".experts." in n]
        dense = [(n, p) for n, p in named if (n, p) not in experts]
        # Routed experts with their own peak lr: the same schedule, scaled end to end.
        scale = 1.0 if opt.expert_lr is None else opt.expert_lr / opt.lr
        expert_wd = opt.weight_decay if opt.expert_weight_decay is None else (
            opt.expert_weight_decay)
        for part, wd_on, mult in ((dense, opt.weight_decay, 1.0), (experts, expert_wd, scale)):
            decay = [p for n, p in part if not any(s in n for s in opt.no_decay)]
            no_decay = [p for n, p in part if any(s in n for s in opt.no_decay)]
            schedule = (opt.lr * mult, min_lr * mult, sched.warmup_iters, decay_iters,
                        sched.decay_style)
            for params, wd in ((decay, wd_on), (no_decay, 0.0)):
                if params:
                    groups.append({"params": params, "weight_decay": wd, "eps": opt.eps,
                                   "betas": tuple(opt.betas), "lr": 0.0,
                                   "clip": opt.clip_grad, "module": name})
                    schedules.append(schedule)
    return torch.optim.AdamW(groups), schedules


def _clip(optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter]) -> float:
    """Global norm; each module clipped with its own threshold against that norm."""
    clips = {g["clip"] for g in optimizer.param_groups}
    if len(clips) == 1:
        clip = clips.pop()
        if clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, clip))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    for group in optimizer.param_groups:
        if group["clip"] > 0:
            torch.nn.utils.clip_grads_with_norm_(group["params"], group["clip"], total)
    return float(total)


@cache
def _data(cfg_key: tuple[str, ...]) -> tuple:
    cfg = load_config(DIGITS, BASE + list(cfg_key))
    tokenizer = CharTokenizer()
    task, _ = build_datasets(cfg, tokenizer)
    return tokenizer, task


def reference_setup(overrides: tuple[str, ...] | list[str]
                    ) -> tuple[MimoConfig, object, Callable[[], torch.nn.Module]]:
    """The config, the data task and a builder of the whole model for ``BASE + overrides``
    (the vocabulary padded as the engine pads it, the tokenizer's placeholder ids). The
    model is as built, with the engine's attention core; :func:`reference_run` installs
    its own."""
    cfg = load_config(DIGITS, BASE + list(overrides))
    tokenizer, task = _data(tuple(overrides))
    vocab = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    return cfg, task, lambda: build_mimo_model(cfg, vocab, placeholders)


def frozen(cfg: MimoConfig, name: str) -> bool:
    """Whether ``modules.<m>.freeze`` freezes parameter ``name`` (as inside ``MimoModel``):
    every parameter of a module with ``true``; the encoder tower's (``modality_submodules.
    <m>.encoder.*``, not its projector) with ``"encoder"``."""
    freeze = cfg.modules[module_of(name)].freeze
    if freeze == "encoder":
        return name.split(".")[2] == "encoder"
    return freeze is True


def reference_run(overrides: tuple[str, ...], num_iters: int,
                  extra_objective: Callable[[torch.nn.Module], Callable[[dict], torch.Tensor]]
                  | None = None,
                  batch_at: Callable[[object, object, int, int], dict] | None = None,
                  start_from: dict[str, torch.Tensor] | None = None) -> ReferenceRun:
    """Train ``num_iters`` iterations of the ``BASE + overrides`` config in one process.

    Args:
        overrides: config overrides after ``BASE``.
        num_iters: iterations.
        extra_objective: given the model (before training), returns a function of the
            global batch, called after each forward, whose result is added to the loss
            sum before the division by the token count (e.g. MoE auxiliary losses).
        batch_at: ``(task, stream, iteration, global_batch_size) -> batch``, the global
            batch of an iteration (``None``: ``collate`` of the stream's next samples).
        start_from: parameter name -> value to start from instead of the initialisation
            (a fine-tune from earlier weights); every parameter must be given.
    """
    cfg, task, build = reference_setup(overrides)
    model = build()
    attention = install_reference_attention(model)
    num_layers = len(model.language_model.layers)
    if start_from is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start_from[n])
    for n, p in model.named_parameters():
        p.requires_grad_(not frozen(cfg, n))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer, schedules = _optimizer(cfg, model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stream = task.stream(cfg.train.seed)
    gbs = cfg.train.global_batch_size
    out = ReferenceRun([], [], [], [], {}, initial)
    extra = extra_objective(model) if extra_objective is not None else None
    for k in range(num_iters):
        batch = batch_at(task, stream, k, gbs) if batch_at is not None else collate(
            stream.samples(k * gbs, gbs), task.seq_length, pad_id=task.pad_id,
            image_shape=task.image_shape, audio_shape=task.audio_shape)
        optimizer.zero_grad(set_to_none=True)
        attention.doc_ids = batch.get("doc_ids")  # None: unpacked rows
        calls = attention.calls
        loss_sum, num_tokens, _ = model(batch)
        assert attention.calls == calls + num_layers, "a decoder layer bypassed attn.core"
        objective = loss_sum if extra is None else loss_sum + extra(batch)
        (objective / num_tokens).backward()
        out.num_zeros.append(sum(p.numel() if p.grad is None else int((p.grad == 0).sum())
                                 for p in params))
        out.grad_norms.append(_clip(optimizer, params))
        out.module_norms.append(_module_norms(model))
        for group, schedule in zip(optimizer.param_groups, schedules, strict=True):
            group["lr"] = lr_at(k, *schedule)
        optimizer.step()
        out.losses.append(float(loss_sum.detach() / num_tokens))
        out.num_tokens.append(float(num_tokens))
    out.weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# The digits task with packing on, over the parity schedule (tests.parity.PARITY).
PACKING = ["data.packing=true", "train.iters=12"]


def reference_packer(task: object, stream: object, gbs: int
                     ) -> Callable[[object, object, int, int], dict]:
    """An independent greedy packer for the plain loop (keeps its stream position):
    consecutive samples of ``stream`` in a row while they fit, ``gbs`` rows a batch.

    Returns:
        The ``batch_at`` argument of :func:`reference_run`.
    """
    kwargs = {"pad_id": task.pad_id, "image_shape": task.image_shape,
              "audio_shape": task.audio_shape}
    rows_at = packed_rows(task, stream, gbs)

    def batch_at(task_: object, stream_: object, k: int, gbs_: int) -> dict:
        return collate_packed(rows_at(), task.seq_length, **kwargs)

    return batch_at


def packed_rows(task: object, stream: object, gbs: int) -> Callable[[], list[list[dict]]]:
    """The greedy packing of :func:`reference_packer`: each call, the next ``gbs`` rows of
    consecutive samples of ``stream`` (a row takes samples while they fit)."""
    state = {"pos": 0}

    def fits(row: list, s: dict) -> bool:
        return sum(x["tokens"].numel() for x in row) + s["tokens"].numel() <= task.seq_length

    def rows_at() -> list[list[dict]]:
        rows: list[list] = [[]]
        while True:
            s = stream.samples(state["pos"], 1)[0]
            if rows[-1] and not fits(rows[-1], s):
                if len(rows) == gbs:
                    break
                rows.append([])
            rows[-1].append(s)
            state["pos"] += 1
        return rows

    return rows_at


def packed_reference_run(overrides: tuple[str, ...], num_iters: int) -> ReferenceRun:
    """:func:`reference_run` of ``overrides`` on the digits stream packed by
    :func:`reference_packer` (the task and its seed of ``PACKING``)."""
    cfg, task, _ = reference_setup(tuple(PACKING))
    return reference_run(overrides, num_iters, batch_at=reference_packer(
        task, task.stream(cfg.train.seed), cfg.train.global_batch_size))


def _module_norms(model: torch.nn.Module) -> dict[str, float]:
    sq: dict[str, float] = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            m = module_of(n)
            sq[m] = sq.get(m, 0.0) + float(p.grad.double().pow(2).sum())
    return {m: math.sqrt(v) for m, v in sq.items()}
