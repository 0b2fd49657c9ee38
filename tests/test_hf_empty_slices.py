"""Hugging Face towers under tensor parallelism with data-parallel slices that hold nothing.

A DTensor linear given a 3-D input views its product back to 3-D inside the sharded op;
with zero rows DTensor cannot place that view when the token count does not divide by
the TP degree (CLIP's 577 positions at TP 8, Whisper's 1500 at TP 8) and raised. The
layers now hand the sharded linears matrices (``mimotron.models.blocks.linear_on_rows``).

Two checks: every tower family (CLIP, SigLIP, Whisper; odd position counts) plus its
projector under TP 2 gives ``[0, tokens, lm_hidden]`` for zero rows, and gradients equal to
the unsharded module's on real rows; and the engine trains a CLIP tower with 17 positions
and 17 output tokens (class token kept) and a Whisper encoder, both TP 2 (colocated with
the language model at DP 2) on micro-batches of 2 samples, so a tower's slice is at times
empty, like the plain PyTorch loop.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from mimotron.forked_ranks import run_ranks
from mimotron.models.encoders import ModalitySubmodule, Projector
from mimotron.models.hf.clip import ClipVisionTower, SiglipVisionTower
from mimotron.models.hf.whisper import WhisperEncoderTower
from mimotron.models.init import init_parameters_
from tests.common import coloc
from tests.parity import (
    PARITY,
    assert_module_norms_match,
    assert_steps_match,
    assert_weights_match,
    checked_modules,
    engine_results,
    reference,
)
from tests.reference import ReferenceRun

LM_HIDDEN = 24
SEED = 3
_LAYER = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu",
          "layer_norm_eps": 1e-5}
_VIT = {"num_channels": 1, "hidden_size": 16, "intermediate_size": 32, **_LAYER}
# Odd position counts (TP 2 does not divide them): 2x2 patches + CLIP's class token (kept
# in the output), 3x3 SigLIP patches, 3 Whisper frames after the stride-2 conv.
TOWERS: dict[str, tuple[type, dict, tuple[int, ...], int]] = {
    "clip": (ClipVisionTower, {**_VIT, "image_size": 4, "patch_size": 2,
                               "vision_feature_select_strategy": "full"}, (1, 4, 4), 5),
    "siglip": (SiglipVisionTower, {**_VIT, "image_size": 6, "patch_size": 2}, (1, 6, 6), 9),
    "whisper": (WhisperEncoderTower, {
        "num_mel_bins": 4, "max_source_positions": 3, "d_model": 16, "encoder_layers": 2,
        "encoder_attention_heads": 4, "encoder_ffn_dim": 32}, (4, 6), 3),
}


def _submodule(cls: type, args: dict) -> ModalitySubmodule:
    tower = cls(**args)
    sub = ModalitySubmodule(tower, Projector(tower.output_size, LM_HIDDEN))
    return init_parameters_(sub, SEED, prefix="modality_submodules.x.")


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _tp_rank(rank: int, world: int) -> dict[str, dict]:
    """Per family: the output shape and gradients for zero rows, and the gradients'
    largest relative difference from the unsharded module on two real rows."""
    from torch.distributed.device_mesh import DeviceMesh

    from mimotron.parallel.tensor_parallel import apply_tensor_parallel

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    out = {}
    for family, (cls, args, shape, _) in TOWERS.items():
        plain, sharded = _submodule(cls, args), _submodule(cls, args)
        apply_tensor_parallel(sharded, mesh, is_language=False)
        empty = sharded(torch.zeros(0, *shape))
        empty.sum().backward()
        zero_grads = _grads(sharded)
        assert all(g is not None for g in zero_grads.values()), family
        empty_ok = all(not bool(g.any()) for g in zero_grads.values())
        sharded.zero_grad(set_to_none=True)
        x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(7))
        weights = torch.randn(2, TOWERS[family][3], LM_HIDDEN,
                              generator=torch.Generator().manual_seed(8))
        (sharded(x) * weights).sum().backward()
        (plain(x) * weights).sum().backward()
        want, got = _grads(plain), _grads(sharded)
        assert set(got) == set(want), family
        worst = max(float((got[n] - w).norm() / w.norm()) for n, w in want.items()
                    if "wk.bias" not in n)  # its gradient is zero in exact arithmetic
        out[family] = {"shape": tuple(empty.shape), "empty_grads_zero": empty_ok,
                       "worst": worst}
    return out


def test_towers_under_tp2_take_zero_rows() -> None:
    results = run_ranks(2, _tp_rank, timeout_s=180)
    for rank, res in enumerate(results):
        for family, (_, _, _, tokens) in TOWERS.items():
            got = res[family]
            where = f"rank {rank} {family}"
            assert got["shape"] == (0, tokens, LM_HIDDEN), where
            assert got["empty_grads_zero"], where
            assert got["worst"] < 1e-5, f"{where}: gradient relative error {got['worst']}"


def _save_folders(root: Path) -> dict[str, Path]:
    """A CLIP tower on the digits images (8x8, patches of 2: 16 + 1 positions) and a
    Whisper model on the digits spectrograms (129 bins, 16 frames: 8 positions)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, WhisperConfig, WhisperModel

    torch.manual_seed(0)
    paths = {"vision": root / "vision", "audio": root / "audio"}
    CLIPVisionModel(CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_channels=1, image_size=8, patch_size=2)).save_pretrained(paths["vision"])
    WhisperModel(WhisperConfig(
        d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, num_mel_bins=129,
        max_source_positions=8, max_target_positions=16, vocab_size=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )).save_pretrained(paths["audio"])
    return paths


