"""Config loading, overrides, defaults and single-field validation."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from mimotron.config import (
    DECAY_STYLES,
    PRECISIONS,
    WEIGHT_DECAY_STYLES,
    DecayStyle,
    Precision,
    WeightDecayStyle,
    config_from_dict,
    load_config,
    parse_override,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.toml"


def test_default_config_loads_and_has_contract_keys():
    cfg = load_config(DIGITS)
    assert set(cfg.modules) == {"vision", "audio", "language"}
    assert cfg.encoder_names == ["vision", "audio"]
    assert cfg.modules["vision"].kind == "vit" and cfg.modules["vision"].modality == "image"
    assert cfg.num_microbatches == cfg.train.global_batch_size // cfg.train.micro_batch_size
    assert cfg.log_dir == Path("runs/digits")
    assert cfg.checkpoint_dir == Path("runs/digits/checkpoints")


@pytest.mark.parametrize(
    ("item", "keys", "value"),
    [
        ("train.iters=5", ["train", "iters"], 5),
        ("train.precision=bf16", ["train", "precision"], "bf16"),
        ("train.precision='fp16'", ["train", "precision"], "fp16"),
        ("optimizer.betas=[0.9, 0.95]", ["optimizer", "betas"], [0.9, 0.95]),
        ("checkpoint.async_save=true", ["checkpoint", "async_save"], True),
        ("optimizer.lr=3e-4", ["optimizer", "lr"], 3e-4),
    ],
)
def test_parse_override_values_are_toml(item, keys, value):
    assert parse_override(item) == (keys, value)


def test_overrides_apply_and_create_module_tables():
    cfg = load_config(DIGITS, ["train.iters=7", "scheduler.warmup_iters=2",
                               "modules.vision.optimizer.lr=1e-4",
                               "modules.vision.optimizer.warmup_iters=3",
                               "modules.language.parallel.data=2"])
    assert cfg.train.iters == 7
    assert cfg.effective_optimizer("vision").lr == 1e-4
    assert cfg.effective_optimizer("audio").lr == cfg.optimizer.lr
    assert cfg.effective_scheduler("vision").warmup_iters == 3
    assert cfg.effective_scheduler("language").warmup_iters == cfg.scheduler.warmup_iters


def test_int_accepted_for_float_field():
    cfg = load_config(DIGITS, ["optimizer.lr=1"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.foo=1"], "unknown key train.foo; valid keys:"),
        (["modules.vision.parallel.tensr=2"], "unknown key modules.vision.parallel.tensr"),
        (["modules.vision.optimizer.lrr=1"], "unknown key modules.vision.optimizer.lrr"),
        (["train.iters=ten"], "train.iters='ten' is invalid: expected int"),
        (["train.iters=0"], "train.iters=0"),
        (["train.precision=fp8"], "train.precision='fp8'"),
        (["train.global_batch_size=60"], "train.global_batch_size=60"),
        (["optimizer.lr=-1"], "optimizer.lr=-1"),
        (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9]"),
        (["modules.vision.optimizer.min_lr=1.0"], "modules.vision.optimizer.min_lr=1.0"),
        (["scheduler.decay_style=step"], "scheduler.decay_style='step'"),
        (["modules.vision.kind=clip"], "modules.vision.kind='clip'"),
        (["modules.vision.num_heads=5"], "modules.vision.num_heads=5"),
        (["data.seq_length=16"], "data.seq_length=16"),
        (["data.dataset=imagenet"], "data.dataset='imagenet'"),
        (["eval.interval=0"], "eval.interval=0"),
        (["noequals"], "expected key=value"),
        (["train.iters=50", "scheduler.warmup_iters=100"], "scheduler.warmup_iters=100"),
        (["train.schedule=gpipe"], "train.schedule='gpipe'"),
    ],
)
def test_bad_values_name_the_field(overrides, needle):
    with pytest.raises(ValueError, match=None) as info:
        load_config(DIGITS, overrides)
    assert needle in str(info.value)


def test_missing_language_module(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[modules.vision]\nkind = "vit"\n')
    with pytest.raises(ValueError, match="a module named 'language' is required"):
        load_config(p)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    p = tmp_path / "bad.toml"
    p.write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(p)


def test_two_encoders_for_one_modality_rejected():
    with pytest.raises(ValueError, match="modality 'image' is already encoded"):
        load_config(DIGITS, ["modules.audio.kind=vit"])


def test_choice_tuples_come_from_the_literal_types():
    assert PRECISIONS == typing.get_args(Precision) == ("fp32", "bf16", "fp16")
    assert typing.get_args(DecayStyle) == DECAY_STYLES
    assert typing.get_args(WeightDecayStyle) == WEIGHT_DECAY_STYLES


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"train": {"precision": "fp8"}},
         "train.precision='fp8' is invalid: expected one of ('fp32', 'bf16', 'fp16')"),
        ({"scheduler": {"weight_decay_style": "step"}},
         "scheduler.weight_decay_style='step' is invalid: expected one of "
         "('constant', 'linear', 'cosine')"),
        ({"modules": {"language": {"optimizer": {"name": "lion"}}}},
         "modules.language.optimizer.name='lion' is invalid: expected one of "
         "('adamw', 'adam', 'sgd')"),
        ({"modules": {"v": {"kind": "clip"}}},
         "modules.v.kind='clip' is invalid: expected one of ('vit', 'audio', 'language')"),
        ({"data": {"dataset": ["digits"]}},
         "data.dataset=['digits'] is invalid: expected one of ('digits', 'mock', 'llava')"),
    ],
)
def test_parser_rejects_values_outside_a_literal(raw, message):
    """Literal fields are checked while parsing, before validation, in the usual format."""
    with pytest.raises(ValueError) as info:
        config_from_dict(raw)
    assert str(info.value) == message


def test_parser_accepts_literal_values():
    cfg = config_from_dict({"train": {"precision": "bf16", "schedule": "no_pipelining"},
                            "modules": {"language": {"optimizer": {"decay_style": "linear"}}}})
    assert (cfg.train.precision, cfg.train.schedule) == ("bf16", "no_pipelining")
    assert cfg.modules["language"].optimizer == {"decay_style": "linear"}


def test_validate_checks_numbers_of_a_config_built_in_code():
    """The finiteness and int64 checks walk the dataclasses, so a config made in code (not
    parsed) is covered too, per-module optimizer overrides included."""
    cfg = load_config(DIGITS)
    cfg.optimizer.eps = float("inf")
    with pytest.raises(ValueError, match=r"^optimizer.eps=inf is invalid: expected a finite"):
        validate_config(cfg)
    cfg = load_config(DIGITS)
    cfg.modules["vision"].optimizer["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"^modules.vision.optimizer.lr=nan is invalid"):
        validate_config(cfg)
    cfg = load_config(DIGITS)
    cfg.train.seed = 2**64
    with pytest.raises(ValueError, match=r"^train.seed=.* an integer in \[-9223372036854775808"):
        validate_config(cfg)
    cfg.train.seed = 2**63 - 1  # the largest seed: accepted
    validate_config(cfg)
    with pytest.raises(ValueError, match=r"^optimizer.lr=10{400} is invalid: expected a finite"):
        load_config(DIGITS, ["optimizer.lr=1" + "0" * 400])


# The config modules that check or load; the models may use the schema and the readers of
# a Hugging Face folder below them, never these.
_CONFIG_CHECKS = ("mimotron.config", "mimotron.config.load", "mimotron.config.validation",
                  "mimotron.config.limits", "mimotron.config.setup_rules",
                  "mimotron.config.numbers", "mimotron.config.paths", "mimotron.config.docs")


def test_config_and_models_import_each_other_only_downwards():
    """The models import the config's schema and its folder readers, never its loader or
    its checks
    (never the loader or the checks), and no config module imports a model inside a
    function (a cycle dodged there would be a cycle)."""
    import ast

    package = ROOT / "mimotron"
    config_files = [package / f for f in ("config/load.py", "config/schema.py", "config/numbers.py",
                                          "config/paths.py", "config/limits.py",
                                          "config/validation.py")]  # fmt: skip
    model_files = sorted((package / "models").rglob("*.py"))
    assert len(model_files) > 10

    def imports(path: Path) -> list[tuple[str, bool]]:
        """(module, at module level) of every ``from mimotron...`` / ``import mimotron...``."""
        tree, out = ast.parse(path.read_text()), []
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            out += [(n, id(node) in top) for n in names if n.startswith("mimotron")]
        return out

    for path in config_files:
        late = [m for m, at_top in imports(path) if not at_top]
        assert not late, f"{path.name} imports {late} inside a function or block"
    for path in model_files:
        upward = [m for m, _ in imports(path) if m in _CONFIG_CHECKS]
        assert not upward, f"{path.relative_to(ROOT)} imports {upward}"
