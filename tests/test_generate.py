"""``mimotron generate``: the KV cache, replies of an overfit model, sampling, bad input.

The KV-cache cases decode a sequence in pieces (a prompt, a chunk of three, then one
token at a time) and compare every position's logits with one full forward of the
whole sequence, and for Hugging Face decoders with ``transformers``' own logits.

The end-to-end cases train the demo's models (``make demo-llava``'s CLIP / Whisper /
Qwen2 folders and BPE tokenizer, random weights) on the train split of 8 demo samples
(6: image, image + audio) for 50 iterations at a high learning rate, until every
caption is the greedy continuation, then generate from the run directory, the
checkpoint through the CLI, and both export formats; an ``hf-llava`` export is refused.
Where generation stops is tested on hand-set models in ``tests/test_generate_stops.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mimotron.checkpoint.export import read_full_model
from mimotron.checkpoint.files import file_digest, rank_files, write_manifest
from mimotron.checkpoint.state import META, MODEL
from mimotron.cli.main import main as cli_main
from mimotron.config import load_config
from mimotron.data.run_data import build_llava_tasks, build_tokenizer
from mimotron.demo.llava_assets import write_llava_assets
from mimotron.forked_ranks import run_ranks
from mimotron.generate import Generator, Sampling
from mimotron.models.hf.llama import build_hf_language_model
from mimotron.models.kv_cache import KVCache
from mimotron.models.language import LanguageModel
from tests.hf_decoders import assert_close_relative, hf_logits, hf_model
from tests.llava_overfit import NUM_ITERS, NUM_SAMPLES, overfit_toml
from tests.parity import train

SEQ = 20


# ---- the KV cache -----------------------------------------------------------------------


def _decode_in_pieces(lm: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of every position: a 7-token prompt, a 3-token chunk, then one at a time."""
    cache = KVCache(tokens.shape[1])
    cuts = [0, 7, 10, *range(11, tokens.shape[1] + 1)]
    with torch.no_grad():
        parts = [lm(lm.embed_tokens(tokens[:, a:b]), cache=cache)
                 for a, b in zip(cuts, cuts[1:], strict=False)]
    assert cache.length == tokens.shape[1]
    return torch.cat(parts, dim=1)


def test_cached_decoding_equals_full_forward_builtin() -> None:
    """mimotron's decoder (MHA, its own RoPE): cached logits = the full forward's."""
    torch.manual_seed(0)
    lm = LanguageModel(64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=SEQ).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, 64, (2, SEQ))
    with torch.no_grad():
        full = lm(lm.embed_tokens(tokens))
    assert_close_relative(_decode_in_pieces(lm, tokens), full)
    cache = KVCache(SEQ + 1)
    cache.advance(SEQ)
    with pytest.raises(ValueError, match="exceeds max_seq_len=20"):
        lm(lm.embed_tokens(tokens[:, :1]), cache=cache)


@pytest.mark.parametrize("model_type, overrides", [
    ("qwen2", {"num_key_value_heads": 2, "rope_theta": 1e6}),
    ("llama", {"num_key_value_heads": 2, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}}),
    ("qwen3", {"num_key_value_heads": 2, "head_dim": 12}),
])  # fmt: skip
def test_cached_decoding_equals_full_forward_hf(tmp_path: Path, model_type: str,
                                                overrides: dict[str, Any]) -> None:
    """Qwen2 (q/k/v biases, GQA), Llama (llama3 RoPE), Qwen3 (q/k norms, head_dim):
    cached logits = our full forward = transformers' logits."""
    hf = hf_model(tmp_path, model_type, **overrides)
    ours = build_hf_language_model(tmp_path).eval()
    tokens = torch.arange(2 * SEQ).view(2, SEQ) * 37 % 128
    want = hf_logits(hf, tokens)
    with torch.no_grad():
        assert_close_relative(ours(ours.embed_tokens(tokens)), want)
    assert_close_relative(_decode_in_pieces(ours, tokens), want)


def test_cache_refuses_what_it_cannot_hold() -> None:
    cache = KVCache(4)
    k = torch.zeros(1, 3, 2, 8)
    cache.append("0", k, k)
    with pytest.raises(ValueError, match="holds 4 positions: 0 cached plus 5 new"):
        cache.append("1", torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8))
    with pytest.raises(ValueError, match="max_len=0 is invalid"):
        KVCache(0)


# ---- an overfit model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def overfit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trained run, its config, and the train samples (conversation + files)."""
    root = tmp_path_factory.mktemp("generate")
    assets = root / "assets"
    write_llava_assets(assets, num_samples=NUM_SAMPLES)
    config = overfit_toml(root, assets)
    run_ranks(1, train, [], config, timeout_s=300)
    cfg = load_config(config)
    task, _ = build_llava_tasks(cfg, build_tokenizer(cfg))
    samples = [task.get(i) for i in range(len(task))]
    records = [json.loads(x) for x in (assets / "data" / "data.jsonl").read_text().splitlines()]
    for s in samples:
        record = records[int(task.indices[s["index"]])]
        s["question"] = record["conversations"][0]["value"].split("\n", 1)[1]
        s["files"] = {m: [str(assets / "data" / record[m])] if m in record else []
                      for m in ("image", "audio")}
    return {"root": root, "run": root / "run", "samples": samples}


def _ask(generator: Generator, sample: dict[str, Any], **sampling: Any) -> Any:
    return generator.generate(sample["question"], sample["files"]["image"],
                              sample["files"]["audio"], Sampling(**sampling))


