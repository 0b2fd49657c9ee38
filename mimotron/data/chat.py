"""A LLaVA conversation through a chat template: token ids, and which ones are trained.

:func:`encode_conversation` renders the conversation with the tokenizer's chat template,
tokenizes the text, marks the **assistant tokens** (the only ones the loss covers) and
expands each modality placeholder into as many copies as its encoder emits tokens (the
MIMO merge replaces those positions, in order, by the encoder's output embeddings; see
:meth:`mimotron.models.mimo.MimoModel.merge_embeddings`).

**Which tokens are the assistant's.** A template with ``{% generation %}`` blocks says so
itself: the tokens overlapping a block (``transformers``' ``assistant_masks``). Any other
template is located by rendering the conversation once more with each message's
content replaced by a unique marker: the text between markers is the template's own
(role headers, separators); the contents sit between those pieces. The tokens
overlapping an assistant content are trained, and so is the token right after it when
that token is a special token (the template's end of turn: ``<|im_end|>``,
``<|eot_id|>``, ``</s>``), so the model learns to stop. A template that changes a
content (``| trim``) is still located by its fixed pieces, as long as they do not occur
inside a content.

**Shifted labels** (the :mod:`~mimotron.data.collate` format): position ``i`` predicts
token ``i + 1``, so ``labels = tokens[1:] + [pad]`` and ``loss_mask[i]`` is 1 exactly when
token ``i + 1`` is an assistant token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.sample_keys import LLAVA_LAYOUT, SampleLayout

# LLaVA's speaker names (and the chat names themselves) -> chat template roles.
ROLES: dict[str, str] = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "system": "system",
}  # fmt: skip

_GENERATION_RE = re.compile(r"{%-?\s*generation\s*-?%}")
# Private-use code points: never in real text, and no template treats them specially.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


@dataclass(frozen=True)
class EncodedConversation:
    """A rendered, tokenized conversation.

    Attributes:
        tokens: the ids, placeholders expanded.
        target: per token, whether it is an assistant token (trained on).
        assistant_texts: the assistant contents, in order.
    """

    tokens: list[int]
    target: list[bool]
    assistant_texts: list[str]


def to_messages(
    conversations: Sequence[Mapping[str, object]], system_prompt: str | None = None,
    layout: SampleLayout = LLAVA_LAYOUT,
) -> list[dict[str, str]]:
    """LLaVA ``conversations`` (``from``/``value``) as chat messages (``role``/``content``).

    Args:
        conversations: the turns, e.g. ``[{"from": "human", "value": "<image>\\nHi"}]``.
        system_prompt: a system message put first unless the conversation has one.
        layout: the sample's layout: the names of its turns' keys
            (:data:`~mimotron.data.sample_keys.MESSAGES_LAYOUT`: ``messages`` of
            ``role``/``content`` turns, as LLaMA-Factory and ms-swift keep them).

    Returns:
        The messages.

    Raises:
        ValueError: a turn that is not a dict with a known role and a string content.
    """
    messages: list[dict[str, str]] = []
    for k, turn in enumerate(conversations):
        role = turn.get(layout.role) if isinstance(turn, Mapping) else None
        value = turn.get(layout.content) if isinstance(turn, Mapping) else None
        where = f"{layout.turns}[{k}]"
        if role not in ROLES:
            raise ValueError(f"{where}.{layout.role}={role!r} is invalid: expected "
                             f"{layout.roles} (or one of {sorted(ROLES)})")  # fmt: skip
        if isinstance(value, list):
            # A list of typed parts carries its media inline or as {"type": "image"}
            # slots; which placeholder text stands for them is the tokenizer's.
            raise ValueError(f"{where}.{layout.content} is a list of parts: expected a "
                             "string: the text, with one placeholder (e.g. <image>) where "
                             "each media file goes")  # fmt: skip
        if not isinstance(value, str):
            raise ValueError(f"{where}.{layout.content}={value!r} is invalid: expected a "
                             "string")  # fmt: skip
        messages.append({"role": ROLES[str(role)], "content": value})
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def content_spans(tokenizer: HFTokenizer, messages: Sequence[dict[str, str]], text: str
                  ) -> list[tuple[int, int]]:  # fmt: skip
    """Character span of each message's content inside ``text`` (the template's rendering).

    Args:
        tokenizer: the tokenizer whose template rendered ``text``.
        messages: the messages rendered.
        text: ``tokenizer.render(messages)``.

    Returns:
        One ``(start, end)`` per message.

    Raises:
        ValueError: the template does not render each content once, in order, between
            fixed pieces of its own.
    """
    return spans_from_pieces(tokenizer, template_pieces(tokenizer, messages),
                             [m["content"] for m in messages], text)  # fmt: skip


def template_pieces(tokenizer: HFTokenizer, messages: Sequence[dict[str, str]]) -> list[str]:
    """The template's own text around the contents: ``len(messages) + 1`` pieces.

    The messages are rendered with each content replaced by a unique marker, so the
    pieces depend on the messages' other keys (``role``) only, never on their contents.

    Raises:
        ValueError: the template does not render each content once, in order.
    """
    markers = [f"{_MARK_OPEN}{k}{_MARK_CLOSE}" for k in range(len(messages))]
    marked = tokenizer.render([{**m, "content": mk} for m, mk in zip(messages, markers,
                                                                     strict=True)])  # fmt: skip
    pieces, pos = [], 0
    for k, marker in enumerate(markers):
        at = marked.find(marker, pos)
        if at < 0 or marked.count(marker) != 1:
            raise ValueError(
                f"{tokenizer.template_origin} does not render "
                f"message {k}'s content exactly once, in order: its assistant tokens cannot be "
                "located (add {% generation %} blocks to the template)"
            )
        pieces.append(marked[pos:at])
        pos = at + len(marker)
    pieces.append(marked[pos:])
    return pieces


def spans_from_pieces(tokenizer: HFTokenizer, pieces: list[str], contents: list[str],
                      text: str) -> list[tuple[int, int]]:  # fmt: skip
    """Each content's span in ``text`` given the template's pieces (:func:`template_pieces`).

    Raises:
        ValueError: a template that changes contents cannot be walked by its pieces.
    """
    if "".join(p + c for p, c in zip(pieces, [*contents, ""], strict=True)) == text:
        spans, pos = [], 0
        for piece, content in zip(pieces, contents, strict=False):
            spans.append((pos + len(piece), pos + len(piece) + len(content)))
            pos = spans[-1][1]
        return spans
    return _walk_pieces(tokenizer, pieces, text)


def _walk_pieces(tokenizer: HFTokenizer, pieces: list[str], text: str) -> list[tuple[int, int]]:
    """Spans of contents the template changed: each ends where the next fixed piece starts."""
    def fail(why: str) -> ValueError:
        return ValueError(
            f"{tokenizer.template_origin} changes message "
            f"contents and {why}: its assistant tokens cannot be located (add "
            "{% generation %} blocks to the template)"
        )

    if not text.startswith(pieces[0]) or not text.endswith(pieces[-1]):
        raise fail("its rendering does not start and end with its fixed text")
    spans, pos, last_end = [], len(pieces[0]), len(text) - len(pieces[-1])
    for k, piece in enumerate(pieces[1:-1], start=1):
        if not piece:
            raise fail(f"renders messages {k - 1} and {k} with nothing between them")
        at = text.find(piece, pos, last_end)
        if at < 0:
            raise fail(f"its text before message {k} is missing from the rendering")
        spans.append((pos, at))
        pos = at + len(piece)
    if pos > last_end:
        raise fail("its last message overlaps the closing text")
    spans.append((pos, last_end))
    return spans


def overlap_targets(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], ids: Sequence[int],
    special_ids: frozenset[int],
) -> list[bool]:
    """Tokens overlapping a span, plus a special token right after each span's last one."""
    target = [False] * len(offsets)
    for start, end in spans:
        last = -1
        for j, (t_start, t_end) in enumerate(offsets):
            if t_start < end and t_end > start and t_end > t_start:
                target[j], last = True, j
        after = last + 1 if last >= 0 else next(
            (j for j, (t_start, _) in enumerate(offsets) if t_start >= end), len(offsets))
        if after < len(ids) and ids[after] in special_ids and offsets[after][0] >= end:
            target[after] = True
    return target


