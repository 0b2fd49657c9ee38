"""What a LoRA language model costs, measured on the fake-device tracker.

Llama-2-7B's language model at its real widths, heads, vocabulary and 2048-token
samples (its config.json-only folder, cut to 2 layers so a dry-run step takes seconds),
rank-128 adapters on every linear layer of a layer, bf16, on its own rank (a split
layout: CLIP ViT-L/14-336's tower frozen on rank 0, the projector training). The
frozen base is held once in bf16: 2 bytes per parameter where a trained model holds 4
(and 2 more of step casts, plus 12 of gradient and Adam state); the adapters train in
fp32. The plan's estimate of the rank is within 0.85-1.15 of its measured peak, with the
language layers fully recomputed as in ``tests/test_memory_peak.py`` (the band the
estimate is held to there).
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data.run_data import build_tokenizer
from mimotron.dryrun.memory_peak import measure_peak
from mimotron.estimate.memory import estimate_memory
from mimotron.parallel.layout import check_layout
from tests.memory_band import BAND, HF, ROOT, shallow_folder

LORA_7B = ["modules.language.lora.rank=128", "modules.language.lora.alpha=256.0",
           "modules.vision.freeze='encoder'", "modules.vision.parallel.data=1",
           "modules.language.parallel.tensor=1", "modules.language.parallel.pipeline=1",
           "modules.language.parallel.layers_per_stage=[]",
           "modules.language.parallel.rank_offset=1", "train.global_batch_size=4",
           "modules.language.recompute='full'"]


@pytest.fixture(scope="module")
def shallow_7b(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("hf_lora")
    vision = shallow_folder(HF / "clip_vit_l14_336", root / "clip", {"num_hidden_layers": 3})
    language = shallow_folder(HF / "llama2_7b", root / "llama", {"num_hidden_layers": 2})
    return [f"modules.vision.hf_path={vision}", f"modules.language.hf_path={language}",
            f"log.dir={root / 'runs'}"]


def test_the_base_is_held_once_in_bf16_and_the_estimate_holds(shallow_7b: list[str]) -> None:
    cfg = load_config(str(ROOT / "configs" / "llava15_7b_8gpu.toml"), shallow_7b + LORA_7B)
    vocab = padded_vocab_size(build_tokenizer(cfg).vocab_size)
    estimate = estimate_memory(cfg, check_layout(cfg), vocab, [1])[1]
    (language,) = [e for e in estimate if e.module == "language"]
    adapters, base = language.grads // 4, language.num_params - language.grads // 4
    assert 0.02 < adapters / base < 0.05  # rank 128 of 4096-wide projections
    peak = measure_peak(cfg, [1], run_first=[0])[1]
    held = peak.breakdown["Parameter"]
    per_base_param = (held - 4 * adapters) / base
    assert 1.99 <= per_base_param <= 2.01, (per_base_param, peak.format())
    # The estimate's weights: the parameters as held, and the adapters' 16-bit step casts
    # (the norms, 20k parameters held in fp32, it counts at 2 bytes).
    assert language.weights == pytest.approx(held + 2 * adapters, rel=1e-4)
    total = sum(e.total for e in estimate)
    assert BAND[0] <= total / peak.peak <= BAND[1], (
        f"estimate {total / 2**20:.0f} MiB vs {peak.format()}")
    print(f"LoRA 7B-shaped language rank: base {per_base_param:.3f} B/param, estimate "
          f"{total / 2**20:.0f} MiB / measured {peak.peak / 2**20:.0f} MiB "
          f"= {total / peak.peak:.3f}")
