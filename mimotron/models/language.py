"""Decoder-only language model and its loss.

The model is split the way the MIMO engine needs it: ``embed_tokens`` (first stage) runs
before modality embeddings are merged in, ``forward`` runs the layers on the merged
hidden states and, on the last stage, the final norm and the output head (untied
unless ``tie_word_embeddings``, which needs both ends on one stage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mimotron.config.rope_scaling import validate_rope_scaling
from mimotron.models.attention import AttentionSegments, Documents, attention_segments
from mimotron.models.blocks import (
    RMSNorm,
    chunk_modules,
    default_inv_freq,
    is_last_chunk,
    make_layers,
    rope_cache,
    to_residual_dtype,
)
from mimotron.models.deepstack import add_visual, visual_rows
from mimotron.models.kv_cache import KVCache
from mimotron.models.moe import MoEOptions, check_layer_freq, moe_factory
from mimotron.models.mrope import check_mrope_section, mrope_axes, mrope_tables
from mimotron.models.rope_scaling import rope_inv_freq
from mimotron.parallel.context_parallel import load_balanced_positions
from mimotron.parallel.sequence_parallel import gather_sequence, scatter_sequence


class LanguageModel(nn.Module):
    """Causal transformer with rotary embeddings; pipeline-splittable by global layer.

    The defaults are mimotron's toy decoder. The keyword-only options make it exactly a
    Hugging Face Llama / Qwen2 / Qwen3 decoder (:mod:`mimotron.models.hf.llama` maps a
    ``config.json`` onto them).

    Args:
        vocab_size: number of token ids.
        hidden_size: model width.
        num_layers: layers of the whole model.
        num_heads: attention (query) heads.
        ffn_hidden_size: SwiGLU width (0 = default).
        max_seq_len: longest sequence ``forward`` accepts.
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the token embedding (first pipeline stage).
        post_process: hold the final norm and output head (last pipeline stage).
        num_kv_heads: key/value heads for grouped-query attention (``None`` = all heads).
        head_dim: per-head width (``None`` = ``hidden_size / num_heads``); must be even.
        qkv_bias: biases on the q/k/v projections.
        out_bias: bias on the attention output projection.
        qk_norm: per-head RMSNorm of queries and keys (Qwen3).
        mlp_bias: biases on the SwiGLU projections.
        norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: ``None`` = the toy model's RoPE formula; a dict (``{"rope_type":
            "default" | "linear" | "llama3", ...}``) = ``transformers``' formula for that
            type (:mod:`mimotron.models.rope_scaling`).
        tie_word_embeddings: the output head shares the embedding matrix. Both live on
            one stage only, so this needs ``pre_process`` and ``post_process`` (no
            pipeline split of the language model).
        moe: mixture-of-experts options (:class:`~mimotron.models.moe.MoEOptions`): the
            layers it selects get an MoE block as ``mlp``; ``None`` = dense model.
        mrope_section: 3-D rotary positions (Qwen2.5-VL / Qwen3-VL, :mod:`mimotron.models.
            mrope`): the frequencies of the temporal, height and width axes (summing to
            ``head_dim / 2``); ``forward`` then takes ``[3, B, S]`` ``position_ids``.
            ``None`` = 1-D RoPE.
        mrope_interleaved: Qwen3-VL's interleaved layout of ``mrope_section``
            (``False``: Qwen2.5-VL's consecutive sections).

    Raises:
        ValueError: on a bad ``vocab_size``, ``max_seq_len``, head layout, RoPE scaling,
            M-RoPE section, or tied embeddings on a pipeline stage without both ends.
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
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        mlp_bias: bool = False,
        norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        tie_word_embeddings: bool = False,
        moe: MoEOptions | None = None,
        mrope_section: Sequence[int] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self._check_sizes(vocab_size, hidden_size, num_heads, head_dim, max_seq_len)
        if mrope_interleaved and mrope_section is None:
            raise ValueError("mrope_interleaved=true needs an mrope_section (three counts of "
                             "frequencies: temporal, height, width)")
        if tie_word_embeddings and not (pre_process and post_process):
            raise ValueError(
                "tie_word_embeddings=true needs the embedding and the output head on one "
                "pipeline stage: use pipeline=1 for this language model (or untied weights)"
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.head_dim = head_dim or hidden_size // num_heads
        self.max_seq_len = max_seq_len
        self.pre_process = pre_process
        self.post_process = post_process
        self.rope_theta = float(rope_theta)
        self.rope_scaling = None if rope_scaling is None else validate_rope_scaling(rope_scaling)
        self.mrope_section = (None if mrope_section is None
                              else check_mrope_section(mrope_section, self.head_dim))
        self.mrope_interleaved = bool(mrope_interleaved)
        self.tie_word_embeddings = tie_word_embeddings
        self.embed = nn.Embedding(vocab_size, hidden_size) if pre_process else None
        if moe is not None:
            check_layer_freq(moe.layer_freq, num_layers)
        self.moe = moe
        self.layers = make_layers(
            layer_ids,
            num_layers,
            mlp_factory=None if moe is None else moe_factory(moe, hidden_size, num_layers),
            hidden=hidden_size,
            num_heads=num_heads,
            ffn_hidden=ffn_hidden_size,
            causal=True,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            qk_norm=qk_norm,
            mlp_bias=mlp_bias,
            norm_eps=norm_eps,
        )
        self.final_norm = RMSNorm(hidden_size, norm_eps) if post_process else None
        self.output = nn.Linear(hidden_size, vocab_size, bias=False) if post_process else None
        if tie_word_embeddings:
            self.tie_weights()
        # The TP group when sequence parallelism is on (set by apply_tensor_parallel).
        self.sequence_parallel_group: dist.ProcessGroup | None = None
        # The residual stream in fp32 under autocast (train.fp32_residual_connection).
        self.fp32_residual = False
        # The CP group under context parallelism (set_context_parallel).
        self.context_parallel_group: dist.ProcessGroup | None = None
        # Interleaved 1F1B: global layer ids of each model chunk this instance holds
        # (mimotron.parallel.virtual_pipeline); forward(chunk=j) runs one of them.
        self.layer_chunks: list[list[int]] | None = None

    def set_context_parallel(self, group: dist.ProcessGroup | None) -> None:
        """Run this stage on a context-parallel group's load-balanced positions.

        ``forward`` then takes this rank's positions only (``[B, S / c, H]``, see
        :mod:`mimotron.parallel.context_parallel`) and every attention layer all-gathers
        its keys and values over ``group`` (:mod:`mimotron.parallel.context_attention`).
        ``None`` (or a group of one) switches it off.
        """
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        self.context_parallel_group = group
        for layer in self.layers.values():
            layer.attn.context_parallel_group = group

    def context_positions(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """Global positions this rank holds of a ``seq_len`` sequence (``None`` without CP)."""
        group = self.context_parallel_group
        if group is None:
            return None
        return load_balanced_positions(seq_len, dist.get_world_size(group),
                                       dist.get_rank(group), device)

    def _cp_coordinates(self) -> tuple[int, int]:
        """``(size, rank)`` of this stage's context-parallel group (``(1, 0)`` without)."""
        group = self.context_parallel_group
        return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))

    def _rope_and_plan(
        self, seq: int, batch: int, rope: tuple[torch.Tensor, torch.Tensor],
        documents: Documents | None, position_ids: torch.Tensor | None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionSegments | None]:
        """RoPE rows at this rank's positions, and the attention plan of its queries.

        No plan for an unpacked row without context parallelism (plain causal SDPA).
        Packed rows index RoPE by ``position_ids`` (restarting per document).
        """
        cp_size, cp_rank = self._cp_coordinates()
        if documents is None and cp_size == 1:
            return rope, None
        device = rope[0].device
        pos = self.context_positions(seq, device)
        if documents is None:
            documents = Documents.whole(batch, seq)
            rope = (rope[0][pos], rope[1][pos])
        else:
            rows = (position_ids if position_ids is not None
                    else torch.arange(seq, device=device).expand(batch, seq))
            rows = rows if pos is None else rows[:, pos]
            rope = (rope[0][rows].unsqueeze(1), rope[1][rows].unsqueeze(1))
        return rope, attention_segments(documents, device, cp_size, cp_rank)

    @staticmethod
    def _check_sizes(
        vocab_size: int, hidden_size: int, num_heads: int, head_dim: int | None, max_seq_len: int
    ) -> None:
        if vocab_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"LanguageModel needs vocab_size >= 1 and max_seq_len >= 1, "
                f"got vocab_size={vocab_size}, max_seq_len={max_seq_len}"
            )
        if head_dim is not None:
            if head_dim < 2 or head_dim % 2 or num_heads < 1:
                raise ValueError(
                    f"head_dim={head_dim} with num_heads={num_heads} is invalid: expected an "
                    "even head_dim (for rotary embeddings) and num_heads >= 1"
                )
        elif num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(
                f"num_heads={num_heads} is invalid: expected a divisor of "
                f"hidden_size={hidden_size} leaving an even head size (for rotary embeddings)"
            )

    def tie_weights(self) -> None:
        """Make the output head use the embedding's parameter (again, e.g. after TP sharding).

        Raises:
            ValueError: if this instance does not hold both the embedding and the head.
        """
        if self.embed is None or self.output is None:
            raise ValueError("tie_weights needs a LanguageModel holding both embed and output")
        self.output.weight = self.embed.weight

    def rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` tables for ``seq`` positions on ``device``."""
        if self.rope_scaling is None:
            return rope_cache(seq, self.head_dim, base=self.rope_theta, device=device)
        # transformers computes the frequencies on the CPU once; so do we (then move).
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        return rope_cache(seq, self.head_dim, device=device, inv_freq=inv_freq)

    def _inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies ``[head_dim // 2]``, fp32, computed on the CPU."""
        if self.rope_scaling is None:
            return default_inv_freq(self.head_dim, self.rope_theta, torch.device("cpu"))
        return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)

    def mrope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row ``(cos, sin)`` of M-RoPE positions (:mod:`mimotron.models.mrope`).

        Args:
            position_ids: ``[3, B, S]`` (temporal, height, width), or ``[B, S]`` (text
                positions: the same on every axis).

        Returns:
            fp32 ``[B, 1, S, head_dim // 2]`` each, on ``position_ids``' device.

        Raises:
            ValueError: a model built without ``mrope_section``, or another shape.
        """
        if self.mrope_section is None:
            raise ValueError("3-D position_ids need a LanguageModel built with mrope_section")
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        axes = mrope_axes(self.mrope_section, self.mrope_interleaved, self.head_dim)
        return mrope_tables(position_ids, self._inv_freq(), axes)

    def _mrope_and_plan(
        self, seq: int, batch: int, device: torch.device, documents: Documents | None,
        position_ids: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionSegments | None]:
        """:meth:`_rope_and_plan` of M-RoPE positions (whole rows: this rank takes its
        load-balanced columns under context parallelism)."""
        if tuple(position_ids.shape[-2:]) != (batch, seq) or position_ids.dim() not in (2, 3):
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} for hidden "
                             f"states of {batch} x {seq}: expected [3, {batch}, {seq}] or "
                             f"[{batch}, {seq}] (whole rows, also under context parallelism)")
        cp_size, cp_rank = self._cp_coordinates()
        positions = position_ids.to(device)
        held = self.context_positions(seq, device)
        if held is not None:
            positions = positions[..., held]
        rope = self.mrope(positions)
        if documents is None and cp_size == 1:
            return rope, None
        documents = documents if documents is not None else Documents.whole(batch, seq)
        return rope, attention_segments(documents, device, cp_size, cp_rank)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Look up token embeddings ``[B, S] -> [B, S, hidden]`` (first stage only).

        Raises:
            ValueError: on a stage without the embedding.
        """
        if self.embed is None:
            raise ValueError("embed_tokens called on a LanguageModel built with pre_process=False")
        return self.embed(tokens)

    def forward(self, hidden: torch.Tensor, documents: Documents | None = None,
                position_ids: torch.Tensor | None = None, chunk: int | None = None,
                cache: KVCache | None = None,
                deepstack: Sequence[torch.Tensor | None] | None = None,
                visual_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers (and, on the last stage, the norm and output head).

        Args:
            hidden: ``[B, S, hidden]`` embeddings (merged) or a previous stage's output;
                under context parallelism ``[B, S / c, hidden]``, this rank's positions.
            documents: packed rows only (``data.packing``): where each row's documents
                start (:meth:`~mimotron.models.attention.Documents.from_doc_ids`);
                attention is then causal within each document only. Whole rows
                (``S`` positions) under context parallelism too.
            position_ids: with ``documents``: ``[B, S]`` RoPE positions (restarting at 0
                for every document); whole under context parallelism too. A model with
                ``mrope_section`` takes ``[3, B, S]`` (temporal, height, width;
                :mod:`mimotron.data.mrope_positions`) or ``[B, S]`` (text), with or
                without ``documents`` (``None``: ``0 .. S - 1``).
            chunk: interleaved pipelines only: run model chunk ``chunk`` of
                ``layer_chunks`` (the head only after the last one); ``None`` = every layer.
            cache: incremental decoding (:mod:`mimotron.models.kv_cache`; one process,
                the whole model): ``hidden`` holds the ``S`` positions after the
                ``cache.length`` cached ones, which attend to all of them; the cache
                then holds them too. Training passes ``None``. With ``mrope_section``,
                ``position_ids`` are those ``S`` positions (``[3, B, S]``).
            deepstack: Qwen3-VL's DeepStack: the layer of global index ``i <
                len(deepstack)`` adds ``deepstack[i]`` (``[num visual, hidden]``) to its
                output at the visual positions, in row-major order (only the layers
                this stage holds add theirs; ``None`` where another stage holds layer
                ``i``, :mod:`mimotron.pipeline.deepstack_link`).
            visual_mask: with ``deepstack``: bool ``[B, S]`` of the visual positions,
                whole rows also under context parallelism (on the host, it costs no
                device synchronisation).

        Returns:
            Logits ``[B, S, vocab]`` on the last stage, else hidden states ``[B, S, hidden]``.

        Raises:
            ValueError: if ``S`` exceeds ``max_seq_len``, ``documents``, ``position_ids``
                or ``visual_mask`` do not match it, or ``deepstack`` has the wrong row count.
        """
        if cache is not None:
            return self._cached_forward(hidden, cache, position_ids, deepstack, visual_mask)
        seq = hidden.shape[1]
        if self.context_parallel_group is not None:
            seq *= dist.get_world_size(self.context_parallel_group)
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.max_seq_len}")
        if documents is not None and (documents.seq_len, documents.num_rows) != (
                seq, hidden.shape[0]):
            raise ValueError(f"documents of {documents.num_rows} rows x {documents.seq_len} "
                             f"positions for hidden states of {hidden.shape[0]} x {seq}")
        # Recomputed per call: tiny, and avoids buffers that meta-device builds and
        # checkpoints would have to special-case.
        if self.mrope_section is not None and position_ids is not None:
            rope, plan = self._mrope_and_plan(seq, hidden.shape[0], hidden.device, documents,
                                              position_ids)
        else:
            if position_ids is not None and position_ids.dim() == 3:
                raise ValueError("position_ids of shape [3, B, S] need a LanguageModel built "
                                 "with mrope_section")
            rope, plan = self._rope_and_plan(seq, hidden.shape[0],
                                             self.rope(seq, hidden.device), documents,
                                             position_ids)
        visual = (None if not deepstack else visual_rows(
            visual_mask, deepstack, (hidden.shape[0], seq), hidden.device,
            self._visual_positions(seq, hidden.device if visual_mask is None
                                   else visual_mask.device)))
        hidden = to_residual_dtype(hidden, self.fp32_residual)
        group = self.sequence_parallel_group
        if group is not None:
            # Sequence parallelism: layers and norms hold seq / tp; stages exchange whole
            # sequences (mimotron.parallel.sequence_parallel).
            hidden = scatter_sequence(hidden, group)
        layers = chunk_modules(self.layers, self.layer_chunks, chunk)
        ids = (list(map(int, self.layers)) if chunk is None
               else list(self.layer_chunks[chunk]))  # type: ignore[index]
        for index, layer in zip(ids, layers, strict=True):
            hidden = layer(hidden, rope) if plan is None else layer(hidden, rope, plan)
            features = (deepstack[index] if visual is not None and deepstack is not None
                        and index < len(deepstack) else None)
            if features is not None:
                hidden = add_visual(hidden, features, visual)
        last = is_last_chunk(self.layer_chunks, chunk)
        if self.final_norm is None or self.output is None or not last:
            return hidden if group is None else gather_sequence(hidden, group)
        return self.output(self.final_norm(hidden))

    def _visual_positions(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """The global positions along dim 1 of this rank's hidden states (``None``: all):
        its load-balanced ones under CP, then its chunk of those under sequence
        parallelism (:func:`~mimotron.parallel.sequence_parallel.scatter_sequence`)."""
        held = self.context_positions(seq, device)
        group = self.sequence_parallel_group
        if group is not None:
            held = torch.arange(seq, device=device) if held is None else held
            held = held.chunk(dist.get_world_size(group))[dist.get_rank(group)]
        return held

    def _cached_forward(self, hidden: torch.Tensor, cache: KVCache,
                        position_ids: torch.Tensor | None = None,
                        deepstack: Sequence[torch.Tensor] | None = None,
                        visual_mask: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` of positions ``[cache.length, cache.length + S)`` (see there)."""
        whole = self.pre_process and self.post_process and self.layer_chunks is None
        parallel = (self.context_parallel_group is not None
                    or self.sequence_parallel_group is not None)
        if not whole or parallel:
            raise ValueError("a KV cache needs the whole language model on one process (no "
                             "pipeline stage, context or sequence parallelism)")
        start, seq = cache.length, hidden.shape[1]
        if start + seq > self.max_seq_len:
            raise ValueError(f"sequence length {start + seq} exceeds "
                             f"max_seq_len={self.max_seq_len}")
        if self.mrope_section is not None and position_ids is not None:
            rope, _ = self._mrope_and_plan(seq, hidden.shape[0], hidden.device, None,
                                           position_ids)
        else:
            cos, sin = self.rope(start + seq, hidden.device)
            rope = (cos[start:], sin[start:])
        # A prompt with images (Qwen3-VL): its first layers add the DeepStack features.
        visual = (None if not deepstack else visual_rows(
            visual_mask, deepstack, (hidden.shape[0], seq), hidden.device, None))
        hidden = to_residual_dtype(hidden, self.fp32_residual)
        for key, layer in self.layers.items():
            hidden = layer(hidden, rope, None, cache.layer(key))
            if visual is not None and deepstack is not None and int(key) < len(deepstack):
                hidden = add_visual(hidden, deepstack[int(key)], visual)
        cache.advance(seq)
        assert self.final_norm is not None and self.output is not None
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
