"""A tiny LLaVA folder as users have one, its LLaVA-format data, and transformers' model as
the independent reference.

:func:`save_llava_folder` writes what ``llava-hf/llava-1.5-7b-hf`` holds, at toy sizes:
``config.json`` (``model_type`` ``llava``: a CLIP vision tower, a Llama decoder),
``model.safetensors`` in the hub layout (``layout="hub"``, as llava-hf publishes it),
the ``model.language_model.*`` layout of transformers 4.52-4.57 (``"flat"``) or as
transformers 5 saves it (``"saved"``: no ``vision_model.`` level in the tower; and
``"sharded-fp16"``: float16 in several shards with an index), the CLIP
image processor and a tokenizer (trained locally) with ``<image>`` at ``image_token_index``.

:func:`hf_name` maps a parameter of mimotron's ``MimoModel`` to the parameter of
``transformers``' ``LlavaForConditionalGeneration`` it must equal, from the
per-family maps (each tested against transformers on its own) and the LLaVA module
layout written out here; :func:`hf_llava_loss` is transformers' loss of a mimotron batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mimotron.data.bpe import CHATML_TEMPLATE, train_bpe_tokenizer
from mimotron.forked_ranks import run_groups
from mimotron.models.hf.clip import CLIP_WEIGHTS
from mimotron.models.hf.llama import LLAMA_WEIGHTS
from tests.common import engine_run
from tests.hf_data import write_jsonl, write_png

IMAGE = 16  # CLIP input side; patches of 8 -> 4 patches + the class token
IMAGE_TOKENS = 4  # "default" strategy: the class token dropped
SENTENCES = ["what digit is in this picture", "the digit is seven", "the digit is three",
             "describe the image", "a cat sits on a mat", "you are a helpful assistant",
             "what is two plus two", "four"] * 4


def save_llava_folder(root: Path, layout: str = "hub", lm_layers: int = 2,
                      vision_layers: int = 4, seed: int = 0, siglip: bool = False,
                      **llava: Any) -> Path:
    """A random LLaVA folder under ``root`` (see the module docstring); returns it.

    ``siglip``: a SigLIP tower with its pooling head (``vision_use_head``, which LLaVA
    never runs) instead of CLIP's; ``llava``: ``LlavaConfig`` keys to set.
    """
    import transformers

    folder = root / "llava"
    tokenizer_dir = train_bpe_tokenizer(SENTENCES, root / "tok", vocab_size=300,
                                        chat_template=CHATML_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    vocab = -(-len(tokenizer) // 64) * 64  # a multiple of 64: no padding rows
    torch.manual_seed(seed)
    tower = transformers.SiglipVisionConfig if siglip else transformers.CLIPVisionConfig
    config = transformers.LlavaConfig(
        vision_config=tower(
            hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
            num_attention_heads=4, image_size=IMAGE, patch_size=8).to_dict(),
        text_config=transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64,
            num_hidden_layers=lm_layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256).to_dict(),
        **{"image_token_index": image_id, "image_seq_length": IMAGE_TOKENS,
           # not the default -2: the folder's choice must be read
           "vision_feature_layer": -3, **llava})
    model = transformers.LlavaForConditionalGeneration(config)
    if layout == "sharded-fp16":  # as llava-1.5-7b-hf: float16, several shards and an index
        model.half().save_pretrained(folder, max_shard_size="40KB")
    else:
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE},
    ).save_pretrained(folder)  # fmt: skip
    if layout in ("hub", "flat"):
        file = folder / "model.safetensors"
        rename = flat_name if layout == "flat" else (lambda n: n)
        save_file({rename(_with_vision_model(n)): t for n, t in load_file(file).items()},
                  str(file), metadata={"format": "pt"})
    return folder


def _with_vision_model(name: str) -> str:
    """transformers 5 writes ``vision_tower.embeddings.*``; published folders hold
    ``vision_tower.vision_model.embeddings.*``."""
    head = "vision_tower."
    return head + "vision_model." + name[len(head):] if name.startswith(head) else name


def flat_name(hub: str) -> str:
    """A hub-layout tensor name in the ``model.language_model.*`` layout (which is also
    how ``LlavaForConditionalGeneration`` names its parameters)."""
    for old, new in (("language_model.model.", "model.language_model."),
                     ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if hub.startswith(old):
            return new + hub[len(old):]
    raise AssertionError(hub)


def hf_name(ours: str) -> str:
    """The ``LlavaForConditionalGeneration`` parameter a ``MimoModel`` parameter equals."""
    if ours.startswith("language_model."):
        return flat_name("language_model." + LLAMA_WEIGHTS.to_hf(ours[len("language_model."):]))
    head = "modality_submodules.vision."
    assert ours.startswith(head), ours
    local = ours[len(head):]
    if local.startswith("projector."):
        return "model.multi_modal_projector." + local[len("projector."):].replace(
            "fc1.", "linear_1.").replace("fc2.", "linear_2.")
    assert local.startswith("encoder."), ours
    return "model.vision_tower." + CLIP_WEIGHTS.to_hf(local[len("encoder."):])


def hf_llava_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' mean loss of a mimotron batch (``tokens``, ``labels``, ``loss_mask``,
    ``image``, ``has_image``): its labels are the trained next tokens, -100 elsewhere,
    one position later (transformers shifts them back)."""
    tokens = batch["tokens"]
    labels = torch.full_like(tokens, -100)
    trained = batch["loss_mask"].bool()
    labels[:, 1:][trained[:, :-1]] = batch["labels"][:, :-1][trained[:, :-1]]
    assert not bool(trained[:, -1].any()), "a last-position target has no place in HF labels"
    pixels = batch["image"][batch["has_image"].bool()]
    out = model(input_ids=tokens, pixel_values=pixels if len(pixels) else None, labels=labels)
    return out.loss