def _without_key_bias(results: list[dict], ref: ReferenceRun) -> tuple[list[dict],
                                                                     ReferenceRun]:
    """Results and reference without CLIP's ``attn.wk.bias``: its gradient is zero in exact
    arithmetic (it adds the same ``q . b`` to every score of a query), so Adam turns
    round-off into +-lr steps there; its effect on the loss is nil, which the losses and
    grad norms cover."""
    def keep(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: w for n, w in weights.items() if not n.endswith("attn.wk.bias")}

    return ([{**r, "weights": keep(r["weights"])} for r in results],
            replace(ref, weights=keep(ref.weights)))


def test_hf_towers_tp2_with_empty_slices_train_like_one_process(tmp_path: Path) -> None:
    """Colocated on 2 ranks: CLIP and Whisper at TP 2, the language model at DP 2;
    micro-batches of 2 samples, so an encoder's slice (the whole micro-batch) at times
    holds no sample of its modality; NUM_ITERS iterations of the parity schedule."""
    pytest.importorskip("transformers")
    paths = _save_folders(tmp_path)
    shared = [f"modules.vision.hf_path='{paths['vision']}'",
              f"modules.audio.hf_path='{paths['audio']}'",
              "modules.vision.vision_feature_layer=-1",
              "modules.vision.vision_feature_select_strategy='full'",
              "modules.vision.hidden_size=32", "modules.vision.num_layers=2",
              "modules.audio.hidden_size=32", "modules.audio.num_layers=1",
              "modules.audio.downsample_factor=2", "train.micro_batch_size=2"]
    tp2 = {"tensor": 2, "data": 1}
    overrides = PARITY + coloc(tp2, tp2, {"data": 2}) + shared
    results = engine_results(overrides)
    ref = reference(shared)
    assert_steps_match(results, ref)
    assert_module_norms_match(results, ref, checked_modules(overrides))
    assert_weights_match(*_without_key_bias(results, ref))
    assert ref.losses[-1] < ref.losses[0]
    # The path under test ran: encoder calls on slices holding no sample.
    assert sum(r["empty_encoder_outputs"] for r in results) > 0
