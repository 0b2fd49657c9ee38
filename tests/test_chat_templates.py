"""Built-in chat templates (``data.chat_template``): the published text, the trained tokens.

Each built-in is compared with references that share nothing with it:

- ``chatml``: the chat template of ``Qwen/Qwen2-7B-Instruct``'s ``tokenizer_config.json``
  (:data:`QWEN2_PUBLISHED`, the hub file's text) and the Qwen2 ChatML template that
  ``transformers`` ships as ``Qwen2AudioProcessor.default_chat_template``, both rendered by
  ``transformers``' own ``apply_chat_template``, and a string written by hand;
- ``llama3``: the chat template of ``meta-llama/Meta-Llama-3-8B-Instruct``'s
  ``tokenizer_config.json`` (:data:`LLAMA3_PUBLISHED`) rendered the same way, and a string
  written by hand from the model card's prompt format;
- ``vicuna``: LLaVA-1.5's training prompt, as ``llava/conversation.py`` builds it
  (``haotian-liu/LLaVA``; ``scripts/v1_5/finetune.sh`` trains with ``--version v1``,
  i.e. ``conv_vicuna_v1``: ``SeparatorStyle.TWO``, ``sep=" "``, ``sep2="</s>"``, roles
  ``USER``/``ASSISTANT``): :func:`llava_v1_prompt` redoes its ``get_prompt`` loop, and
  a string is written by hand.

The tokenizers are byte-level BPEs trained here with each family's control tokens as
special tokens and no chat template of their own (tests/hf_data.py; no download).
"""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoTokenizer

from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.hf_export import run_tokenizer, write_tokenizer
from mimotron.config import load_config
from mimotron.data.bpe import CHATML_TEMPLATE, CHATML_TEMPLATE_PLAIN, train_bpe_tokenizer
from mimotron.data.chat import encode_conversation, shifted_sample
from mimotron.data.chat_templates import VICUNA_TEMPLATE, builtin_templates
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.run_data import build_llava_tasks, build_tokenizer, run_hf_tokenizer
from tests.common import BASE, DIGITS
from tests.hf_data import SENTENCES, make_tokenizer

# Qwen/Qwen2-7B-Instruct, tokenizer_config.json "chat_template" (the hub file's text).
QWEN2_PUBLISHED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json "chat_template".
LLAMA3_PUBLISHED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# conv_vicuna_v1.system in llava/conversation.py (Vicuna v1.1's system message).
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's "
                 "questions.")  # fmt: skip

# Each family's control tokens (pad first, eos last: train_bpe_tokenizer's rule).
SPECIALS = {
    "chatml": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "llama3": ("<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"),
    "vicuna": ("<unk>", "<s>", "</s>"),
}  # fmt: skip
BOS = {"llama3": "<|begin_of_text|>", "vicuna": "<s>"}
END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "vicuna": "</s>"}

HI = [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "hello"}]
LONG = [  # a system message, two rounds, contents with edge whitespace (llama3 trims)
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "<image>\nwhat digit is in this picture"},
    {"role": "assistant", "content": "the digit is seven"},
    {"role": "user", "content": " and this tone? "},
    {"role": "assistant", "content": " nine\n"},
]
CONVERSATIONS = {"hi": HI, "long": LONG, "no_system": LONG[1:]}


def template_free_tokenizer(folder, name, texts=SENTENCES):
    """A BPE folder with ``name``'s control tokens as specials and no chat template."""
    folder = train_bpe_tokenizer(texts, folder, vocab_size=320, chat_template="",
                                 special_tokens=SPECIALS[name])  # fmt: skip
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if name in BOS:
        tok = AutoTokenizer.from_pretrained(str(folder))
        tok.bos_token = BOS[name]
        tok.save_pretrained(str(folder))
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template is None
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat_templates")
    return {name: template_free_tokenizer(base / name, name) for name in SPECIALS}


@pytest.fixture(scope="module")
def tokenizers(folders):
    return {name: run_hf_tokenizer(folders[name], ["vit", "audio"], name) for name in folders}


def reference_render(tokenizer, template, messages, add_generation_prompt=False):
    """``transformers``' rendering of ``messages`` with another template, same tokenizer."""
    return tokenizer.tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt)


