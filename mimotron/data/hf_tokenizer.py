"""A Hugging Face tokenizer folder as the run's tokenizer, with modality placeholders.

:class:`HFTokenizer` loads a local tokenizer folder (``tokenizer.json`` and
``tokenizer_config.json``, the chat template in either that file or
``chat_template.jinja``) through ``transformers.AutoTokenizer`` with
``local_files_only=True``: a folder that is not there is an error, never a download.

**Placeholders.** Each modality has a placeholder token (``<image>``, ``<audio>``). One
that the tokenizer lacks is added as a special token (so text never splits it and the
chat template's ``<image>`` maps to one id); :attr:`HFTokenizer.num_added` says how many
ids were appended. The language model's embedding then needs
``max(its rows, HFTokenizer.vocab_size)`` rows: :func:`resize_embedding_rows` grows a
weight deterministically.

**New embedding rows** (the rule :func:`new_embedding_rows` implements): row ``r`` of the
grown table is ``mean + noise_scale * std * z_r``, where ``mean`` and ``std`` are the
per-dimension mean and standard deviation of the original rows and ``z_r`` is a standard
normal vector drawn from a generator seeded by ``(seed, r)`` only. The mean keeps a new
token's logits and hidden states in the range of the pretrained ones (the
"mean-resizing" of Hewitt, 2021, that ``transformers`` also uses); the small noise keeps
the new rows distinct, so a tied output head does not give them identical logits. Every
row depends on nothing but ``(seed, r)`` and the original table, so a vocabulary shard
can compute its own rows without the others (given the mean and std).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mimotron.config.schema import CHAT_TEMPLATES
from mimotron.data.digits import sample_rng
from mimotron.data.template_check import check_chat_template, check_template_renders
from mimotron.data.tokenizer import MODALITIES

# Salt of the new-row generators: unrelated to the data streams' salts.
_EMBEDDING_SALT = 0x656D6264

DEFAULT_NOISE_SCALE = 0.01


class HFTokenizer:
    """A local Hugging Face tokenizer with one placeholder token per modality.

    Args:
        path: the tokenizer folder (``data.tokenizer``).
        modalities: modalities that need a placeholder, in the order they are added.
        placeholder_tokens: modality -> placeholder text; defaults to ``<image>`` and
            ``<audio>``.
        chat_template: a Jinja template that replaces the folder's own.
        chat_template_origin: where ``chat_template`` came from, for messages (e.g.
            ``data.chat_template='vicuna'``); empty = "given in code".
        placeholder_ids: modality -> an id the tokenizer already has whose token is that
            modality's placeholder (a Qwen-VL folder's ``image_token_id``, its
            ``<|image_pad|>``); nothing is added for it. Overrides ``placeholder_tokens``.

    Raises:
        ValueError: the folder does not exist, holds no fast tokenizer (or a
            ``tokenizer.json`` lacking what a load reads), has no chat template or one that
            does not render within the loop bound (:mod:`~mimotron.data.template_check`),
            a placeholder does not encode to exactly one id, or a ``placeholder_ids`` id
            is not a special token of the tokenizer.
    """

    def __init__(
        self,
        path: str | Path,
        modalities: Sequence[str] = MODALITIES,
        placeholder_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        chat_template_origin: str = "",
        placeholder_ids: Mapping[str, int] | None = None,
    ) -> None:
        self.path = Path(path)
        self.tokenizer = _load_fast_tokenizer(self.path)
        # Export writes the tokenizer's files again when the template is not the folder's.
        self.template_replaced = chat_template is not None
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        if not isinstance(self.tokenizer.chat_template, str) or not self.tokenizer.chat_template:
            raise ValueError(
                f"data.tokenizer={str(self.path)!r} has no chat template: expected a "
                "'chat_template' in tokenizer_config.json or a chat_template.jinja file, or "
                f"data.chat_template set to one of {CHAT_TEMPLATES} or a .jinja file"
            )
        given = chat_template_origin or chat_template is not None
        # What the messages about rendering a conversation name as the template.
        self.template_origin = (chat_template_origin or
                                f"the chat template of data.tokenizer={str(self.path)!r}")
        check_chat_template(self.tokenizer.chat_template, self.path, given)
        unknown = [m for m in modalities if m not in MODALITIES]
        if unknown:
            raise ValueError(f"modalities={list(modalities)!r} is invalid: expected items of "
                             f"{MODALITIES}")  # fmt: skip
        existing = {m: self._special_text(m, int(i)) for m, i in (placeholder_ids or {}).items()}
        texts = {m: f"<{m}>" for m in MODALITIES} | dict(placeholder_tokens or {}) | existing
        self.modalities: tuple[str, ...] = tuple(modalities)
        self._placeholder_text = {m: texts[m] for m in self.modalities}
        self.base_vocab_size = len(self.tokenizer)
        self._add_placeholders()
        self.num_added = len(self.tokenizer) - self.base_vocab_size
        self._placeholder_ids = {m: self._single_id(t) for m, t in self._placeholder_text.items()}
        for m, token_id in (placeholder_ids or {}).items():
            if m in self._placeholder_ids and self._placeholder_ids[m] != token_id:
                raise ValueError(f"{self._placeholder_text[m]!r} encodes to id "
                                 f"{self._placeholder_ids[m]} with data.tokenizer="
                                 f"{str(self.path)!r}, not the model's {m} id {token_id}")
        # Rendered once with its loops counted: a template that never ends is refused here.
        check_template_renders(self.tokenizer.chat_template, self.path, given,
                               _template_variables(self.tokenizer))
        self.special_ids = frozenset(
            i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special
        )

    def _special_text(self, modality: str, token_id: int) -> str:
        """The text of ``token_id``, a special token the tokenizer already has.

        Raises:
            ValueError: one line naming the id: not a special token of the tokenizer (its
                text would split, or a new token would be added).
        """
        token = self.tokenizer.added_tokens_decoder.get(token_id)
        if token is None or not token.special:
            raise ValueError(f"the {modality} placeholder id {token_id} (the model's "
                             f"config.json) is not a special token of data.tokenizer="
                             f"{str(self.path)!r}: expected the tokenizer of that model, "
                             f"whose {modality} token has that id")
        return str(token.content)

    def _add_placeholders(self) -> None:
        """Add the placeholders that are not yet single special tokens."""
        from tokenizers import AddedToken  # Deferred like every Hugging Face import.

        added_specials = {t.content for t in self.tokenizer.added_tokens_decoder.values()
                          if t.special}  # fmt: skip
        missing = [t for t in self._placeholder_text.values() if t not in added_specials]
        if missing:
            # normalized=False: the text is matched verbatim; special: never split.
            self.tokenizer.add_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing],
                special_tokens=True,
            )

    def _single_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"placeholder {text!r} encodes to {len(ids)} ids {ids} with data.tokenizer="
                f"{str(self.path)!r}: expected exactly one"
            )
        return int(ids[0])

    # ---- ids ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, the added placeholders included (``len(tokenizer)``)."""
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        """The padding id: the tokenizer's pad token, else its eos token, else 0.

        Padding never carries loss, so any id works; a real one keeps decoded batches
        readable.
        """
        for token_id in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if token_id is not None:
                return int(token_id)
        return 0

    @property
    def chat_template(self) -> str:
        """The Jinja chat template in use."""
        return str(self.tokenizer.chat_template)

    def placeholder_id(self, modality: str) -> int:
        """Id of the placeholder token of ``modality``.

        Raises:
            ValueError: the modality has no placeholder in this tokenizer.
        """
        if modality not in self._placeholder_ids:
            raise ValueError(
                f"modality={modality!r} is invalid: expected one of {self.modalities}"
            )
        return self._placeholder_ids[modality]

    def placeholder_text(self, modality: str) -> str:
        """The placeholder as it appears in conversation text, e.g. ``"<image>"``."""
        self.placeholder_id(modality)  # validates the modality
        return self._placeholder_text[modality]

    # ---- text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without the tokenizer's own bos/eos."""
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens (placeholders included) kept."""
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template's text of ``messages`` (``role``/``content`` dicts)."""
        return str(self.tokenizer.apply_chat_template(list(messages), tokenize=False))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` and each token's ``(start, end)`` character span."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def __repr__(self) -> str:
        return (f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, "
                f"num_added={self.num_added})")  # fmt: skip


def _template_variables(tokenizer: Any) -> dict[str, Any]:
    """The special tokens ``transformers`` passes a chat template (``bos_token``, ...)."""
    return {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}


def _load_fast_tokenizer(path: Path) -> Any:
    """``AutoTokenizer`` from a local folder; a fast tokenizer (offsets) is required."""
    if not path.is_dir():
        raise ValueError(
            f"data.tokenizer={str(path)!r} is invalid: expected a local tokenizer folder "
            "(tokenizer.json, tokenizer_config.json); nothing is downloaded"
        )
    _check_tokenizer_json(path / "tokenizer.json")
    from transformers import AutoTokenizer  # Deferred: importing transformers takes ~1 s.

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers' parse errors are plain Exception
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(
            f"data.tokenizer={str(path)!r} could not be loaded as a Hugging Face tokenizer: "
            f"{message}"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"data.tokenizer={str(path)!r} loads a slow tokenizer: expected a fast one "
            "(a tokenizer.json), whose character offsets locate the assistant replies"
        )
    return tokenizer


# What transformers and tokenizers read first from a tokenizer.json: without them the load
# fails with a bare KeyError or "Model missing." that names no file.
_TOKENIZER_JSON_KEYS = ("added_tokens", "model")


def _check_tokenizer_json(file: Path) -> None:
    """A ``tokenizer.json`` (when present) is a JSON object with the keys a load reads.

    Raises:
        ValueError: one line naming the file and what is missing.
    """
    if not file.is_file():
        return  # a folder of slow-tokenizer files: refused after loading, by name
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{str(file)!r} is not JSON ({exc}): expected a tokenizers file "
                         "(Tokenizer.save / save_pretrained writes one)") from None
    if not isinstance(content, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(content).__name__}: expected "
                         "a JSON object (a tokenizers file, as save_pretrained writes it)")
    missing = [k for k in _TOKENIZER_JSON_KEYS if k not in content]
    if missing:
        raise ValueError(f"{str(file)!r} is missing {', '.join(map(repr, missing))}: expected "
                         "a complete tokenizers file (as save_pretrained writes it)")


def new_embedding_rows(
    mean: torch.Tensor,
    std: torch.Tensor,
    rows: Sequence[int],
    seed: int,
    noise_scale: float = DEFAULT_NOISE_SCALE,
) -> torch.Tensor:
    """Initial values of embedding rows ``rows`` (the rule in the module docstring).

    Args:
        mean: per-dimension mean of the original rows, ``[H]``.
        std: per-dimension standard deviation of the original rows, ``[H]``.
        rows: the row ids to build (e.g. a vocabulary shard's new rows).
        seed: the run's seed.
        noise_scale: noise size relative to ``std``; 0 gives exactly the mean.

    Returns:
        ``[len(rows), H]`` in ``mean``'s dtype.
    """
    hidden = mean.numel()
    noise = np.stack([sample_rng(seed, _EMBEDDING_SALT, int(r)).standard_normal(hidden)
                      for r in rows]) if rows else np.zeros((0, hidden))  # fmt: skip
    mean64, std64 = mean.detach().double().cpu(), std.detach().double().cpu()
    out = mean64 + noise_scale * std64 * torch.from_numpy(noise)
    return out.to(mean.dtype)


def resize_embedding_rows(
    weight: torch.Tensor,
    new_vocab: int,
    seed: int,
    noise_scale: float = DEFAULT_NOISE_SCALE,
) -> torch.Tensor:
    """``weight`` ([V, H]) grown to ``new_vocab`` rows; the old rows are copied bitwise.

    A table that already has ``new_vocab`` rows or more is returned unchanged (many
    checkpoints pad their vocabulary past the tokenizer's).

    Args:
        weight: the original embedding (or untied output) table.
        new_vocab: rows wanted (``HFTokenizer.vocab_size``).
        seed: the run's seed; new rows depend only on ``(seed, row)`` and ``weight``.
        noise_scale: see :func:`new_embedding_rows`.

    Returns:
        A new ``[max(V, new_vocab), H]`` tensor on ``weight``'s device and dtype (or
        ``weight`` itself when nothing is added).

    Raises:
        ValueError: ``weight`` is not 2-D or has no rows.
    """
    if weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} is invalid: expected [vocab >= 1, hidden]"
        )
    old = weight.shape[0]
    if new_vocab <= old:
        return weight
    rows64 = weight.detach().double()
    # unbiased=False: a one-row table has std 0 (the new rows are then exactly the mean).
    mean, std = rows64.mean(dim=0), rows64.std(dim=0, unbiased=False)
    new = new_embedding_rows(mean, std, range(old, new_vocab), seed, noise_scale)
    return torch.cat([weight.detach(), new.to(device=weight.device, dtype=weight.dtype)])
