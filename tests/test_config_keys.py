"""No config key may be silently ignored: every accepted key changes something observable.

The keys are enumerated from the config dataclasses (``MimoConfig`` sections,
``modules.<m>.*``, ``modules.<m>.parallel.*`` and the per-module ``[optimizer]`` /
``[scheduler]`` overrides), so a new field fails :func:`test_every_key_has_a_probe`
until it gets a probe here (or, only if its effect needs a multi-rank run, an entry in
``ALLOWED``). A probe applies one override (on top of a small one-process config and a
probe-specific context) and shows that one of these changes, or that the value is
rejected with a ``ValueError`` naming the key:

* ``built``: ``setup_mimo`` on one process: parameter names/shapes/values, optimizer
  types and param groups, each module's clipping of unit gradients, each module's loss
  scaler over a fixed overflow pattern, lr/weight decay over 12 scheduler steps, the
  first training batch, the number of validation steps, the module groups' timeout;
* ``step``: one training step (which pipeline schedule ran, loss, grad norm);
* ``plan``: the layout plan and each module's layers per stage;
* ``memory``: the per-rank memory estimate ``mimotron plan`` prints;
* ``run``: a 2-3 iteration one-process ``train_mimo`` in a fresh directory: the files it
  writes, the metrics records, the console lines, the checkpoint saves, an exception;
* ``rerun``: the same run twice in one directory: whether the second one is refused, and
  the files left.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import mimotron.checkpoint.manager as manager_module
import mimotron.training.step as step_module
from mimotron.config import (
    MimoConfig,
    load_config,
)
from mimotron.estimate.memory import estimate_memory
from mimotron.parallel.layout import check_layout
from mimotron.parallel.virtual_pipeline import stage_layers
from mimotron.runtime import init_runtime
from mimotron.training.loop import run_training, setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.metrics import TrainingDivergedError
from mimotron.training.step import default_forward_step
from tests.common import DIGITS, ONE_RANK, SMALL_MODEL, config_keys

BASE = [*SMALL_MODEL, *ONE_RANK, "train.iters=8", "eval.iters=1", "eval.interval=1000",
        "log.progress=false", "log.dir='logs'"]
NONCOLOCATED = [f"modules.{m}.parallel.{k}={v}"
                for i, m in enumerate(("vision", "audio", "language"))
                for k, v in (("data", 1), ("rank_offset", i))]
FP16 = ["train.precision=fp16"]
MOCK = ["data.dataset=mock"]
RUN = ["train.iters=2"]
SAVE = [*RUN, "checkpoint.interval=1"]
PROFILE = [*RUN, "profile.enabled=true", "profile.start=1", "profile.end=1"]
# Only for keys whose effect needs more than one rank.
ALLOWED = {
    # ZeRO-1 needs a DP group of >= 2 ranks (one replica: nothing to shard); its effect
    # (per-rank state / DP, bitwise-equal training) is asserted by
    # tests/test_sharded_optimizer.py.
    "modules.<m>.parallel.shard_optimizer",
    # Overlap needs a DP group of >= 2 ranks; its effect (buckets launched during the
    # backward, bitwise-equal training) is asserted by tests/test_overlap_grad_reduce.py.
    "train.overlap_grad_reduce",
    # Only ZeRO-1 modules (DP >= 2) gather parameters; its effect (a gather pending
    # after the step, bitwise-equal training) is asserted by tests/test_overlap_zero.py.
    "train.overlap_param_gather",
}

# [optimizer] / [scheduler] probes: (key=value, observer, context), the key relative to
# its table; used both globally and per module (``modules.vision.optimizer.<key>``).
OPTIM_PROBES: dict[str, tuple[str, str, list[str]]] = {
    "name": ("name='sgd'", "built", []),
    "lr": ("lr=0.01", "built", []),
    "min_lr": ("min_lr=1e-4", "built", []),
    "weight_decay": ("weight_decay=0.3", "built", []),
    "betas": ("betas=[0.8, 0.9]", "built", []),
    "eps": ("eps=1e-6", "built", []),
    "momentum": ("momentum=0.5", "built", ["name='sgd'"]),
    "clip_grad": ("clip_grad=0.01", "built", []),
    "no_decay": ("no_decay=['norm']", "built", []),
    "initial_loss_scale": ("initial_loss_scale=512", "built", FP16),
    "min_loss_scale": ("min_loss_scale=4096", "built", FP16),
    "loss_scale_window": ("loss_scale_window=2", "built", FP16),
    "hysteresis": ("hysteresis=1", "built", FP16),
}
SCHED_PROBES: dict[str, tuple[str, str, list[str]]] = {
    "warmup_iters": ("warmup_iters=4", "built", []),
    "decay_style": ("decay_style='linear'", "built", []),
    "decay_iters": ("decay_iters=4", "built", []),
    "min_lr": ("min_lr=1e-4", "built", []),
    "start_weight_decay": ("start_weight_decay=0.2", "built", ["weight_decay_style='linear'"]),
    "end_weight_decay": ("end_weight_decay=0.2", "built", ["weight_decay_style='linear'"]),
    "weight_decay_style": ("weight_decay_style='cosine'", "built",
                           ["start_weight_decay=0.0", "end_weight_decay=0.2",
                            "weight_decay_style='linear'"]),
}


def _table_probes() -> dict[str, tuple[list[str], str, list[str]]]:
    out = {}
    for table, probes in (("optimizer", OPTIM_PROBES), ("scheduler", SCHED_PROBES)):
        for key, (item, kind, ctx) in probes.items():
            glob = [c if c in FP16 else f"{table}.{c}" for c in ctx]
            out[f"{table}.{key}"] = ([f"{table}.{item}"], kind, glob)
            if table == "scheduler" and key == "min_lr":
                continue  # not a per-module key (the module's optimizer.min_lr is)
            per = [c if c in FP16 else f"modules.vision.optimizer.{c}" for c in ctx]
            out[f"modules.<m>.optimizer.{key}"] = ([f"modules.vision.optimizer.{item}"],
                                                   kind, per)
    return out


MOE = ["modules.language.num_experts=4"]
LORA = ["modules.language.lora.rank=2"]


def _par(item: str) -> list[str]:
    return [f"modules.language.parallel.{item}"]


# key -> (overrides, observer, context); observer "error:<observer>" = rejected.
PROBES: dict[str, tuple[list[str], str, list[str]]] = {
    "name": (["name='other'"], "run", [*RUN, "log.dir=''"]),
    "modules.<m>.kind": (["modules.vision.kind='audio'"], "error:built", []),
    "modules.<m>.hidden_size": (["modules.vision.hidden_size=16"], "built", []),
    "modules.<m>.num_layers": (["modules.vision.num_layers=2"], "built", []),
    "modules.<m>.num_heads": (["modules.vision.num_heads=2"], "step", []),
    "modules.<m>.ffn_hidden_size": (["modules.vision.ffn_hidden_size=48"], "built", []),
    "modules.<m>.projector_hidden_size": (["modules.vision.projector_hidden_size=16"],
                                          "built", []),
    "modules.<m>.image_size": (["modules.vision.image_size=4"], "built", MOCK),
    "modules.<m>.patch_size": (["modules.vision.patch_size=4"], "built", MOCK),
    "modules.<m>.in_channels": (["modules.vision.in_channels=3"], "built", MOCK),
    "modules.<m>.num_freq_bins": (["modules.audio.num_freq_bins=65"], "built", MOCK),
    "modules.<m>.num_frames": (["modules.audio.num_frames=8"], "built", MOCK),
    "modules.<m>.num_audio_tokens": (["modules.audio.num_audio_tokens=8"], "built", []),
    "modules.<m>.freeze": (["modules.vision.freeze=true"], "built", []),
    # Recompute changes no number (tests/test_recompute.py: parity, kept bytes); what it
    # changes that one process can see is the activation memory the plan estimates.
    "modules.<m>.recompute": (["modules.language.recompute='full'"], "memory", []),
    "modules.<m>.recompute_num_layers": (["modules.language.recompute_num_layers=1"],
                                         "memory", ["modules.language.recompute='full'"]),
    # The hf_path keys' effects (a loaded model, its sizes, its options) need Hugging
    # Face folders: tests/test_hf_training.py. Here: a folder that is not there, and
    # the HF-only options on a module without hf_path, are refused.
    "modules.<m>.hf_path": (["modules.language.hf_path='no-such-hf-folder'"], "error:built",
                            []),
    # One vision-language folder's modules: tests/test_hf_vlm.py.
    "hf_path": (["hf_path='no-such-hf-folder'"], "error:built", []),
    "modules.<m>.vision_feature_layer": (["modules.vision.vision_feature_layer=-1"],
                                         "error:built", []),
    "modules.<m>.vision_feature_select_strategy": (
        ["modules.vision.vision_feature_select_strategy='full'"], "error:built", []),
    # Native-resolution slots: tests/test_qwen_vl_engine.py.
    "modules.<m>.max_pixels": (["modules.vision.max_pixels=64"], "error:built", []),
    "modules.<m>.downsample_factor": (["modules.audio.downsample_factor=2"], "error:built", []),
    "modules.<m>.downsample_mode": (["modules.audio.downsample_mode='stack'"], "error:built",
                                    []),
    # Mixture of experts: parameters (built) or routing / aux losses (one step's numbers).
    "modules.<m>.num_experts": (["modules.language.num_experts=4"], "built", []),
    "modules.<m>.top_k": (["modules.language.top_k=1"], "step", MOE),
    "modules.<m>.moe_ffn_hidden_size": (["modules.language.moe_ffn_hidden_size=32"], "built",
                                        MOE),
    "modules.<m>.num_shared_experts": (["modules.language.num_shared_experts=1"], "built", MOE),
    "modules.<m>.moe_shared_expert_gate": (["modules.language.moe_shared_expert_gate=true"],
                                           "built",
                                           [*MOE, "modules.language.num_shared_experts=1"]),
    "modules.<m>.moe_layer_freq": (["modules.language.moe_layer_freq=2"], "built", MOE),
    "modules.<m>.moe_router_score": (["modules.language.moe_router_score='sigmoid'"], "step",
                                     MOE),
    "modules.<m>.moe_norm_topk_prob": (["modules.language.moe_norm_topk_prob=false"], "step",
                                       MOE),
    "modules.<m>.moe_aux_loss_coeff": (["modules.language.moe_aux_loss_coeff=1.0"], "step",
                                       MOE),
    "modules.<m>.moe_z_loss_coeff": (["modules.language.moe_z_loss_coeff=0.1"], "step", MOE),
    "modules.<m>.parallel.tensor": (_par("tensor=2"), "plan", NONCOLOCATED),
    "modules.<m>.parallel.pipeline": (_par("pipeline=2"), "plan", NONCOLOCATED),
    "modules.<m>.parallel.data": (_par("data=2"), "plan", NONCOLOCATED),
    "modules.<m>.parallel.context": (_par("context=2"), "plan", NONCOLOCATED),
    # FSDP2 shards the module's state over its DP group: the estimate holds 1 / dp of it
    # (training with it: tests/test_fsdp.py).
    "modules.<m>.parallel.fsdp": (_par("fsdp=true"), "memory",
                                  [*NONCOLOCATED, "modules.language.parallel.data=2"]),
    "modules.<m>.parallel.expert": (_par("expert=2"), "error:plan", NONCOLOCATED),
    "modules.<m>.parallel.expert_tensor": (_par("expert_tensor=2"), "error:plan",
                                           NONCOLOCATED),
    "modules.<m>.parallel.rank_offset": (["modules.vision.parallel.rank_offset=1",
                                          "modules.audio.parallel.rank_offset=0"], "plan",
                                         NONCOLOCATED),
    "modules.<m>.parallel.sequence_parallel": (_par("sequence_parallel=true"), "error:plan",
                                               NONCOLOCATED),
    "modules.<m>.parallel.layers_per_stage": (_par("layers_per_stage=[1, 2]"), "plan",
                                              [*NONCOLOCATED, *_par("pipeline=2"),
                                               "modules.language.num_layers=3"]),
    "modules.<m>.parallel.virtual_pipeline": (_par("virtual_pipeline=2"), "plan",
                                              [*NONCOLOCATED, *_par("pipeline=2"),
                                               "modules.language.num_layers=4"]),
    "modules.<m>.lora.rank": (["modules.language.lora.rank=2"], "built", []),
    "modules.<m>.lora.alpha": (["modules.language.lora.alpha=4"], "step", LORA),
    "modules.<m>.lora.dropout": (["modules.language.lora.dropout=0.5"], "step", LORA),
    "modules.<m>.lora.targets": (["modules.language.lora.targets=['attn.wq']"], "built", LORA),
    "data.dataset": (["data.dataset='mock'"], "built", []),
    "data.seq_length": (["data.seq_length=96"], "built", []),
    "data.train_fraction": (["data.train_fraction=0.5"], "built", []),
    "data.p_image": (["data.p_image=5.0"], "built", []),
    "data.p_audio": (["data.p_audio=5.0"], "built", []),
    "data.p_both": (["data.p_both=5.0"], "built", []),
    "data.p_text": (["data.p_text=5.0"], "built", []),
    "data.image_shift": (["data.image_shift=3"], "built", []),
    "data.mock_num_samples": (["data.mock_num_samples=64"], "built", [*MOCK, "eval.iters=0"]),
    # The llava keys are refused with the synthetic datasets (their effect on a llava run
    # is asserted by tests/test_llava_training.py); num_workers shows in the banner.
    "data.path": (["data.path='x.jsonl'"], "error:built", []),
    "data.valid_path": (["data.valid_path='x.jsonl'"], "error:built", []),
    "data.root": (["data.root='x'"], "error:built", []),
    "data.allow_outside_root": (["data.allow_outside_root=true"], "error:built", []),
    "data.tokenizer": (["data.tokenizer='x'"], "error:built", []),
    "data.chat_template": (["data.chat_template='vicuna'"], "error:built", []),
    "data.skip_bad_samples": (["data.skip_bad_samples=true"], "error:built", []),
    "data.system_prompt": (["data.system_prompt='x'"], "error:built", []),
    "data.index_dir": (["data.index_dir='x'"], "error:built", []),
    "data.ignore_keys": (["data.ignore_keys=['video']"], "error:built", []),
    "data.allow_large_vocab": (["data.allow_large_vocab=true"], "error:built", []),
    "data.num_workers": (["data.num_workers=2"], "run", ["log.progress=true"]),
    "data.packing": (["data.packing=true"], "built", []),  # the first training batch
    # Who holds which sample and item of the first training batch (one rank: the order of
    # the micro-batches' samples; the encoder's batch of items); their effect across
    # ranks (even work, training like the plain loop) is asserted by tests/test_balance.py.
    "data.balance_tokens": (["data.balance_tokens=true"], "built", []),
    "data.balance_encoders": (["data.balance_encoders=true"], "built", []),
    "data.max_images_per_sample": (["data.max_images_per_sample=2"], "error:built", []),
    "train.iters": (["train.iters=12"], "built", []),
    "train.global_batch_size": (["train.global_batch_size=32"], "built", []),
    "train.micro_batch_size": (["train.micro_batch_size=4"], "built", []),
    "train.seed": (["train.seed=7"], "built", []),
    "train.precision": (["train.precision='fp16'"], "built", []),
    # fp32 residual stream under bf16: more bytes kept per layer (and a different loss).
    "train.fp32_residual_connection": (["train.fp32_residual_connection=true"], "memory",
                                       ["train.precision='bf16'"]),
    "train.schedule": (["train.schedule='no_pipelining'"], "step", []),
    "train.exit_interval": (["train.exit_interval=1"], "run", RUN),
    "train.exit_duration_mins": (["train.exit_duration_mins=1e-9"], "run", RUN),
    # Every fp16 step overflows at this scale: max_skipped=1 stops the run.
    "train.max_skipped": (["train.max_skipped=1"], "run",
                          [*RUN, *FP16, "optimizer.initial_loss_scale=1e30"]),
    "train.pg_timeout_s": (["train.pg_timeout_s=77"], "built", []),
    "train.grad_bucket_mb": (["train.grad_bucket_mb=0"], "error:built", []),
    "train.overwrite": (["train.overwrite=true"], "rerun", RUN),
    # Refused off colocated layouts; its effect (one encoder forward per step, training
    # like the plain loop) is asserted by tests/test_encoder_batching.py.
    "train.encoder_batching": (["train.encoder_batching=true"], "error:plan", NONCOLOCATED),
    # Which encoders run ahead (the layout's plans); their training like the plain loop
    # is asserted by tests/test_frozen_ahead.py.
    "train.frozen_ahead": (["train.frozen_ahead=false"], "plan",
                           [*NONCOLOCATED, "modules.vision.freeze=true"]),
    "eval.interval": (["eval.interval=1"], "run", RUN),
    "eval.iters": (["eval.iters=2"], "built", []),
    "checkpoint.dir": (["checkpoint.dir='ck'"], "run", SAVE),
    "checkpoint.interval": (["checkpoint.interval=1"], "run", RUN),
    "checkpoint.load": (["checkpoint.load='missing'"], "error:built", []),
    # Their effect (a new run from the weights, optimizer state or schedule of another
    # run's checkpoint) is asserted by tests/test_finetune.py.
    "checkpoint.pretrained": (["checkpoint.pretrained='missing'"], "error:built", []),
    "checkpoint.pretrained_optimizer": (["checkpoint.pretrained_optimizer=true"],
                                        "error:built", []),
    "checkpoint.pretrained_schedule": (["checkpoint.pretrained_schedule=true"], "error:built",
                                       []),
    "checkpoint.async_save": (["checkpoint.async_save=true"], "run", SAVE),
    "checkpoint.keep": (["checkpoint.keep=1"], "run", [*SAVE, "train.iters=3"]),
    "log.dir": (["log.dir='elsewhere'"], "run", RUN),
    "log.interval": (["log.interval=2"], "run", [*RUN, "log.interval=1"]),
    "log.tensorboard": (["log.tensorboard=true"], "run", RUN),
    # Offline (WANDB_MODE, tests/conftest.py): the run's folder under log.dir/wandb.
    "log.wandb": (["log.wandb=true"], "run", RUN),
    "log.wandb_project": (["log.wandb_project='x'"], "error:built", []),
    "log.progress": (["log.progress=true"], "run", RUN),
    "profile.enabled": (["profile.enabled=true"], "run",
                        [*RUN, "profile.start=1", "profile.end=1"]),
    "profile.start": (["profile.start=2"], "run", [*PROFILE, "profile.end=2"]),
    "profile.end": (["profile.end=2"], "run", PROFILE),
    "profile.ranks": (["profile.ranks=[1]"], "error:run", PROFILE),
    **_table_probes(),
    # Expert param groups exist only on a module with experts (the language model).
    "optimizer.expert_lr": (["optimizer.expert_lr=0.01"], "built", MOE),
    "optimizer.expert_weight_decay": (["optimizer.expert_weight_decay=0.3"], "built", MOE),
    "modules.<m>.optimizer.expert_lr": (["modules.language.optimizer.expert_lr=0.01"], "built",
                                        MOE),
    "modules.<m>.optimizer.expert_weight_decay": (
        ["modules.language.optimizer.expert_weight_decay=0.3"], "built", MOE),
}


def test_every_key_has_a_probe() -> None:
    keys = config_keys()
    assert "optimizer.clip_grad" in keys and "modules.<m>.parallel.tensor" in keys
    assert not set(PROBES) & ALLOWED
    assert sorted(keys - set(PROBES) - ALLOWED) == [], "keys without a probe"
    assert sorted((set(PROBES) | ALLOWED) - keys) == [], "probes of keys that do not exist"


# ---- observers -----------------------------------------------------------------------


def _built(cfg: MimoConfig) -> Any:
    run = setup_mimo(cfg, init_runtime())
    model = [(n, tuple(p.shape), round(p.double().sum().item(), 9), p.requires_grad)
             for n, p in run.model.named_parameters()]
    opt = run.optimizer
    for p in run.model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.clip_grad_norm()
    clipped = {n: [round(p.grad.sum().item(), 9) for _, p in i.params]
               for n, i in opt.module_infos.items() if i.is_active}
    scales = {}
    for n, info in opt.module_infos.items():
        scaler = copy.deepcopy(info.loss_scaler)
        trace = []
        for found_inf in [False] * 3 + [True] * 12:
            scaler.update(found_inf)
            trace.append(float(scaler.scale))
        scales[n] = (type(scaler).__name__, trace)
    groups = [(g["module"], type(i.optimizer).__name__, len(g["params"]),
               {k: g.get(k) for k in ("lr", "weight_decay", "betas", "eps", "momentum")})
              for i in opt.module_infos.values() if i.is_active for g in i.optimizer.param_groups]
    sched = []
    for _ in range(12):
        for s in run.schedulers.values():
            s.step()
        sched.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
    batch = next(run.train_data_iterator)
    batch_fp = [(m, k, tuple(v.shape), round(v.double().sum().item(), 6))
                for mb in batch for m, t in sorted(mb.items()) for k, v in sorted(t.items())
                if isinstance(v, torch.Tensor)]
    valid_steps = sum(1 for _ in run.valid_data_iterator())
    timeouts = sorted(str(g.timeout) for g in run.infra.grids.values())
    return model, clipped, scales, groups, sched, (len(batch), batch_fp), valid_steps, timeouts


def _step(cfg: MimoConfig) -> Any:
    run = setup_mimo(cfg, init_runtime())
    # Which plan the step ran: 1F1B (pipelined) or micro-batch after micro-batch.
    with mock.patch.object(step_module, "rank_actions", wraps=step_module.rank_actions) as plans:
        loss, skipped, norm, _ = train_step_mimo(
            default_forward_step, run.train_data_iterator, run.model, run.optimizer,
            run.schedulers, run.global_state, run.communicator, infra=run.infra)
    return [c.args[3] for c in plans.call_args_list], loss["loss"], skipped, norm


def _plan(cfg: MimoConfig) -> Any:
    layout = check_layout(cfg)
    stages = {n: stage_layers(m.num_layers, m.parallel.pipeline, m.parallel.layers_per_stage)
              for n, m in cfg.modules.items()}
    return repr(layout), stages


def _run(cfg: MimoConfig) -> Any:
    out, err = io.StringIO(), io.StringIO()
    saves: list[bool] = []
    real_save = manager_module.save_checkpoint

    def save(*args: Any, **kwargs: Any) -> Any:
        saves.append(bool(kwargs.get("async_save")))
        return real_save(*args, **kwargs)

    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        failure = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(manager_module, "save_checkpoint", save):
            try:
                summary = run_training(cfg, init_runtime())
            except TrainingDivergedError as exc:  # the intended effect of train.max_skipped
                failure, summary = exc, {}
        files = sorted("tfevents" if "tfevents" in p.name else str(p)
                       for p in Path().rglob("*") if p.is_file())
        metrics = [sorted(json.loads(line)) + [json.loads(line).get("iteration")]
                   for p in Path().rglob("metrics.jsonl") for line in p.read_text().splitlines()]
    lines = len((out.getvalue() + err.getvalue()).splitlines())
    return (files, metrics, lines, saves, type(failure).__name__, summary.get("iteration"),
            sorted(summary.get("eval") or {}))


def _rerun(cfg: MimoConfig) -> Any:
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run_training(cfg, init_runtime())
        try:
            run_training(cfg, init_runtime())
            refused = None
        except ValueError as exc:  # a fresh start over the first run
            refused = type(exc).__name__
        files = sorted(re.sub(r"previous-[^/]+", "previous-*", str(p))
                       for p in Path().rglob("*") if p.is_file())
    return refused, files


def _memory(cfg: MimoConfig) -> Any:
    return estimate_memory(cfg, check_layout(cfg), 64)


OBSERVERS = {"built": _built, "step": _step, "plan": _plan, "memory": _memory, "run": _run,
             "rerun": _rerun}


def _observe(kind: str, overrides: list[str]) -> Any:
    return OBSERVERS[kind](load_config(DIGITS, BASE + overrides))


@pytest.fixture(scope="module")
def baselines() -> dict[tuple[str, ...], Any]:
    """Observations of the probe contexts alone, shared by the probes (deterministic)."""
    return {}


@pytest.mark.parametrize("key", sorted(PROBES))
def test_key_changes_something_observable(key: str, baselines: dict) -> None:
    overrides, kind, context = PROBES[key]
    observer = kind.removeprefix("error:")
    cache_key = (observer, *context)
    if cache_key not in baselines:  # the context alone is valid
        baselines[cache_key] = _observe(observer, context)
    if kind.startswith("error:"):
        with pytest.raises(ValueError, match=key.rsplit(".", 1)[-1]):
            _observe(observer, context + overrides)
        return
    assert baselines[cache_key] != _observe(kind, context + overrides), key