def llava_v1_prompt(messages, default_system=VICUNA_SYSTEM):
    """LLaVA's ``Conversation.get_prompt`` for ``SeparatorStyle.TWO`` (``conv_vicuna_v1``)."""
    system, turns = default_system, messages
    if messages[0]["role"] == "system":  # LLaVA sets conv.system to it
        system, turns = messages[0]["content"], messages[1:]
    roles, seps = {"user": "USER", "assistant": "ASSISTANT"}, (" ", "</s>")
    prompt = system + seps[0]
    for i, message in enumerate(turns):
        prompt += roles[message["role"]] + ": " + message["content"] + seps[i % 2]
    return prompt


# ---- the text, as published --------------------------------------------------------------
def test_chatml_by_hand():
    tok_text = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    assert builtin_templates()["chatml"].source.count("You are a helpful assistant.") == 1
    assert _render("chatml", HI) == tok_text


def test_llama3_by_hand():
    assert _render("llama3", HI, bos_token="<|begin_of_text|>") == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<image>\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>"
    )


def test_vicuna_by_hand():
    assert _render("vicuna", HI, eos_token="</s>", bos_token="<s>") == (
        "<s>A chat between a curious user and an artificial intelligence assistant. The "
        "assistant gives helpful, detailed, and polite answers to the user's questions. "
        "USER: <image>\nhi ASSISTANT: hello</s>"
    )
    # A tokenizer without a bos_token renders none.
    assert _render("vicuna", HI, eos_token="</s>").startswith("A chat between")


