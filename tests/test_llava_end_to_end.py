"""The whole real path at once: Hugging Face folders + LLaVA data -> ``mimotron train`` ->
``mimotron export --format hf`` -> ``transformers``.

Everything a user with real checkpoints has is generated locally (nothing is
downloaded): a CLIP vision tower with its ``CLIPImageProcessor``, a Whisper model with its
``WhisperFeatureExtractor``, a tied Qwen2 decoder whose ``vocab_size`` is the BPE
tokenizer's own length (so ``<image>``/``<audio>`` grow the vocabulary), the tokenizer
trained on the task's conversations, and the digits/DTMF task written as LLaVA JSONL +
PNG + WAV. A TOML file names them all (``modules.<m>.hf_path``, ``data.dataset =
"llava"``); the CLI trains it on a heterogeneous layout (vision | audio | language on
three ranks) with checkpoints, then exports it. Every exported module must load in
``transformers`` with no missing or unexpected keys, hold exactly the trained tensors,
and give our trained module's forward; the exported tokenizer gives the placeholders
the ids training used. A ``preprocessor_config.json`` whose output the tower cannot take
is refused before launch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from mimotron.checkpoint.export import load_exported, read_full_model, split_by_module
from mimotron.checkpoint.hf_export import VOCAB_SIZE_UNPADDED
from mimotron.cli.main import main as cli_main
from mimotron.config import load_config
from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.run_data import build_tokenizer, check_data
from mimotron.models.build import build_module
from mimotron.models.hf.clip import CLIP_WEIGHTS
from mimotron.models.hf.llama import LLAMA_WEIGHTS
from mimotron.models.hf.whisper import WHISPER_WEIGHTS
from tests.hf_data import folder_tensors

transformers = pytest.importorskip("transformers")

NUM_ITERS = 4
IMAGE = 16  # CLIP input side; patches of 8 -> 4 image tokens after dropping the class token
MELS, POSITIONS = 16, 50  # Whisper: 16 mel bins, 1 s at hop 160 -> 100 frames = 2 x 50


def _save_folders(root: Path, base_vocab: int) -> dict[str, Path]:
    """Random CLIP / Whisper / Qwen2 folders with their processors, as users have them."""
    paths = {m: root / m for m in ("vision", "audio", "language")}
    torch.manual_seed(0)
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_channels=3, image_size=IMAGE, patch_size=8)).save_pretrained(paths["vision"])
    transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE},
    ).save_pretrained(paths["vision"])  # fmt: skip
    transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, num_mel_bins=MELS,
        max_source_positions=POSITIONS, max_target_positions=16, vocab_size=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )).save_pretrained(paths["audio"])
    transformers.WhisperFeatureExtractor(
        feature_size=MELS, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400,
    ).save_pretrained(paths["audio"])  # fmt: skip
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=base_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True)).save_pretrained(paths["language"])
    return paths


def _toml(root: Path, paths: dict[str, Path], data: Path, tokenizer: Path) -> Path:
    """The config a user writes: folders, data, a vision | audio | language layout."""
    text = f"""
name = "llava_e2e"

[modules.vision]
kind = "vit"
hf_path = "{paths['vision']}"
parallel = {{ data = 1, rank_offset = 0 }}

[modules.audio]
kind = "audio"
hf_path = "{paths['audio']}"
downsample_factor = 10
parallel = {{ data = 1, rank_offset = 1 }}

[modules.language]
kind = "language"
hf_path = "{paths['language']}"
parallel = {{ data = 1, rank_offset = 2 }}

[data]
dataset = "llava"
path = "{data}"
tokenizer = "{tokenizer}"
seq_length = 96

[train]
iters = {NUM_ITERS}
global_batch_size = 8
micro_batch_size = 4
seed = 11
precision = "fp32"

[optimizer]
lr = 3e-3

[scheduler]
warmup_iters = 1

[eval]
interval = 1000

[checkpoint]
interval = 2

[log]
dir = "{root / 'run'}"
interval = 1
"""
    path = root / "llava_e2e.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Train through the CLI, export through the CLI; what both wrote."""
    root = tmp_path_factory.mktemp("llava_e2e")
    data = write_llava_task(root / "data", num_samples=40, seed=5)
    tokenizer = train_bpe_tokenizer(conversation_texts(data), root / "tokenizer",
                                    vocab_size=300)  # fmt: skip
    base_vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    paths = _save_folders(root / "hf", base_vocab)
    config = _toml(root, paths, data, tokenizer)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", str(config)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint = root / "run" / "checkpoints"
    out = root / "export"
    assert cli_main(["export", "--format", "hf", str(checkpoint), str(out)]) == 0
    return {"root": root, "config": config, "checkpoint": checkpoint, "out": out,
            "paths": paths, "base_vocab": base_vocab}


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max())
    assert err <= rel * float(want.abs().max()), err


def _assert_holds(folder: Path, module: torch.nn.Module, weight_map: Any,
                  vocab: int | None = None) -> None:
    """The exported folder holds every trained tensor of ``module``, bit for bit.

    A language model's vocabulary tables are compared on their first ``vocab`` rows (the
    rest is padding); its tied head is the embedding.
    """
    got = folder_tensors(folder)
    prefix = weight_map.choose_prefix(got)
    state = module.state_dict()
    if vocab is not None:
        state = {n: t[:vocab] if n == "embed.weight" else t
                 for n, t in state.items() if n != "output.weight"}
    for name, tensor in state.items():
        want = tensor[0] if name in weight_map.reshaped else tensor
        assert torch.equal(got[prefix + weight_map.to_hf(name)], want), name
    assert len(state) >= 10


