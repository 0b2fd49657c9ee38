"""The rules of ``data.balance_tokens`` and ``data.balance_encoders``: what balancing
cannot yet be combined with, refused when the config loads (before any rank starts)."""

from __future__ import annotations

from mimotron.config.schema import MimoConfig
from mimotron.names import LANGUAGE

__all__ = ["check_balance"]


def check_balance(cfg: MimoConfig) -> None:
    """Refuse the combinations balancing does not support, naming the keys.

    Args:
        cfg: the :class:`~mimotron.config.schema.MimoConfig`.

    Raises:
        ValueError: ``balance_tokens`` with an MoE language model (its aux loss depends
            on which samples share a micro-batch); ``balance_encoders`` into a
            context-parallel language model (its bridge routes rows by the encoder
            slice's placeholder positions).
    """
    d, language = cfg.data, cfg.modules[LANGUAGE]
    if d.balance_tokens and language.num_experts:
        raise ValueError(
            f"data.balance_tokens=true is invalid with modules.language.num_experts="
            f"{language.num_experts}: the MoE aux loss depends on which samples share a "
            "micro-batch; set balance_tokens=false or num_experts=0")
    if not d.balance_encoders:
        return
    if language.parallel.context > 1:
        raise ValueError(
            f"data.balance_encoders=true is invalid with modules.language.parallel.context="
            f"{language.parallel.context}: the bridge into a context-parallel language model "
            "routes rows by the encoder slice's placeholder positions; set "
            "balance_encoders=false or context=1")