def write_image_data(root: Path, num_samples: int = 24, seed: int = 0) -> Path:
    """LLaVA-format JSONL: images of several sizes (the processor resizes them) with
    one- and two-turn conversations, and every fourth sample text-only."""
    samples = []
    for i in range(num_samples):
        turns = [{"from": "human", "value": "<image>\nwhat digit is in this picture"},
                 {"from": "gpt", "value": "the digit is " + ("seven", "three")[i % 2]}]
        if i % 3 == 1:
            turns += [{"from": "human", "value": "describe the image"},
                      {"from": "gpt", "value": "a cat sits on a mat"}]
        sample: dict[str, Any] = {"id": f"s{i}", "conversations": turns}
        if i % 4 == 3:
            turns[0]["value"] = "what is two plus two"
            turns[1]["value"] = "four"
        else:
            size = (12 + 4 * (i % 3), 20 - 2 * (i % 4))
            sample["image"] = write_png(root / f"img{i}.png", *size, seed=seed + i).name
        samples.append(sample)
    return write_jsonl(root / "train.jsonl", samples)


def write_config(root: Path, folder: Path, data: Path, iters: int = 10) -> Path:
    """A run of the folder as a user writes it: the folder once, the data, the schedule.
    Layouts come as overrides of ``modules.<m>.parallel``."""
    path = root / "llava_one_folder.toml"
    path.write_text(f"""
name = "llava_one_folder"
hf_path = "{folder}"

[data]
dataset = "llava"
path = "{data}"
seq_length = 128

{parity_tables(iters, seed=7, lr=2e-3)}
[log]
dir = "{root / 'run'}"
interval = 1
progress = false
""")
    return path


def parity_tables(iters: int, seed: int, lr: float) -> str:
    """The TOML tables of a run the plain loop follows: batches of 8 in micro-batches of
    4, fp32, AdamW at ``lr`` with clipping at 0.5 and weight decay, 2 warm-up
    iterations, no evaluation."""
    return f"""
[train]
iters = {iters}
global_batch_size = 8
micro_batch_size = 4
seed = {seed}
precision = "fp32"

[optimizer]
lr = {lr}
clip_grad = 0.5
weight_decay = 0.1

[scheduler]
warmup_iters = 2

[eval]
interval = 1000
"""


@dataclass
class HFReference:
    """What the plain loop on transformers' model did: per iteration the mean loss and
    the gradient norm before clipping; the final and initial weights under mimotron's
    names (``MimoModel``'s), and the loss tokens per iteration."""

    losses: list[float]
    grad_norms: list[float]
    num_tokens: list[int]
    weights: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]


@dataclass(frozen=True)
class HFFamily:
    """How the plain loop meets one family: its transformers model from the folder, the
    transformers parameter a ``MimoModel`` parameter equals, the mean loss of a batch."""

    load: Any
    name_of: Any
    loss: Any


def _llava_model(path: str) -> Any:
    import transformers

    return transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)


LLAVA = HFFamily(_llava_model, lambda name, model: hf_name(name), hf_llava_loss)