def has_generation_blocks(tokenizer: HFTokenizer) -> bool:
    """Whether the chat template marks assistant replies with ``{% generation %}``."""
    return bool(_GENERATION_RE.search(tokenizer.chat_template))


def _template_targets(tokenizer: HFTokenizer, messages: list[dict[str, str]],
                      ids: list[int]) -> list[bool]:  # fmt: skip
    """``{% generation %}`` templates: ``transformers``' assistant token mask."""
    out = tokenizer.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    if list(out["input_ids"]) != ids:
        raise ValueError(
            f"data.tokenizer={str(tokenizer.path)!r}: the chat template's tokenization differs "
            "from the rendered text's (expected the same ids)"
        )
    return [bool(m) for m in out["assistant_masks"]]


def encode_conversation(
    tokenizer: HFTokenizer,
    messages: Sequence[dict[str, str]],
    num_tokens: Mapping[str, int],
) -> EncodedConversation:
    """Render, tokenize, mark the assistant tokens and expand the placeholders.

    Args:
        tokenizer: the run's tokenizer.
        messages: chat messages (see :func:`to_messages`).
        num_tokens: modality -> encoder output tokens per item (each placeholder becomes
            that many copies); a modality not listed must not occur in the text.

    Returns:
        The encoded conversation.

    Raises:
        ValueError: no assistant turn, a placeholder in an assistant turn, a placeholder
            of a modality without a count, a placeholder the tokenizer did not keep whole,
            or a template whose assistant replies cannot be located.
    """
    messages, assistant = checked_messages(tokenizer, messages, num_tokens)
    text = tokenizer.render(messages)
    ids, offsets = tokenizer.encode_with_offsets(text)
    if has_generation_blocks(tokenizer):
        target = _template_targets(tokenizer, messages, ids)
    else:
        spans = content_spans(tokenizer, messages, text)
        spans = [s for s, m in zip(spans, messages, strict=True) if m["role"] == "assistant"]
        target = overlap_targets(offsets, spans, ids, tokenizer.special_ids)
    return expand_placeholders(tokenizer, messages, ids, target, num_tokens, assistant)