def _render(name, messages, **tokens):
    """The built-in rendered by a bare ``jinja2`` sandbox (not ``transformers``)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(builtin_templates()[name].source).render(
        messages=messages, add_generation_prompt=False, **tokens)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_chatml_renders_as_qwen2(tokenizers, conversation):
    from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor

    tok, messages = tokenizers["chatml"], CONVERSATIONS[conversation]
    shipped = Qwen2AudioProcessor.default_chat_template.fget(None)
    for prompt in (False, True):
        ours = tok.tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=prompt)  # fmt: skip
        assert ours == reference_render(tok, QWEN2_PUBLISHED, messages, prompt)
        assert ours == reference_render(tok, shipped, messages, prompt)
    assert tok.render(messages) == reference_render(tok, QWEN2_PUBLISHED, messages)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_llama3_renders_as_meta_llama3(tokenizers, conversation):
    tok, messages = tokenizers["llama3"], CONVERSATIONS[conversation]
    for prompt in (False, True):
        ours = tok.tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=prompt)  # fmt: skip
        assert ours == reference_render(tok, LLAMA3_PUBLISHED, messages, prompt)
        assert ours.startswith("<|begin_of_text|><|start_header_id|>")


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_vicuna_renders_as_llava_v1_5(tokenizers, conversation):
    tok, messages = tokenizers["vicuna"], CONVERSATIONS[conversation]
    # LLaVA-1.5 tokenises get_prompt() with the Llama tokenizer's <s> first: the template
    # writes the tokenizer's bos_token there.
    bos = tok.tokenizer.bos_token
    assert bos is not None
    assert tok.render(messages) == bos + llava_v1_prompt(messages)
    # LLaVA's generation prompt: get_prompt with the last message None ends "ASSISTANT:".
    prompt = tok.tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                               add_generation_prompt=True)  # fmt: skip
    assert prompt == bos + llava_v1_prompt(messages[:-1]) + "ASSISTANT:"


def test_vicuna_system_message_only_first(tokenizers):
    tok = tokenizers["vicuna"]
    with pytest.raises(Exception, match="system message first only"):
        tok.render([*HI, {"role": "system", "content": "late"}])


# ---- which tokens train --------------------------------------------------------------------
def target_runs(tok, encoded):
    """The decoded runs of consecutive trained tokens."""
    runs, current = [], []
    for token, trained in zip(encoded.tokens, encoded.target, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return [tok.decode(run) for run in [*runs, *([current] if current else [])]]


@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_only_the_replies_and_their_end_token_train(tokenizers, name):
    tok = tokenizers[name]
    messages = LONG + [{"role": "user", "content": "and <audio>?"},
                       {"role": "assistant", "content": "eight"}]  # fmt: skip
    encoded = encode_conversation(tok, messages, {"image": 3, "audio": 2})
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    if name == "llama3":
        replies = [r.strip() for r in replies]
    runs = target_runs(tok, encoded)
    assert len(runs) == len(replies), runs
    for run, reply in zip(runs, replies, strict=True):
        # A BPE token may glue the space of vicuna's "ASSISTANT: " to the reply's first
        # word; that token overlaps the reply, so it trains (as in LLaVA's own masks).
        glued = name == "vicuna" and run == " " + reply + END[name]
        assert run == reply + END[name] or glued, (run, reply)
    # The end of each turn is one special token, the one the model learns to stop on.
    end_id = tok.encode(END[name])
    assert len(end_id) == 1 and end_id[0] in tok.special_ids
    for modality, copies in (("image", 3), ("audio", 2)):
        at = [i for i, t in enumerate(encoded.tokens) if t == tok.placeholder_id(modality)]
        assert len(at) == copies and not any(encoded.target[i] for i in at)
    sample = shifted_sample(encoded, tok.pad_id, 256)
    assert int(sample["loss_mask"].sum()) == sum(encoded.target[1:])


@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_the_generation_prompt_is_the_trained_prefix(tokenizers, name):
    # What generate renders before the reply is what training rendered there.
    tok = tokenizers[name]
    messages = CONVERSATIONS["no_system"]
    prompt = tok.tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                               add_generation_prompt=True)  # fmt: skip
    assert tok.render(messages).startswith(prompt)


def test_a_template_file_replaces_the_tokenizers_own(tmp_path):
    folder = make_tokenizer(tmp_path / "tok")  # its own template: ChatML with generation blocks
    file = tmp_path / "plain.jinja"
    file.write_text(CHATML_TEMPLATE_PLAIN)
    own = run_hf_tokenizer(folder, ["vit"])
    tok = run_hf_tokenizer(folder, ["vit"], str(file))
    assert (own.template_replaced, tok.template_replaced) == (False, True)
    assert own.chat_template == CHATML_TEMPLATE and tok.chat_template == CHATML_TEMPLATE_PLAIN
    assert "{% generation" not in tok.chat_template
    # The same text; this one's trained tokens come from the located contents.
    assert tok.render(LONG) == own.render(LONG)
    num_tokens = {"image": 2}
    assert encode_conversation(tok, LONG, num_tokens) == encode_conversation(own, LONG,
                                                                             num_tokens)


# ---- errors ---------------------------------------------------------------------------------
def test_config_errors_name_the_value(tmp_path):
    from mimotron.config.validation import check_chat_template_key

    with pytest.raises(ValueError, match=r"data.chat_template='qwen' is invalid: .*"
                       r"\('chatml', 'llama3', 'vicuna'\)"):
        check_chat_template_key("qwen")
    with pytest.raises(ValueError, match="data.chat_template=.*missing.jinja.*no such file"):
        check_chat_template_key(str(tmp_path / "missing.jinja"))
    (tmp_path / "t.txt").write_text("{{ messages }}")
    with pytest.raises(ValueError, match=r"t.txt' is invalid: .*named \*.jinja"):
        check_chat_template_key(str(tmp_path / "t.txt"))
    for value in ("", "chatml", "llama3", "vicuna"):
        check_chat_template_key(value)
    with pytest.raises(ValueError, match="data.chat_template='vicuna' is invalid: expected "
                                         "unset with data.dataset='digits'"):
        load_config(DIGITS, [*BASE, "data.chat_template='vicuna'"])


def test_tokenizer_errors_name_the_template(tmp_path, folders):
    # chatml's control tokens are not specials of the vicuna tokenizer.
    with pytest.raises(ValueError, match=r"data.chat_template='chatml' with data.tokenizer="
                                         r".*'<\|im_start\|>' is not a special token"):
        run_hf_tokenizer(folders["vicuna"], ["vit"], "chatml")
    with pytest.raises(ValueError, match=r"'<\|start_header_id\|>' is not a special token"):
        run_hf_tokenizer(folders["chatml"], ["vit"], "llama3")
    no_eos = train_bpe_tokenizer(SENTENCES, tmp_path / "no_eos", chat_template="")
    _drop_key(no_eos, "eos_token")
    with pytest.raises(ValueError, match="data.chat_template='vicuna' .* has no eos_token"):
        run_hf_tokenizer(no_eos, ["vit"], "vicuna")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match=r"^data.chat_template='.*broken.jinja': the chat "
                                         "template does not compile"):
        run_hf_tokenizer(folders["chatml"], ["vit"], str(broken))
    empty = tmp_path / "empty.jinja"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match="empty.jinja' is invalid: the file is empty"):
        run_hf_tokenizer(folders["chatml"], ["vit"], str(empty))
    # A folder without a template, and no data.chat_template: the message says what to set.
    with pytest.raises(ValueError, match=r"has no chat template: .* data.chat_template set to "
                                         r"one of \('chatml', 'llama3', 'vicuna'\)"):
        run_hf_tokenizer(folders["vicuna"], ["vit"])


def _drop_key(folder, key):
    """Remove ``key`` from the folder's tokenizer_config.json."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop(key, None)
    config_file.write_text(json.dumps(config))


