"""The Hugging Face tokenizer: placeholders, chat-template labels, embedding rows.

The tokenizer is a byte-level BPE trained here with ``tokenizers`` and saved as a
``transformers`` folder (tests/hf_data.py); nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

from mimotron.data.bpe import CHATML_TEMPLATE, CHATML_TEMPLATE_PLAIN, train_bpe_tokenizer
from mimotron.data.chat import encode_conversation, shifted_sample, to_messages
from mimotron.data.chat_batch import ConversationEncoder
from mimotron.data.hf_tokenizer import HFTokenizer, new_embedding_rows, resize_embedding_rows
from tests.hf_data import SENTENCES, make_tokenizer

# Like Llama 3's template: contents are trimmed, the turn ends with a special token.
TRIM_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|im_end|>' }}{% endfor %}"
)
# Drops system messages: their content never appears in the rendering.
DROP_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
)

CONVERSATION = [
    {"from": "human", "value": "<image>\nwhat digit is in this picture"},
    {"from": "gpt", "value": "the digit is seven"},
    {"from": "human", "value": "and <audio> this tone?"},
    {"from": "gpt", "value": " the answer is nine "},
]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    return {
        "generation": make_tokenizer(base / "generation", CHATML_TEMPLATE),
        "plain": make_tokenizer(base / "plain", CHATML_TEMPLATE_PLAIN),
        "trim": make_tokenizer(base / "trim", TRIM_TEMPLATE),
        "drop": make_tokenizer(base / "drop", DROP_SYSTEM_TEMPLATE),
    }


def target_runs(tokens, target):
    """Consecutive runs of target tokens."""
    runs, current = [], []
    for token, is_target in zip(tokens, target, strict=True):
        if is_target:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_placeholders_are_added_as_single_special_tokens(tok_dirs):
    tok = HFTokenizer(tok_dirs["generation"])
    assert tok.num_added == 2
    assert tok.vocab_size == tok.base_vocab_size + 2 == len(tok.tokenizer)
    image, audio = tok.placeholder_id("image"), tok.placeholder_id("audio")
    assert {image, audio} == {tok.base_vocab_size, tok.base_vocab_size + 1}
    # Never split, even glued to other text.
    assert tok.encode("x<image>y<audio>").count(image) == 1
    assert tok.encode("x<image>y<audio>").count(audio) == 1


def test_placeholders_already_present_are_not_added_again(tmp_path, tok_dirs):
    tok = HFTokenizer(tok_dirs["generation"])
    tok.tokenizer.save_pretrained(str(tmp_path / "saved"))
    again = HFTokenizer(tmp_path / "saved")
    assert again.num_added == 0
    assert again.placeholder_id("image") == tok.placeholder_id("image")
    only_audio = HFTokenizer(tok_dirs["plain"], modalities=("audio",))
    assert only_audio.num_added == 1
    with pytest.raises(ValueError, match="modality='image' is invalid"):
        only_audio.placeholder_id("image")


def test_missing_folder_is_an_error_not_a_download(tmp_path):
    with pytest.raises(ValueError, match="expected a local tokenizer folder"):
        HFTokenizer(tmp_path / "Qwen" / "Qwen2-0.5B")


def test_tokenizer_without_chat_template_is_an_error(tmp_path):
    folder = train_bpe_tokenizer(SENTENCES, tmp_path / "t", chat_template="")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no chat template"):
        HFTokenizer(folder)
    assert HFTokenizer(folder, chat_template=CHATML_TEMPLATE_PLAIN).num_added == 2


@pytest.mark.parametrize("kind", ["generation", "plain", "trim"])
def test_labels_cover_exactly_the_assistant_replies_and_turn_ends(tok_dirs, kind):
    tok = HFTokenizer(tok_dirs[kind])
    encoded = encode_conversation(tok, to_messages(CONVERSATION), {"image": 5, "audio": 2})
    runs = [tok.decode(run) for run in target_runs(encoded.tokens, encoded.target)]
    replies = [t["value"] for t in CONVERSATION if t["from"] == "gpt"]
    if kind == "trim":
        replies = [r.strip() for r in replies]
    assert runs == [r + "<|im_end|>" for r in replies]
    assert encoded.assistant_texts == [t["value"] for t in CONVERSATION if t["from"] == "gpt"]


def test_generation_markers_and_located_contents_agree(tok_dirs):
    with_markers, plain = HFTokenizer(tok_dirs["generation"]), HFTokenizer(tok_dirs["plain"])
    messages = to_messages(CONVERSATION, system_prompt="you are a helpful assistant")
    a = encode_conversation(with_markers, messages, {"image": 3, "audio": 1})
    b = encode_conversation(plain, messages, {"image": 3, "audio": 1})
    assert a == b
    assert with_markers.render(messages) == plain.render(messages)


def test_placeholders_expand_to_the_encoder_token_counts(tok_dirs):
    tok = HFTokenizer(tok_dirs["plain"])
    encoded = encode_conversation(tok, to_messages(CONVERSATION), {"image": 7, "audio": 3})
    image, audio = tok.placeholder_id("image"), tok.placeholder_id("audio")
    assert encoded.tokens.count(image) == 7 and encoded.tokens.count(audio) == 3
    first = encoded.tokens.index(image)
    assert encoded.tokens[first : first + 7] == [image] * 7  # one contiguous block
    assert not any(t for t, i in zip(encoded.target, encoded.tokens, strict=True)
                   if i in (image, audio))  # fmt: skip
    unexpanded = encode_conversation(tok, to_messages(CONVERSATION), {"image": 1, "audio": 1})
    assert len(encoded.tokens) == len(unexpanded.tokens) + 6 + 2


def test_shifted_sample_predicts_the_next_token_where_it_is_an_assistant_token(tok_dirs):
    tok = HFTokenizer(tok_dirs["plain"])
    encoded = encode_conversation(tok, to_messages(CONVERSATION), {"image": 2, "audio": 2})
    sample = shifted_sample(encoded, tok.pad_id, seq_length=len(encoded.tokens))
    tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
    assert tokens.tolist() == encoded.tokens
    assert labels[:-1].tolist() == encoded.tokens[1:] and int(labels[-1]) == tok.pad_id
    assert mask.tolist() == [float(t) for t in encoded.target[1:]] + [0.0]
    with pytest.raises(ValueError, match="more than data.seq_length"):
        shifted_sample(encoded, tok.pad_id, seq_length=len(encoded.tokens) - 1)


def test_conversation_errors_name_the_problem(tok_dirs):
    tok = HFTokenizer(tok_dirs["plain"])
    with pytest.raises(ValueError, match=r"conversations\[1\].from='bot' is invalid"):
        to_messages([{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}])
    with pytest.raises(ValueError, match="no assistant"):
        encode_conversation(tok, to_messages(CONVERSATION[:1]), {"image": 1})
    bad = [*CONVERSATION[:1], {"from": "gpt", "value": "look <image>"}]
    with pytest.raises(ValueError, match="placeholders belong in 'human' turns"):
        encode_conversation(tok, to_messages(bad), {"image": 1})
    with pytest.raises(ValueError, match="no audio encoder"):
        encode_conversation(tok, to_messages(CONVERSATION), {"image": 1})


def test_template_that_drops_a_content_is_an_error(tok_dirs):
    tok = HFTokenizer(tok_dirs["drop"])
    messages = to_messages(CONVERSATION, system_prompt="you are a helpful assistant")
    with pytest.raises(ValueError, match="does not render message 0's content"):
        encode_conversation(tok, messages, {"image": 1, "audio": 1})
    # Without the system message the same template is fine.
    encoded = encode_conversation(tok, to_messages(CONVERSATION), {"image": 1, "audio": 1})
    assert sum(encoded.target) > 0


def _one_at_a_time(tok, conversations, num_tokens):
    out = []
    for messages in conversations:
        try:
            out.append(encode_conversation(tok, messages, num_tokens))
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
    return out


@pytest.mark.parametrize("kind", ["generation", "plain", "trim", "drop"])
def test_a_batch_encodes_each_conversation_as_one_at_a_time(tok_dirs, kind):
    # Every template kind of the tests, conversations of several role sequences (the
    # plain path reuses its template pieces per sequence), text-only ones, and each way
    # a conversation fails (no reply, a placeholder in a reply, a modality without a
    # count, a content the template drops): the same tokens, targets or message.
    tok = HFTokenizer(tok_dirs[kind])
    num_tokens = {"image": 3, "audio": 2}
    image_only = [{"from": "human", "value": "<image>\nwhat digit is in this picture"},
                  *({"from": "gpt", "value": f"the digit is {w}"} for w in ("one", " two "))]
    conversations = [
        to_messages(CONVERSATION), to_messages(CONVERSATION, "you are a helpful assistant"),
        to_messages(CONVERSATION[:2]), to_messages(image_only[:2]),
        to_messages([image_only[0], image_only[2]], "you are a helpful assistant"),
        to_messages([{"from": "human", "value": "seven plus three"},
                     {"from": "gpt", "value": "is ten"}]),
        to_messages(CONVERSATION[:1]),  # no assistant turn
        to_messages([*CONVERSATION[:1], {"from": "gpt", "value": "look <image>"}]),
        to_messages(CONVERSATION[2:]), to_messages(CONVERSATION),
    ]  # fmt: skip
    want = _one_at_a_time(tok, conversations, num_tokens)
    got = ConversationEncoder(tok, num_tokens).encode(conversations)
    assert [g if not isinstance(g, ValueError) else f"ValueError: {g}" for g in got] == want
    assert sum(isinstance(w, str) for w in want) >= 2 + (kind == "drop") * 2
    without_audio = ConversationEncoder(tok, {"image": 3}).encode(conversations)
    assert [g if not isinstance(g, ValueError) else f"ValueError: {g}"
            for g in without_audio] == _one_at_a_time(tok, conversations, {"image": 3})


def test_resized_embedding_keeps_old_rows_and_adds_deterministic_new_ones():
    weight = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    grown = resize_embedding_rows(weight, 13, seed=7)
    assert grown.shape == (13, 6) and grown.dtype == weight.dtype
    assert torch.equal(grown[:10], weight)
    assert torch.equal(grown, resize_embedding_rows(weight, 13, seed=7))
    assert not torch.equal(grown[10:], resize_embedding_rows(weight, 13, seed=8)[10:])
    # New rows are near the mean of the old ones (noise 1% of the std) and distinct.
    mean, std = weight.double().mean(0), weight.double().std(0, unbiased=False)
    assert torch.allclose(grown[10:].double(), mean.expand(3, 6), atol=float(std.max()) * 0.1)
    assert not torch.equal(grown[10], grown[11])
    # A shard computes its own rows alone: row r depends on (seed, r) only.
    assert torch.equal(new_embedding_rows(mean.float(), std.float(), [12], 7)[0],
                       new_embedding_rows(mean.float(), std.float(), [11, 12], 7)[1])
    assert torch.equal(resize_embedding_rows(weight, 13, seed=7, noise_scale=0.0)[12],
                       mean.float())
    assert resize_embedding_rows(weight, 10, seed=7) is weight
    with pytest.raises(ValueError, match=r"expected \[vocab >= 1, hidden\]"):
        resize_embedding_rows(torch.zeros(4), 5, seed=0)
