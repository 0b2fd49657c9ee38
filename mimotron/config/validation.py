"""Every check of a run config, in one layer above the config schema and the models.

``mimotron plan`` and ``mimotron train`` refuse the same configs, before any process
starts, because both go through here (:func:`mimotron.config.load_config` calls it) and
then through :func:`mimotron.parallel.layout.check_layout` (the layout's rules and
:mod:`mimotron.config.setup_rules`, what a rank's set-up applies). The layers::

    config_schema   the dataclasses (pure: no checks, no models)
    models          import config_schema only
    validation      this module: field rules, and the rules that need the models
                    (a Hugging Face folder's config.json, mixture-of-experts options)
    config          TOML and overrides parsed into the schema; load_config

so neither the config nor the models import each other inside a function to dodge a
cycle. A Hugging Face folder's ``config.json`` is read once per load
(:class:`~mimotron.config.hf_folder.HFConfigs`, one per :func:`load_config` call, handed
down to every check that reads it) and kept on the resolved module, so what runs after
the load (the layout's rules, ``mimotron plan``'s estimates) does not read it again.

Every rule raises ``ValueError`` with one line naming the field, its value and what would
be valid.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from mimotron.config.balance import check_balance
from mimotron.config.context_length import check_context_length
from mimotron.config.hf_folder import HFConfigs, preprocessor_file
from mimotron.config.hf_resolve import resolve_hf_module
from mimotron.config.hf_vlm import is_vlm_config
from mimotron.config.limits import check_limits
from mimotron.config.lora import check_lora
from mimotron.config.moe_options import check_layer_freq, check_moe_options
from mimotron.config.native_vision import check_native_layout
from mimotron.config.numbers import check_numbers
from mimotron.config.paths import check_paths
from mimotron.config.sample_keys import check_ignore_keys
from mimotron.config.schema import (
    CHAT_TEMPLATES,
    DATASETS,
    DECAY_STYLES,
    ENCODER_KINDS,
    FREEZE_PARTS,
    LANGUAGE_KINDS,
    MODULE_KINDS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    WEIGHT_DECAY_STYLES,
    CheckpointConfig,
    MimoConfig,
    ModuleConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
)
from mimotron.config.shard_paths import is_shard_path, shard_paths
from mimotron.names import LANGUAGE

__all__ = ["HF_ONLY_KEYS", "TOY_AUDIO_RATE", "HFConfigs", "check_chat_template_key",
           "validate_config"]


def validate_config(cfg: MimoConfig, hf: HFConfigs | None = None) -> MimoConfig:
    """Check every single-field and cross-field rule; raise ``ValueError`` on the first.

    Args:
        cfg: the config (sizes of Hugging Face modules filled in, or filled in here).
        hf: the config.json reader of this load (``None``: a fresh one).

    Returns:
        ``cfg``, so calls can be chained.
    """
    hf = hf if hf is not None else HFConfigs()
    # First: a non-finite float or an int beyond int64 would otherwise reach the
    # per-field rules below with a misleading message, or pass them (eps = inf > 0).
    check_numbers(cfg)
    check_paths(cfg)  # name, log.dir, checkpoint.dir: never a system folder
    _validate_modules(cfg, hf)
    _validate_vlm_projector(cfg, hf)
    check_native_layout(cfg)
    for name in cfg.modules:
        check_lora(cfg, name)
        if cfg.modules[name].lora.rank:
            _validate_lora_base(cfg, name, hf)
    _validate_train(cfg)
    _validate_optim(cfg.optimizer, "optimizer")
    _validate_scheduler(cfg.scheduler, "scheduler")
    _validate_warmup(cfg, cfg.scheduler, "scheduler")
    for name in cfg.modules:
        _validate_optim(cfg.effective_optimizer(name), f"modules.{name}.optimizer")
        _validate_expert_optim(cfg, name)
        _validate_scheduler(cfg.effective_scheduler(name), f"modules.{name}.optimizer")
        _validate_warmup(cfg, cfg.effective_scheduler(name), f"modules.{name}.optimizer")
    _validate_data(cfg)
    check_context_length(cfg, hf)
    check_balance(cfg)
    _validate_run_tables(cfg)
    check_limits(cfg, hf)  # Timeouts torch takes; a model size some machine could hold.
    return cfg


def _validate_lora_base(cfg: Any, name: str, hf: HFConfigs) -> None:
    """Adapters on an encoder loaded from a tower-only folder: its projector would start
    random and stay frozen (a built-in module's base is the seed's, deterministic: the
    tests' and demos' case)."""
    mod = cfg.modules[name]
    if cfg.checkpoint.pretrained or not mod.hf_path or not mod.is_encoder:
        return
    if not is_vlm_config(hf.read(mod.hf_path)):
        raise ValueError(f"modules.{name}.lora.rank={mod.lora.rank}: modules.{name}.hf_path="
                         f"{mod.hf_path!r} holds the tower only, so the projector would start "
                         "random and stay frozen; train the projector first and load it with "
                         "checkpoint.pretrained, or use a whole vision-language folder")


def _validate_run_tables(cfg: MimoConfig) -> None:
    """``[eval]``, ``[checkpoint]``, ``[log]`` and ``[profile]``."""
    _check(cfg.eval.interval >= 1, "eval.interval", cfg.eval.interval, "an integer >= 1")
    _check(cfg.eval.iters >= 0, "eval.iters", cfg.eval.iters, "an integer >= 0")
    _check(cfg.checkpoint.interval >= 0, "checkpoint.interval", cfg.checkpoint.interval,
           "an integer >= 0 (0 = no periodic saves)")
    _check(cfg.checkpoint.keep >= 1, "checkpoint.keep", cfg.checkpoint.keep, ">= 1")
    _validate_pretrained(cfg.checkpoint)
    _check(cfg.log.interval >= 1, "log.interval", cfg.log.interval, "an integer >= 1")
    _validate_wandb(cfg)
    _check(0 <= cfg.profile.start <= cfg.profile.end, "profile.start", cfg.profile.start,
           f"0 <= profile.start <= profile.end ({cfg.profile.end})")


def resolve_module(name: str, mod: ModuleConfig, table: dict[str, Any], hf: HFConfigs
                   ) -> None:  # fmt: skip
    """Fill a Hugging Face module's size keys from its ``config.json`` (read by ``hf``).

    Args:
        name: the module name (for messages).
        mod: the module as parsed from ``table``.
        table: its TOML table: a key it sets that contradicts config.json is an error,
            even when equal to the default.
        hf: the config.json reader of this load.

    Raises:
        ValueError: see :func:`~mimotron.config.hf_resolve.resolve_hf_module`.
    """
    if mod.hf_path and mod.kind in MODULE_KINDS:
        resolve_hf_module(name, mod, explicit=set(table), configs=hf)


def _validate_wandb(cfg: MimoConfig) -> None:
    """``log.wandb*``: the package is there (found, not imported: that takes a second)."""
    log = cfg.log
    _check(log.wandb or not log.wandb_project, "log.wandb_project", log.wandb_project,
           "unset with log.wandb=false (set log.wandb=true to log to wandb)")
    if log.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("log.wandb=True is invalid: the wandb package is not installed "
                         "(pip install 'mimotron[wandb]')")


def _check(ok: bool, name: str, value: Any, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {valid}")


def _validate_vlm_projector(cfg: MimoConfig, hf: HFConfigs) -> None:
    """A vision module split from a vision-language folder brings its projector, whose
    output width is the folder's language model's: the run's must have that width."""
    language = cfg.modules[LANGUAGE]
    for name, mod in cfg.modules.items():
        if mod.kind != "vit" or not mod.hf_path or not is_vlm_config(hf.read(mod.hf_path)) \
                or mod.hf_native is not None:  # a Qwen-VL merger: sized by the folder
            continue
        if mod.projector_hidden_size != language.hidden_size:
            raise ValueError(
                f"modules.{name}.hf_path={mod.hf_path!r} brings a projector into a "
                f"{mod.projector_hidden_size}-wide language model (its text_config) but "
                f"modules.language.hidden_size={language.hidden_size}: load the language model "
                "from the same folder (modules.language.hf_path) or one of that width")