# ---- a run, and its export --------------------------------------------------------------------
@pytest.fixture(scope="module")
def vicuna_run(tmp_path_factory):
    """A LLaVA digits task and a tokenizer without a template; overrides selecting vicuna."""
    base = tmp_path_factory.mktemp("vicuna_run")
    path = write_llava_task(base / "data", num_samples=16, seed=5)
    texts = conversation_texts(path) + [VICUNA_SYSTEM] * 4
    tok = template_free_tokenizer(base / "tok", "vicuna", texts)
    return [
        "data.dataset='llava'", f"data.path='{path}'", f"data.tokenizer='{tok}'",
        "data.chat_template='vicuna'", "data.seq_length=192", "modules.vision.in_channels=3",
        f"data.index_dir='{base / 'index'}'", "train.global_batch_size=4",
        "train.micro_batch_size=2", "data.train_fraction=0.5",
    ]  # fmt: skip


def test_a_tokenizer_without_a_template_builds_llava_data_with_vicuna(vicuna_run):
    cfg = load_config(DIGITS, [*BASE, *vicuna_run])
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.chat_template == VICUNA_TEMPLATE
    train, _ = build_llava_tasks(cfg, tokenizer)
    sample = train.dataset.load(0)
    tokens = sample["tokens"].tolist()
    bos = tokenizer.tokenizer.bos_token_id
    assert bos is not None and tokens[0] == bos  # LLaVA-1.5's sequences start with <s>
    text = tokenizer.decode(tokens[1:])
    assert text.startswith(VICUNA_SYSTEM + " USER: ") and text.endswith("</s>")
    trained = sample["labels"][sample["loss_mask"] > 0].tolist()
    assert tokenizer.decode(trained).endswith("</s>")
    assert "USER" not in tokenizer.decode(trained)
    # Without the key the same folder is refused, naming the key to set.
    with pytest.raises(ValueError, match="data.chat_template set to one of"):
        build_tokenizer(load_config(DIGITS, [*BASE, *vicuna_run, "data.chat_template=''"]))


@pytest.mark.parametrize("kinds", [("language",), ("vit", "language")])
def test_export_writes_the_template_training_used(tmp_path, folders, kinds):
    import shutil

    # A folder like llava-1.5-7b-hf's: the processor's template in a legacy
    # chat_template.json, which a processor would read before chat_template.jinja.
    source = tmp_path / "tok"
    shutil.copytree(folders["vicuna"], source)
    (source / "chat_template.json").write_text(json.dumps({"chat_template": "STALE"}))
    run_config = {"data": {"tokenizer": str(source), "chat_template": "vicuna"},
                  "modules": {str(k): {"kind": k} for k in kinds}}  # fmt: skip
    tok = run_tokenizer(run_config)
    assert tok.num_added == (1 if "vit" in kinds else 0)
    folder = ExportFolder(tmp_path / "out")
    folder.check(run_config)
    write_tokenizer(tok, folder, "")
    folder.finish()
    assert not (tmp_path / "out" / "chat_template.json").exists()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert loaded.chat_template == VICUNA_TEMPLATE
    assert loaded.apply_chat_template(HI, tokenize=False) == tok.render(HI)
    assert len(loaded) == tok.vocab_size


def test_a_run_with_vicuna_trains(vicuna_run):
    from mimotron.forked_ranks import run_groups
    from tests.common import ONE_RANK, train_steps

    ((steps,),) = run_groups([(1, train_steps, ([*vicuna_run, *ONE_RANK], 3), {})],
                             timeout_s=240)
    losses = [step[0] for step in steps]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(step[3] > 0 for step in steps)  # tokens trained: the replies and their </s>


@pytest.mark.parametrize("name", ["chatml", "llama3", "vicuna"])
def test_a_processors_list_content_renders_as_the_string_training_renders(name):
    # What an exported processor's users pass (transformers' multimodal message format).
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]
    tokens = {"eos_token": "</s>", "bos_token": "<s>"}
    assert _render(name, parts, **tokens) == _render(name, HI, **tokens)
