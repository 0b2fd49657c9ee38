"""``data.seq_length`` against the positions a Hugging Face language model was trained
on (its ``config.json`` ``max_position_embeddings``).

Rotary positions past the trained context are positions the model never saw: without
RoPE scaling the loss of a longer run starts far above where a shorter one would, and
nothing says why. So a longer ``seq_length`` is refused when the folder has no RoPE
scaling (:func:`check_context_length`, one line naming both values), and is a warning
(:func:`context_length_note`, printed by ``mimotron plan`` and ``mimotron train``)
when it has one (linear, dynamic, YaRN, Llama 3: the model extends its context as the
scaling says), and where a long row may still hold only trained positions (packed rows
restart positions per document; Qwen-VL's 3-D positions advance an image by its grid's
side). The built-in language model has no trained context and is not checked.
"""

from __future__ import annotations

from mimotron.config.hf_folder import HFConfigs
from mimotron.config.hf_resolve import language_spec, part_config
from mimotron.config.hf_specs import LlamaFamilySpec
from mimotron.config.schema import MimoConfig
from mimotron.names import LANGUAGE

__all__ = ["check_context_length", "context_length_note"]


def _spec(cfg: MimoConfig, hf: HFConfigs | None) -> LlamaFamilySpec:
    """The language model's spec: from the load's reader, or (``None``) from the
    config.json the load recorded (no file read again)."""
    mod = cfg.modules[LANGUAGE]
    if hf is None:
        return language_spec(mod)
    return language_spec(mod, part_config(hf.read(mod.hf_path), mod.kind))


def _context(cfg: MimoConfig, hf: HFConfigs | None) -> tuple[int, str] | None:
    """``(max_position_embeddings, rope type)`` of a Hugging Face language model whose
    context ``data.seq_length`` exceeds; ``None`` where it does not (or no folder)."""
    mod = cfg.modules.get(LANGUAGE)
    if mod is None or not mod.hf_path:
        return None
    spec = _spec(cfg, hf)
    if cfg.data.seq_length <= spec.max_position_embeddings:
        return None
    return spec.max_position_embeddings, str(spec.rope_scaling.get("rope_type", "default"))


def check_context_length(cfg: MimoConfig, hf: HFConfigs | None = None) -> None:
    """Refuse a ``data.seq_length`` past the language model's trained context when its
    folder has no RoPE scaling.

    Raises:
        ValueError: one line naming ``data.seq_length``, the folder's
            ``max_position_embeddings`` and what would be valid.
    """
    found = _context(cfg, hf)
    if found is None or found[1] != "default" or _positions_may_fit(cfg, hf):
        return
    limit = found[0]
    raise ValueError(
        f"data.seq_length={cfg.data.seq_length} is invalid: modules.language.hf_path="
        f"{cfg.modules[LANGUAGE].hf_path!r} was trained on max_position_embeddings={limit} "
        f"positions and its config.json has no RoPE scaling; use data.seq_length <= {limit},"
        " or a folder whose config.json sets rope_scaling (linear, dynamic, yarn, llama3)")


def _positions_may_fit(cfg: MimoConfig, hf: HFConfigs | None) -> bool:
    """Whether a row longer than the context may still hold only trained positions:
    packed rows restart positions per document, and 3-D rotary positions (Qwen-VL)
    advance an image by its grid's side, not its token count."""
    return cfg.data.packing or _spec(cfg, hf).mrope_section is not None


def context_length_note(cfg: MimoConfig, hf: HFConfigs | None = None) -> str | None:
    """The warning where ``data.seq_length`` exceeds the trained context and is not
    refused: under RoPE scaling, packed rows or 3-D rotary positions (``None``
    otherwise; ``hf`` ``None``: the config.json the load recorded)."""
    found = _context(cfg, hf)
    if found is None:
        return None
    limit, rope = found
    head = (f"warning: data.seq_length={cfg.data.seq_length} exceeds the language model's "
            f"max_position_embeddings={limit}")
    if rope != "default":
        return (f"{head}; its RoPE scaling ({rope}) extends the positions past what it was "
                "trained on")
    return (f"{head}; a packed document or a sample longer than {limit} positions gets "
            "positions it was not trained on")