def _validate_modules(cfg: MimoConfig, hf: HFConfigs) -> None:
    if LANGUAGE not in cfg.modules:
        raise ValueError(
            f"modules: a module named 'language' is required (have {sorted(cfg.modules)}); "
            "add a [modules.language] table with kind = \"language\""
        )
    _check(
        cfg.modules[LANGUAGE].kind in LANGUAGE_KINDS,
        "modules.language.kind",
        cfg.modules[LANGUAGE].kind,
        f"one of {LANGUAGE_KINDS}",
    )
    modalities: dict[str, str] = {}
    for name, mod in cfg.modules.items():
        p = f"modules.{name}"
        _check(mod.kind in MODULE_KINDS, f"{p}.kind", mod.kind, f"one of {MODULE_KINDS}")
        if name != LANGUAGE:
            _check(mod.is_encoder, f"{p}.kind", mod.kind, f"an encoder kind {ENCODER_KINDS}")
            if mod.modality in modalities:
                raise ValueError(
                    f"{p}.kind={mod.kind!r} is invalid: modality {mod.modality!r} is already "
                    f"encoded by modules.{modalities[mod.modality]}; one encoder per modality"
                )
            modalities[mod.modality] = name
        _validate_hf_keys(name, mod, hf)
        for key in ("hidden_size", "num_layers", "num_heads"):
            val = getattr(mod, key)
            _check(isinstance(val, int) and val >= 1, f"{p}.{key}", val, "an integer >= 1")
        _check(
            # A checkpoint's head_dim need not be hidden_size / num_heads (Qwen3).
            bool(mod.hf_path) or mod.hidden_size % mod.num_heads == 0,
            f"{p}.num_heads",
            mod.num_heads,
            f"a divisor of hidden_size={mod.hidden_size}",
        )
        if mod.kind == "vit" and mod.hf_native is None:  # native: no fixed image size
            _check(
                mod.patch_size >= 1 and mod.image_size % mod.patch_size == 0,
                f"{p}.patch_size",
                mod.patch_size,
                f"a positive divisor of image_size={mod.image_size}",
            )
        if mod.kind == "audio":
            _check(
                mod.num_audio_tokens >= 1 and mod.num_frames % mod.num_audio_tokens == 0,
                f"{p}.num_audio_tokens",
                mod.num_audio_tokens,
                f"a positive divisor of num_frames={mod.num_frames}",
            )
        _validate_freeze(mod, p)
        _validate_moe(mod, p)
        _validate_recompute(mod, p)
        _validate_parallel(mod.parallel, f"{p}.parallel")


