"""A tokenizer whose vocabulary dwarfs the model it is to train: refused before launch.

The language model's embedding and output head take their rows from the tokenizer
(:func:`~mimotron.config.vocab_size.model_vocab_size`): a wrong ``data.tokenizer`` folder
of 3 million entries silently grows a model of 0.6 M parameters to 769 M, and the run is
killed for memory on its first step with no word on why. :func:`vocabulary_check`
refuses, in one line naming the vocabulary, the parameter counts and the fix, when

* the vocabulary's parameters (padded rows x the language model's ``hidden_size`` x 2,
  or x 1 with tied embeddings) exceed :data:`VOCAB_SHARE_LIMIT` times the rest of the
  model (every module's layers, from the sizes alone: a lower bound), **and**
* they exceed :data:`VOCAB_ABSOLUTE_LIMIT` parameters (a small model with a real
  tokenizer, 32 000 ids next to a toy decoder, is a normal test set-up and passes).

``data.allow_large_vocab = true`` accepts such a vocabulary. Real models are far inside
the rule: Llama 3 8B's 128 256 ids are 1 G parameters next to 7 G.
"""

from __future__ import annotations

from mimotron.config.hf_resolve import language_spec
from mimotron.config.limits import module_parameters
from mimotron.config.schema import MimoConfig
from mimotron.config.vocab_size import model_vocab_size
from mimotron.names import LANGUAGE

VOCAB_SHARE_LIMIT = 100
"""The vocabulary's parameters may be at most this many times the rest of the model..."""
VOCAB_ABSOLUTE_LIMIT = 100_000_000
"""...or at most this many parameters (refused only when over both)."""


def vocabulary_parameters(cfg: MimoConfig, vocab_size: int) -> tuple[int, int, int, int]:
    """``(parameters, rows, hidden, tables)`` of the language model's embedding and head.

    Args:
        cfg: the run config.
        vocab_size: the tokenizer's vocabulary (its added placeholders included).
    """
    lm = cfg.modules[LANGUAGE]
    rows = model_vocab_size(cfg, vocab_size)
    tables = 1 if lm.hf_path and language_spec(lm).tie_word_embeddings else 2
    return rows * lm.hidden_size * tables, rows, lm.hidden_size, tables


def rest_parameters(cfg: MimoConfig) -> int:
    """Parameters of every module's layers, the language model's vocabulary left out."""
    total = 0
    for mod in cfg.modules.values():
        dense, experts = module_parameters(mod)
        if mod.is_language and mod.hf_path:  # module_parameters' own condition
            # module_parameters counts a checkpoint's embedding and head: not "the rest".
            spec = language_spec(mod)
            dense -= spec.vocab_size * mod.hidden_size * (1 if spec.tie_word_embeddings else 2)
        total += dense + experts
    return total


def vocabulary_check(cfg: MimoConfig, vocab_size: int) -> None:
    """Raise when the vocabulary's parameters dwarf the model (rule: module docstring).

    Args:
        cfg: the run config (``data.allow_large_vocab`` turns the check off).
        vocab_size: the tokenizer's vocabulary (its added placeholders included).

    Raises:
        ValueError: one line naming the vocabulary, the parameter counts and the fix.
    """
    if cfg.data.allow_large_vocab:
        return
    params, rows, hidden, tables = vocabulary_parameters(cfg, vocab_size)
    rest = rest_parameters(cfg)
    if params <= VOCAB_ABSOLUTE_LIMIT or params <= VOCAB_SHARE_LIMIT * rest:
        return
    raise ValueError(
        f"data.tokenizer={cfg.data.tokenizer!r} has a vocabulary of {vocab_size} ids: the "
        f"language model's embedding and output head would hold {rows} x {hidden} x "
        f"{tables} = {params} parameters, {params // max(rest, 1)} times the {rest} of the "
        f"rest of the model (refused over {VOCAB_SHARE_LIMIT} times and "
        f"{VOCAB_ABSOLUTE_LIMIT} parameters); set data.tokenizer to the model's own "
        "tokenizer, or data.allow_large_vocab=true to train this vocabulary anyway"
    )
