"""The memory estimate of ``mimotron plan`` against tensors counted in the real model.

Activations are checked against what autograd saves (``saved_tensors_hooks``, each
distinct storage once) when the real modules run forward: the difference between two
batch sizes, so what does not scale with the batch (autocast's weight copies, RoPE
tables) cancels and the per-sample bytes remain. The backward workspace is checked
against the live-byte peak of a real backward (``benchmarks/tensor_memory.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mimotron.config import load_config
from mimotron.estimate.memory import (
    activation_bytes,
    backward_workspace_bytes,
    estimate_memory,
    microbatches_in_flight,
    reduce_bucket_bytes,
)
from mimotron.models.build import build_module
from mimotron.models.language import language_loss
from mimotron.parallel.layout import check_layout
from tests.common import DIGITS
from tests.saved_bytes import SEQ, VOCAB, language_bytes_per_sample, per_sample

REPO = Path(__file__).resolve().parents[1]


def _cfg(precision: str, *extra: str):
    return load_config(DIGITS, [f"train.precision={precision}", *extra])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_language_activations_match_saved_tensors(precision):
    measured, estimate = language_bytes_per_sample(_cfg(precision), precision)
    # Left out: RMSNorm's per-token rsqrt, SDPA's logsumexp, the loss's per-token terms.
    assert estimate <= measured <= estimate * 1.02, (measured, estimate)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["vision", "audio"])
def test_encoder_activations_match_saved_tensors(name, precision):
    cfg = _cfg(precision)
    mod = cfg.modules[name]
    torch.manual_seed(0)
    encoder = build_module(cfg, name, VOCAB)
    shape = ((mod.in_channels, mod.image_size, mod.image_size) if mod.kind == "vit"
             else (mod.num_freq_bins, mod.num_frames))
    measured = per_sample(encoder, lambda n: torch.randn(n, *shape), precision, loss=False)
    samples = cfg.train.micro_batch_size // mod.parallel.data
    estimate = activation_bytes(cfg, name, VOCAB, in_flight=1) / samples
    assert estimate <= measured <= estimate * 1.02, (measured, estimate)


def test_microbatches_in_flight_follow_the_1f1b_warmup():
    cfg = load_config(DIGITS, [])
    layout = check_layout(cfg)
    # Encoders on their own ranks are one pipeline position ahead of the language model.
    assert [microbatches_in_flight(cfg, layout, m) for m in ("vision", "audio", "language")] \
        == [2, 2, 1]
    piped = load_config(DIGITS, ["modules.language.parallel.pipeline=2",
                                 "modules.language.parallel.data=1"])
    lay = check_layout(piped)
    assert microbatches_in_flight(piped, lay, "vision") == 3
    assert [microbatches_in_flight(piped, lay, "language", s) for s in (0, 1)] == [2, 1]
    plain = load_config(DIGITS, ['train.schedule="no_pipelining"'])
    assert microbatches_in_flight(plain, check_layout(plain), "vision") == 1


def test_estimate_total_peaks_once_and_shows_the_bucket():
    cfg = load_config(DIGITS, [])
    est = {e.module: e for items in estimate_memory(cfg, check_layout(cfg), VOCAB).values()
           for e in items}
    lm = est["language"]
    # DP 2: the fp32 gradients of a < 32 MiB model fit one bucket, flattened whole.
    assert lm.reduce_bucket == lm.num_params * 4 == reduce_bucket_bytes(cfg, "language",
                                                                          lm.num_params)
    assert est["vision"].reduce_bucket == 0  # DP 1: nothing reduced
    assert lm.total == lm.weights + lm.grads + lm.optimizer + lm.activations + lm.workspace
    assert lm.activations == activation_bytes(cfg, "language", VOCAB)


def test_backward_workspace_matches_a_measured_backward():
    """Peak of a real backward over the saved activations is the workspace.

    As in a step's later micro-batches, the gradients already exist (accumulated in
    place), so what the backward adds on top of the live forward is its workspace.
    """
    sys.path.insert(0, str(REPO))
    from benchmarks.tensor_memory import TensorMemoryMeter

    cfg = _cfg("fp32")
    torch.manual_seed(0)
    lm = build_module(cfg, "language", VOCAB)
    samples = cfg.train.micro_batch_size // cfg.modules["language"].parallel.data
    x = torch.randn(samples, SEQ, 128, requires_grad=True)
    labels = torch.zeros(samples, SEQ, dtype=torch.long)

    def loss() -> torch.Tensor:
        return language_loss(lm(x), labels, torch.ones(samples, SEQ))[0]

    loss().backward()  # the gradients exist from here on
    with TensorMemoryMeter(torch.device("cpu")) as meter:
        out = loss()
        meter.mark("forward")
        out.backward()
        meter.mark("backward")
    extra = meter.marks[1].peak_since_previous - meter.marks[0].live
    workspace = backward_workspace_bytes(cfg, "language")
    assert 0.8 * workspace <= extra <= 1.25 * workspace, (extra, workspace)
