"""Many conversations encoded at once: what :func:`~mimotron.data.chat.encode_conversation`
gives for each, at a fraction of the per-sample cost.

The sample check (:mod:`~mimotron.data.llava_check`) tokenises every conversation of a
data set once; at 200 000 samples the per-call overhead of ``transformers`` (its chat
template and tokenizer wrappers, called two or three times per sample) was most of the
check's CPU. :class:`ConversationEncoder` renders a batch of conversations with one chat
template call and tokenises the batch with one call of the fast (Rust) tokenizer
(``encode_batch`` underneath), then marks the assistant tokens the same way
:func:`~mimotron.data.chat.encode_conversation` does:

* a ``{% generation %}`` template: ``transformers``' assistant mask of the same batched
  call (the rendering and the tokenisation are the ones the single path makes);
* any other template: the template's own pieces around the contents
  (:func:`~mimotron.data.chat.template_pieces`) depend only on the messages' roles, so
  they are rendered once per sequence of roles and reused by every conversation that
  has it (the single path renders them once per conversation).

The result per conversation is the same :class:`~mimotron.data.chat.EncodedConversation`
(tokens, targets, assistant texts), or the ``ValueError`` the single path raises for it.
A batch whose rendering fails as a whole (a template that raises on one conversation) is
encoded one conversation at a time, so each conversation gets its own result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mimotron.data.chat import (
    EncodedConversation,
    checked_messages,
    encode_conversation,
    expand_placeholders,
    has_generation_blocks,
    overlap_targets,
    spans_from_pieces,
    template_pieces,
)
from mimotron.data.hf_tokenizer import HFTokenizer

Result = EncodedConversation | ValueError
_PieceKey = tuple[tuple[tuple[str, str], ...], ...]


class ConversationEncoder:
    """Batched :func:`~mimotron.data.chat.encode_conversation` for one tokenizer.

    Holds the template pieces seen so far, by sequence of roles (a handful in a data set);
    one encoder per checker, so nothing is shared between processes or tokenizers.

    Args:
        tokenizer: the run's tokenizer (with its chat template).
        num_tokens: modality -> encoder output tokens per placeholder.
    """

    def __init__(self, tokenizer: HFTokenizer, num_tokens: Mapping[str, int]) -> None:
        self.tokenizer = tokenizer
        self.num_tokens = dict(num_tokens)
        self.generation = has_generation_blocks(tokenizer)
        self._pieces: dict[_PieceKey, list[str] | ValueError] = {}

    def encode(self, conversations: Sequence[Sequence[dict[str, str]]]) -> list[Result]:
        """Each conversation encoded, or the ``ValueError`` encoding it alone raises.

        Args:
            conversations: chat messages per conversation (``role``/``content`` dicts).

        Returns:
            One result per conversation, in order.
        """
        results: list[Result | None] = [None] * len(conversations)
        todo: list[tuple[int, list[dict[str, str]], list[str]]] = []
        for k, messages in enumerate(conversations):
            try:
                todo.append((k, *checked_messages(self.tokenizer, messages, self.num_tokens)))
            except ValueError as exc:
                results[k] = exc
        if todo:
            try:
                encoded = self._encode_checked([(m, a) for _, m, a in todo])
            except Exception:  # noqa: BLE001 - one conversation's failure: each alone
                encoded = [self._encode_one(m) for _, m, _ in todo]
            for (k, _, _), result in zip(todo, encoded, strict=True):
                results[k] = result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _encode_one(self, messages: list[dict[str, str]]) -> Result:
        """The single path (its own exceptions other than ``ValueError`` propagate)."""
        try:
            return encode_conversation(self.tokenizer, messages, self.num_tokens)
        except ValueError as exc:
            return exc

    def _encode_checked(self, batch: list[tuple[list[dict[str, str]], list[str]]]
                        ) -> list[Result]:  # fmt: skip
        """Render and tokenise the batch in one call each; mark and expand per conversation."""
        hf = self.tokenizer.tokenizer
        messages = [m for m, _ in batch]
        if self.generation:
            out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)  # fmt: skip
            ids = [list(i) for i in out["input_ids"]]
            targets = [[bool(t) for t in mask] for mask in out["assistant_masks"]]
        else:
            texts = hf.apply_chat_template(messages, tokenize=False)
            enc = hf(texts, add_special_tokens=False, return_offsets_mapping=True)
            ids = [list(i) for i in enc["input_ids"]]
            targets = []
            for msgs, text, offsets, token_ids in zip(messages, texts, enc["offset_mapping"],
                                                      ids, strict=True):  # fmt: skip
                targets.append(self._targets(msgs, text, offsets, token_ids))
        out_list: list[Result] = []
        for (msgs, assistant), token_ids, target in zip(batch, ids, targets, strict=True):
            if isinstance(target, ValueError):
                out_list.append(target)
                continue
            try:
                out_list.append(expand_placeholders(self.tokenizer, msgs, token_ids, target,
                                                    self.num_tokens, assistant))  # fmt: skip
            except ValueError as exc:
                out_list.append(exc)
        return out_list

    def _targets(self, messages: list[dict[str, str]], text: str,
                 offsets: Sequence[tuple[int, int]], ids: list[int]
                 ) -> list[bool] | ValueError:  # fmt: skip
        """Assistant tokens of a template without generation blocks (pieces reused)."""
        try:
            pieces = self._template_pieces(messages)
            spans = spans_from_pieces(self.tokenizer, pieces, [m["content"] for m in messages],
                                      text)  # fmt: skip
        except ValueError as exc:
            return exc
        spans = [s for s, m in zip(spans, messages, strict=True) if m["role"] == "assistant"]
        return overlap_targets([tuple(o) for o in offsets], spans, ids,
                               self.tokenizer.special_ids)  # fmt: skip

    def _template_pieces(self, messages: list[dict[str, str]]) -> list[str]:
        """:func:`~mimotron.data.chat.template_pieces`, once per sequence of roles."""
        key = tuple(tuple(sorted((str(k), repr(v)) for k, v in m.items() if k != "content"))
                    for m in messages)  # fmt: skip
        if key not in self._pieces:
            try:
                self._pieces[key] = template_pieces(self.tokenizer, messages)
            except ValueError as exc:
                self._pieces[key] = exc
        pieces = self._pieces[key]
        if isinstance(pieces, ValueError):
            raise ValueError(str(pieces))  # a fresh one: a re-raise would grow its traceback
        return pieces
