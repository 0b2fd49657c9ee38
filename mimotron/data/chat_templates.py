"""The built-in chat templates ``data.chat_template`` names, and the lookup of its value.

A base model's tokenizer often has no chat template (``llava-1.5-7b-hf`` keeps its
template in the processor's ``chat_template.json``; most base decoders have none), and
a tokenizer's own template may not be the format the run wants to train. The value of
``data.chat_template`` (:func:`resolve_chat_template`) is

- ``""``: the tokenizer's own template (nothing is replaced);
- a built-in name (:data:`~mimotron.config.schema.CHAT_TEMPLATES`):

  * ``chatml``: Qwen2's ChatML (``Qwen2-7B-Instruct``'s ``tokenizer_config.json``):
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, and first the system
    message ``You are a helpful assistant.`` when the conversation has none;
  * ``llama3``: Llama 3 Instruct (``Meta-Llama-3-8B-Instruct``):
    ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content | trim}<|eot_id|>`` per
    message, the tokenizer's ``bos_token`` first;
  * ``vicuna``: LLaVA-1.5's training format (its ``--version v1``, ``conv_vicuna_v1`` of
    ``llava/conversation.py``, ``SeparatorStyle.TWO``): the tokenizer's ``bos_token``
    (``<s>``, which LLaVA-1.5's tokenisation keeps at the start), the system message
    (Vicuna's by default) and a space, then ``USER: {content} `` and ``ASSISTANT: {content}</s>``,
    where ``</s>`` is the tokenizer's ``eos_token`` (Vicuna's, so any tokenizer's own
    end token stops the model);

- or the path of a ``.jinja`` file holding a template.

A message's ``content`` is a string (what training renders) or, as ``transformers``'
processors pass it, a list of parts: ``{"type": "image"}`` renders ``<image>`` and a
newline (llava-1.5-hf's processor template does the same), ``{"type": "text", "text":
...}`` its text. So an exported processor takes the messages its users write.

The templates mark no ``{% generation %}`` blocks: :mod:`~mimotron.data.chat` locates
the assistant contents between the template's fixed pieces and trains each reply plus
the special token that ends it (``<|im_end|>``, ``<|eot_id|>``, the eos token). So a
built-in's control tokens must be single special tokens of the tokenizer
(:func:`check_template_tokens`): split into plain pieces, the end of a turn would never
be trained and the model would not learn to stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mimotron.config.schema import CHAT_TEMPLATES
from mimotron.config.validation import check_chat_template_key

if TYPE_CHECKING:  # an annotation only: the tokenizer imports nothing from here
    from mimotron.data.hf_tokenizer import HFTokenizer

# Every tag strips the whitespace around it ({%- -%}): the text rendered is exactly the
# string literals, whatever the indentation here or transformers' trim settings.
_CONTENT = r"""{%- macro content_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'image' -%}
                {{- '<image>\n' -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

CHATML_TEMPLATE = _CONTENT + r"""{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\n' + content_text(message['content'])
        + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# bos_token is the tokenizer's (<|begin_of_text|> for Llama 3); a tokenizer without
# one renders nothing there rather than failing.
LLAMA3_TEMPLATE = _CONTENT + r"""{%- for message in messages -%}
    {%- if loop.first and bos_token is defined and bos_token is not none -%}
        {{- bos_token -}}
    {%- endif -%}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}
    {{- content_text(message['content']) | trim -}}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

# Vicuna v1.1's system message: LLaVA-1.5's default (conv_vicuna_v1.system).
VICUNA_TEMPLATE = _CONTENT + r"""{%- if eos_token is not defined or eos_token is none -%}
    {{- raise_exception('the vicuna chat template ends each reply with the eos_token, '
                        ~ 'and the tokenizer has none') -}}
{%- endif -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = "A chat between a curious user and an artificial intelligence assistant. "
                     ~ "The assistant gives helpful, detailed, and polite answers to the user's "
                     ~ "questions." -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if bos_token is defined and bos_token is not none -%}
    {{- bos_token -}}
{%- endif -%}
{{- system + ' ' -}}
{%- for message in turns -%}
    {%- if message['role'] == 'user' -%}
        {{- 'USER: ' + content_text(message['content']) + ' ' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- 'ASSISTANT: ' + content_text(message['content']) + eos_token -}}
    {%- else -%}
        {{- raise_exception('the vicuna chat template takes a system message first only, '
                            ~ 'then user and assistant turns') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template chosen by ``data.chat_template``.

    Attributes:
        value: the key's value (a built-in name or the file's path).
        source: the Jinja template.
        control_tokens: texts that must each be one special token of the tokenizer.
        needs_eos: the template ends replies with the tokenizer's ``eos_token``.
    """

    value: str
    source: str
    control_tokens: tuple[str, ...] = ()
    needs_eos: bool = False

    @property
    def origin(self) -> str:
        """Where the template came from, for messages: ``data.chat_template='vicuna'``."""
        return f"data.chat_template={self.value!r}"


def builtin_templates() -> dict[str, ChatTemplate]:
    """The built-in templates by name (a new dict each call: no shared mutable state)."""
    templates = {
        "chatml": ChatTemplate("chatml", CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
        "llama3": ChatTemplate("llama3", LLAMA3_TEMPLATE,
                               ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
        "vicuna": ChatTemplate("vicuna", VICUNA_TEMPLATE, needs_eos=True),
    }  # fmt: skip
    assert tuple(templates) == CHAT_TEMPLATES, (tuple(templates), CHAT_TEMPLATES)
    return templates


def resolve_chat_template(value: str) -> ChatTemplate | None:
    """The template ``data.chat_template`` names, or ``None`` for ``""`` (the tokenizer's).

    Args:
        value: the key's value: empty, a built-in name or a ``.jinja`` file's path.

    Returns:
        The template, or ``None``.

    Raises:
        ValueError: an unknown name, a missing file or one that is not UTF-8 text or is
            empty (one line naming the value).
    """
    check_chat_template_key(value)
    if not value:
        return None
    if value in CHAT_TEMPLATES:
        return builtin_templates()[value]
    try:
        source = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"data.chat_template={value!r} could not be read ({exc}): expected "
                         "a UTF-8 .jinja file") from None
    if not source.strip():
        raise ValueError(f"data.chat_template={value!r} is invalid: the file is empty "
                         "(expected a Jinja chat template)")
    return ChatTemplate(value, source)


def check_template_tokens(template: ChatTemplate, tokenizer: HFTokenizer) -> None:
    """Raise unless the tokenizer keeps each control token of ``template`` whole and special.

    Args:
        template: the run's template (:func:`resolve_chat_template`).
        tokenizer: the tokenizer it replaced the template of.

    Raises:
        ValueError: a control token that is not one special token, or no ``eos_token``
            for a template that ends replies with it; one line naming both keys.
    """
    where = f"{template.origin} with data.tokenizer={str(tokenizer.path)!r}"
    eos = tokenizer.tokenizer.eos_token
    if template.needs_eos and eos is None:
        raise ValueError(f"{where}: the tokenizer has no eos_token, which the template ends "
                         "each reply with; use a tokenizer that has one")
    for text in (*template.control_tokens, *([eos] if template.needs_eos else [])):
        ids = tokenizer.encode(text)
        if len(ids) != 1 or ids[0] not in tokenizer.special_ids:
            raise ValueError(f"{where}: {text!r} is not a special token of the tokenizer "
                             f"(it encodes to {len(ids)} ids {ids}): the template's turns "
                             "could not end with a trained stop token; use the tokenizer's "
                             "own format or a template file made for it")
