"""Unit tests for mimotron.models: blocks, init, encoders, LM, MimoModel and builders."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from mimotron.config import MimoConfig, load_config
from mimotron.forked_ranks import run_ranks
from mimotron.models import (
    Attention,
    AudioEncoder,
    LanguageModel,
    MimoModel,
    VisionEncoder,
    build_mimo_model,
    build_module,
    count_parameters,
    init_parameters_,
    language_loss,
    rope_cache,
)

VOCAB = 40
PLACEHOLDERS = {"vision": 38, "audio": 39}


@pytest.fixture(scope="module")
def cfg() -> MimoConfig:
    return load_config("configs/digits.toml")


def _with_seed(cfg: MimoConfig, seed: int) -> MimoConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))


def make_batch(kinds: list[str], seq: int = 64, generator_seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch with one sample per entry of ``kinds`` ("both", "image", "audio", "text").

    Layout per sample: bos(1), vision placeholders if any, audio placeholders if any,
    then random text tokens; the last 8 real positions are scored.
    """
    gen = torch.Generator().manual_seed(generator_seed)
    batch_size = len(kinds)
    tokens = torch.zeros(batch_size, seq, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, seq)
    has_image = torch.tensor([k in ("both", "image") for k in kinds])
    has_audio = torch.tensor([k in ("both", "audio") for k in kinds])
    for i in range(batch_size):
        row = [1]
        row += [PLACEHOLDERS["vision"]] * (16 if has_image[i] else 0)
        row += [PLACEHOLDERS["audio"]] * (4 if has_audio[i] else 0)
        row += torch.randint(2, 30, (12,), generator=gen).tolist()
        tokens[i, : len(row)] = torch.tensor(row)
        loss_mask[i, len(row) - 9 : len(row) - 1] = 1.0
    labels = torch.roll(tokens, -1, dims=1)
    image = torch.rand(batch_size, 1, 8, 8, generator=gen) * has_image.view(-1, 1, 1, 1)
    audio = torch.randn(batch_size, 129, 16, generator=gen) * has_audio.view(-1, 1, 1)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "image": image,
        "has_image": has_image,
        "audio": audio,
        "has_audio": has_audio,
    }


@pytest.fixture(scope="module")
def model(cfg: MimoConfig) -> MimoModel:
    return build_mimo_model(cfg, VOCAB, PLACEHOLDERS)


# ---- embedding merge ------------------------------------------------------------------


def _merge(model: MimoModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    embeds = {n: model.encode(n, batch) for n in ("vision", "audio")}
    present = {n: model.present_mask(n, batch) for n in ("vision", "audio")}
    text = model.language_model.embed_tokens(batch["tokens"])
    return model.merge_embeddings(batch["tokens"], text, embeds, present), text, embeds


def test_merge_places_embeddings_in_order(model: MimoModel) -> None:
    batch = make_batch(["both", "image", "audio", "text"])
    merged, text, embeds = _merge(model, batch)
    assert embeds["vision"].shape == (2, 16, 128) and embeds["audio"].shape == (2, 4, 128)
    # Sample 0 carries both: vision at 1..16, audio at 17..20.
    torch.testing.assert_close(merged[0, 1:17], embeds["vision"][0])
    torch.testing.assert_close(merged[0, 17:21], embeds["audio"][0])
    torch.testing.assert_close(merged[1, 1:17], embeds["vision"][1])  # image only
    torch.testing.assert_close(merged[2, 1:5], embeds["audio"][1])  # audio only
    # Everything that is not a placeholder (incl. the whole text-only sample) is text.
    is_text = (batch["tokens"] != 38) & (batch["tokens"] != 39)
    torch.testing.assert_close(merged[is_text], text[is_text])
    torch.testing.assert_close(merged[3], text[3])


def test_merge_with_no_present_samples(model: MimoModel) -> None:
    batch = make_batch(["image", "text"])
    merged, text, embeds = _merge(model, batch)
    assert embeds["audio"].shape == (0, 4, 128)
    torch.testing.assert_close(merged[1], text[1])


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("drop_one_vision", r"sample 1: 15 placeholder tokens for module 'vision' \(modality 'im"),
        ("audio_flag_without_tokens", r"sample 1: 0 placeholder tokens for module 'audio'.*4"),
        ("tokens_without_flag", r"sample 2: 4 placeholder tokens for module 'audio'.*0"),
    ],
)
def test_merge_count_mismatch_raises(model: MimoModel, edit: str, match: str) -> None:
    batch = make_batch(["both", "image", "text"])
    if edit == "drop_one_vision":
        batch["tokens"][1, 16] = 5
    elif edit == "audio_flag_without_tokens":
        batch["has_audio"][1] = True
    else:
        batch["tokens"][2, 30:34] = PLACEHOLDERS["audio"]
    with pytest.raises(ValueError, match=match):
        _merge(model, batch)


def test_merge_rejects_placeholders_without_embeddings(model: MimoModel) -> None:
    batch = make_batch(["image"])
    text = model.language_model.embed_tokens(batch["tokens"])
    with pytest.raises(ValueError, match="no embeddings"):
        model.merge_embeddings(batch["tokens"], text, {}, {})


