"""A separate LLaVA validation file (``data.valid_path``) and the tokenizer's default.

The data is the digits task exported as LLaVA JSONL + PNG + WAV twice (40 training and
12 validation samples, different seeds) with a BPE tokenizer trained locally, as in
``tests/test_llava_training.py``. The expectations (sample counts, kinds) are read from
the JSONL files themselves, not from the code under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

from mimotron.config import load_config
from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.run_data import build_llava_tasks, build_tokenizer
from mimotron.runtime import init_runtime
from mimotron.training.loop import run_training
from tests.common import BASE, DIGITS, ONE_RANK

NUM_TRAIN, NUM_VALID = 40, 12


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """Two data files, their tokenizer, and the overrides that select them."""
    base = tmp_path_factory.mktemp("valid_path")
    train = write_llava_task(base / "train", num_samples=NUM_TRAIN, seed=3)
    valid = write_llava_task(base / "valid", num_samples=NUM_VALID, seed=5)
    tokenizer = train_bpe_tokenizer(conversation_texts(train), base / "tok", vocab_size=300)
    overrides = [
        "data.dataset='llava'", f"data.path='{train}'", f"data.tokenizer='{tokenizer}'",
        "data.seq_length=96", "modules.vision.in_channels=3",
    ]  # fmt: skip
    return {"base": base, "train": train, "valid": valid, "tokenizer": tokenizer,
            "overrides": overrides}  # fmt: skip


def _kinds(path) -> dict[str, int]:
    """Samples per kind, counted from the JSONL file itself."""
    counts = {"image": 0, "audio": 0, "both": 0, "text only": 0}
    for line in path.read_text().splitlines():
        raw = json.loads(line)
        has = ("image" in raw, "audio" in raw)
        counts[{(True, True): "both", (True, False): "image", (False, True): "audio",
                (False, False): "text only"}[has]] += 1  # fmt: skip
    return counts


def test_valid_path_rules(llava):
    over = [*BASE, *ONE_RANK, *llava["overrides"]]
    # With a validation file data.path trains in full: train_fraction defaults to 1.0 ...
    cfg = load_config(DIGITS, [*over, f"data.valid_path='{llava['valid']}'"])
    assert cfg.data.train_fraction == 1.0
    # ... and a share of it left out is refused, as is 1.0 without a validation file.
    with pytest.raises(ValueError, match=r"data.train_fraction=0.8 is invalid: expected 1.0 "
                                         r"with data.valid_path set"):
        load_config(DIGITS, [*over, f"data.valid_path='{llava['valid']}'",
                             "data.train_fraction=0.8"])  # fmt: skip
    with pytest.raises(ValueError, match=r"data.train_fraction=1.0 is invalid: .*valid_path"):
        load_config(DIGITS, [*over, "data.train_fraction=1.0"])
    with pytest.raises(ValueError, match=r"data.valid_path='.*missing.jsonl' is invalid"):
        load_config(DIGITS, [*over, f"data.valid_path='{llava['base'] / 'missing.jsonl'}'"])
    # A validation file with no usable sample is named by its own key.
    bad = llava["base"] / "bad.jsonl"
    bad.write_text('{"id": "x", "conversations": []}\n')
    cfg = load_config(DIGITS, [*over, f"data.valid_path='{bad}'", "data.skip_bad_samples=true"])
    with pytest.raises(ValueError, match=r"^data.valid_path='.*bad.jsonl' has no usable sample"):
        build_llava_tasks(cfg, build_tokenizer(cfg))


def test_tokenizer_defaults_to_the_language_models_folder(llava, tmp_path):
    """Unset, data.tokenizer is modules.language.hf_path (a Hugging Face folder holding
    the tokenizer, as downloaded checkpoints do); with neither, the error names both."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "language"
    # The sizes configs/digits.toml gives the language model (they must agree).
    transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4,
                             vocab_size=300).save_pretrained(folder)  # fmt: skip
    over = [*ONE_RANK, *[o for o in llava["overrides"] if not o.startswith("data.tokenizer")]]
    with pytest.raises(ValueError, match=r"data.tokenizer is unset and so is "
                                         r"modules.language.hf_path"):
        load_config(DIGITS, over)
    cfg = load_config(DIGITS, [*over, f"modules.language.hf_path='{folder}'"])
    assert cfg.data.tokenizer == str(folder)  # recorded in the config (checkpoints, export)
    with pytest.raises(ValueError, match=r"data.tokenizer='.*language'.*its default"):
        build_tokenizer(cfg)  # a model folder without a tokenizer: said where it came from
    for item in llava["tokenizer"].iterdir():
        shutil.copy(item, folder / item.name)
    ours = build_tokenizer(cfg)
    theirs = build_tokenizer(load_config(DIGITS, [*ONE_RANK, *llava["overrides"]]))
    assert ours.vocab_size == theirs.vocab_size
    text = "<image><audio>\nadd the digit and the key"
    assert ours.encode(text) == theirs.encode(text)


def test_evaluation_reads_the_valid_file_and_training_all_of_data_path(llava, tmp_path):
    """One rank, 3 iterations: evaluation covers the 12 samples of the validation file
    (a 0.8 split of the training file would give 8), and the banner's data lines give
    both files with their sizes and kinds."""
    cfg = load_config(DIGITS, [*BASE, *ONE_RANK, *llava["overrides"],
                               f"data.valid_path='{llava['valid']}'", "train.iters=3",
                               "log.interval=3", "eval.iters=0", f"log.dir='{tmp_path}'"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = run_training(cfg, init_runtime())
    assert summary["eval"]["eval_samples"] == NUM_VALID
    train_task, valid_task = build_llava_tasks(cfg, build_tokenizer(cfg))
    longest = max(task.length_of(i) for task in (train_task, valid_task)
                  for i in range(len(task)))
    data = [x for x in out.getvalue().splitlines() if x.startswith("data: ")]
    assert data[0] == (f"data: llava, train {NUM_TRAIN} samples ({llava['train']}), "
                       f"validation {NUM_VALID} ({llava['valid']}); packing off")

    def counts(path) -> str:
        return ", ".join(f"{k} {n}" for k, n in _kinds(path).items() if n)

    assert data[1] == (f"data: train {counts(llava['train'])}; validation "
                       f"{counts(llava['valid'])}; longest sample {longest} of 96 tokens "
                       "(data.seq_length)")
