"""Run configuration: dataclasses, TOML loading, ``key=value`` overrides, validation.

One TOML file describes a run (docs/design.md, "Configuration"). Overrides are dotted
paths whose values are parsed as TOML (``train.iters=5``,
``optimizer.betas=[0.9,0.95]``); a value that is not valid TOML is taken as a string
(``train.precision=bf16``). Unknown keys are rejected with the list of valid ones.
``MimoConfig.validate`` raises ``ValueError`` naming the field, the bad value and what
would be valid; layout rules that involve several modules live in
:mod:`mimotron.parallel.layout`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mimotron.config_limits import check_limits
from mimotron.config_numbers import check_numbers
from mimotron.config_paths import check_paths
from mimotron.config_schema import (
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
    DataConfig,
    DatasetName,
    DecayStyle,
    EncoderKind,
    EvalConfig,
    LanguageKind,
    LogConfig,
    ModuleConfig,
    ModuleKind,
    OptimizerConfig,
    OptimizerName,
    ParallelConfig,
    Precision,
    ProfileConfig,
    Schedule,
    SchedulerConfig,
    TrainConfig,
    WeightDecayStyle,
)
from mimotron.names import LANGUAGE

__all__ = [
    "DATASETS",
    "DECAY_STYLES",
    "ENCODER_KINDS",
    "FREEZE_PARTS",
    "LANGUAGE_KINDS",
    "MODULE_KINDS",
    "OPTIMIZERS",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "WEIGHT_DECAY_STYLES",
    "CheckpointConfig",
    "DataConfig",
    "DatasetName",
    "DecayStyle",
    "EncoderKind",
    "EvalConfig",
    "LanguageKind",
    "LogConfig",
    "MimoConfig",
    "ModuleConfig",
    "ModuleKind",
    "OptimizerConfig",
    "OptimizerName",
    "ParallelConfig",
    "Precision",
    "ProfileConfig",
    "Schedule",
    "SchedulerConfig",
    "TrainConfig",
    "WeightDecayStyle",
    "apply_override",
    "config_from_dict",
    "load_config",
    "parse_override",
]


@dataclass
class MimoConfig:
    """The whole run: model modules with their layouts, data, training, logging."""

    name: str = "mimotron"
    """Run name; outputs go to ``runs/<name>/`` unless log.dir is set."""
    modules: dict[str, ModuleConfig] = field(default_factory=dict)
    """The model's modules, one ``[modules.<m>]`` table each, in merge order; ``language``
    is required.
    """
    data: DataConfig = field(default_factory=DataConfig)
    """The ``[data]`` table."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The ``[train]`` table."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The ``[optimizer]`` table (defaults for every module)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The ``[scheduler]`` table (defaults for every module)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The ``[eval]`` table."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The ``[checkpoint]`` table."""
    log: LogConfig = field(default_factory=LogConfig)
    """The ``[log]`` table."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """The ``[profile]`` table."""

    # ---- derived values -------------------------------------------------------------
    @property
    def encoder_names(self) -> list[str]:
        """Encoder modules in config order (the order embeddings are merged)."""
        return [n for n, m in self.modules.items() if m.is_encoder]

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // self.train.micro_batch_size

    @property
    def log_dir(self) -> Path:
        return Path(self.log.dir or f"runs/{self.name}")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.log_dir / "checkpoints"

    def effective_optimizer(self, module: str) -> OptimizerConfig:
        """``[optimizer]`` with the module's overrides applied."""
        keys = {f.name for f in dataclasses.fields(OptimizerConfig)}
        over = {k: v for k, v in self.modules[module].optimizer.items() if k in keys}
        return dataclasses.replace(self.optimizer, **copy.deepcopy(over))

    def effective_scheduler(self, module: str) -> SchedulerConfig:
        """``[scheduler]`` with the module's overrides applied."""
        keys = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"min_lr"}
        over = {k: v for k, v in self.modules[module].optimizer.items() if k in keys}
        return dataclasses.replace(self.scheduler, **over)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- validation -------------------------------------------------------------------
    def validate(self) -> MimoConfig:
        """Check every single-field and cross-field rule; raise ``ValueError`` on the first.

        Returns self so calls can be chained.
        """
        # First: a non-finite float or an int beyond int64 would otherwise reach the
        # per-field rules below with a misleading message, or pass them (eps = inf > 0).
        check_numbers(self)
        check_paths(self)  # name, log.dir, checkpoint.dir: never a system folder
        _validate_modules(self)
        _validate_train(self)
        _validate_optim(self.optimizer, "optimizer")
        _validate_scheduler(self.scheduler, "scheduler")
        _validate_warmup(self, self.scheduler, "scheduler")
        for name in self.modules:
            _validate_optim(self.effective_optimizer(name), f"modules.{name}.optimizer")
            _validate_expert_optim(self, name)
            _validate_scheduler(self.effective_scheduler(name), f"modules.{name}.optimizer")
            _validate_warmup(self, self.effective_scheduler(name), f"modules.{name}.optimizer")
        _validate_data(self)
        _check(self.eval.interval >= 1, "eval.interval", self.eval.interval, "an integer >= 1")
        _check(self.eval.iters >= 0, "eval.iters", self.eval.iters, "an integer >= 0")
        _check(
            self.checkpoint.interval >= 0,
            "checkpoint.interval",
            self.checkpoint.interval,
            "an integer >= 0 (0 = no periodic saves)",
        )
        _check(self.checkpoint.keep >= 1, "checkpoint.keep", self.checkpoint.keep, ">= 1")
        _validate_pretrained(self.checkpoint)
        _check(self.log.interval >= 1, "log.interval", self.log.interval, "an integer >= 1")
        _validate_wandb(self)
        _check(
            0 <= self.profile.start <= self.profile.end,
            "profile.start",
            self.profile.start,
            f"0 <= profile.start <= profile.end ({self.profile.end})",
        )
        check_limits(self)  # Timeouts torch takes; a model size some machine could hold.
        return self


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