def test_gradients_reach_encoders(cfg: MimoConfig) -> None:
    model = build_mimo_model(cfg, VOCAB, PLACEHOLDERS)
    loss_sum, num_tokens, correct = model(make_batch(["both", "image", "audio", "text"]))
    assert num_tokens.item() == 32 and correct.shape == (4,)
    (loss_sum / num_tokens).backward()
    for name in ("vision", "audio"):
        sub = model.modality_submodules[name]
        for param_name, param in sub.named_parameters():
            assert param.grad is not None, f"{name}.{param_name} got no gradient"
        assert sub.encoder.front_end.parameters().__next__().grad.abs().sum() > 0
        assert sub.projector.fc2.weight.grad.abs().sum() > 0


# ---- init -----------------------------------------------------------------------------


def test_stage_init_matches_full_model(cfg: MimoConfig) -> None:
    full = build_mimo_model(cfg, VOCAB, PLACEHOLDERS).state_dict()
    lm_stage = build_module(cfg, "language", VOCAB, layer_ids=[1], pre_process=False)
    vit_stage = build_module(cfg, "vision", VOCAB, layer_ids=[1], pre_process=False)
    stages = {"language_model.": lm_stage, "modality_submodules.vision.": vit_stage}
    for prefix, stage in stages.items():
        names = [n for n, _ in stage.named_parameters()]
        assert names and all(".layers.0." not in "." + n for n in names)
        assert any("layers.1." in n for n in names)
        for name, param in stage.named_parameters():
            assert torch.equal(param, full[prefix + name]), prefix + name
    # A rank holding only the LM gets the LM of the full model.
    alone = build_mimo_model(cfg, VOCAB, PLACEHOLDERS, modules={"language"})
    assert len(alone.modality_submodules) == 0
    for name, param in alone.named_parameters():
        assert torch.equal(param, full[name]), name


def test_init_seed_determinism(cfg: MimoConfig) -> None:
    first = build_module(cfg, "audio", VOCAB).state_dict()
    again = build_module(cfg, "audio", VOCAB).state_dict()
    other = build_module(_with_seed(cfg, 99), "audio", VOCAB).state_dict()
    random_names = [n for n, v in first.items() if v.numel() > 1 and v.std() > 0]
    assert len(random_names) > 10
    for name, value in first.items():
        assert torch.equal(value, again[name]), name
        # Constants (norm weights, biases) agree across seeds; every random draw differs.
        assert torch.equal(value, other[name]) == (name not in random_names), name


def test_init_stds() -> None:
    lm = init_parameters_(LanguageModel(VOCAB, num_layers=2), seed=0)
    assert torch.all(lm.layers["0"].attn_norm.weight == 1)
    assert abs(lm.layers["0"].attn.wq.weight.std().item() - 128**-0.5) < 5e-3  # fan-in
    assert abs(lm.layers["0"].attn.wo.weight.std().item() - 0.01) < 1e-3  # 0.02/sqrt(4)
    assert abs(lm.embed.weight.std().item() - 0.02) < 2e-3
    vit = init_parameters_(VisionEncoder(), seed=0)
    assert abs(vit.front_end.proj.weight.std().item() - 0.5) < 0.1  # fan-in 4
    assert torch.all(vit.front_end.proj.bias == 0)


# ---- attention under head sharding ---------------------------------------------------


def _half(attn: Attention, part: int, num_parts: int) -> Attention:
    """The attention a column/row-sharded rank would run (weights sliced by heads)."""
    width = attn.wq.out_features // num_parts
    cols = slice(part * width, (part + 1) * width)
    half = copy.deepcopy(attn)
    for proj in ("wq", "wk", "wv"):
        layer = nn.Linear(attn.wq.in_features, width, bias=False)
        layer.weight.data.copy_(getattr(attn, proj).weight[cols])
        setattr(half, proj, layer)
    half.wo = nn.Linear(width, attn.wo.out_features, bias=False)
    half.wo.weight.data.copy_(attn.wo.weight[:, cols])
    return half


@pytest.mark.parametrize("causal", [True, False])
def test_head_sharded_attention_sums_to_full(causal: bool) -> None:
    torch.manual_seed(0)
    attn = init_parameters_(Attention(64, 4, causal=causal), seed=3)
    x = torch.randn(3, 10, 64)
    rope = rope_cache(10, 16)
    full = attn(x, rope)
    summed = sum(_half(attn, p, 2)(x, rope) for p in range(2))
    torch.testing.assert_close(summed, full, rtol=1e-5, atol=1e-6)


