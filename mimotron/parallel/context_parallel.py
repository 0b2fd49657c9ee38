"""Context parallelism (CP) for the language model: which positions a CP rank holds.

With ``modules.language.parallel.context = c`` the sequence of every language
micro-batch is cut into ``2c`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2c - 1 - r`` (causal load balancing: under a causal mask late positions attend to
more keys, so pairing an early chunk with a late one gives every rank the same
attention work). A rank's positions are therefore two ascending runs, and
:func:`load_balanced_positions` lists them in ascending order: a rank's local sequence
is the global sequence restricted to its positions, order kept.

The pure helpers here are the contract between the data path (tokens, labels and masks
stay whole ``[B, S]`` on every CP rank; each rank indexes its positions), the language
model (RoPE and the attention mask use global positions) and the bridge into a CP
language model, which sends each CP rank only the encoder rows of the placeholders in
its positions (:func:`placeholder_selection`).

**Row contract of the bridge.** An encoder output ``[N, T, H]`` (one ``[T, H]`` block
per present sample or packed item, in batch order) flattened to ``[N * T, H]`` lists
one row per placeholder token of the slice, in row-major order of the slice's
``[B, S]`` tokens (sample by sample, position by position). CP rank ``r`` receives
``flat[placeholder_selection(tokens, pid, c, r)]``: the same rows, restricted to its
positions, still in row-major order, which is exactly the order of
``tokens[:, positions] == pid`` — the language side merges them with one masked
assignment into its local embeddings.
"""

from __future__ import annotations

import torch

from mimotron.config.hf_resolve import language_spec
from mimotron.config.schema import LANGUAGE_KINDS, MimoConfig, ModuleConfig
from mimotron.names import LANGUAGE