def test_overfit_model_replies_with_its_training_captions(overfit: dict[str, Any]) -> None:
    """Greedy replies from the run directory are the captions, each prompt token for
    token a training sample's tokens before its answer, stopped at the end of turn."""
    generator = Generator.from_path(overfit["run"], device="cpu")
    samples = overfit["samples"]
    assert {s["kind"] for s in samples} == {"image", "both"} and len(samples) == 6
    for s in samples:
        answer_at = int(s["loss_mask"].nonzero()[0]) + 1  # the first trained token
        prompt, _ = generator.encode(s["question"], s["files"]["image"], s["files"]["audio"])
        assert prompt.tokens == s["tokens"][:answer_at].tolist(), s["sample_id"]
        reply = _ask(generator, s)
        assert (reply.text, reply.stop) == (s["answer"], "end"), s["sample_id"]
        # The reply's tokens are the training tokens of the answer, the stop token after.
        trained = s["tokens"][answer_at:answer_at + len(reply.token_ids) + 1].tolist()
        assert trained[:-1] == reply.token_ids and trained[-1] in prompt.stop_ids


def test_sampling_with_a_seed_is_reproducible(overfit: dict[str, Any]) -> None:
    generator = Generator.from_path(overfit["run"], device="cpu")
    both = next(s for s in overfit["samples"] if s["kind"] == "both")
    hot = {"temperature": 3.0, "max_new_tokens": 6}
    first = [_ask(generator, both, seed=seed, **hot).token_ids for seed in range(4)]
    assert [_ask(generator, both, seed=seed, **hot).token_ids for seed in range(4)] == first
    assert len({tuple(t) for t in first}) > 1, "the seed changes nothing at temperature 3"
    # A top_p below every token's probability keeps only the most likely one: greedy.
    assert _ask(generator, both, temperature=3.0, top_p=1e-6, seed=5).text == both["answer"]


def test_cli_and_both_export_formats_give_the_same_reply(overfit: dict[str, Any],
                                                        capsys: pytest.CaptureFixture) -> None:
    both = next(s for s in overfit["samples"] if s["kind"] == "both")
    checkpoint = overfit["run"] / "checkpoints"
    args = ["generate", str(checkpoint), "--prompt", both["question"],
            "--image", *both["files"]["image"], "--audio", *both["files"]["audio"]]
    capsys.readouterr()
    assert cli_main(args) == 0
    out, err = capsys.readouterr()
    assert out == both["answer"] + "\n"
    assert f"iter_{NUM_ITERS:07d}" in err and "stopped at end" in err
    for format in ("hf", "mimotron"):
        export = overfit["root"] / f"{format}_export"
        assert cli_main(["export", "--format", format, str(checkpoint), str(export)]) == 0
        assert _ask(Generator.from_path(export, device="cpu"), both).text == both["answer"]


def _one_line_error(args: list[str], capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mimotron generate: "), err
    return err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save, one process
def test_bad_input_is_one_line_naming_it(overfit: dict[str, Any], tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    run = str(overfit["run"])
    image = overfit["samples"][0]["files"]["image"][0]
    missing = str(tmp_path / "missing.png")
    err = _one_line_error(["generate", run, "--prompt", "hi", "--image", missing], capsys)
    assert f"--image file '{missing}' not found" in err
    err = _one_line_error(["generate", run, "--prompt", "<image><image> hi", "--image", image],
                          capsys)
    assert "--prompt holds 2 <image> but 1 --image file(s)" in err
    err = _one_line_error(["generate", run, "--prompt", "hi", "--top-p", "0"], capsys)
    assert "top_p=0.0 is invalid" in err
    err = _one_line_error(["generate", str(tmp_path), "--prompt", "hi"], capsys)
    assert "is not a trained model" in err
    # A checkpoint holding the encoders only (written here as mimotron writes one).
    tensors, meta = read_full_model(overfit["run"] / "checkpoints")
    state: dict[str, Any] = {MODEL + n: t for n, t in tensors.items()
                             if not n.startswith("language_model.")}
    state[META] = json.dumps(meta)
    partial = tmp_path / "partial" / "iter_0000001"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
    write_manifest(partial, 1, {}, {n: file_digest(partial / n) for n in rank_files(partial, 0)})
    err = _one_line_error(["generate", str(partial), "--prompt", "hi"], capsys)
    assert (f"checkpoint {partial} holds no language model (no "
            "model.language_model.* tensors)") in err
    # A --format mimotron export without the language model's file.
    export = tmp_path / "export"
    assert cli_main(["export", str(overfit["run"] / "checkpoints"), str(export)]) == 0
    (export / "language.safetensors").unlink()
    err = _one_line_error(["generate", str(export), "--prompt", "hi"], capsys)
    assert f"export {export} holds no language model (no language.safetensors)" in err


def test_hf_llava_export_is_refused_naming_what_to_pass(overfit: dict[str, Any], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    llava = tmp_path / "llava"
    assert cli_main(["export", "--format", "hf-llava", "--modules", "vision,language",
                     str(overfit["run"] / "checkpoints"), str(llava)]) == 0
    err = _one_line_error(["generate", str(llava), "--prompt", "hi"], capsys)
    assert (f"{str(llava)!r} is a 'mimotron export --format hf-llava' folder, which "
            "transformers loads (LlavaForConditionalGeneration): pass the run directory or "
            "checkpoint it was exported from, or a 'mimotron export' folder of --format "
            "mimotron or hf") in err