def checked_messages(tokenizer: HFTokenizer, messages: Sequence[dict[str, str]],
                     num_tokens: Mapping[str, int]) -> tuple[list[dict[str, str]], list[str]]:
    """Copies of ``messages`` and the assistant contents, checked before any rendering.

    Raises:
        ValueError: no assistant turn, or a misplaced placeholder (see
            :func:`encode_conversation`).
    """
    messages = [dict(m) for m in messages]
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("the conversation has no assistant ('gpt') turn: nothing to train on")
    _check_placeholder_text(tokenizer, messages, num_tokens)
    return messages, assistant


def _check_placeholder_text(tokenizer: HFTokenizer, messages: list[dict[str, str]],
                            num_tokens: Mapping[str, int]) -> None:  # fmt: skip
    """Placeholders only in user/system turns, only of modalities with a count."""
    for m in tokenizer.modalities:
        placeholder = tokenizer.placeholder_text(m)
        for k, message in enumerate(messages):
            if placeholder not in message["content"]:
                continue
            if message["role"] == "assistant":
                raise ValueError(f"message {k} (assistant) holds {placeholder!r}: placeholders "
                                 "belong in 'human' turns")  # fmt: skip
            if m not in num_tokens:
                raise ValueError(f"message {k} holds {placeholder!r} but the model has no {m} "
                                 f"encoder (have {sorted(num_tokens)})")  # fmt: skip