def check_context_split(seq_len: int, cp_size: int) -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits into ``2 * cp_size`` equal chunks.

    Args:
        seq_len: the language micro-batch's sequence length (``data.seq_length``).
        cp_size: the context-parallel degree.
    """
    if cp_size < 1 or seq_len % (2 * cp_size):
        raise ValueError(
            f"data.seq_length={seq_len} is invalid with modules.language.parallel.context="
            f"{cp_size}: context parallelism cuts the sequence into 2 x context = "
            f"{2 * cp_size} equal chunks, so seq_length must be a multiple of {2 * cp_size}"
        )


def moe_source(mod: ModuleConfig, name: str) -> str:
    """Where a module's mixture-of-experts layers come from, ``""`` for a dense module.

    ``modules.<m>.num_experts`` for the built-in model; for a language ``hf_path`` the
    folder's config.json (Qwen2-MoE / Qwen3-MoE), since ``num_experts`` stays 0 there.
    The message names the field a user would change.
    """
    if mod.num_experts > 0:
        return f"modules.{name}.num_experts={mod.num_experts}"
    if mod.hf_path and mod.kind in LANGUAGE_KINDS:

        spec = language_spec(mod)
        if spec.moe is not None:
            return (f"modules.{name}.hf_path (a {spec.model_type} checkpoint with "
                    f"{spec.moe.num_experts} experts)")
    return ""


def check_context_parallel(cfg: MimoConfig, name: str) -> None:
    """Raise (before any collective) unless module ``name`` can run its ``context`` degree.

    Raises:
        ValueError: one line naming the field: CP on an encoder (their inputs are short;
            CP applies to the language model only), with MoE (``num_experts > 0`` or an
            MoE ``hf_path`` checkpoint, :func:`moe_source`), a ``data.seq_length`` that
            does not split into ``2 x context`` chunks, or one whose CP chunk ``tensor``
            does not divide under sequence parallelism. A dense ``hf_path`` decoder is
            accepted (GQA, biases, qk_norm, scaled RoPE, tied embeddings). Colocated and
            non-colocated layouts are both accepted (the colocated bridge is
            :mod:`mimotron.pipeline.colocated_cp`).
    """
    mod = cfg.modules[name]
    par, p = mod.parallel, f"modules.{name}.parallel.context"
    if par.context == 1:
        return
    if par.context < 1:
        raise ValueError(f"{p}={par.context} is invalid: expected a positive degree")
    if name != LANGUAGE:
        raise ValueError(f"{p}={par.context} is invalid: encoders' inputs are short, context "
                         f"parallelism applies to modules.{LANGUAGE} only; use 1")
    moe = moe_source(mod, name)
    if moe:
        # A dense hf_path decoder (Llama / Qwen2 / Qwen3) is the same LanguageModel with
        # GQA, biases, qk_norm, scaled RoPE or tied embeddings: tests/test_hf_context_parallel.py.
        raise ValueError(f"{p}={par.context} is invalid with {moe}: context parallelism "
                         "supports dense language models only (built-in or hf_path); use 1")
    seq = cfg.data.seq_length
    check_context_split(seq, par.context)
    if par.sequence_parallel and (seq // par.context) % par.tensor:
        raise ValueError(
            f"data.seq_length={seq} is invalid with {p}={par.context} and modules.{name}."
            f"parallel.sequence_parallel=true: each CP rank's {seq // par.context} positions "
            f"must be divisible by modules.{name}.parallel.tensor={par.tensor}")


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int,
                            device: torch.device | None = None) -> torch.Tensor:
    """Global positions held by CP rank ``cp_rank``: chunks ``r`` and ``2c - 1 - r``.

    Args:
        seq_len: global sequence length, a multiple of ``2 * cp_size``.
        cp_size: the context-parallel degree ``c``.
        cp_rank: this rank's coordinate in the CP group, ``0 <= r < c``.
        device: where the index tensor lives.

    Returns:
        int64 ``[seq_len // cp_size]``, ascending.

    Raises:
        ValueError: on a length that does not split, or a rank outside the group.
    """
    return torch.cat([torch.arange(start, end, device=device)
                      for start, end in load_balanced_ranges(seq_len, cp_size, cp_rank)])


def load_balanced_ranges(seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of :func:`load_balanced_positions`, as host integers:
    the head chunk ``r`` and the tail chunk ``2c - 1 - r``.

    Raises:
        ValueError: on a length that does not split, or a rank outside the group.
    """
    check_context_split(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside a context-parallel group of {cp_size}")
    chunk = seq_len // (2 * cp_size)
    tail = (2 * cp_size - 1 - cp_rank) * chunk
    return [(cp_rank * chunk, (cp_rank + 1) * chunk), (tail, tail + chunk)]


def gathered_positions(seq_len: int, cp_size: int,
                       device: torch.device | None = None) -> torch.Tensor:
    """Global positions of a CP all-gather's result: rank 0's positions, then rank 1's, ...

    Keys and values all-gathered over the CP group arrive in this order; the attention
    mask compares them with the local query positions instead of reordering them.
    """
    return torch.cat([load_balanced_positions(seq_len, cp_size, r, device)
                      for r in range(cp_size)])


def position_membership(seq_len: int, cp_size: int, cp_rank: int,
                        device: torch.device | None = None) -> torch.Tensor:
    """bool ``[seq_len]``: True at the positions CP rank ``cp_rank`` holds."""
    held = torch.zeros(seq_len, dtype=torch.bool, device=device)
    held[load_balanced_positions(seq_len, cp_size, cp_rank, device)] = True
    return held


def placeholder_selection(tokens: torch.Tensor, placeholder_id: int, cp_size: int,
                          cp_rank: int) -> torch.Tensor:
    """Which placeholder rows of a slice go to CP rank ``cp_rank`` (the row contract).

    Args:
        tokens: ``[B, S]`` token ids of the samples whose encoder rows are routed.
        placeholder_id: the module's placeholder token id.
        cp_size: the language model's CP degree.
        cp_rank: the destination CP rank.

    Returns:
        bool ``[num_placeholders]``, one entry per placeholder token of ``tokens`` in
        row-major order; True where its position belongs to ``cp_rank``.
    """
    held = position_membership(tokens.shape[1], cp_size, cp_rank, tokens.device)
    is_placeholder = tokens == placeholder_id
    return held.expand_as(tokens)[is_placeholder]


def local_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` restricted to ``positions`` along dim 1 (``[B, S, ...] -> [B, S / c, ...]``)."""
    return x.index_select(1, positions)
