"""``mimotron export --format hf-llava``: a trained run as one transformers LLaVA folder.

A short run on the demo assets (``mimotron.demo.llava_assets``: LLaVA JSONL + PNG + WAV,
a CLIP tower, a Whisper encoder), with a tied Qwen2 decoder whose folder holds its own
tokenizer and whose ``vocab_size`` is that tokenizer's length (the usual case: the
``<image>``/``<audio>`` placeholders grow the vocabulary, and ``data.tokenizer`` is the
model folder), CLIP feature layer -2 (its last layer is copied, not trained), 3
iterations on one rank. Then, from that one checkpoint:

- ``hf-llava`` refuses the run's audio encoder unless ``--modules`` leaves it out;
- ``AutoModelForImageTextToText`` / ``AutoProcessor`` load the folder cleanly; the
  processor gives the prompt the ids and the image the pixels mimotron's data path gives
  them; the logits equal our ``MimoModel``'s (fp32, 1e-5 relative) and greedy
  ``generate`` picks the tokens our own greedy loop over ``MimoModel`` picks;
- the default (``mimotron``) export loads with ``load_exported`` into a model holding
  the checkpoint's tensors bit for bit (it used to be refused for such runs);
- ``--format hf``: the language folder loads with ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mimotron.checkpoint.export import load_exported, read_full_model
from mimotron.cli.main import main as cli_main
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.media import ImageProcessor
from mimotron.demo.llava_assets import write_llava_assets
from mimotron.forked_ranks import run_ranks
from mimotron.models.mimo import MimoModel

transformers = pytest.importorskip("transformers")

from tests.hf_checkpoint import save_qwen2_for_tokenizer  # noqa: E402
from tests.parity import train  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_llava.toml"
NUM_ITERS = 3
NUM_NEW_TOKENS = 6
PROMPT = "<image>\nwhich digit is this"


def _language_folder(folder: Path, tokenizer: Path) -> Path:
    """A tied Qwen2 decoder holding its tokenizer; vocab_size = the tokenizer's length."""
    for file in tokenizer.iterdir():
        (folder / file.name).parent.mkdir(parents=True, exist_ok=True)
        (folder / file.name).write_bytes(file.read_bytes())
    return save_qwen2_for_tokenizer(folder, seed=7, hidden_size=64, max_positions=128,
                                    tied=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trained run's checkpoint and what it was trained from."""
    root = tmp_path_factory.mktemp("hf_llava")
    assets = root / "assets"
    write_llava_assets(assets, num_samples=24)
    language = _language_folder(root / "language", assets / "tokenizer")
    models = assets / "models"
    overrides = [
        f"modules.vision.hf_path='{models / 'vision'}'", "modules.vision.vision_feature_layer=-2",
        f"modules.audio.hf_path='{models / 'audio'}'", f"modules.language.hf_path='{language}'",
        f"data.path='{assets / 'data' / 'data.jsonl'}'", f"data.tokenizer='{language}'",
        "data.num_workers=0", *[f"modules.{m}.parallel.rank_offset=0"
                                for m in ("vision", "audio", "language")],
        "modules.language.parallel.data=1", f"train.iters={NUM_ITERS}",
        "train.global_batch_size=8", "train.micro_batch_size=8", "scheduler.warmup_iters=1",
        "optimizer.lr=3e-3", "eval.interval=1000", f"checkpoint.interval={NUM_ITERS}",
        f"log.dir='{root / 'run'}'", "log.interval=1",
    ]  # fmt: skip
    run_ranks(1, train, overrides, CONFIG, timeout_s=240)
    return {"root": root, "checkpoint": root / "run" / "checkpoints", "language": language,
            "vision": models / "vision", "data": assets / "data"}


def _export(run: dict[str, Any], name: str, *args: str) -> tuple[int, Path]:
    out = run["root"] / name
    return cli_main(["export", *args, str(run["checkpoint"]), str(out)]), out


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max())
    assert err <= rel * float(want.abs().max()), err


def _logits(model: MimoModel, tokens: torch.Tensor, image: torch.Tensor, vocab: int
            ) -> torch.Tensor:
    """Our model's logits for one prompt with one image (the real vocabulary only)."""
    language = model.language_model
    assert language is not None
    embeds = {"vision": model.modality_submodules["vision"](image[None])}
    hidden = model.merge_embeddings(tokens, language.embed_tokens(tokens), embeds,
                                    {"vision": torch.ones(1, dtype=torch.bool)})
    return language(hidden)[..., :vocab]