def _validate_moe(mod: ModuleConfig, p: str) -> None:
    """The mixture-of-experts keys (``num_experts`` > 0 turns them on)."""
    check_moe_options(mod.num_experts, mod.top_k, mod.moe_router_score,
                      mod.num_shared_experts, prefix=f"{p}.")
    if mod.num_experts == 0:
        return
    _check(mod.kind in LANGUAGE_KINDS and not mod.hf_path, f"{p}.num_experts", mod.num_experts,
           "0: experts are built for the language module without hf_path only")
    _check(mod.moe_ffn_hidden_size >= 0, f"{p}.moe_ffn_hidden_size", mod.moe_ffn_hidden_size,
           "an integer >= 0")
    _check(not mod.moe_shared_expert_gate or mod.num_shared_experts >= 1,
           f"{p}.moe_shared_expert_gate", mod.moe_shared_expert_gate,
           "false without shared experts (num_shared_experts >= 1)")
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        _check(getattr(mod, key) >= 0, f"{p}.{key}", getattr(mod, key), "a number >= 0")
    check_layer_freq(mod.moe_layer_freq, mod.num_layers, prefix=f"{p}.")


def _validate_pretrained(ck: CheckpointConfig) -> None:
    """What to keep of ``checkpoint.pretrained`` needs a pretrained checkpoint."""
    for key in ("pretrained_optimizer", "pretrained_schedule"):
        _check(not getattr(ck, key) or bool(ck.pretrained), f"checkpoint.{key}",
               getattr(ck, key), "false without checkpoint.pretrained (the checkpoint to "
               "start from)")


def _validate_freeze(mod: ModuleConfig, p: str) -> None:
    """``freeze``: a bool, or a part only an encoder has (the language model has no tower)."""
    if isinstance(mod.freeze, bool):
        return
    parts = " or ".join(f'"{x}" (its tower frozen, its projector trained)' for x in FREEZE_PARTS)
    valid = f"true, false or {parts}" if mod.is_encoder else (
        "true or false (a part can be frozen in an encoder only)")
    _check(mod.is_encoder and mod.freeze in FREEZE_PARTS, f"{p}.freeze", mod.freeze, valid)


