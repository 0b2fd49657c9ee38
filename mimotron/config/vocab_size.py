"""The language model's vocabulary size: the tokenizer's, a checkpoint's, padded.

Kept apart from :mod:`mimotron.models.build` (which re-exports it) so that the layout
checks can size the vocabulary without building a model (a Hugging Face decoder's from
its config.json).
"""

from __future__ import annotations

from mimotron.config.hf_resolve import language_spec
from mimotron.config.schema import MimoConfig
from mimotron.names import LANGUAGE

# The vocabulary is padded to a multiple of this (Megatron's make-vocab-divisible), the
# same for every layout, so TP can split it and layouts share one model.
VOCAB_MULTIPLE = 64


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Round the tokenizer's vocabulary up to a multiple of ``multiple``."""
    return -(-vocab_size // multiple) * multiple


def unpadded_vocab_size(cfg: MimoConfig, vocab_size: int) -> int:
    """The language model's real vocabulary: the tokenizer's, or a checkpoint's if larger.

    Args:
        cfg: run config.
        vocab_size: the tokenizer's vocabulary (its added placeholders included).

    Returns:
        ``max(vocab_size, config.json vocab_size)`` for a language model with
        ``hf_path``, else ``vocab_size``; no padding.
    """
    lm = cfg.modules.get(LANGUAGE)
    if lm is not None and lm.hf_path:
        vocab_size = max(vocab_size, language_spec(lm).vocab_size)
    return vocab_size


def model_vocab_size(cfg: MimoConfig, vocab_size: int) -> int:
    """The language model's vocabulary: the tokenizer's, or a checkpoint's if larger.

    Args:
        cfg: run config.
        vocab_size: the tokenizer's vocabulary (padded or not).

    Returns:
        :func:`unpadded_vocab_size` padded to ``VOCAB_MULTIPLE``; rows past the
        checkpoint's are initialised by :mod:`mimotron.models.hf.vocab`.
    """
    return padded_vocab_size(unpadded_vocab_size(cfg, vocab_size))