def _validate_modules(cfg: MimoConfig) -> None:
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
        _validate_hf_keys(name, mod)
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
        if mod.kind == "vit":
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
    from mimotron.models.moe import check_layer_freq, check_moe_options

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


def _validate_hf_keys(name: str, mod: ModuleConfig) -> None:
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
        # Only here: importing the models (and DTensor with them) costs the launcher ~1 s.
        from mimotron.models.hf.resolve import resolve_hf_module

        resolve_hf_module(name, mod)


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
    experts = cfg.modules[LANGUAGE].num_experts
    if d.packing and experts:
        # The MoE aux loss is weighted per row: packed documents would change it.
        raise ValueError(f"data.packing=True is invalid with modules.language.num_experts="
                         f"{experts}: set data.packing=false or num_experts=0")
    if d.dataset == "llava":
        _validate_llava(cfg)
        return  # The dataset checks each sample's length against seq_length.
    for key in ("path", "valid_path", "root", "allow_outside_root", "tokenizer",
                "skip_bad_samples", "system_prompt", "index_dir"):
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
    from mimotron.data.webdataset import is_shard_path, shard_paths

    if Path(path).is_file():
        return True
    try:
        return is_shard_path(path) and bool(shard_paths(path))
    except ValueError:
        return False


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
    for name, m in cfg.modules.items():
        hf_path = getattr(m, "hf_path", "")  # Set by Hugging Face modules only.
        if hf_path and m.modality is not None:
            file = Path(hf_path) / "preprocessor_config.json"
            _check(file.is_file(), f"modules.{name}.hf_path", hf_path,
                   "a folder with a preprocessor_config.json (the input preprocessing)")
        elif m.kind == "vit":
            _check(m.in_channels == 3, f"modules.{name}.in_channels", m.in_channels,
                   "3 with data.dataset='llava' (images are read as RGB)")
        elif m.kind == "audio":
            _check(TOY_AUDIO_RATE % m.num_frames == 0, f"modules.{name}.num_frames",
                   m.num_frames, f"a divisor of {TOY_AUDIO_RATE} with data.dataset='llava' "
                   "(frames per 1 s clip at 16 kHz)")


# ---- loading ----------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> MimoConfig:
    """Read a TOML file (or start from defaults), apply ``key=value`` overrides, validate.

    Args:
        path: TOML file; ``None`` starts from an empty table (defaults only).
        overrides: dotted ``key=value`` strings; values are parsed as TOML.

    Returns:
        The validated config.

    Raises:
        ValueError: unknown key, wrong type, or an invalid value (the message names it).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
    for item in overrides or []:
        apply_override(raw, item)
    return config_from_dict(raw).validate()


def _read_toml(path: Path) -> dict[str, Any]:
    """The table of a TOML file; ValueError saying what is wrong with the path or text."""
    name = repr(str(path))
    if path.is_dir():
        raise ValueError(f"config file {name} is a directory: expected a TOML file")
    if not path.exists():
        raise ValueError(f"config file {name} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"config file {name} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(f"config file {name} is not UTF-8 text (TOML must be): byte "
                         f"0x{data[exc.start]:02x} on line {line}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {name} is not valid TOML: {exc}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into the key path and the TOML-parsed value."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is invalid: expected key=value, e.g. train.iters=10")
    key, text = item.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise ValueError(f"override {item!r} is invalid: empty key segment in {key!r}")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # Not TOML: take it as a string (train.precision=bf16).
    return keys, value


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set one dotted ``key=value`` into a raw config dict, creating tables as needed."""
    keys, value = parse_override(item)
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r} is invalid: {k!r} is not a table")
    node[keys[-1]] = value