def _validate_recompute(mod: ModuleConfig, p: str) -> None:
    """``recompute`` and ``recompute_num_layers`` (the parser checks the choice for TOML)."""
    _check(mod.recompute in RECOMPUTE_MODES, f"{p}.recompute", mod.recompute,
           f"one of {RECOMPUTE_MODES}")
    n = mod.recompute_num_layers
    _check(0 <= n <= mod.num_layers, f"{p}.recompute_num_layers", n,
           f"an integer in [0, num_layers={mod.num_layers}] (0 = every layer)")
    _check(n == 0 or mod.recompute != "none", f"{p}.recompute_num_layers", n,
           "0 with recompute='none' (set recompute to 'selective' or 'full')")


# Keys that only mean something for one kind with hf_path (checked against their defaults).
HF_ONLY_KEYS: dict[str, tuple[str, ...]] = {
    "vit": ("vision_feature_layer", "vision_feature_select_strategy"),
    "audio": ("downsample_factor", "downsample_mode"),
}


def _validate_hf_keys(name: str, mod: ModuleConfig, hf: HFConfigs) -> None:
    """Options that only apply with ``hf_path`` are rejected elsewhere; sizes come from it."""
    defaults = ModuleConfig()
    for kind, keys in HF_ONLY_KEYS.items():
        for key in keys:
            value = getattr(mod, key)
            if value != getattr(defaults, key) and (not mod.hf_path or mod.kind != kind):
                raise ValueError(
                    f"modules.{name}.{key}={value!r} is invalid: it only applies to a "
                    f"kind={kind!r} module with hf_path set; remove it"
                )
    if mod.hf_path:
        resolve_hf_module(name, mod, configs=hf)


def _validate_parallel(par: ParallelConfig, p: str) -> None:
    for key in ("tensor", "pipeline", "data", "context", "expert", "expert_tensor",
                "virtual_pipeline"):
        val = getattr(par, key)
        _check(isinstance(val, int) and val >= 1, f"{p}.{key}", val, "a positive integer")
    _check(par.rank_offset >= 0, f"{p}.rank_offset", par.rank_offset, "an integer >= 0")
    if par.layers_per_stage:
        _check(
            len(par.layers_per_stage) == par.pipeline and all(n >= 1 for n in par.layers_per_stage),
            f"{p}.layers_per_stage",
            par.layers_per_stage,
            f"{par.pipeline} positive layer counts (one per pipeline stage)",
        )


def _validate_train(cfg: MimoConfig) -> None:
    t = cfg.train
    _check(t.iters >= 1, "train.iters", t.iters, "an integer >= 1")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "an integer >= 1")
    _check(
        t.global_batch_size >= t.micro_batch_size
        and t.global_batch_size % t.micro_batch_size == 0,
        "train.global_batch_size",
        t.global_batch_size,
        f"a positive multiple of train.micro_batch_size={t.micro_batch_size}",
    )
    _check(t.precision in PRECISIONS, "train.precision", t.precision, f"one of {PRECISIONS}")
    _check(t.schedule in SCHEDULES, "train.schedule", t.schedule, f"one of {SCHEDULES}")
    _check(t.max_skipped >= 1, "train.max_skipped", t.max_skipped, "an integer >= 1")
    _check(t.pg_timeout_s > 0, "train.pg_timeout_s", t.pg_timeout_s, "a positive number")
    _check(t.grad_bucket_mb > 0, "train.grad_bucket_mb", t.grad_bucket_mb, "a positive number")
    _check(t.exit_interval >= 0, "train.exit_interval", t.exit_interval, "an integer >= 0")


def _validate_expert_optim(cfg: MimoConfig, name: str) -> None:
    """The expert weight decay is a constant (a module without experts ignores both keys)."""
    o, s = cfg.effective_optimizer(name), cfg.effective_scheduler(name)
    scheduled = s.start_weight_decay is not None or s.end_weight_decay is not None
    _check(o.expert_weight_decay is None or not scheduled,
           f"modules.{name}.optimizer.expert_weight_decay", o.expert_weight_decay,
           "unset while a weight-decay schedule (start/end_weight_decay) is set")


