"""Train mimotron's demo model with your own forward step (using mimotron as a library).

The forward step below is the built-in one plus an auxiliary z-loss (PaLM), which keeps
``log Z = logsumexp(logits)`` near 0. It returns its two loss terms by name as
``[sum, count]`` pairs, so ``metrics.jsonl`` gets ``lm_loss`` and ``z_loss`` beside
``loss`` (= ``lm_loss + Z_LOSS_WEIGHT * z_loss``, all per loss token).

    torchrun --nproc-per-node 4 examples/custom_forward_step.py [key=value ...]

(``configs/digits.toml`` places vision, audio and a 2-way data-parallel language model on
4 ranks; any layout works, e.g. add ``train.iters=200``. This step assumes the language
model is not tensor parallel: with vocab-sharded logits, score them with
``mimotron.training.step.language_loss_step`` instead of ``language_loss``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mimotron import setup_mimo, train_mimo
from mimotron.config import load_config
from mimotron.models.language import language_loss
from mimotron.runtime import init_runtime
from mimotron.training.step import language_input

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
Z_LOSS_WEIGHT = 1e-3


def forward_step(model: nn.Module, batch: dict[str, torch.Tensor],
                 embeddings: dict[str, torch.Tensor | None]
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The language model's step: called on the ranks that hold it, once per micro-batch.

    Args:
        model: the ``MimoModel`` (on this rank).
        batch: this rank's slice of the micro-batch (``tokens``, ``labels``,
            ``loss_mask``, ``has_image``, ... see ``mimotron.data.collate``).
        embeddings: encoder name -> its projected outputs for the samples carrying its
            modality (already moved here from the encoder's ranks).

    Returns:
        ``(loss_sum, num_loss_tokens, metrics)``. Losses are SUMS over tokens: the engine
        divides by the global batch's token count. In ``metrics``, ``correct`` and
        ``samples`` give ``train_accuracy``; a ``[sum, count]`` pair is logged by name as
        sum / count (summed over micro-batches and data-parallel replicas first).
    """
    logits = model.language_model(language_input(model, batch, embeddings))
    lm_sum, num_tokens, correct = language_loss(logits, batch["labels"], batch["loss_mask"])
    z_sum = (logits.float().logsumexp(dim=-1).pow(2) * batch["loss_mask"]).sum()
    real = batch["index"] >= 0  # Evaluation pads the last batch with index -1 samples.
    metrics = {
        "lm_loss": torch.stack([lm_sum.detach(), num_tokens]),
        "z_loss": torch.stack([z_sum.detach(), num_tokens]),
        "correct": (correct & real).sum(),
        "samples": real.sum(),
    }
    return lm_sum + Z_LOSS_WEIGHT * z_sum, num_tokens, metrics


def main(overrides: list[str]) -> dict:
    """Train the demo config (with ``key=value`` overrides); returns the run summary."""
    cfg = load_config(CONFIG, overrides)
    runtime = init_runtime(cfg.train.pg_timeout_s)  # Joins torchrun's group, or makes one.
    run = setup_mimo(cfg, runtime)  # Grids, model slice, optimizer, schedulers, data.
    summary = train_mimo(forward_step, run.model, run.optimizer, run.schedulers,
                         run.train_data_iterator, run.valid_data_iterator, run.global_state,
                         run.infra, run.communicator)
    if runtime.is_main:
        print(f"final loss {summary['loss']:.4f}, eval {summary['eval']}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
