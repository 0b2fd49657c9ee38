"""Layout planning: placements, rank maps, and the rules that reject bad layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.parallel.layout import check_layout
from mimotron.parallel.virtual_pipeline import stage_layers

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"


def _par(module: str, **kw: int) -> list[str]:
    return [f"modules.{module}.parallel.{k}={v}" for k, v in kw.items()]


# The shipped config is non-colocated; cases start from every module on ranks [0, 1).
COLOCATED_1 = [f"modules.{m}.parallel.{k}={v}" for m in ("vision", "audio", "language")
               for k, v in (("data", 1), ("rank_offset", 0))]


def _layout(overrides: list[str], env_world_size: int | None = None):
    return check_layout(load_config(DIGITS, ["train.micro_batch_size=8",
                                            "train.global_batch_size=32", *COLOCATED_1,
                                            *overrides]),
                       env_world_size=env_world_size)


def _map(layout) -> list[list[tuple]]:
    return [[(r.module, r.tp, r.dp, r.pp) for r in roles] for roles in layout.rank_map()]


NONCOLO_4 = (_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
             + _par("language", data=1, tensor=2, rank_offset=2))

VALID = [
    pytest.param(_par("vision", data=2) + _par("audio", data=2) + _par("language", data=2),
                 True, [[("vision", 0, 0, 0), ("audio", 0, 0, 0), ("language", 0, 0, 0)],
                        [("vision", 0, 1, 0), ("audio", 0, 1, 0), ("language", 0, 1, 0)]],
                 id="colocated-dp2"),
    pytest.param(NONCOLO_4, False,
                 [[("vision", 0, 0, 0)], [("audio", 0, 0, 0)], [("language", 0, 0, 0)],
                  [("language", 1, 0, 0)]], id="noncolocated-lang-tp2"),
    pytest.param(_par("vision", data=2, rank_offset=0) + _par("audio", data=1, rank_offset=2)
                 + _par("language", data=1, rank_offset=3), False,
                 [[("vision", 0, 0, 0)], [("vision", 0, 1, 0)], [("audio", 0, 0, 0)],
                  [("language", 0, 0, 0)]], id="fan-in-dp2-to-dp1"),
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                 + _par("language", data=2, pipeline=2, rank_offset=2), False,
                 [[("vision", 0, 0, 0)], [("audio", 0, 0, 0)], [("language", 0, 0, 0)],
                  [("language", 0, 1, 0)], [("language", 0, 0, 1)], [("language", 0, 1, 1)]],
                 id="lang-dp2-pp2"),
    pytest.param(_par("vision", data=4) + _par("audio", data=4)
                 + _par("language", data=2, tensor=2), True,
                 [[("vision", 0, 0, 0), ("audio", 0, 0, 0), ("language", 0, 0, 0)],
                  [("vision", 0, 1, 0), ("audio", 0, 1, 0), ("language", 1, 0, 0)],
                  [("vision", 0, 2, 0), ("audio", 0, 2, 0), ("language", 0, 1, 0)],
                  [("vision", 0, 3, 0), ("audio", 0, 3, 0), ("language", 1, 1, 0)]],
                 id="colocated-vision-dp4-language-tp2dp2"),
    pytest.param(_par("vision", tensor=2, data=1, rank_offset=0)
                 + _par("audio", data=2, rank_offset=2) + _par("language", data=1, rank_offset=4),
                 False, [[("vision", 0, 0, 0)], [("vision", 1, 0, 0)], [("audio", 0, 0, 0)],
                         [("audio", 0, 1, 0)], [("language", 0, 0, 0)]],
                 id="vision-tp2-audio-dp2"),
]


@pytest.mark.parametrize(("overrides", "colocated", "expected"), VALID)
def test_valid_layouts_rank_maps(overrides, colocated, expected):
    layout = _layout(overrides)
    assert layout.colocated is colocated
    assert layout.world_size == len(expected)
    assert _map(layout) == expected
    assert layout.topology == {"vision": ["language"], "audio": ["language"]}


def test_stage_roles_first_last():
    layout = _layout(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                     + _par("language", pipeline=2, data=1, rank_offset=2))
    roles = [r[0] for r in layout.rank_map()]
    assert (roles[2].is_first_stage, roles[2].is_last_stage) == (True, False)
    assert (roles[3].is_first_stage, roles[3].is_last_stage) == (False, True)
    assert "first" in layout.format_rank_map() and "last" in layout.format_rank_map()


INVALID = [
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=0)
                 + _par("language", data=1, rank_offset=1), "modules.vision.parallel.rank_offset",
                 id="partial-overlap"),
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=2)
                 + _par("language", data=1, rank_offset=3), "would hold no module (stub ranks)",
                 id="gap"),
    pytest.param(_par("vision", data=1, rank_offset=1) + _par("audio", data=1, rank_offset=1)
                 + _par("language", data=1, rank_offset=1), "must start at 0", id="offset-start"),
    pytest.param(_par("vision", data=2, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                 + _par("language", data=1, rank_offset=2), "partially overlap",
                 id="overlap-inside-block"),
    pytest.param(_par("vision", data=3, rank_offset=0) + _par("audio", data=1, rank_offset=3)
                 + _par("language", data=2, rank_offset=4),
                 "modules.vision.parallel.data=3 is invalid: it feeds modules.language",
                 id="dp3-to-dp2"),
    pytest.param(_par("vision", data=2) + _par("audio", data=2) + _par("language", data=2)
                 + ["train.micro_batch_size=3", "train.global_batch_size=12"],
                 "train.micro_batch_size=3", id="mbs-not-divisible-by-dp"),
    pytest.param(_par("language", tensor=3, data=1) + _par("vision", tensor=3, data=1)
                 + _par("audio", tensor=3, data=1), "must divide modules.vision.num_heads",
                 id="tp-heads"),
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                 + _par("language", pipeline=3, data=1, rank_offset=2),
                 "modules.language.parallel.pipeline=3", id="pp-more-than-layers"),
    pytest.param(_par("vision", data=1, pipeline=2) + _par("audio", data=2)
                 + _par("language", data=2),
                 "in a colocated layout only the language model may be pipelined",
                 id="colocated-pp"),
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                 + _par("language", data=4, expert=3, rank_offset=2),
                 "modules.language.parallel.expert=3", id="expert-does-not-divide"),
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                 + _par("language", pipeline=2, rank_offset=2)
                 + ["modules.language.parallel.layers_per_stage=[1, 2]"],
                 "layers_per_stage=[1, 2] is invalid: it must sum", id="stage-layers-sum"),
    pytest.param(_par("language", tensor=0), "modules.language.parallel.tensor=0",
                 id="zero-degree"),
    pytest.param(_par("vision", data=-2), "modules.vision.parallel.data=-2", id="negative-degree"),
    pytest.param(_par("language", context=2) + _par("vision", context=2)
                 + _par("audio", context=2), "context parallelism applies to modules.language only",
                 id="context"),
    pytest.param(_par("vision", rank_offset=-1), "rank_offset=-1", id="negative-offset"),
    pytest.param(["modules.language.parallel.sequence_parallel=true"],
                 "sequence parallelism needs tensor > 1", id="sequence-parallel"),
    pytest.param(_par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
                 + _par("language", pipeline=2, rank_offset=2)
                 + ["modules.language.parallel.layers_per_stage=[2]"],
                 "2 positive layer counts", id="stage-layers-count"),
]


@pytest.mark.parametrize(("overrides", "needle"), INVALID)
def test_invalid_layouts_name_the_field(overrides, needle):
    with pytest.raises(ValueError) as info:
        _layout(overrides)
    assert needle in str(info.value)


def test_world_size_mismatch_under_launcher():
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 does not match the layout, which needs 4"):
        _layout(NONCOLO_4, env_world_size=3)
    assert _layout(NONCOLO_4, env_world_size=4).world_size == 4


def test_world_size_read_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        _layout(NONCOLO_4)


def test_missing_language_rejected_before_layout():
    with pytest.raises(ValueError, match="'language' is required"):
        load_config(None, ["modules.vision.kind=vit"])


def test_large_layout_rank_map_is_consistent():
    # 256 ranks: two 64-rank encoder blocks feeding a 128-rank language block.
    cfg = load_config(DIGITS, [
        *_par("vision", data=64, rank_offset=0), *_par("audio", data=64, rank_offset=64),
        "modules.language.num_layers=8",
        *_par("language", tensor=4, pipeline=2, data=16, rank_offset=128),
        "train.micro_batch_size=64", "train.global_batch_size=256"])
    layout = check_layout(cfg)
    assert layout.world_size == 256 and not layout.colocated
    seen = {}
    for roles in layout.rank_map():
        (r,) = roles
        key = (r.module, r.tp, r.dp, r.pp)
        assert key not in seen
        seen[key] = r.rank
        assert layout.modules[r.module].rank_at(tp=r.tp, dp=r.dp, pp=r.pp) == r.rank
    assert len(seen) == 256


@pytest.mark.parametrize(("num_layers", "pipeline", "given", "expected"), [
    (4, 2, None, [[0, 1], [2, 3]]),
    (5, 2, None, [[0, 1, 2], [3, 4]]),
    (4, 2, [1, 3], [[0], [1, 2, 3]]),
    (3, 3, None, [[0], [1], [2]]),
])
def test_stage_layers(num_layers, pipeline, given, expected):
    assert stage_layers(num_layers, pipeline, given) == expected
