"""Where ``mimotron generate`` stops: eos, the end of turn, ``max_new_tokens``, the context.

The tokenizers are trained here (:func:`~mimotron.data.bpe.train_bpe_tokenizer`) in the
two layouts where the end of turn is not the ``eos`` token: Llama-3's (``<|eot_id|>``
ends a turn, ``<|end_of_text|>`` is ``eos``) and a base Qwen2's (``<|im_end|>`` /
``<|endoftext|>``). The model is a language model whose next token depends on the
current token alone, written into a ``mimotron export`` folder and loaded as
``mimotron generate`` loads one: every layer's output projections are zero (each
layer adds nothing to the residual), token ``t``'s embedding is a one-hot column
``slot(t)``, and the output head maps that column to the token that follows ``t`` in a
table the test chooses. So the greedy reply is known token for token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mimotron.checkpoint.export import CONFIG_FILE
from mimotron.cli.main import main as cli_main
from mimotron.config import config_from_dict
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data.bpe import CHATML_TEMPLATE, train_bpe_tokenizer
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.generate import Generator, Sampling
from mimotron.generate.prompt import encode_prompt
from mimotron.models.build import build_module
from mimotron.names import LANGUAGE

HIDDEN = 32
SEQ_LENGTH = 32  # data.seq_length: the context of a built-in language model
HF_CONTEXT = 48  # max_position_embeddings of the Hugging Face folder (> SEQ_LENGTH)

LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# (template, special tokens: padding first, the end of turn, eos last (train_bpe_tokenizer))
STYLES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "llama3": (LLAMA3_TEMPLATE, ("<|pad|>", "<|start_header_id|>", "<|end_header_id|>",
                                 "<|eot_id|>", "<|end_of_text|>"), "<|eot_id|>"),
    "qwen2-base": (CHATML_TEMPLATE, ("<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"),
                   "<|im_end|>"),
}
CORPUS = ["zero one two three four five six seven eight nine", "what comes next one two"]


def _tokenizer(root: Path, style: str) -> Path:
    template, specials, _ = STYLES[style]
    return train_bpe_tokenizer(CORPUS, root / f"tokenizer_{style}", vocab_size=400,
                               chat_template=template, special_tokens=specials)


def _ids(tokenizer: HFTokenizer, style: str) -> dict[str, int]:
    """The ids a test needs: eos, the end of turn, and two words."""
    fast = tokenizer.tokenizer
    words = [tokenizer.encode(w) for w in (" one", " two")]
    assert all(len(w) == 1 for w in words), words
    return {"eos": int(fast.eos_token_id), "eot": int(fast.convert_tokens_to_ids(STYLES[style][2])),
            "one": words[0][0], "two": words[1][0]}


def _hf_folder(root: Path, vocab_size: int) -> Path:
    """A Llama folder whose context is HF_CONTEXT (its weights are replaced by the export's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / "hf_language"
    LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=HF_CONTEXT,
        tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def _export(root: Path, tokenizer_dir: Path, follows: dict[int, int], hf: bool = False) -> Path:
    """A ``mimotron export`` folder of a language model whose greedy choice after token
    ``t`` is ``follows[t]`` (the module docstring); any other token is followed by id 0."""
    (root / "data.jsonl").write_text("")
    tokenizer = HFTokenizer(tokenizer_dir, modalities=())
    vocab = padded_vocab_size(tokenizer.vocab_size)
    language: dict[str, Any] = {"kind": "language"}
    if hf:
        language["hf_path"] = str(_hf_folder(root, tokenizer.vocab_size))
    else:
        language.update(hidden_size=HIDDEN, num_layers=1, num_heads=2, ffn_hidden_size=64)
    cfg = config_from_dict({"name": "stops", "modules": {LANGUAGE: language}, "data": {
        "dataset": "llava", "path": str(root / "data.jsonl"), "tokenizer": str(tokenizer_dir),
        "seq_length": SEQ_LENGTH}})
    lm = build_module(cfg, LANGUAGE, vocab)
    state = {name: torch.zeros_like(t) for name, t in lm.state_dict().items()}
    state["final_norm.weight"].fill_(1.0)
    assert len(follows) <= HIDDEN
    for slot, (token, after) in enumerate(sorted(follows.items())):
        state["embed.weight"][token, slot] = 1.0
        state["output.weight"][after, slot] = 1.0
    out = root / "export"
    out.mkdir()
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    save_file(state, str(out / f"{LANGUAGE}.safetensors"))
    return out


@pytest.fixture(params=sorted(STYLES))
def style(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _setup(tmp_path: Path, style: str, follows: Callable[[dict[str, int], int], dict[int, int]],
           hf: bool = False) -> tuple[Generator, dict[str, int]]:
    """A generator whose table is ``follows(ids, last prompt token)``."""
    tokenizer_dir = _tokenizer(tmp_path, style)
    tokenizer = HFTokenizer(tokenizer_dir, modalities=())
    ids = _ids(tokenizer, style)
    last = encode_prompt(tokenizer, "one", {}).tokens[-1]  # every prompt ends with it
    export = _export(tmp_path, tokenizer_dir, follows(ids, last), hf)
    return Generator.from_path(export, device="cpu"), ids


def _cycle(ids: dict[str, int], last: int) -> dict[int, int]:
    """one two one two ... and never a stop token."""
    return {last: ids["one"], ids["one"]: ids["two"], ids["two"]: ids["one"]}


def test_stop_set_is_eos_and_the_end_of_turn(tmp_path: Path, style: str) -> None:
    tokenizer = HFTokenizer(_tokenizer(tmp_path, style), modalities=())
    ids = _ids(tokenizer, style)
    assert ids["eos"] != ids["eot"]
    assert encode_prompt(tokenizer, "one", {}).stop_ids == {ids["eos"], ids["eot"]}


def test_reply_stops_at_the_end_of_turn(tmp_path: Path, style: str) -> None:
    """one two <end of turn>: the reply is "one two", stopped at the end."""
    generator, ids = _setup(tmp_path, style, lambda ids, last: {
        last: ids["one"], ids["one"]: ids["two"], ids["two"]: ids["eot"]})
    reply = generator.generate("what comes next", sampling=Sampling(max_new_tokens=10))
    assert (reply.token_ids, reply.text, reply.stop) == ([ids["one"], ids["two"]], " one two",
                                                         "end")


def test_reply_stops_at_eos(tmp_path: Path) -> None:
    generator, ids = _setup(tmp_path, "llama3", lambda ids, last: {
        last: ids["two"], ids["two"]: ids["eos"]})
    reply = generator.generate("what comes next", sampling=Sampling(max_new_tokens=10))
    assert (reply.token_ids, reply.stop) == ([ids["two"]], "end")


def test_reply_stops_after_max_new_tokens(tmp_path: Path) -> None:
    generator, ids = _setup(tmp_path, "llama3", _cycle)
    reply = generator.generate("what comes next", sampling=Sampling(max_new_tokens=3))
    assert (reply.token_ids, reply.stop) == ([ids["one"], ids["two"], ids["one"]],
                                             "max_new_tokens")


@pytest.mark.parametrize("hf, context", [(False, SEQ_LENGTH), (True, HF_CONTEXT)])
def test_reply_stops_at_the_context_length(tmp_path: Path, hf: bool, context: int) -> None:
    """The prompt and the reply fill the context exactly: data.seq_length for a built-in
    model, max_position_embeddings (larger here) for a Hugging Face one."""
    generator, ids = _setup(tmp_path, "qwen2-base", _cycle, hf)
    assert generator.max_len == context
    for prompt in ("what comes next", "one two three four five six seven eight nine"):
        reply = generator.generate(prompt, sampling=Sampling(max_new_tokens=100))
        num = context - reply.prompt_tokens
        assert num >= 2 and reply.stop == "context", (reply, num)
        assert reply.token_ids == [ids["one"], ids["two"]] * (num // 2) + [ids["one"]] * (num % 2)
        # With room for exactly max_new_tokens more, that limit is the one reported.
        reply = generator.generate(prompt, sampling=Sampling(max_new_tokens=num))
        assert (len(reply.token_ids), reply.stop) == (num, "max_new_tokens")


def test_cli_prints_the_reply_cut_at_the_context(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """A long reply from a Hugging Face decoder trained on shorter sequences
    (data.seq_length < max_position_embeddings) runs to the decoder's context."""
    generator, ids = _setup(tmp_path, "qwen2-base", _cycle, hf=True)
    prompt = generator.encode("what comes next")[0]
    num = HF_CONTEXT - len(prompt.tokens)
    capsys.readouterr()
    assert cli_main(["generate", str(tmp_path / "export"), "--prompt", "what comes next",
                     "--max-new-tokens", "1000"]) == 0
    out, err = capsys.readouterr()
    assert out == " one two" * (num // 2) + " one" * (num % 2) + "\n"
    assert err.endswith(f"prompt {len(prompt.tokens)} tokens, reply {num} tokens, stopped at "
                        "context (the language model's context length, "
                        f"{HF_CONTEXT} tokens)\n"), err


def test_prompt_filling_the_context_is_refused(tmp_path: Path) -> None:
    generator, _ = _setup(tmp_path, "qwen2-base", _cycle)
    short = len(generator.encode("what comes next")[0].tokens)
    prompt = "what comes next" + " one" * (SEQ_LENGTH - short)  # " one" is one token
    assert len(generator.encode(prompt)[0].tokens) == SEQ_LENGTH
    with pytest.raises(ValueError, match=f"the prompt takes {SEQ_LENGTH} tokens .* context is "
                                         f"{SEQ_LENGTH}, leaving no room for a reply"):
        generator.generate(prompt)
