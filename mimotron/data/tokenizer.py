"""Character-level tokenizer and number words for the digits task.

The demo language model reads and writes lowercase English, so a character vocabulary
of ~33 symbols is enough and keeps the embedding table tiny. Ids are laid out as:

==========  ===============================================================
id          symbol
==========  ===============================================================
0           ``<pad>`` (padding; never a training target)
1           ``<bos>``
2           ``<eos>`` (ends every answer; decoding stops here)
3, 4, ...   one placeholder per modality: ``<image>`` = 3, ``<audio>`` = 4
next        the characters: space, ``=``, ``a``-``z``
==========  ===============================================================

Placeholder tokens mark where the language model's input embeddings are replaced by an
encoder's output embeddings (one placeholder per encoder output token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Modalities in placeholder-id order; a tuple so the layout can never change at run time.
MODALITIES: tuple[str, ...] = ("image", "audio")

_SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
_CHARACTERS = " =abcdefghijklmnopqrstuvwxyz"

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen",
)  # fmt: skip


def number_to_words(value: int) -> str:
    """Spell a number of the digits task in English words.

    Args:
        value: an integer in ``[0, 18]`` (the largest sum of two digits is 9 + 9).

    Returns:
        The word, e.g. ``"seventeen"``.

    Raises:
        ValueError: ``value`` is outside ``[0, 18]``.
    """
    if not 0 <= value < len(NUMBER_WORDS):
        raise ValueError(f"value={value!r} is invalid: expected an integer in [0, 18]")
    return NUMBER_WORDS[value]


class CharTokenizer:
    """Maps lowercase text to ids and back, with one placeholder id per modality.

    Example:
        >>> tok = CharTokenizer()
        >>> tok.decode([tok.bos_id] + tok.encode("seven") + [tok.eos_id, 9])
        'seven'
    """

    def __init__(self) -> None:
        symbols = list(_SPECIALS) + [f"<{m}>" for m in MODALITIES] + list(_CHARACTERS)
        self._symbols: tuple[str, ...] = tuple(symbols)
        self._first_char_id = len(_SPECIALS) + len(MODALITIES)
        self._char_to_id: dict[str, int] = {
            c: self._first_char_id + i for i, c in enumerate(_CHARACTERS)
        }

    # ---- ids ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids (specials, placeholders and characters)."""
        return len(self._symbols)

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>`` (0)."""
        return 0

    @property
    def bos_id(self) -> int:
        """Id of ``<bos>`` (1)."""
        return 1

    @property
    def eos_id(self) -> int:
        """Id of ``<eos>`` (2)."""
        return 2

    @property
    def first_char_id(self) -> int:
        """Smallest id of an ordinary character; ids below it are specials or placeholders."""
        return self._first_char_id

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modalities that have a placeholder token, in id order."""
        return MODALITIES

    def placeholder_id(self, modality: str) -> int:
        """Id of the placeholder token of ``modality``.

        Args:
            modality: ``"image"`` or ``"audio"``.

        Returns:
            The placeholder id (``<image>`` = 3, ``<audio>`` = 4).

        Raises:
            ValueError: unknown modality.
        """
        if modality not in MODALITIES:
            raise ValueError(f"modality={modality!r} is invalid: expected one of {MODALITIES}")
        return len(_SPECIALS) + MODALITIES.index(modality)

    def symbol(self, token_id: int) -> str:
        """Printable symbol of one id (``"<image>"``, ``"a"``, ...), for debugging."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token_id={token_id!r} is invalid: expected an id in [0, {self.vocab_size})"
            )
        return self._symbols[token_id]

    # ---- text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Turn text into character ids (no ``<bos>``/``<eos>`` added).

        Args:
            text: lowercase letters, spaces and ``=``.

        Returns:
            One id per character.

        Raises:
            ValueError: ``text`` holds a character outside the vocabulary.
        """
        try:
            return [self._char_to_id[c] for c in text]
        except KeyError as exc:
            raise ValueError(
                f"text={text!r} is invalid: character {exc.args[0]!r} is not in the "
                f"vocabulary; valid characters are {_CHARACTERS!r}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text.

        Decoding stops at the first ``<eos>``; ``<pad>``, ``<bos>`` and placeholders are
        skipped so a whole sample (prompt included) decodes to its readable text.

        Args:
            ids: token ids (a list, or a 1-D tensor's ``tolist()``).

        Returns:
            The text.
        """
        chars: list[str] = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == self.eos_id:
                break
            if self._first_char_id <= token_id < self.vocab_size:
                chars.append(self._symbols[token_id])
        return "".join(chars)

    def placeholders(self, counts: Sequence[tuple[str, int]]) -> list[int]:
        """Placeholder ids for several modalities, e.g. ``[("image", 16), ("audio", 4)]``.

        Args:
            counts: ``(modality, number of placeholder tokens)`` pairs, in prompt order.

        Returns:
            The concatenated placeholder ids.
        """
        ids: list[int] = []
        for modality, count in counts:
            ids.extend([self.placeholder_id(modality)] * count)
        return ids

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
