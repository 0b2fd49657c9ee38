"""Train a small byte-level BPE tokenizer locally and save it as a Hugging Face folder.

Real runs load the tokenizer that ships with their language model
(:class:`~mimotron.data.hf_tokenizer.HFTokenizer`); this builds one from a handful of
sentences for the tests and the demo, with no download. The folder it writes
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) is what
``transformers.AutoTokenizer.from_pretrained`` reads, so the demo goes through exactly
the code a user with a real checkpoint runs.

Two ChatML (Qwen-style) templates are provided: :data:`CHATML_TEMPLATE` marks the
assistant replies with ``{% generation %}`` blocks (the content and its closing
``<|im_end|>``), :data:`CHATML_TEMPLATE_PLAIN` renders the same text without them, so
both ways of finding the assistant tokens can be compared on one tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

# The control tokens of ChatML; <|endoftext|> doubles as padding.
CHATML_SPECIALS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHATML_TEMPLATE_PLAIN = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int = 320,
    chat_template: str = CHATML_TEMPLATE,
    special_tokens: Sequence[str] = CHATML_SPECIALS,
) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it as a Hugging Face folder.

    The result is deterministic for the same texts and arguments (the BPE trainer breaks
    ties by a fixed order). Every byte is in the initial alphabet, so any text encodes.

    Args:
        texts: training sentences (a few dozen are plenty for a toy vocabulary).
        out_dir: folder to write (created if missing).
        vocab_size: target vocabulary size, specials and the 256 byte symbols included.
        chat_template: the Jinja chat template stored with the tokenizer.
        special_tokens: control tokens, in id order from 0; the first is the padding
            token and the last the end-of-turn (``eos``) token.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: fewer than two special tokens, or a vocabulary too small for the
            byte alphabet and the specials.
    """
    # Deferred: the tokenizer libraries are only needed for Hugging Face data.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if len(special_tokens) < 2:
        raise ValueError(
            f"special_tokens={list(special_tokens)!r} is invalid: expected at least a padding "
            "and an end-of-turn token"
        )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(
            f"vocab_size={vocab_size!r} is invalid: expected at least "
            f"{len(alphabet) + len(special_tokens)} (256 byte symbols plus the specials)"
        )
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=alphabet, show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=special_tokens[0], eos_token=special_tokens[-1]
    )
    fast.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out