def _dtensor_tp_rank(rank: int, world_size: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    hidden = torch.randn(2, 12, 128)
    reference = init_parameters_(LanguageModel(VOCAB), seed=7, prefix="language_model.")
    expected = reference(hidden)
    sharded = LanguageModel(VOCAB)
    plan = {}
    for i in ("0", "1"):
        plan.update({f"layers.{i}.attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.mlp.{n}": ColwiseParallel() for n in ("w1", "w3")})
        plan[f"layers.{i}.attn.wo"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.w2"] = RowwiseParallel()
    parallelize_module(sharded, init_device_mesh("cpu", (world_size,)), plan)
    # Init after sharding must give each rank its slice of the full-shape draw.
    init_parameters_(sharded, seed=7, prefix="language_model.")
    assert sharded.layers["0"].attn.wq.weight.to_local().shape == (64, 128)
    got = sharded(hidden)
    return (got - expected).abs().max().item()


def test_dtensor_tensor_parallel_matches_one_process() -> None:
    errors = run_ranks(2, _dtensor_tp_rank, timeout_s=120)
    assert max(errors) < 1e-5


# ---- encoders, LM, stages -------------------------------------------------------------


def test_encoder_shapes_and_pipeline_stages() -> None:
    vit = init_parameters_(VisionEncoder(num_layers=2), seed=1)
    images = torch.rand(5, 1, 8, 8)
    assert vit(images).shape == (5, 16, 64)
    first = VisionEncoder(num_layers=2, layer_ids=[0], post_process=False)
    last = VisionEncoder(num_layers=2, layer_ids=[1], pre_process=False)
    for stage in (first, last):
        init_parameters_(stage, seed=1)
    torch.testing.assert_close(last(first(images)), vit(images))
    audio = init_parameters_(AudioEncoder(), seed=1)
    assert audio(torch.randn(3, 129, 16)).shape == (3, 4, 64)
    with pytest.raises(ValueError, match="spectrograms"):
        audio(torch.randn(3, 129, 15))
    with pytest.raises(ValueError, match="layer_ids"):
        VisionEncoder(num_layers=2, layer_ids=[2])


def test_language_model_causal_and_stages() -> None:
    lm = init_parameters_(LanguageModel(VOCAB, num_layers=2), seed=2)
    tokens = torch.randint(0, VOCAB, (2, 10))
    logits = lm(lm.embed_tokens(tokens))
    assert logits.shape == (2, 10, VOCAB)
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
    torch.testing.assert_close(lm(lm.embed_tokens(changed))[:, :6], logits[:, :6])
    first = init_parameters_(LanguageModel(VOCAB, layer_ids=[0], post_process=False), seed=2)
    last = init_parameters_(LanguageModel(VOCAB, layer_ids=[1], pre_process=False), seed=2)
    torch.testing.assert_close(last(first(first.embed_tokens(tokens))), logits)
    with pytest.raises(ValueError, match="pre_process=False"):
        last.embed_tokens(tokens)


def test_language_loss_hand_example() -> None:
    # Vocab 3; sample 0 scores 2 tokens (both argmax-correct), sample 1 scores one wrong
    # token, sample 2 scores nothing.
    logits = torch.full((3, 2, 3), -1e4)
    logits[0, 0, 1] = logits[0, 1, 2] = 0.0
    logits[1, 0] = torch.tensor([0.0, 0.0, 0.0])
    logits[1, 1, 0] = 0.0
    logits[2, :, 0] = 0.0
    labels = torch.tensor([[1, 2], [0, 1], [0, 0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    mask[1, 0] = 0.0  # sample 1 scores only position 1 (label 1, predicted 0)
    loss_sum, num_tokens, correct = language_loss(logits, labels, mask)
    assert num_tokens.item() == 3 and num_tokens.dtype == torch.float32
    assert loss_sum.item() == pytest.approx(1e4, rel=1e-4)  # two ~0 terms + one 1e4
    assert correct.tolist() == [True, False, False]
    labels = torch.zeros(1, 4, dtype=torch.long)
    uniform = language_loss(torch.zeros(1, 4, 3), labels, torch.ones(1, 4))
    assert uniform[0].item() == pytest.approx(4 * torch.log(torch.tensor(3.0)).item())
    assert uniform[2].tolist() == [True]  # argmax of a tie is index 0 = the label


# ---- builders and training sanity -----------------------------------------------------


def test_count_parameters_matches_built_modules(cfg: MimoConfig, model: MimoModel) -> None:
    counts = {n: count_parameters(cfg, n, VOCAB) for n in cfg.modules}
    assert counts["language"] == sum(p.numel() for p in model.language_model.parameters())
    assert counts["vision"] == sum(
        p.numel() for p in model.modality_submodules["vision"].parameters()
    )
    assert 550_000 < sum(counts.values()) < 750_000  # docs/design.md, "The demo task": about 650k
    with pytest.raises(ValueError, match="unknown module"):
        count_parameters(cfg, "nope", VOCAB)
    with torch.device("meta"):
        stage = build_module(cfg, "language", VOCAB, layer_ids=[1], pre_process=False, init=False)
    assert all(p.is_meta for p in stage.parameters())
    assert stage.embed is None and stage.output is not None


def test_tiny_model_loss_decreases(cfg: MimoConfig) -> None:
    torch.manual_seed(0)
    model = build_mimo_model(cfg, VOCAB, PLACEHOLDERS)
    batch = make_batch(["both", "image", "audio", "text"] * 2, generator_seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(30):
        loss_sum, num_tokens, _ = model(batch)
        loss = loss_sum / num_tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