def _validate_optim(o: OptimizerConfig, p: str) -> None:
    _check(o.name in OPTIMIZERS, f"{p}.name", o.name, f"one of {OPTIMIZERS}")
    _check(o.lr > 0, f"{p}.lr", o.lr, "a positive number")
    _check(0 <= o.min_lr <= o.lr, f"{p}.min_lr", o.min_lr, f"0 <= min_lr <= lr ({o.lr})")
    _check(o.weight_decay >= 0, f"{p}.weight_decay", o.weight_decay, "a number >= 0")
    _check(o.expert_lr is None or o.expert_lr > 0, f"{p}.expert_lr", o.expert_lr,
           "a positive number (or unset: lr)")
    _check(o.expert_weight_decay is None or o.expert_weight_decay >= 0,
           f"{p}.expert_weight_decay", o.expert_weight_decay, "a number >= 0 (or unset)")
    _check(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        f"{p}.betas",
        o.betas,
        "two numbers in [0, 1)",
    )
    _check(o.eps > 0, f"{p}.eps", o.eps, "a positive number")
    _check(o.clip_grad >= 0, f"{p}.clip_grad", o.clip_grad, "a number >= 0 (0 = no clipping)")
    _check(o.initial_loss_scale > 0, f"{p}.initial_loss_scale", o.initial_loss_scale, "> 0")
    _check(o.loss_scale_window >= 1, f"{p}.loss_scale_window", o.loss_scale_window, ">= 1")
    _check(o.hysteresis >= 1, f"{p}.hysteresis", o.hysteresis, ">= 1")


def _validate_warmup(cfg: MimoConfig, s: SchedulerConfig, p: str) -> None:
    decay = s.decay_iters or cfg.train.iters
    _check(s.warmup_iters <= decay, f"{p}.warmup_iters", s.warmup_iters,
           f"<= the decay length ({decay}: scheduler.decay_iters, or train.iters when 0)")


def _validate_scheduler(s: SchedulerConfig, p: str) -> None:
    _check(s.warmup_iters >= 0, f"{p}.warmup_iters", s.warmup_iters, "an integer >= 0")
    _check(s.decay_style in DECAY_STYLES, f"{p}.decay_style", s.decay_style,
           f"one of {DECAY_STYLES}")
    _check(s.decay_iters >= 0, f"{p}.decay_iters", s.decay_iters, "an integer >= 0")
    _check(
        s.weight_decay_style in WEIGHT_DECAY_STYLES,
        f"{p}.weight_decay_style",
        s.weight_decay_style,
        f"one of {WEIGHT_DECAY_STYLES}",
    )


def _validate_data(cfg: MimoConfig) -> None:
    d = cfg.data
    _check(d.dataset in DATASETS, "data.dataset", d.dataset, f"one of {DATASETS}")
    if d.valid_path:  # data.path trains in full: a share of it left out would be lost
        _check(d.train_fraction == 1.0, "data.train_fraction", d.train_fraction,
               "1.0 with data.valid_path set (data.path trains in full; leave it unset)")
    else:
        _check(0 < d.train_fraction < 1, "data.train_fraction", d.train_fraction,
               "a number in (0, 1) (or 1.0 with a LLaVA validation file: data.valid_path)")
    probs = (d.p_image, d.p_audio, d.p_both, d.p_text)
    _check(
        all(p >= 0 for p in probs) and sum(probs) > 0,
        "data.p_image",
        probs,
        "non-negative mixture weights p_image/p_audio/p_both/p_text with a positive sum",
    )
    _check(d.num_workers >= 0, "data.num_workers", d.num_workers, "an integer >= 0")
    _check(d.max_images_per_sample >= 1 and (d.dataset == "llava" or d.max_images_per_sample == 1),
           "data.max_images_per_sample", d.max_images_per_sample,
           "an integer >= 1 (above 1 with data.dataset='llava' only)")
    experts = cfg.modules[LANGUAGE].num_experts
    if d.packing and experts:
        # The MoE aux loss is weighted per row: packed documents would change it.
        raise ValueError(f"data.packing=True is invalid with modules.language.num_experts="
                         f"{experts}: set data.packing=false or num_experts=0")
    if d.dataset == "llava":
        _validate_llava(cfg)
        return  # The dataset checks each sample's length against seq_length.
    for key in ("path", "valid_path", "root", "allow_outside_root", "tokenizer",
                "chat_template", "skip_bad_samples", "system_prompt", "index_dir", "ignore_keys",
                "allow_large_vocab"):
        # Never silently ignored: these only mean something for a file dataset.
        _check(not getattr(d, key), f"data.{key}", getattr(d, key),
               f"unset with data.dataset={d.dataset!r} (it is read by 'llava' only)")
    # Prompt = <bos> + placeholders of every encoder + separator; answers need room too.
    placeholders = sum(m.num_output_tokens for m in cfg.modules.values())
    need = placeholders + 2 + 30 if d.dataset == "digits" else placeholders + 4
    _check(
        d.seq_length >= need,
        "data.seq_length",
        d.seq_length,
        f">= {need} ({placeholders} placeholder tokens plus prompt and the longest answer)",
    )


