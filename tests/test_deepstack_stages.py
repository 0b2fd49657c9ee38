"""Qwen3-VL's DeepStack layers spread over the language model's pipeline stages.

* The link's parts on their own: a feature set spread densely over a rank's positions
  and read back (whole rows and each context-parallel rank's), and how many sets each
  link of a layer split carries.
* The memory estimate counts the sets each stage's links carry.
* The engine, against the plain loop on transformers' own model (10 iterations at a real
  learning rate: losses, grad norms, final weights): a 4-layer language model whose
  three DeepStack layers sit on different stages, (a) one layer on the first stage and
  three on the second, with tensor and sequence parallelism; (b) interleaved (2 stages
  x 2 model chunks of one layer each: DeepStack on virtual stages 0, 1 and 2, so the
  second passes the third's set on) with context parallelism. All DeepStack layers on
  the first stage: ``test_qwen_vl_engine``.
"""

from __future__ import annotations

import pytest
import torch

from mimotron.config import load_config
from mimotron.config.native_vision import deepstack_source
from mimotron.estimate.activation_terms import deepstack_link_bytes_per_sample
from mimotron.parallel.context_parallel import load_balanced_positions
from mimotron.parallel.virtual_pipeline import rank_layers
from mimotron.pipeline.deepstack_link import (
    dense_features,
    feature_rows,
    link_extras,
)
from tests.hf_vlm import hf_reference_run, run_layouts
from tests.qwen_vl import QWEN_FAMILY, save_qwen_folder, write_qwen_config

transformers = pytest.importorskip("transformers")

IMAGE_ID = 3  # the character tokenizer's <image>
NUM_ITERS = 10
HIDDEN = 6


def _mask_and_features(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 16, generator=gen) < 0.4
    mask[0, 5] = True  # at least one visual position
    return mask, torch.randn(int(mask.sum()), HIDDEN, generator=gen)


def test_a_feature_set_spreads_over_the_visual_positions_and_reads_back() -> None:
    mask, features = _mask_and_features(0)
    dense = dense_features(features, mask, None, torch.zeros(3, 16, HIDDEN))
    assert torch.equal(dense[mask], features)  # row-major order, as the model takes them
    assert not dense[~mask].any()
    assert torch.equal(feature_rows(dense, mask, None), features)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_each_context_parallel_rank_carries_its_own_positions(cp_rank: int) -> None:
    mask, features = _mask_and_features(1)
    whole = dense_features(features, mask, None, torch.zeros(3, 16, HIDDEN))
    held = load_balanced_positions(16, 2, cp_rank, torch.device("cpu"))
    dense = dense_features(features, mask, held, torch.zeros(3, 8, HIDDEN))
    assert torch.equal(dense, whole[:, held])
    # Read back: every visual position's row, zeros at those the other rank holds.
    mine = torch.zeros_like(mask)
    mine[:, held] = mask[:, held]
    want = torch.where(mine[mask][:, None], features, torch.zeros_like(features))
    assert torch.equal(feature_rows(dense, mask, held), want)


def test_a_link_carries_the_sets_of_the_deepstack_layers_after_it() -> None:
    # Layers 0 | 1 2 3 with 3 DeepStack layers: into stage 1 go sets 1 and 2.
    assert link_extras(3, [[0]]) == {(0, False): 3, (0, True): 2}
    assert link_extras(3, [[1, 2, 3]]) == {(0, False): 2, (0, True): 0}
    # Interleaved, rank 0 of 2 with chunks [0], [2]: sets 1 after chunk 0, none later.
    assert link_extras(2, [[0], [2]]) == {(0, False): 2, (0, True): 1,
                                          (1, False): 0, (1, True): 0}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("qwen3_vl")
    save_qwen_folder(root / "folder", "qwen3_vl", IMAGE_ID, text_layers=4, deepstack=[0, 1, 2])
    return {"config": write_qwen_config(root, root / "folder", 256, NUM_ITERS)}


@pytest.mark.parametrize("over", [
    ["modules.language.parallel.layers_per_stage=[1, 3]"],
    ["modules.language.parallel.virtual_pipeline=2", "modules.language.parallel.context=2"]])
def test_the_memory_estimate_counts_what_the_links_carry(qwen3: dict, over: list[str]) -> None:
    """Each stage keeps its links' tensors: the sets the engine's links carry (out of
    every chunk, into every chunk but the embeddings') x positions x hidden, fp32."""
    cfg = load_config(qwen3["config"], ["modules.language.parallel.pipeline=2",
                                        "modules.language.parallel.rank_offset=1", *over])
    lm = cfg.modules["language"]
    positions = cfg.data.seq_length // lm.parallel.context
    for stage in range(2):
        layers, chunks = rank_layers(lm.num_layers, lm.parallel, stage)
        extras = link_extras(3, chunks or [layers])
        sets = sum(n for (j, down), n in extras.items() if down or (chunks or [layers])[j][0])
        assert sets > 0
        assert deepstack_link_bytes_per_sample(cfg, "language", chunks or [layers]) == (
            sets * positions * lm.hidden_size * 4), (over, stage)


def test_the_config_accepts_deepstack_on_any_stage(qwen3: dict) -> None:
    cfg = load_config(qwen3["config"], [
        "modules.language.parallel.pipeline=2", "modules.language.parallel.rank_offset=1",
        "modules.language.parallel.virtual_pipeline=2"])
    assert deepstack_source(cfg) == ("vision", 3)


_LAYOUTS = {
    "vision | language PP 2 [1, 3] x TP 2 + SP": (5, [
        "modules.language.parallel.pipeline=2", "modules.language.parallel.tensor=2",
        "modules.language.parallel.sequence_parallel=true",
        "modules.language.parallel.layers_per_stage=[1, 3]",
        "modules.language.parallel.rank_offset=1"]),
    "vision | language PP 2 x virtual 2 x CP 2": (5, [
        "modules.language.parallel.pipeline=2", "modules.language.parallel.virtual_pipeline=2",
        "modules.language.parallel.context=2", "modules.language.parallel.rank_offset=1"]),
}


def test_deepstack_over_two_stages_trains_like_a_plain_loop(qwen3: dict) -> None:
    ref = hf_reference_run(qwen3["config"], NUM_ITERS, family=QWEN_FAMILY)
    assert ref.losses[-1] < ref.losses[0] - 0.3, ref.losses
    run_layouts(qwen3["config"], ref, _LAYOUTS, NUM_ITERS, timeout_s=400)