def config_from_dict(raw: dict[str, Any]) -> MimoConfig:
    """Build a ``MimoConfig`` from a nested dict, rejecting unknown keys and wrong types."""
    raw = dict(raw)
    modules = raw.pop("modules", {})
    if not isinstance(modules, dict):
        raise ValueError("modules is invalid: expected tables [modules.<name>]")
    cfg = _build(MimoConfig, raw, "")
    for name, table in modules.items():
        if not isinstance(table, dict):
            raise ValueError(f"modules.{name} is invalid: expected a table")
        cfg.modules[name] = _build(ModuleConfig, table, f"modules.{name}.")
        if cfg.modules[name].hf_path and cfg.modules[name].kind in MODULE_KINDS:
            from mimotron.models.hf.resolve import resolve_hf_module

            # The keys the table set: one equal to the default still contradicts.
            resolve_hf_module(name, cfg.modules[name], explicit=set(table))
        _check_override_keys(cfg.modules[name].optimizer, f"modules.{name}.optimizer")
    _data_defaults(cfg, raw.get("data") or {})
    return cfg


def _data_defaults(cfg: MimoConfig, table: dict[str, Any]) -> None:
    """Defaults that depend on other keys, filled in once so the recorded config has them.

    A LLaVA run without ``data.tokenizer`` reads the language model's folder
    (``modules.language.hf_path``); with ``data.valid_path`` and no ``data.train_fraction``
    the whole of ``data.path`` trains (1.0 instead of 0.8).
    """
    d = cfg.data
    language = cfg.modules.get(LANGUAGE)
    if d.dataset == "llava" and not d.tokenizer and language is not None:
        d.tokenizer = getattr(language, "hf_path", "") or ""
    if d.valid_path and "train_fraction" not in table:
        d.train_fraction = 1.0


def _check_override_keys(over: dict[str, Any], p: str) -> None:
    valid = {f.name for f in dataclasses.fields(OptimizerConfig)}
    valid |= {f.name for f in dataclasses.fields(SchedulerConfig)} - {"min_lr"}
    for key in over:
        if key not in valid:
            raise ValueError(f"unknown key {p}.{key}; valid keys: {', '.join(sorted(valid))}")
        # Type-check through the dataclass that owns the key.
        optimizer_keys = {f.name for f in dataclasses.fields(OptimizerConfig)}
        owner = OptimizerConfig if key in optimizer_keys else SchedulerConfig
        _build(owner, {key: over[key]}, f"{p}.")


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            raise ValueError(
                f"unknown key {prefix}{key}; valid keys: {', '.join(sorted(fields))}"
            )
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} is invalid: expected a table")
        return _build(hint, value, f"{name}.")
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if isinstance(value, list | dict) or value not in choices:
            raise ValueError(f"{name}={value!r} is invalid: expected one of {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        # The first alternative that takes the value (``int | list[int]``, ``bool |
        # Literal[...]``); else the first alternative's error, naming the choices too.
        for alt in args[1:]:
            cls = typing.get_origin(alt) or alt
            if cls is typing.Literal:
                if isinstance(value, str) and value in typing.get_args(alt):
                    return value
            elif isinstance(cls, type) and isinstance(value, cls):
                return _coerce(alt, value, name)
        choices = [c for alt in args if typing.get_origin(alt) is typing.Literal
                   for c in typing.get_args(alt)]
        try:
            return _coerce(args[0], value, name)
        except ValueError as exc:
            if not choices:
                raise
            raise ValueError(f"{exc} or one of {tuple(choices)}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name}={value!r} is invalid: expected a list")
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, name) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} is invalid: expected a table")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{name}={value!r} is invalid: expected a finite number "
                             "(not inf or nan)") from None
    if hint in (int, str, bool, float) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise ValueError(f"{name}={value!r} is invalid: expected {hint.__name__}")
    return value
