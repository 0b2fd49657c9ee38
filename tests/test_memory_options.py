"""Every option that changes a rank's memory changes ``mimotron plan``'s estimate.

Every config key (enumerated from the dataclasses, as ``tests/test_config_keys.py``
does) is in one of three tables, so a new key fails :func:`test_every_key_is_classified`
until it is placed:

* :data:`PROBES`: flipping the key moves one part of the estimate (weights, gradients,
  optimizer state, activations, buckets, gathers) of one module, and that module's
  per-rank total, in the expected direction (largest over the module's ranks);
* :data:`THROUGH`: the key reaches memory only through keys probed here (a Hugging
  Face folder's sizes, the tokenizer's vocabulary);
* :data:`NO_EFFECT`: the key changes values, schedules, host-side work or files, not
  what a device holds at the peak of a step; each with the reason.
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.estimate.memory import estimate_memory
from mimotron.parallel.layout import check_layout
from tests.common import DIGITS, colocated, config_keys, noncolocated, par

LM = "language"
MOE = ["modules.language.num_experts=4", "modules.language.top_k=2"]
NC = noncolocated({}, {}, {"data": 2})  # the demo layout: vision | audio | language DP 2
PP2 = noncolocated({}, {}, {"pipeline": 2}) + ["modules.language.num_layers=4"]
# Gradient buffers that outgrow the activations: a wider model, 2 samples per step,
# 0.25 MiB buckets (so one bucket holds less than the gradients).
BUCKETS = NC + ["modules.language.hidden_size=256", "train.micro_batch_size=2",
                "train.global_batch_size=4", "train.grad_bucket_mb=0.25"]

# key: (base overrides, the flip, module, part of the estimate, +1 up / -1 down)
PROBES: dict[str, tuple[list[str], list[str], str, str, int]] = {
    "modules.<m>.hidden_size": (NC, ["modules.language.hidden_size=256"], LM, "weights", 1),
    "modules.<m>.num_layers": (NC, ["modules.language.num_layers=4"], LM, "activations", 1),
    "modules.<m>.ffn_hidden_size": (NC, ["modules.language.ffn_hidden_size=512"], LM,
                                    "activations", 1),
    "modules.<m>.projector_hidden_size": (NC, ["modules.vision.projector_hidden_size=256"],
                                          "vision", "weights", 1),
    "modules.<m>.image_size": (NC + ["data.seq_length=128"], ["modules.vision.image_size=16"],
                               "vision", "activations", 1),
    "modules.<m>.patch_size": (NC, ["modules.vision.patch_size=4"], "vision", "activations",
                               -1),
    "modules.<m>.in_channels": (NC, ["modules.vision.in_channels=3"], "vision", "weights", 1),
    "modules.<m>.num_frames": (NC, ["modules.audio.num_frames=32"], "audio", "activations",
                               1),
    "modules.<m>.num_freq_bins": (NC, ["modules.audio.num_freq_bins=64"], "audio", "weights",
                                  -1),
    "modules.<m>.num_audio_tokens": (NC, ["modules.audio.num_audio_tokens=8"], "audio",
                                     "activations", 1),
    "modules.<m>.freeze": (NC, ["modules.vision.freeze=true"], "vision", "grads", -1),
    # In 1F1B a frozen encoder holds the outputs of its forwards in flight; running ahead
    # it holds the whole step's until the step's sends complete.
    "train.frozen_ahead": (NC + ["modules.vision.freeze=true", "train.micro_batch_size=2"],
                           ["train.frozen_ahead=false"], "vision", "activations", -1),
    # Only the adapters train: fewer gradients; fewer targets, fewer still.
    "modules.<m>.lora.rank": (NC, ["modules.language.lora.rank=8"], LM, "grads", -1),
    "modules.<m>.lora.targets": (NC + ["modules.language.lora.rank=8"],
                                 ["modules.language.lora.targets=['attn.wq']"], LM, "grads", -1),
    "modules.<m>.recompute": (NC, ["modules.language.recompute='full'"], LM, "activations",
                              -1),
    "modules.<m>.recompute_num_layers": (NC + ["modules.language.recompute='full'"],
                                         ["modules.language.recompute_num_layers=1"], LM,
                                         "activations", 1),
    "modules.<m>.num_experts": (NC + MOE, ["modules.language.num_experts=8"], LM, "weights",
                                1),
    "modules.<m>.top_k": (NC + MOE, ["modules.language.top_k=3"], LM, "activations", 1),
    "modules.<m>.moe_ffn_hidden_size": (NC + MOE, ["modules.language.moe_ffn_hidden_size=64"],
                                        LM, "weights", -1),
    "modules.<m>.num_shared_experts": (NC + MOE, ["modules.language.num_shared_experts=1"],
                                       LM, "activations", 1),
    "modules.<m>.moe_shared_expert_gate": (NC + MOE + ["modules.language.num_shared_experts=1"],
                                           ["modules.language.moe_shared_expert_gate=true"],
                                           LM, "activations", 1),
    "modules.<m>.moe_layer_freq": (NC + MOE, ["modules.language.moe_layer_freq=2"], LM,
                                   "weights", -1),
    "modules.<m>.parallel.tensor": (NC, par(LM, tensor=2), LM, "activations", -1),
    "modules.<m>.parallel.pipeline": (NC, par(LM, pipeline=2), LM, "weights", -1),
    "modules.<m>.parallel.data": (noncolocated({}, {}, {}), par(LM, data=2), LM,
                                  "activations", -1),
    "modules.<m>.parallel.context": (NC, par(LM, context=2), LM, "activations", -1),
    "modules.<m>.parallel.expert": (colocated(2) + MOE, par(LM, expert=2), LM, "weights", -1),
    "modules.<m>.parallel.expert_tensor": (colocated(2) + MOE, par(LM, expert_tensor=2), LM,
                                           "weights", -1),
    "modules.<m>.parallel.sequence_parallel": (NC + par(LM, tensor=2),
                                               par(LM, sequence_parallel="true"), LM,
                                               "activations", -1),
    "modules.<m>.parallel.shard_optimizer": (NC, par(LM, shard_optimizer="true"), LM,
                                             "optimizer", -1),
    "modules.<m>.parallel.fsdp": (NC, par(LM, fsdp="true"), LM, "weights", -1),
    "modules.<m>.parallel.virtual_pipeline": (PP2, par(LM, virtual_pipeline=2), LM,
                                              "activations", 1),
    "modules.<m>.parallel.layers_per_stage": (PP2, ["modules.language.parallel."
                                                    "layers_per_stage=[3,1]"], LM,
                                              "activations", 1),
    "train.micro_batch_size": (NC, ["train.micro_batch_size=32"], LM, "activations", 1),
    # One micro-batch per step, then two: stage 0 of PP 2 holds both.
    "train.global_batch_size": (PP2 + ["train.global_batch_size=16"],
                                ["train.global_batch_size=32"], LM, "activations", 1),
    "train.precision": (NC, ["train.precision=bf16"], LM, "activations", -1),
    "train.fp32_residual_connection": (NC + ["train.precision=bf16"],
                                       ["train.fp32_residual_connection=true"], LM,
                                       "activations", 1),
    "train.schedule": (PP2, ["train.schedule='no_pipelining'"], LM, "activations", -1),
    "train.encoder_batching": (colocated(2), ["train.encoder_batching=true"], "vision",
                               "activations", 1),
    "train.overlap_grad_reduce": (BUCKETS, ["train.overlap_grad_reduce=true"], LM,
                                  "reduce_bucket", 1),
    "train.overlap_param_gather": (BUCKETS + par(LM, shard_optimizer="true"),
                                   ["train.overlap_param_gather=true"], LM, "param_gather", 1),
    "train.grad_bucket_mb": (BUCKETS, ["train.grad_bucket_mb=4"], LM, "reduce_bucket", 1),
    "data.seq_length": (NC, ["data.seq_length=128"], LM, "activations", 1),
    "optimizer.name": (NC, ["optimizer.name='sgd'"], LM, "optimizer", -1),
    "optimizer.momentum": (NC + ["optimizer.name='sgd'"], ["optimizer.momentum=0.9"], LM,
                           "optimizer", 1),
    "modules.<m>.optimizer.name": (NC, ["modules.language.optimizer.name='sgd'"], LM,
                                   "optimizer", -1),
    "modules.<m>.optimizer.momentum": (NC + ["modules.language.optimizer.name='sgd'"],
                                       ["modules.language.optimizer.momentum=0.9"], LM,
                                       "optimizer", 1),
}

THROUGH: dict[str, str] = {
    "modules.<m>.kind": "the module's architecture, through its size keys probed here",
    "modules.<m>.hf_path": "config.json's sizes fill the size keys probed here",
    "hf_path": "a vision-language folder's modules, each through modules.<m>.hf_path",
    "modules.<m>.vision_feature_layer": "Hugging Face vision: the layers kept (num_layers)",
    "modules.<m>.vision_feature_select_strategy": "Hugging Face vision: the class token "
                                                  "in the output tokens (image_size, "
                                                  "patch_size)",
    "modules.<m>.max_pixels": "Qwen-VL vision: the token slots per image "
                              "(num_output_tokens)",
    "modules.<m>.downsample_factor": "Hugging Face audio: the output tokens "
                                     "(num_audio_tokens)",
    "modules.<m>.downsample_mode": "Hugging Face audio: stacked frames widen the projector "
                                   "input (projector weights, from the built module)",
    "data.dataset": "shapes come from data.seq_length and the tokenizer's vocabulary",
    "data.tokenizer": "llava: the vocabulary (embedding and head rows) of the built model",
    "data.max_images_per_sample": "llava only: the vision encoder's inputs per sample "
                                  "(tests/test_llava_multi_image.py checks the estimate)",
}

_VALUES = "values the optimizer computes with; its state per parameter is unchanged"
_SCHEDULE = "a schedule of values over iterations"
_ROUTING = "routing arithmetic: a per-token scalar at most"
_HOST = "host-side work or files, not device memory"
_RUN = "run control"
NO_EFFECT: dict[str, str] = {
    **{f"{p}.{k}": _VALUES for p in ("optimizer", "modules.<m>.optimizer")
       for k in ("lr", "min_lr", "weight_decay", "betas", "eps", "clip_grad",
                 "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
                 "no_decay", "expert_lr", "expert_weight_decay") if f"{p}.{k}" != (
                     "modules.<m>.optimizer.min_lr")},
    "modules.<m>.optimizer.min_lr": _VALUES,
    "modules.<m>.lora.alpha": "the adapters' scale: a value, not a size",
    "modules.<m>.lora.dropout": "a mask on the adapters' input, freed with the batch (not "
                                "estimated)",
    **{f"scheduler.{k}": _SCHEDULE for k in ("warmup_iters", "decay_iters", "decay_style",
                                             "min_lr", "start_weight_decay",
                                             "end_weight_decay", "weight_decay_style")},
    **{f"modules.<m>.optimizer.{k}": _SCHEDULE
       for k in ("warmup_iters", "decay_iters", "decay_style", "start_weight_decay",
                 "end_weight_decay", "weight_decay_style")},
    **{f"modules.<m>.{k}": _ROUTING for k in ("moe_router_score", "moe_norm_topk_prob",
                                              "moe_aux_loss_coeff", "moe_z_loss_coeff")},
    "modules.<m>.num_heads": "fused attention keeps no per-head scores; only its "
                             "log-sum-exp (4 bytes per head and token) does, left out",
    "modules.<m>.parallel.rank_offset": "where a block starts, not what a rank holds",
    "data.balance_tokens": "which samples share a micro-batch: every row is seq_length "
                           "long either way",
    "data.balance_encoders": "which replica encodes which item: a replica takes at most its "
                             "slice's item slots of a micro-batch, what the estimate holds",
    "data.packing": "packed rows attend within their documents with no mask, so a layer "
                    "keeps what it keeps unpacked (per-document RoPE rows, 4 bytes per "
                    "token and head dimension a forward, left out)",
    **{f"data.{k}": "which samples carry media: the estimate holds a full micro-batch of "
                    "every encoder (the peak)" for k in ("p_image", "p_audio", "p_both",
                                                          "p_text")},
    **{f"data.{k}": _HOST for k in ("train_fraction", "image_shift", "mock_num_samples",
                                    "num_workers", "path", "valid_path", "index_dir", "root",
                                    "allow_outside_root", "skip_bad_samples",
                                    "system_prompt", "ignore_keys", "chat_template")},
    "data.allow_large_vocab": "lets a larger vocabulary through the check; the estimate "
                              "counts the vocabulary the tokenizer has either way",
    **{f"eval.{k}": "evaluation runs forward only, keeping nothing for backward: below "
                    "the training peak" for k in ("interval", "iters")},
    **{f"checkpoint.{k}": _HOST for k in ("async_save", "dir", "interval", "keep", "load",
                                          "pretrained", "pretrained_optimizer",
                                          "pretrained_schedule")},
    **{f"log.{k}": _HOST for k in ("dir", "interval", "progress", "tensorboard", "wandb",
                                   "wandb_project")},
    **{f"profile.{k}": _HOST for k in ("enabled", "start", "end", "ranks")},
    "name": _HOST,
    **{f"train.{k}": _RUN for k in ("iters", "seed", "max_skipped", "pg_timeout_s",
                                    "exit_interval", "exit_duration_mins", "overwrite")},
}


def test_every_key_is_classified() -> None:
    tables = [set(PROBES), set(THROUGH), set(NO_EFFECT)]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    classified = set().union(*tables)
    keys = config_keys()
    assert keys - classified == set(), "unclassified: place each in PROBES, THROUGH or NO_EFFECT"
    assert classified - keys == set(), "no longer config keys"


def _module_max(overrides: list[str], module: str, part: str) -> tuple[int, int]:
    """``(largest part, largest total)`` over the module's ranks."""
    cfg = load_config(DIGITS, [*overrides, "log.dir=/tmp/mimotron-test-memory-options"])
    items = [e for per_rank in estimate_memory(cfg, check_layout(cfg), 64).values()
             for e in per_rank if e.module == module]
    return max(getattr(e, part) for e in items), max(e.total for e in items)


@pytest.mark.parametrize("key", list(PROBES))
def test_option_moves_the_estimate(key: str) -> None:
    base, flip, module, part, sign = PROBES[key]
    before, after = _module_max(base, module, part), _module_max([*base, *flip], module, part)
    assert sign * (after[0] - before[0]) > 0, (part, before[0], after[0])
    assert sign * (after[1] - before[1]) > 0, ("total", before[1], after[1])
