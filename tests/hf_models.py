"""Small Hugging Face model folders as modules, and their training checked against the
plain loop.

:func:`save_models` saves a random CLIP vision tower, Whisper model and Llama decoder
sized for the digits task; :func:`hf_overrides` names them by ``modules.<m>.hf_path``;
:func:`check_against_reference` trains a layout of them on forked ranks and compares it
with ``tests.reference`` (which starts from the same folders). The Llama vocabulary
(:data:`HF_VOCAB`) is smaller than the padded model vocabulary (64), so the embedding and
the untied head carry rows that are not in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from mimotron.config import load_config
from mimotron.data.hf_tokenizer import resize_embedding_rows
from mimotron.forked_ranks import run_ranks
from tests.common import BASE, DIGITS, engine_run
from tests.reference import reference_run

NUM_ITERS = 10
HF_VOCAB = 40  # below the padded model vocabulary (64): 24 rows are not in the checkpoint


def save_models(root: Path, kv_heads: int = 2, tied: bool = False, lm_layers: int = 2,
                 vision_layers: int = 3, audio_layers: int = 2) -> dict[str, Path]:
    """A CLIP vision tower, a Whisper model and a Llama decoder (seeded) saved under
    ``root/<module>``; returns module -> folder."""
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        LlamaConfig,
        LlamaForCausalLM,
        WhisperConfig,
        WhisperModel,
    )

    torch.manual_seed(0)
    paths = {m: root / m for m in ("vision", "audio", "language")}
    # The digits task's inputs: 1 x 8 x 8 images, 129 x 16 spectrograms.
    CLIPVisionModel(CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
        num_attention_heads=4,
        num_channels=1, image_size=8, patch_size=2)).save_pretrained(paths["vision"])
    WhisperModel(WhisperConfig(
        d_model=32, encoder_layers=audio_layers, encoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, num_mel_bins=129,
        max_source_positions=8, max_target_positions=16, vocab_size=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )).save_pretrained(paths["audio"])
    LlamaForCausalLM(LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=lm_layers, num_attention_heads=4, num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=tied)).save_pretrained(paths["language"])
    return paths


def hf_overrides(paths: dict[str, Path]) -> list[str]:
    """Overrides naming the folders of :func:`save_models` as the three modules."""
    return [f"modules.vision.hf_path='{paths['vision']}'",
            f"modules.audio.hf_path='{paths['audio']}'",
            f"modules.language.hf_path='{paths['language']}'",
            "modules.audio.downsample_factor=2",
            # configs/digits.toml and BASE size the toy modules; these match the folders.
            "modules.vision.hidden_size=32", "modules.vision.num_layers=2",
            "modules.audio.hidden_size=32", "modules.audio.num_layers=2",
            "modules.language.hidden_size=64",
            "train.iters=10"]


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def check_against_reference(hf_dirs: dict[str, Path], shared: list[str],
                            overrides: list[str], world: int,
                            run: Callable[..., dict] = engine_run) -> list[dict]:
    """Train ``overrides`` on ``world`` forked ranks (``run`` on each) and check it against
    the plain loop of ``shared``: the reference's initial rows, every step, final weights.

    Returns:
        Every rank's results, for a caller's own further checks.
    """
    results = run_ranks(world, run, overrides, NUM_ITERS, timeout_s=300)
    ref = reference_run(tuple(shared), NUM_ITERS)

    # The reference starts from the checkpoints: rows [0, 40) of the embedding and head
    # are the folder's, the rest are new; the projectors are mimotron's own.
    with safe_open(hf_dirs["language"] / "model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        head = f.get_tensor("lm_head.weight")
    assert torch.equal(ref.initial["language_model.embed.weight"][:HF_VOCAB], embed)
    assert torch.equal(ref.initial["language_model.output.weight"][:HF_VOCAB], head)
    assert ref.initial["language_model.embed.weight"].shape[0] == 64
    # The extra rows follow the tokenizer-resize rule (mean + seeded noise x std).
    for ours, table in (("embed", embed), ("output", head)):
        want = resize_embedding_rows(table, 64, seed=load_config(DIGITS, BASE).train.seed)
        torch.testing.assert_close(ref.initial[f"language_model.{ours}.weight"], want,
                                   rtol=1e-6, atol=1e-7)
    assert not torch.equal(ref.initial["language_model.embed.weight"][HF_VOCAB:],
                           ref.initial["language_model.output.weight"][HF_VOCAB:])

    for rank, res in enumerate(results):
        for it, (loss, norm, skipped, tokens) in enumerate(res["steps"]):
            where = f"rank {rank} iteration {it}"
            assert skipped is False and tokens == ref.num_tokens[it], where
            assert _rel(loss, ref.losses[it]) <= 1e-4, f"{where}: {loss} vs {ref.losses[it]}"
            assert _rel(norm, ref.grad_norms[it]) <= 1e-4, f"{where}: {norm}"
    assert ref.losses[-1] < ref.losses[0]  # a real learning rate: the model moved
    merged: dict[str, torch.Tensor] = {}
    for res in results:
        merged.update(res["weights"])
    assert set(merged) == set(ref.weights)
    for name, want in ref.weights.items():
        if name.endswith("attn.wk.bias"):
            # Its gradient is zero in exact arithmetic (a key bias adds the same q.b to
            # every score of a query; softmax ignores it), so Adam turns round-off into
            # +-lr steps: not comparable. Its loss effect is nil, covered by the losses.
            continue
        err = (merged[name] - want).norm() / max(float(want.norm()), 1e-12)
        assert float(err) <= 1e-4, f"{name}: relative error {float(err)}"
        assert not math.isnan(float(err))
        assert not torch.equal(want, ref.initial[name]) or "embed_positions" in name
    return results