def expand_placeholders(
    tokenizer: HFTokenizer, messages: list[dict[str, str]], ids: list[int], target: list[bool],
    num_tokens: Mapping[str, int], assistant: list[str],
) -> EncodedConversation:
    """Each placeholder id -> ``num_tokens[modality]`` copies (never trained on).

    Raises:
        ValueError: the template added or dropped placeholders.
    """
    if len(ids) != len(target):
        raise ValueError(f"{len(ids)} token ids but {len(target)} assistant flags")
    positions = []
    for m in tokenizer.modalities:
        placeholder_id = tokenizer.placeholder_id(m)
        in_text = sum(msg["content"].count(tokenizer.placeholder_text(m)) for msg in messages)
        in_ids = ids.count(placeholder_id)
        if in_text != in_ids:
            raise ValueError(
                f"{in_text} {tokenizer.placeholder_text(m)!r} in the text became {in_ids} "
                "placeholder ids (the chat template adds or drops placeholders)"
            )
        at = -1
        for _ in range(in_ids):  # list.index: the scan runs in C, not per token here
            at = ids.index(placeholder_id, at + 1)
            positions.append((at, num_tokens[m]))
    tokens, targets, start = [], [], 0
    for at, copies in sorted(positions):
        tokens += ids[start:at] + [ids[at]] * copies
        targets += target[start:at] + [False] * copies
        start = at + 1
    return EncodedConversation(tokens + ids[start:], targets + target[start:], assistant)


def replace_placeholder(messages: Sequence[dict[str, str]], old: str, new: str
                        ) -> list[dict[str, str]]:  # fmt: skip
    """Copies of ``messages`` with every ``old`` of their contents written as ``new``.

    A Qwen-VL model reads an image as ``<|vision_start|><|image_pad|><|vision_end|>``
    where LLaVA data writes ``<image>``; the chat template then renders the model's own
    text, as ``transformers``' processor would.
    """
    return [{**m, "content": m["content"].replace(old, new)} for m in messages]


def placeholder_order(messages: Sequence[dict[str, str]], texts: Mapping[str, str]
                      ) -> tuple[str, ...]:  # fmt: skip
    """The name of each placeholder of ``texts`` (name -> text) in ``messages``, in text
    order: ``("image", "video")`` for a conversation holding ``<image>`` then ``<video>``.
    """
    by_text = {text: name for name, text in texts.items()}
    pattern = re.compile("|".join(re.escape(text) for text in by_text))
    return tuple(by_text[m] for message in messages for m in pattern.findall(message["content"]))


def expand_runs(encoded: EncodedConversation, placeholder_id: int, counts: Sequence[int]
                ) -> EncodedConversation:  # fmt: skip
    """The ``k``-th ``placeholder_id`` of ``encoded`` -> ``counts[k]`` copies (never trained).

    :func:`encode_conversation` gives every placeholder of a modality the same count; a
    native-resolution image has its own (its grid's merged tokens), so its conversation is
    encoded with one id per image and expanded here.

    Raises:
        ValueError: as many placeholders as ``counts`` are not found, or a count below 1.
    """
    at = [i for i, t in enumerate(encoded.tokens) if t == placeholder_id]
    if len(at) != len(counts) or any(c < 1 for c in counts):
        raise ValueError(f"{len(at)} placeholder ids {placeholder_id} for the token counts "
                         f"{list(counts)}: expected one placeholder per count >= 1")
    tokens: list[int] = []
    targets: list[bool] = []
    start = 0
    for i, copies in zip(at, counts, strict=True):
        tokens += encoded.tokens[start:i] + [placeholder_id] * copies
        targets += encoded.target[start:i] + [False] * copies
        start = i + 1
    return EncodedConversation(tokens + encoded.tokens[start:], targets + encoded.target[start:],
                               encoded.assistant_texts)


def shifted_sample(encoded: EncodedConversation, pad_id: int, seq_length: int
                   ) -> dict[str, torch.Tensor]:  # fmt: skip
    """``tokens``, next-token ``labels`` and ``loss_mask`` in the collate format.

    Raises:
        ValueError: the conversation needs more than ``seq_length`` tokens.
    """
    tokens = encoded.tokens
    if len(tokens) > seq_length:
        raise ValueError(f"the conversation needs {len(tokens)} tokens (placeholders expanded): "
                         f"more than data.seq_length={seq_length}")  # fmt: skip
    labels = tokens[1:] + [pad_id]
    loss_mask = [float(t) for t in encoded.target[1:]] + [0.0]
    return {
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.float32),
    }