def _greedy(model: MimoModel, tokens: torch.Tensor, image: torch.Tensor, vocab: int,
            eos: int) -> tuple[list[int], list[torch.Tensor]]:
    """Our own greedy loop: the most likely token but ``eos`` (ruled out, as
    ``min_new_tokens`` does, so every step is compared), appended, the whole prompt
    again. Returns the tokens and each step's logits."""
    new: list[int] = []
    steps: list[torch.Tensor] = []
    for _ in range(NUM_NEW_TOKENS):
        steps.append(_logits(model, tokens, image, vocab)[0, -1])
        scores = steps[-1].clone()
        scores[eos] = -float("inf")
        new.append(int(scores.argmax()))
        tokens = torch.cat([tokens, torch.tensor([new[-1:]])], dim=1)
    return new, steps


def test_audio_module_is_refused_unless_left_out(run, capsys):
    code, out = _export(run, "refused", "--format", "hf-llava")
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "'audio'" in err and "--modules vision,language" in err, err
    assert not out.exists() or not any(out.iterdir())
    code, _ = _export(run, "refused2", "--format", "hf", "--modules", "vision,language")
    assert code == 2 and "--format hf-llava only" in capsys.readouterr().err


def test_hf_llava_computes_what_mimotron_computes(run):
    from PIL import Image

    code, out = _export(run, "llava", "--format", "hf-llava", "--modules", "vision,language")
    assert code == 0
    llava, info = transformers.AutoModelForImageTextToText.from_pretrained(
        out, output_loading_info=True)
    assert type(llava).__name__ == "LlavaForConditionalGeneration"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    llava.eval()
    processor = transformers.AutoProcessor.from_pretrained(out)

    # The default export of the same checkpoint is our model, bit for bit.
    code, default = _export(run, "default")
    assert code == 0
    cfg, ours = load_exported(default)
    tensors, _ = read_full_model(run["checkpoint"])
    state = ours.state_dict()
    assert sorted(state) == sorted(tensors)
    assert all(torch.equal(state[n], t) for n, t in tensors.items())
    ours.eval()

    tokenizer = HFTokenizer(run["language"], modalities=("image", "audio"))  # as trained
    image_id, vocab = tokenizer.placeholder_id("image"), tokenizer.vocab_size
    assert llava.config.image_token_index == image_id
    assert llava.config.text_config.vocab_size == vocab
    num_tokens = cfg.modules["vision"].num_output_tokens
    assert llava.config.image_seq_length == num_tokens == 16  # 4 x 4 patches, no class token

    # The prompt: the processor's ids are ours, the <image> expanded as training does.
    text = tokenizer.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                   tokenize=False, add_generation_prompt=True)
    ids = [i for t in tokenizer.encode(text) for i in ([t] * num_tokens if t == image_id
                                                         else [t])]
    png = Image.open(sorted((run["data"] / "images").iterdir())[0])
    inputs = processor(images=png, text=text, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    # The pixels: mimotron's preprocessing, also for an image that must be resized.
    pixels = ImageProcessor.from_pretrained(run["vision"])
    assert torch.equal(inputs["pixel_values"][0], pixels(png))
    odd = Image.fromarray(np.random.default_rng(0).integers(0, 256, (13, 11, 3), np.uint8))
    theirs = processor.image_processor(odd, return_tensors="pt")["pixel_values"][0]
    _close(theirs, pixels(odd), rel=1e-6)

    tokens = torch.tensor([ids])
    with torch.no_grad():
        want = _logits(ours, tokens, pixels(png), vocab)
        _close(llava(**inputs).logits, want)
        eos = tokenizer.tokenizer.eos_token_id
        greedy, steps = _greedy(ours, tokens, pixels(png), vocab, eos)
        generated = llava.generate(**inputs, max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                   min_new_tokens=NUM_NEW_TOKENS, eos_token_id=eos,
                                   pad_token_id=eos, output_logits=True,
                                   return_dict_in_generate=True)
    assert generated.sequences[0, len(ids):].tolist() == greedy
    # Every step's logits too (transformers' with its KV cache, ours from scratch): the
    # few tokens of a 3-iteration model may repeat.
    assert len(generated.logits) == NUM_NEW_TOKENS
    for got, want_step in zip(generated.logits, steps, strict=True):
        _close(got[0], want_step)
    # Tied: no lm_head in the file, transformers ties it (the SigLIP case below is untied).
    assert llava.config.tie_word_embeddings
    with safe_open(out / "model.safetensors", "pt") as handle:
        names = list(handle.keys())  # noqa: SIM118 - a safetensors handle, not a dict
        # Layer 1 is past the feature layer (-2): copied from the tower's folder, as is.
        layer = "encoder.layers.1.mlp.fc2.weight"
        with safe_open(run["vision"] / "model.safetensors", "pt") as original:
            assert torch.equal(handle.get_tensor("vision_tower.vision_model." + layer),
                               original.get_tensor(layer))
    assert "language_model.lm_head.weight" not in names
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json",
            "chat_template.jinja", "generation_config.json"} <= files
    assert json.loads((out / "mimotron_config.json").read_text())["modules"]["audio"]


