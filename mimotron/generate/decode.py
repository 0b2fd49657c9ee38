"""Text generation on one process: the prompt once, then one token per step from a KV cache.

:class:`Generator` holds a trained model (:func:`~mimotron.generate.source.load_model`)
and answers prompts with images and audio clips:

1. the user turn gets its placeholders and is encoded exactly as a training sample's
   user turn (:mod:`mimotron.generate.prompt`);
2. each file is preprocessed as training preprocessed it and run through its encoder
   and projector; the embeddings replace the placeholders
   (:meth:`~mimotron.models.mimo.MimoModel.merge_embeddings`, as in training);
3. the language model runs the prompt once, filling a
   :class:`~mimotron.models.kv_cache.KVCache`, then each new token alone: a step
   computes one position's keys and values, not the whole sequence again;
4. the next token is the most likely one (``temperature = 0``, the default) or drawn
   from the softmax at ``temperature``, restricted to the smallest set of most likely
   tokens whose probability reaches ``top_p``, with a generator seeded by ``seed``
   (the same seed gives the same reply). Ids the tokenizer cannot decode (the
   vocabulary's padding rows) and the placeholders are never picked.

Generation stops at the tokenizer's ``eos`` or the chat template's end of turn, after
``max_new_tokens`` tokens, or when the prompt and the reply hold as many tokens as the
language model's context length: ``data.seq_length`` for a built-in model, the larger of
it and ``max_position_embeddings`` for one from a Hugging Face folder (a decoder
pretrained on longer sequences than the run trained on keeps its own context).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mimotron.config.hf_resolve import language_spec
from mimotron.data.mrope_positions import decode_positions
from mimotron.data.run_data import encoder_modalities, native_image_module
from mimotron.generate.native_prompt import encode_native_prompt
from mimotron.generate.prompt import Prompt, check_files, encode_prompt, media_loader, user_text
from mimotron.generate.source import LoadedModel, load_model
from mimotron.models.kv_cache import KVCache
from mimotron.models.language import LanguageModel
from mimotron.names import LANGUAGE

STOP_END = "end"
"""The reply ended with ``eos`` or the template's end of turn."""
STOP_MAX_NEW_TOKENS = "max_new_tokens"
STOP_CONTEXT = "context"
"""The prompt and the reply fill the language model's context length."""
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked.

    Attributes:
        max_new_tokens: the most tokens to generate (>= 1).
        temperature: 0 = greedy (the most likely token); > 0 = sample from the softmax
            of ``logits / temperature``.
        top_p: sample from the smallest set of most likely tokens whose probability
            reaches ``top_p`` (0 < top_p <= 1; 1 = every token).
        seed: seeds the sampling generator.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> Sampling:
        """Raise ``ValueError`` naming the first invalid field; ``self`` otherwise."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} is invalid: expected an "
                             "integer >= 1")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature={self.temperature!r} is invalid: expected a finite "
                             "number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: expected 0 < top_p <= 1")
        return self


@dataclass(frozen=True)
class Generation:
    """A generated reply.

    Attributes:
        text: the reply, decoded (the stop token left out).
        token_ids: its ids (the stop token left out).
        stop: why it ended: :data:`STOP_END`, :data:`STOP_MAX_NEW_TOKENS` or
            :data:`STOP_CONTEXT`.
        prompt_tokens: the prompt's length, placeholders expanded.
    """

    text: str
    token_ids: list[int]
    stop: str
    prompt_tokens: int


class Generator:
    """A trained model that answers prompts (module docstring).

    Args:
        loaded: the model, from :func:`~mimotron.generate.source.load_model`.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        lm = loaded.model.language_model
        assert isinstance(lm, LanguageModel)
        self.language_model = lm
        mod = loaded.cfg.modules[LANGUAGE]
        # A pretrained decoder knows its own context; training may have used less. The
        # decoder was built for data.seq_length positions: it accepts max_len here (its
        # RoPE tables are computed per call, for any length).
        self.max_len = max(lm.max_seq_len, language_spec(mod).max_position_embeddings
                           if mod.hf_path else 0)
        lm.max_seq_len = self.max_len
        tokenizer = loaded.tokenizer
        # Never picked: padding rows past the tokenizer's ids, and the placeholders.
        self._banned = torch.zeros(lm.vocab_size, dtype=torch.bool)
        self._banned[tokenizer.vocab_size:] = True
        for modality in tokenizer.modalities:
            self._banned[tokenizer.placeholder_id(modality)] = True
        self._banned = self._banned.to(loaded.device)
        # Per modality, its preprocessing (built on first use: Whisper's filter bank).
        self._loaders: dict[str, Callable[[str | Path], torch.Tensor]] = {}

    @classmethod
    def from_path(cls, path: str | Path, device: str | torch.device | None = None
                  ) -> Generator:
        """Load a run, checkpoint or export folder (:func:`~mimotron.generate.source.
        load_model`) on ``device`` (``None``: the runtime's device)."""
        return cls(load_model(path, device))

    def encode(self, prompt: str, images: Sequence[str | Path] = (),
               audios: Sequence[str | Path] = ()) -> tuple[Prompt, torch.Tensor]:
        """The prompt's tokens and its input embeddings, media merged in.

        Returns:
            ``(prompt, hidden)`` with ``hidden`` ``[1, prompt length, hidden size]``.

        Raises:
            ValueError: a missing or unreadable file, placeholders that do not match
                the files, a modality without an encoder (one line naming it).
        """
        loaded = self.loaded
        cfg, tokenizer, model = loaded.cfg, loaded.tokenizer, loaded.model
        files = {"image": list(images), "audio": list(audios)}
        several = cfg.data.max_images_per_sample > 1  # a run trained on [B, K] images
        text = user_text(tokenizer, prompt, files,
                         {"image": cfg.data.max_images_per_sample})
        encoders = encoder_modalities(cfg)
        media = {}
        for modality, given in files.items():
            if given:
                if modality not in self._loaders:
                    self._loaders[modality] = media_loader(cfg, modality)
                media[modality] = torch.stack([self._loaders[modality](f) for f in given])
        num_tokens = {m: cfg.modules[name].num_output_tokens for m, name in encoders.items()}
        encoded = encode_prompt(tokenizer, text, num_tokens, cfg.data.system_prompt or None)
        tokens = torch.tensor([encoded.tokens], device=loaded.device)
        embeds, present = {}, {}
        for modality, values in media.items():
            name = encoders[modality]
            # One row: [1, n, ...] images with a [1, n] mask (the k-th <image> takes the
            # k-th file), or as before [1, ...] with a [1] flag.
            items = several and modality == "image"
            present[name] = torch.ones((1, len(values)) if items else 1, dtype=torch.bool,
                                       device=loaded.device)
            batch = {modality: (values if items else values[0]).unsqueeze(0).to(loaded.device),
                     f"has_{modality}": present[name]}
            embeds[name] = model.encode(name, batch)
        hidden = model.merge_embeddings(tokens, self.language_model.embed_tokens(tokens),
                                        embeds, present)
        return encoded, hidden

    @torch.no_grad()
    def generate(self, prompt: str, images: Sequence[str | Path] = (),
                 audios: Sequence[str | Path] = (), sampling: Sampling | None = None,
                 videos: Sequence[str | Path] = ()) -> Generation:
        """Answer ``prompt`` about ``images`` / ``audios`` (one audio clip; as many images as
        the run's ``data.max_images_per_sample``).

        Args:
            prompt: the user's text; placeholders are added before it unless it holds
                them (:func:`~mimotron.generate.prompt.user_text`).
            images: image files.
            audios: WAV files.
            sampling: how tokens are picked (default: greedy, 64 new tokens).
            videos: video files or folders of frames (a Qwen-VL model only).

        Returns:
            The reply.

        Raises:
            ValueError: bad sampling options, bad media, or a prompt that fills the
                language model's context.
        """
        sampling = (sampling or Sampling()).check()
        native = native_image_module(self.loaded.cfg)
        forward_args: dict[str, Any] = {}
        if native is not None:  # Qwen-VL: native-resolution images, 3-D positions
            if audios:
                raise ValueError("--audio was given but the model has no audio encoder")
            got = encode_native_prompt(self.loaded, native, prompt, images, videos)
            encoded, hidden, forward_args = got.prompt, got.hidden, got.forward_args
        elif videos:
            raise ValueError("--video was given but the model's vision module takes images "
                             "only (videos need a Qwen2.5-VL / Qwen3-VL folder)")
        else:
            encoded, hidden = self.encode(prompt, images, audios)
        length = len(encoded.tokens)
        if length >= self.max_len:
            raise ValueError(f"the prompt takes {length} tokens (placeholders expanded): the "
                             f"language model's context is {self.max_len}, leaving no room "
                             "for a reply")
        lm = self.language_model
        # The prompt and the reply fit the context; the reply's last token is never fed.
        cache = KVCache(min(length + sampling.max_new_tokens, self.max_len) - 1)
        generator = torch.Generator().manual_seed(sampling.seed)
        logits = lm(hidden, cache=cache, **forward_args)[0, -1]
        out: list[int] = []
        while True:
            token = self._pick(logits, sampling, generator)
            if token in encoded.stop_ids:
                stop = STOP_END
                break
            out.append(token)
            if len(out) == sampling.max_new_tokens:
                stop = STOP_MAX_NEW_TOKENS
                break
            if length + len(out) == self.max_len:
                stop = STOP_CONTEXT
                break
            step = torch.tensor([[token]], device=self.loaded.device)
            # After an M-RoPE prompt a token's position is its cache position + rope_deltas.
            position = ({} if native is None else {"position_ids": decode_positions(
                got.rope_deltas, cache.length, 1)})
            logits = lm(lm.embed_tokens(step), cache=cache, **position)[0, -1]
        text = self.loaded.tokenizer.tokenizer.decode(out, skip_special_tokens=True)
        return Generation(str(text), out, stop, length)

    def _pick(self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
              ) -> int:
        """The next token id from the last position's logits (module docstring)."""
        logits = logits.float().masked_fill(self._banned, float("-inf"))
        if sampling.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / sampling.temperature, dim=-1).cpu()
        sorted_probs, order = probs.sort(descending=True)
        # Keep the most likely tokens until their mass reaches top_p (that one included).
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])


def generate(path: str | Path, prompt: str, images: Sequence[str | Path] = (),
             audios: Sequence[str | Path] = (), sampling: Sampling | None = None,
             device: str | torch.device | None = None) -> Generation:
    """Load a trained model and answer one prompt (:class:`Generator` for several).

    Args:
        path: a run directory, a checkpoint or an export folder
            (:func:`~mimotron.generate.source.find_source`).
        prompt: the user's text.
        images: image files (at most ``data.max_images_per_sample``).
        audios: WAV files (at most one).
        sampling: how tokens are picked (default: greedy, 64 new tokens).
        device: where to run (``None``: the runtime's device).

    Returns:
        The reply.

    Raises:
        ValueError: as :func:`~mimotron.generate.source.load_model` and
            :meth:`Generator.generate`.
        CheckpointError: a damaged or incomplete checkpoint.
    """
    sampling = (sampling or Sampling()).check()  # before the model is read
    check_files({"image": images, "audio": audios})
    return Generator.from_path(path, device).generate(prompt, images, audios, sampling)