# Sample rate of the WAV files a toy audio encoder reads in a LLaVA run (Whisper's rate).
TOY_AUDIO_RATE = 16000


def _data_files_exist(path: str) -> bool:
    """A file, or the tar shards a folder/glob/brace range names (``data/webdataset.py``)."""
    if Path(path).is_file():
        return True
    try:
        return is_shard_path(path) and bool(shard_paths(path))
    except ValueError:
        return False


def check_chat_template_key(value: str) -> None:
    """``data.chat_template``: empty, a built-in name, or an existing ``.jinja`` file.

    A value with a path separator or the ``.jinja`` suffix is a path; any other is a name.
    The data layer resolves the value through this check too, so a run config recorded
    by an earlier run (``mimotron export``) is held to the same rule.

    Raises:
        ValueError: an unknown name, a path that is not a ``.jinja`` file, or a missing file.
    """
    if not value or value in CHAT_TEMPLATES:
        return
    valid = f"'' (the tokenizer's own), one of {CHAT_TEMPLATES} or a path to a .jinja file"
    if not (value.endswith(".jinja") or "/" in value or "\\" in value):
        raise ValueError(f"data.chat_template={value!r} is invalid: not a built-in template; "
                         f"expected {valid}")
    _check(value.endswith(".jinja"), "data.chat_template", value, f"{valid} (a file "
           "holding one Jinja chat template, named *.jinja)")
    _check(Path(value).is_file(), "data.chat_template", value,
           "an existing .jinja file (no such file)")


def _validate_llava(cfg: MimoConfig) -> None:
    """Files and folders a LLaVA run reads; the samples are checked when the data is built."""
    d = cfg.data
    _check(bool(d.path) and _data_files_exist(d.path), "data.path", d.path,
           "an existing LLaVA JSON or JSONL file, or WebDataset .tar shards")
    _check(not d.root or Path(d.root).is_dir(), "data.root", d.root,
           "an existing folder (or empty: the folder of data.path)")
    _check(not d.valid_path or _data_files_exist(d.valid_path), "data.valid_path",
           d.valid_path, "an existing LLaVA JSON or JSONL file, or WebDataset .tar shards "
           "(or empty: a split of data.path)")
    if not d.tokenizer:  # config_from_dict fills it from modules.language.hf_path
        raise ValueError("data.tokenizer is unset and so is modules.language.hf_path: set "
                         "data.tokenizer to a local Hugging Face tokenizer folder (or "
                         "modules.language.hf_path to a folder holding one)")
    _check(Path(d.tokenizer).is_dir(), "data.tokenizer", d.tokenizer,
           "an existing local Hugging Face tokenizer folder (nothing is downloaded)")
    check_chat_template_key(d.chat_template)
    check_ignore_keys(d.ignore_keys)
    for name, m in cfg.modules.items():
        hf_path = getattr(m, "hf_path", "")  # Set by Hugging Face modules only.
        if hf_path and m.modality is not None:
            _check(preprocessor_file(hf_path) is not None, f"modules.{name}.hf_path", hf_path,
                   "a folder with a preprocessor_config.json (the input preprocessing) or a "
                   "processor_config.json holding it")
        elif m.kind == "vit":
            _check(m.in_channels == 3, f"modules.{name}.in_channels", m.in_channels,
                   "3 with data.dataset='llava' (images are read as RGB)")
        elif m.kind == "audio":
            _check(TOY_AUDIO_RATE % m.num_frames == 0, f"modules.{name}.num_frames",
                   m.num_frames, f"a divisor of {TOY_AUDIO_RATE} with data.dataset='llava' "
                   "(frames per 1 s clip at 16 kHz)")