def hf_reference_run(config: Path, num_iters: int, overrides: tuple[str, ...] = (),
                     family: HFFamily = LLAVA, packed: bool = False) -> HFReference:
    """Train ``family``'s transformers model (``LlavaForConditionalGeneration`` by
    default) from the config's folder in a plain loop.

    One process: the whole global batch in one forward, transformers' own loss,
    ``backward``, ``clip_grad_norm_``, ``torch.optim.AdamW`` (norms and biases without
    weight decay) and Megatron's warm-up + cosine schedule written out in
    :func:`tests.reference.lr_at`. From mimotron it borrows what a user would: the config
    and the data API (the global sample order, the tokenised conversations). The names
    of its parameters map to mimotron's by :func:`hf_name`. With
    ``modules.vision.freeze = "encoder"`` (LLaVA-1.5's stage 2) the tower's parameters
    get no gradient and no optimizer state. With ``modules.<m>.lora`` (one rank and alpha)
    PEFT's adapters go on transformers' model with mimotron's initial values
    (:func:`tests.lora_reference.with_adapters`) and train alone in those modules.

    ``packed``: each step takes the samples the engine packs into its rows (the greedy
    packer of :func:`tests.reference.packed_rows`), each sample in a row of its own: a
    packed row's documents attend only within themselves, so the loss is the same.
    """
    from mimotron.config import load_config
    from mimotron.data import build_datasets, collate
    from mimotron.data.run_data import build_tokenizer
    from mimotron.models.build import build_mimo_model
    from mimotron.models.lora import is_lora_parameter
    from mimotron.names import module_prefix
    from tests.lora_reference import with_adapters
    from tests.reference import lr_at

    cfg = load_config(config, list(overrides))
    tokenizer = build_tokenizer(cfg)
    task, _ = build_datasets(cfg, tokenizer)
    model = family.load(cfg.hf_path)
    # Only the names of what mimotron trains (the tower's unused last layer is not).
    built = build_mimo_model(cfg, tokenizer.vocab_size, {
        "vision": tokenizer.placeholder_id("image")})
    names = [n for n, _ in built.named_parameters()]
    name_of = family.name_of
    adapted = {n: m.lora for n, m in cfg.modules.items() if m.lora.rank}
    if adapted:  # PEFT's adapters on transformers' model, holding mimotron's values
        (rank, alpha), = {(t.rank, t.alpha) for t in adapted.values()}  # one PEFT config
        model, name_of = with_adapters(model, built, rank, alpha, family.name_of)
    prefixes = tuple(module_prefix(m) for m in adapted)
    params = dict(model.named_parameters())
    frozen_tower = cfg.modules["vision"].freeze == "encoder"
    # A frozen tower: every encoder parameter but a Qwen-VL tower's patch mergers.
    mergers = ("modality_submodules.vision.encoder.merger.",
               "modality_submodules.vision.encoder.deepstack_mergers.")
    ours = {n: params[name_of(n, model)] for n in names
            if not (frozen_tower and n.startswith("modality_submodules.vision.encoder.")
                    and not n.startswith(mergers))
            and not (n.startswith(prefixes) and prefixes and not is_lora_parameter(n))}
    for p in params.values():
        p.requires_grad_(False)
    for p in ours.values():
        p.requires_grad_(True)
    opt, sched = cfg.optimizer, cfg.scheduler
    groups = [{"params": [p for n, p in ours.items() if not any(s in n for s in opt.no_decay)],
               "weight_decay": opt.weight_decay},
              {"params": [p for n, p in ours.items() if any(s in n for s in opt.no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=tuple(opt.betas), eps=opt.eps)
    initial = {n: p.detach().clone() for n, p in ours.items()}
    out = HFReference([], [], [], {}, initial)
    stream, gbs = task.stream(cfg.train.seed), cfg.train.global_batch_size
    from tests.reference import packed_rows

    rows_at = packed_rows(task, stream, gbs) if packed else None
    for k in range(num_iters):
        samples = ([s for row in rows_at() for s in row] if rows_at is not None
                   else stream.samples(k * gbs, gbs))
        batch = collate(samples, task.seq_length, pad_id=task.pad_id,
                        image_shape=task.image_shape, audio_shape=task.audio_shape)
        optimizer.zero_grad(set_to_none=True)
        loss = family.loss(model, batch)
        loss.backward()
        out.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(list(ours.values()),
                                                                   opt.clip_grad)))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k, opt.lr, opt.min_lr, sched.warmup_iters,
                                sched.decay_iters or cfg.train.iters, sched.decay_style)
        optimizer.step()
        out.losses.append(float(loss.detach()))
        out.num_tokens.append(int(batch["loss_mask"].sum()))
    out.weights = {n: p.detach().clone() for n, p in ours.items()}
    return out


def check_layout_run(layout: str, results: list[dict], ref: HFReference
                     ) -> dict[str, torch.Tensor]:
    """Every rank's losses, gradient norms and loss tokens of one engine run equal the
    plain loop's, iteration by iteration; returns the ranks' final weights, merged."""
    import pytest

    merged: dict[str, torch.Tensor] = {}
    for rank, res in enumerate(results):
        merged.update(res["weights"])
        for it, (loss, norm, skipped, tokens) in enumerate(res["steps"]):
            where = f"{layout}, rank {rank}, iteration {it}"
            assert not skipped and tokens == ref.num_tokens[it], where
            assert loss == pytest.approx(ref.losses[it], rel=1e-5), where
            assert norm == pytest.approx(ref.grad_norms[it], rel=1e-5), where
    return merged


def run_layouts(config: Path, ref: HFReference, layouts: dict[str, tuple[int, list[str]]],
                num_iters: int, timeout_s: float = 300) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``config`` in each layout (``name -> (world size, overrides)``) on forked
    ranks side by side: every rank's steps equal the plain loop's
    (:func:`check_layout_run`) and every weight it trains ends within 1e-4 of it.

    Returns:
        Per layout, its ranks' final weights, merged.
    """
    groups = run_groups([(world, engine_run, (over, num_iters, config), {})
                         for world, over in layouts.values()], timeout_s=timeout_s)
    out = {}
    for layout, results in zip(layouts, groups, strict=True):
        merged = check_layout_run(layout, results, ref)
        for name, want in ref.weights.items():
            err = float((merged[name].reshape(want.shape) - want).norm() / want.norm())
            assert err <= 1e-4, f"{layout}: {name}: relative error {err}"
        out[layout] = merged
    return out
