"""A generation prompt exactly as training saw a user turn, and the media it carries.

**The prompt's tokens.** Training renders a LLaVA conversation with the tokenizer's chat
template and trains on the assistant's tokens (:func:`~mimotron.data.chat.
encode_conversation`); the model learnt to predict the first assistant token from the
tokens before it. :func:`encode_prompt` therefore encodes the conversation
``[system prompt,] user turn, assistant turn`` through that very function, with a
stand-in assistant reply, and keeps the tokens before the first assistant token: the
role headers, the system prompt of ``data.system_prompt`` and the expanded
placeholders are what a training sample holds, token for token.

**Where generation stops.** At the tokenizer's ``eos`` token and at the template's end
of turn: the special token training marked right after the assistant reply
(``<|im_end|>``, ``<|eot_id|>``, ``</s>``).

**Placeholders.** LLaVA data puts ``<image>`` (``<audio>``) before the question, one
per file, ``<image><audio>\\n`` first when a sample holds both. :func:`user_text` does
the same for a prompt without placeholders; a prompt that holds them keeps them where
they are, and their number must match the files given. As in training, each
placeholder is expanded to the encoder's ``num_output_tokens`` copies, and a sample
holds at most one file per modality.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mimotron.config.schema import MimoConfig
from mimotron.data.chat import EncodedConversation, encode_conversation, to_messages
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.run_data import audio_features, encoder_modalities, image_processor

# The stand-in assistant reply: its tokens are cut off, only where they start matters.
STAND_IN = "ok"
_OPTION = {"image": "--image", "audio": "--audio"}


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids and where generation stops.

    Attributes:
        tokens: the ids up to the assistant's first token, placeholders expanded.
        stop_ids: ids that end the reply (``eos``, the template's end of turn).
    """

    tokens: list[int]
    stop_ids: frozenset[int]


def user_text(tokenizer: HFTokenizer, text: str, files: Mapping[str, Sequence[Any]],
              max_files: Mapping[str, int] | None = None) -> str:
    """The user turn: ``text`` with a placeholder per file, first as in LLaVA data.

    Args:
        tokenizer: the run's tokenizer (its placeholder texts).
        text: the user's prompt.
        files: modality -> the files given for it.
        max_files: modality -> the most files a prompt takes (the run's
            ``data.max_images_per_sample`` for images); 1 for a modality not named.

    Returns:
        ``text`` itself when it holds the placeholders already, else the missing ones,
        image before audio, then a newline and ``text``.

    Raises:
        ValueError: more files of a modality than ``max_files``, a modality the model has no
            placeholder for, or a prompt whose placeholders do not match the files.
    """
    prefix = ""
    for modality, given in files.items():
        if not given:
            continue
        option = _OPTION.get(modality, modality)
        if modality not in tokenizer.modalities:
            raise ValueError(f"{option} was given but the model has no {modality} encoder "
                             f"(it takes {list(tokenizer.modalities) or 'text only'})")
        limit = (max_files or {}).get(modality, 1)
        if len(given) > limit:
            raise ValueError(f"{len(given)} {option} files were given: at most {limit} per "
                             "prompt (training samples held at most that many: "
                             "data.max_images_per_sample for images)")
    for modality in tokenizer.modalities:
        placeholder = tokenizer.placeholder_text(modality)
        in_text, num_files = text.count(placeholder), len(files.get(modality, ()))
        if in_text == 0:
            prefix += placeholder * num_files
        elif in_text != num_files:
            raise ValueError(f"--prompt holds {in_text} {placeholder} but {num_files} "
                             f"{_OPTION.get(modality, modality)} file(s) were given: expected "
                             "one placeholder per file")
    return f"{prefix}\n{text}" if prefix else text


def encode_prompt(tokenizer: HFTokenizer, text: str, num_tokens: Mapping[str, int],
                  system_prompt: str | None = None) -> Prompt:
    """The tokens of a user turn up to the assistant's reply (module docstring).

    Args:
        tokenizer: the run's tokenizer.
        text: the user turn (placeholders included, see :func:`user_text`).
        num_tokens: modality -> its encoder's output tokens (the run's encoders).
        system_prompt: the run's ``data.system_prompt`` (``None``: none).

    Returns:
        The prompt.

    Raises:
        ValueError: what encoding a training conversation raises (a placeholder of a
            modality without an encoder, a template that hides the reply).
    """
    conversation = [{"from": "human", "value": text}, {"from": "gpt", "value": STAND_IN}]
    encoded = encode_conversation(tokenizer, to_messages(conversation, system_prompt),
                                  num_tokens)
    return prompt_of(tokenizer, encoded)


def prompt_of(tokenizer: HFTokenizer, encoded: EncodedConversation) -> Prompt:
    """The prompt of an encoded conversation whose assistant turn is :data:`STAND_IN`:
    its tokens up to the reply, and the ids that end a reply.

    Raises:
        ValueError: a template that hides the reply.
    """
    targets = [i for i, is_target in enumerate(encoded.target) if is_target]
    if not targets:
        raise ValueError(f"the chat template of data.tokenizer={str(tokenizer.path)!r} leaves "
                         "no assistant token: the reply cannot be located")
    eos = tokenizer.tokenizer.eos_token_id
    stop = set() if eos is None else {int(eos)}
    # The last trained token is the end of turn when it is special (the stand-in is not).
    end_of_turn = encoded.tokens[targets[-1]]
    if end_of_turn in tokenizer.special_ids:
        stop.add(int(end_of_turn))
    return Prompt(encoded.tokens[:targets[0]], frozenset(stop))


def check_files(files: Mapping[str, Sequence[str | Path]]) -> None:
    """Raise ``ValueError`` naming the first media file that does not exist.

    Args:
        files: modality -> the files given for it.
    """
    for modality, given in files.items():
        for file in given:
            if not Path(file).is_file():
                raise ValueError(f"{_OPTION.get(modality, modality)} file {str(file)!r} not found")


def media_loader(cfg: MimoConfig, modality: str) -> Callable[[str | Path], torch.Tensor]:
    """A function preprocessing one image or audio file as training preprocessed it.

    Args:
        cfg: the run config (the encoder's ``hf_path`` preprocessing or its toy sizes).
        modality: ``"image"`` or ``"audio"``.

    Returns:
        ``file -> [3, H, W]`` pixels or ``[mel bins, frames]`` log-mel features; it
        raises ``ValueError`` naming a missing or undecodable file.
    """
    module = encoder_modalities(cfg)[modality]
    option = _OPTION.get(modality, modality)
    process: Callable[[Any], torch.Tensor] = (
        audio_features(cfg, module) if modality == "audio" else image_processor(cfg, module))

    def load(file: str | Path) -> torch.Tensor:
        path = Path(file)
        check_files({modality: [path]})
        if modality == "audio":
            try:
                return process(path)
            except ValueError as exc:  # names the file already
                raise ValueError(f"{option}: {exc}") from None
        return process(_open_image(path, option))

    return load


def _open_image(path: Path, option: str) -> Any:
    """The decoded PIL image of ``path`` (read in full, file closed)."""
    from PIL import Image  # Deferred: only images need PIL.

    try:
        with Image.open(path) as image:
            image.load()  # decoded now, so the file can close
            return image
    except Exception as exc:  # noqa: BLE001 - any decoding failure is an unreadable image
        raise ValueError(f"{option} file {str(path)!r} is unreadable: "
                         f"{' '.join(str(exc).split())}") from None
