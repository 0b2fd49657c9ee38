"""Decoder-only language model and its loss.

The model is split the way the MIMO engine needs it: ``embed_tokens`` (first stage) runs
before modality embeddings are merged in, ``forward`` runs the layers on the merged
hidden states and, on the last stage, the final norm and the (untied) output head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mimotron.models.blocks import RMSNorm, make_layers, rope_cache


class LanguageModel(nn.Module):
    """Causal transformer with rotary embeddings; pipeline-splittable by global layer.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width.
        num_layers: layers of the whole model.
        num_heads: attention heads (``hidden_size / num_heads`` must be even for RoPE).
        ffn_hidden_size: SwiGLU width (0 = default).
        max_seq_len: longest sequence ``forward`` accepts.
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the token embedding (first pipeline stage).
        post_process: hold the final norm and output head (last pipeline stage).

    Raises:
        ValueError: on a bad ``vocab_size``, ``max_seq_len`` or head layout.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        ffn_hidden_size: int = 0,
        max_seq_len: int = 64,
        layer_ids: list[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        if vocab_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"LanguageModel needs vocab_size >= 1 and max_seq_len >= 1, "
                f"got vocab_size={vocab_size}, max_seq_len={max_seq_len}"
            )
        if num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(
                f"num_heads={num_heads} is invalid: expected a divisor of "
                f"hidden_size={hidden_size} leaving an even head size (for rotary embeddings)"
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.head_dim = hidden_size // num_heads
        self.max_seq_len = max_seq_len
        self.pre_process = pre_process
        self.post_process = post_process
        self.embed = nn.Embedding(vocab_size, hidden_size) if pre_process else None
        self.layers = make_layers(
            layer_ids,
            num_layers,
            hidden=hidden_size,
            num_heads=num_heads,
            ffn_hidden=ffn_hidden_size,
            causal=True,
        )
        self.final_norm = RMSNorm(hidden_size) if post_process else None
        self.output = nn.Linear(hidden_size, vocab_size, bias=False) if post_process else None

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Look up token embeddings ``[B, S] -> [B, S, hidden]`` (first stage only).

        Raises:
            ValueError: on a stage without the embedding.
        """
        if self.embed is None:
            raise ValueError("embed_tokens called on a LanguageModel built with pre_process=False")
        return self.embed(tokens)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run this stage's layers (and, on the last stage, the norm and output head).

        Args:
            hidden: ``[B, S, hidden]`` embeddings (merged) or a previous stage's output.

        Returns:
            Logits ``[B, S, vocab]`` on the last stage, else hidden states ``[B, S, hidden]``.

        Raises:
            ValueError: if ``S`` exceeds ``max_seq_len``.
        """
        seq = hidden.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.max_seq_len}")
        # Recomputed per call: tiny, and avoids buffers that meta-device builds and
        # checkpoints would have to special-case.
        rope = rope_cache(seq, self.head_dim, device=hidden.device)
        for layer in self.layers.values():
            hidden = layer(hidden, rope)
        if self.final_norm is None or self.output is None:
            return hidden
        return self.output(self.final_norm(hidden))


def language_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed next-token cross entropy, token count, and per-sample exact match.

    The loss is a SUM (in fp32), not a mean: the trainer divides by the token count of
    the whole global batch, which is what keeps results independent of micro-batching
    and data parallelism (docs/design.md, "The parity contract").

    Args:
        logits: ``[B, S, vocab]``.
        labels: ``[B, S]`` target ids (already shifted: ``labels[:, t]`` follows ``t``).
        loss_mask: ``[B, S]``; nonzero marks a scored position, and its value weights the
            token's loss (normally 0/1).

    Returns:
        ``(loss_sum, num_tokens, correct)``: fp32 scalars with the weighted loss sum and
        the mask sum, and a bool ``[B]`` that is True where the argmax prediction is right
        at every scored position of the sample. Samples with nothing scored are False.

    Raises:
        ValueError: if the shapes disagree.
    """
    if logits.shape[:-1] != labels.shape or labels.shape != loss_mask.shape:
        raise ValueError(
            f"language_loss: logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must agree on [batch, seq]"
        )
    mask = loss_mask.float()
    per_token = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), reduction="none"
    ).view_as(mask)
    loss_sum = (per_token * mask).sum()
    num_tokens = mask.sum()
    scored = mask != 0
    right = (logits.argmax(dim=-1) == labels) | ~scored
    correct = right.all(dim=1) & scored.any(dim=1)
    return loss_sum, num_tokens, correct
