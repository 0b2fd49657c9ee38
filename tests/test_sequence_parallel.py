"""Sequence parallelism in the language model trains like the plain PyTorch loop.

Every layout class the validator accepts with ``sequence_parallel = true`` (non-colocated
TP 2, non-colocated TP 2 x PP 2, colocated TP 2 x DP 2) is compared over 10 iterations
with :func:`tests.reference.reference_run` (losses, global grad norm, per-module grad
norms as stepped, final weights, 1e-4 relative); the rejected combinations name the field.
"""

from __future__ import annotations

import pytest

import mimotron.models.language as language_module
from mimotron.config import load_config
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, engine_run, noncolocated
from tests.parity import reference, run_against_plain_loop

NUM_ITERS = 10
PARITY = ["train.iters=10"]
SP = ["modules.language.parallel.sequence_parallel=true"]
SEQ = 64  # data.seq_length of configs/digits.toml

CASES = {
    "language-tp2-sp": noncolocated({}, {}, {"tensor": 2}),
    "language-tp2pp2-sp": noncolocated({}, {}, {"tensor": 2, "pipeline": 2}),
}
# Colocated SP: tests/test_recompute.py trains coloc-language-tp2-sp against the plain loop.


def sp_engine_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """:func:`engine_run`, also recording the sequence length each language layer stack ran."""
    shapes: list[int] = []
    scatter = language_module.scatter_sequence

    def recording_scatter(x, group):  # noqa: ANN001, ANN202
        out = scatter(x, group)
        shapes.append(out.shape[1])
        return out

    language_module.scatter_sequence = recording_scatter  # this forked rank only
    return {**engine_run(rank, world, overrides, num_iters), "sharded_seq": shapes}


@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_matches_plain_loop(name):
    # SP does not change the model or the data: the plain loop of PARITY alone.
    results = run_against_plain_loop(CASES[name] + SP, [], sp_engine_run, NUM_ITERS,
                                     schedule=PARITY)
    ref = reference([], NUM_ITERS, PARITY)
    weights = {n: w for res in results for n, w in res["weights"].items()}
    for pname, initial in ref.initial.items():
        assert not (weights[pname] == initial).all(), f"{pname} did not train"
    # The language ranks really ran their layers on seq / tp positions.
    sharded = [s for res in results for s in res["sharded_seq"]]
    assert sharded and set(sharded) == {SEQ // 2}


INVALID = [
    pytest.param(SP, "modules.language.parallel.sequence_parallel=true is invalid with "
                 "modules.language.parallel.tensor=1", id="no-tp"),
    pytest.param(noncolocated({}, {}, {"tensor": 2}) + SP + ["data.seq_length=66"]
                 + ["modules.language.parallel.tensor=4"],
                 "data.seq_length=66 is invalid", id="seq-not-divisible"),
    pytest.param(noncolocated({"tensor": 2}, {}, {})
                 + ["modules.vision.parallel.sequence_parallel=true"],
                 "modules.vision.parallel.sequence_parallel=true is invalid", id="encoder"),
]


@pytest.mark.parametrize(("overrides", "needle"), INVALID)
def test_sequence_parallel_rejections_name_the_field(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        check_layout(load_config(DIGITS, BASE + overrides))


def test_activation_estimate_accounts_for_sequence_parallelism():
    from mimotron.config.schema import default_ffn_hidden_size
    from mimotron.estimate.memory import activation_bytes, layer_bytes_per_token

    def per_token(language: dict, *extra: str) -> tuple[int, int]:
        cfg = load_config(DIGITS, BASE + noncolocated({}, {}, language) + list(extra))
        return layer_bytes_per_token(cfg, "language")

    h = load_config(DIGITS, BASE).modules["language"].hidden_size
    f = default_ffn_hidden_size(h)
    # fp32: the norms' inputs (2 x 4h) and the linears' shared inputs (2 x 4h) are whole
    # on every TP rank; attention (q, k, v, output: 4 x 4h) and SwiGLU (4 x 4f) split.
    norms, linear_inputs, split = 8 * h, 8 * h, 4 * (4 * h + 4 * f)
    assert per_token({}) == per_token({"tensor": 2}) == (norms + linear_inputs, split)
    # SP splits all of it: the norms see seq / tp, the linears keep their input's shard.
    assert per_token({"tensor": 2}, *SP) == (0, split + norms + linear_inputs)
    # Against the saved tensors measured by benchmarks/sequence_parallel.py (wide model,
    # docs/long-sequences.md): 95.1 MiB without SP and 78.1 MiB with it, per TP-2 rank.
    wide = ["modules.language.hidden_size=512", "modules.language.num_layers=4",
            "modules.language.num_heads=8", "train.global_batch_size=16",
            "train.micro_batch_size=16"]
    for extra, measured in (((), 95.1), (SP, 78.1)):
        cfg = load_config(DIGITS, noncolocated({}, {}, {"tensor": 2}) + wide + list(extra))
        assert abs(activation_bytes(cfg, "language") / 2**20 / measured - 1) < 0.01