def test_hf_format_language_folder_loads(run):
    """The model folder is the tokenizer: its config.json must not replace the resized one."""
    code, out = _export(run, "hf", "--format", "hf")
    assert code == 0
    vocab = HFTokenizer(run["language"], modalities=("image", "audio")).vocab_size
    lm, info = transformers.AutoModelForCausalLM.from_pretrained(out / "language",
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert lm.config.vocab_size == vocab
    assert json.loads((run["language"] / "config.json").read_text())["vocab_size"] == vocab - 2


# ---- SigLIP (no class token, strategy "full") and an untied decoder ----------------------

SIGLIP_PROCESSOR = {"image_processor_type": "SiglipImageProcessor", "do_resize": True,
                    "size": {"height": 16, "width": 16}, "resample": 2, "do_rescale": True,
                    "rescale_factor": 1 / 255, "do_normalize": True,
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def test_siglip_tower_and_untied_decoder(tmp_path):
    """No training: a checkpoint written from the modules as training builds them (random
    projector, grown decoder) is enough to check the other tower family's layout."""
    from PIL import Image

    from mimotron.checkpoint.hf_export import VOCAB_SIZE_UNPADDED
    from mimotron.models.encoders import ModalitySubmodule, Projector
    from mimotron.models.hf.clip import SiglipVisionTower
    from mimotron.models.hf.weights import load_hf_weights
    from tests.hf_checkpoint import grown_language, write_checkpoint
    from tests.hf_data import make_tokenizer

    language_dir = save_qwen2_for_tokenizer(make_tokenizer(tmp_path / "qwen"), seed=3,
                                            hidden_size=32, max_positions=256, tied=False)
    vision_dir = tmp_path / "siglip"
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4)).save_pretrained(vision_dir)
    (vision_dir / "preprocessor_config.json").write_text(json.dumps(SIGLIP_PROCESSOR))

    tokenizer = HFTokenizer(language_dir, modalities=("image",))
    vocab, image_id = tokenizer.vocab_size, tokenizer.placeholder_id("image")
    config = json.loads((vision_dir / "config.json").read_text())
    tower = SiglipVisionTower(**SiglipVisionTower.from_hf_config(config),
                              vision_feature_layer=-1, vision_feature_select_strategy="full")
    load_hf_weights(tower, vision_dir, tower.weight_map)
    vision = ModalitySubmodule(tower, Projector(32, 32)).eval()
    model = MimoModel({"vision": vision}, grown_language(language_dir, vocab),
                      {"vision": image_id}, {"vision": "image"}).eval()
    run_config = {"modules": {
        "vision": {"kind": "vit", "hf_path": str(vision_dir), "vision_feature_layer": -1,
                   "vision_feature_select_strategy": "full"},
        "language": {"kind": "language", "hf_path": str(language_dir)}},
        "data": {"tokenizer": str(language_dir)}}
    write_checkpoint(tmp_path / "ckpt", model, {"config": run_config, VOCAB_SIZE_UNPADDED: vocab})
    out = tmp_path / "llava"
    assert cli_main(["export", "--format", "hf-llava", str(tmp_path / "ckpt"), str(out)]) == 0

    llava, info = transformers.AutoModelForImageTextToText.from_pretrained(
        out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert llava.config.image_seq_length == 16 and not llava.config.tie_word_embeddings
    processor = transformers.AutoProcessor.from_pretrained(out)
    text = tokenizer.render([{"role": "user", "content": PROMPT}])
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (20, 24, 3), np.uint8))
    inputs = processor(images=image, text=text, return_tensors="pt")
    ids = [i for t in tokenizer.encode(text) for i in ([t] * 16 if t == image_id else [t])]
    assert inputs["input_ids"][0].tolist() == ids
    pixels = ImageProcessor.from_pretrained(vision_dir)(image)
    _close(inputs["pixel_values"][0], pixels, rel=1e-6)
    with torch.no_grad():
        _close(llava.eval()(**inputs).logits,
               _logits(model, torch.tensor([ids]), pixels, vocab))