def _ours(trained: dict[str, Any]) -> tuple[Any, dict[str, torch.nn.Module], dict[str, Any]]:
    """The run config, our modules holding the checkpoint's trained tensors, the meta."""
    cfg = load_config(trained["config"])
    tensors, meta = read_full_model(trained["checkpoint"])
    state = split_by_module(tensors)
    vocab = state["language"]["embed.weight"].shape[0]
    modules = {}
    for name in ("vision", "audio", "language"):
        module = build_module(cfg, name, vocab)
        module.load_state_dict(state[name], strict=True)
        modules[name] = module.eval()
    return cfg, modules, meta


def test_train_export_from_pretrained_same_forward(trained: dict[str, Any]) -> None:
    root, out = trained["root"], trained["out"]
    records = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == NUM_ITERS and all(torch.isfinite(torch.tensor(losses))), losses
    assert (trained["checkpoint"] / "iter_0000004").is_dir()

    cfg, ours, meta = _ours(trained)
    tokenizer = build_tokenizer(cfg)  # training's tokenizer, placeholders as it added them
    vocab = tokenizer.vocab_size
    assert vocab == trained["base_vocab"] + 2  # <image>, <audio> grew the vocabulary
    assert meta[VOCAB_SIZE_UNPADDED] == vocab
    assert ours["language"].embed.weight.shape[0] == 320  # padded to a multiple of 64

    # Language: loads cleanly, holds the trained rows [0, vocab), same logits.
    lm, info = transformers.AutoModelForCausalLM.from_pretrained(out / "language",
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert lm.config.vocab_size == vocab
    assert "lm_head.weight" not in folder_tensors(out / "language")  # tied: transformers ties it
    _assert_holds(out / "language", ours["language"], LLAMA_WEIGHTS, vocab)
    tokens = torch.arange(2 * 20).view(2, 20) * 37 % vocab
    tokens[0, 2] = tokenizer.placeholder_id("image")
    tokens[1, 5] = tokenizer.placeholder_id("audio")
    with torch.no_grad():
        language = ours["language"]
        _assert_close(lm.eval()(tokens).logits,
                      language(language.embed_tokens(tokens))[..., :vocab])
    exported = transformers.AutoTokenizer.from_pretrained(out / "language")
    for modality in ("image", "audio"):
        assert exported.encode(f"<{modality}>", add_special_tokens=False) == \
            [tokenizer.placeholder_id(modality)]

    # Vision: the LLaVA feature layer (-2) without the class token; the processor kept.
    clip, info = transformers.CLIPVisionModel.from_pretrained(out / "vision",
                                                              output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (out / "vision" / "preprocessor_config.json").is_file()
    _assert_holds(out / "vision", ours["vision"].encoder, CLIP_WEIGHTS)
    images = torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = clip.eval()(pixel_values=images, output_hidden_states=True).hidden_states[-2]
        _assert_close(ours["vision"].encoder(images), want[:, 1:])

    # Audio: the Whisper encoder (decoder copied untouched).
    whisper, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        out / "audio", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _assert_holds(out / "audio", ours["audio"].encoder, WHISPER_WEIGHTS)
    mels = torch.randn(2, MELS, 2 * POSITIONS, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        encoder = ours["audio"].encoder
        hidden = whisper.eval().model.encoder(mels).last_hidden_state
        # downsample_factor 10, "avg": each 10 consecutive frames become one token.
        want = hidden.reshape(2, POSITIONS // 10, 10, -1).mean(dim=2)
        _assert_close(encoder(mels), want)

    # The projectors (ours) are exported as the default export writes them.
    for module in ("vision", "audio"):
        with safe_open(out / f"{module}.safetensors", framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                assert torch.equal(handle.get_tensor(name), ours[module].state_dict()[name])


@pytest.mark.parametrize("module", ["vision", "audio"])
def test_processor_shape_contradicting_the_tower_is_an_error(
    trained: dict[str, Any], module: str, tmp_path: Path
) -> None:
    """A preprocessor_config.json whose output the tower cannot take: refused before launch."""
    folder = tmp_path / module
    shutil.copytree(trained["paths"][module], folder)
    if module == "vision":
        transformers.CLIPImageProcessor(size={"shortest_edge": 24},
                                        crop_size={"height": 24, "width": 24}
                                        ).save_pretrained(folder)  # fmt: skip
        want = "(3, 24, 24)"
    else:
        transformers.WhisperFeatureExtractor(
            feature_size=MELS, sampling_rate=16000, hop_length=160, chunk_length=2, n_fft=400,
        ).save_pretrained(folder)  # fmt: skip
        want = f"({MELS}, 200)"
    cfg = load_config(trained["config"], [f"modules.{module}.hf_path='{folder}'"])
    with pytest.raises(ValueError) as err:
        check_data(cfg)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    assert f"modules.{module}.hf_path" in message and want in message, message


def test_mimotron_format_export_of_a_hf_run_loads(trained: dict[str, Any]) -> None:
    """The default export loads back (architectures from the hf_path folders, vocabulary
    from the tokenizer) into a model holding the checkpoint's tensors bit for bit."""
    out = trained["root"] / "export-mimotron"
    assert cli_main(["export", str(trained["checkpoint"]), str(out)]) == 0
    _, model = load_exported(out)
    tensors, _ = read_full_model(trained["checkpoint"])
    state = model.state_dict()
    assert sorted(state) == sorted(tensors)
    assert all(torch.equal(state[name], tensor) for name, tensor in tensors.items())
