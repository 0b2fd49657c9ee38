"""3-D rotary positions (M-RoPE) and DeepStack of Qwen2.5-VL and Qwen3-VL, against
``transformers``.

Two tiny random ``ForConditionalGeneration`` models are saved with ``save_pretrained``
(Qwen2.5-VL writes the hub layout, ``model.layers.*`` and ``visual.*``; Qwen3-VL the
``model.language_model.*`` one). Checked, each against ``transformers``' own code:

* :func:`~mimotron.data.mrope_positions.mrope_positions` equals ``get_rope_index`` of each
  family (images of several sizes in one row, a video, a text-only row, left padding),
  and restarts per document in a packed row;
* the cos/sin tables (sectioned and interleaved) and the rotated queries equal the
  families' rotary embeddings;
* the language model loaded from the folder equals ``Qwen2_5_VLTextModel`` /
  ``Qwen3VLTextModel`` plus ``lm_head`` fed the same embeddings and positions: logits and
  every parameter's gradient within 1e-5 relative (fp32), with DeepStack features added
  as transformers does, also split over two pipeline stages, over two context-parallel
  ranks (packed rows) and two sequence-parallel ones, and through the KV cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

from mimotron.config.hf_specs import LlamaFamilySpec
from mimotron.data.mrope_positions import MRopeRule, decode_positions, mrope_positions
from mimotron.forked_ranks import run_ranks
from mimotron.models.attention import Documents
from mimotron.models.blocks import apply_rope
from mimotron.models.hf.llama import (
    QWEN_VL_HUB_WEIGHTS,
    QWEN_VL_WEIGHTS,
    build_hf_language_model,
    decoder_weight_map,
)
from mimotron.models.kv_cache import KVCache
from mimotron.models.language import LanguageModel
from mimotron.parallel.context_parallel import load_balanced_positions
from tests.hf_decoders import assert_close_relative

IMAGE, VIDEO, VSTART, VEND, PAD = 120, 121, 122, 123, 0
HIDDEN = 64
TEXT = {"vocab_size": 128, "hidden_size": HIDDEN, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}
# head_dim 16 (hidden / heads): 8 frequencies as 2 temporal, 3 height, 3 width.
QWEN25 = {"text": {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                               "mrope_section": [2, 3, 3]}},
          "vision": {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                     "out_hidden_size": HIDDEN, "spatial_merge_size": 2, "patch_size": 2,
                     "tokens_per_second": 2, "fullatt_block_indexes": [0],
                     "window_size": 16}}
# head_dim 24: 12 frequencies interleaved 4 / 4 / 4.
QWEN3 = {"text": {**TEXT, "head_dim": 24, "attention_bias": True,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 5e3,
                                      "mrope_section": [4, 4, 4], "mrope_interleaved": True}},
         "vision": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                    "out_hidden_size": HIDDEN, "spatial_merge_size": 2, "patch_size": 2,
                    "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 16}}
FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VL", QWEN25), "qwen3_vl": ("Qwen3VL", QWEN3)}
# Row 0: two images of different sizes and a video; row 1: text only; row 2: left
# padding, an image. Grids are (t, h, w) in patches; merge 2 leaves t * h * w / 4 tokens.
ROWS = (((3, ("image", (1, 4, 6)), 2, ("image", (1, 2, 2)), 4, ("video", (3, 4, 4)), 2), 0),
        ((30,), 0),
        ((2, ("image", (1, 6, 2)), 5), 6))
# Qwen2.5-VL: seconds between frames of each video (the first's 1.4 positions apart,
# truncated).
SECONDS = torch.tensor([0.7, 1.3])


def _save(path: Path, family: str) -> torch.nn.Module:
    prefix, sizes = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(
        text_config=dict(sizes["text"]), vision_config=dict(sizes["vision"]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # biases and norm scales away from their constant init
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("mrope")
    return {f: (_save(root / f, f), root / f) for f in FAMILIES}


def _rule(family: str) -> MRopeRule:
    return MRopeRule(family, IMAGE, VIDEO, spatial_merge_size=2, tokens_per_second=2)


def _tokens(parts: tuple, family: str, gen: torch.Generator
            ) -> tuple[list[int], list[tuple], list[tuple]]:
    """One document's ids and its image / video grids (Qwen3-VL: a run per frame)."""
    ids: list[int] = []
    images: list[tuple] = []
    videos: list[tuple] = []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(1, 100, (part,), generator=gen).tolist()
            continue
        kind, (t, h, w) = part
        frame = h * w // 4
        if kind == "image":
            ids += [VSTART] + [IMAGE] * t * frame + [VEND]
            images.append((t, h, w))
        elif family == "qwen3_vl":
            for f in range(t):  # a timestamp token, then the frame
                ids += [100 + f, VSTART] + [VIDEO] * frame + [VEND]
            videos.append((t, h, w))
        else:
            ids += [VSTART] + [VIDEO] * t * frame + [VEND]
            videos.append((t, h, w))
    return ids, images, videos


def _grid(grids: list[tuple]) -> torch.Tensor | None:
    return torch.tensor(grids, dtype=torch.long) if grids else None


def _batch(family: str, rows: tuple = ROWS, seed: int = 0) -> dict:
    """ids, attention mask (left padding) and grids of ``rows``, right-filled to one length."""
    gen = torch.Generator().manual_seed(seed)
    docs = [(_tokens(parts, family, gen), pad) for parts, pad in rows]
    seq = max(pad + len(ids) for (ids, _, _), pad in docs)
    ids = torch.full((len(rows), seq), PAD)
    mask = torch.zeros(len(rows), seq, dtype=torch.long)
    images, videos = [], []
    for r, ((row, imgs, vids), pad) in enumerate(docs):
        ids[r, pad:pad + len(row)] = torch.tensor(row)
        mask[r, pad:pad + len(row)] = 1
        images += imgs
        videos += vids
    return {"ids": ids, "mask": mask, "images": _grid(images), "videos": _grid(videos)}


def _hf_positions(model: torch.nn.Module, batch: dict, family: str, use_mask: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch["ids"]
    types = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    videos = 0 if batch["videos"] is None else len(batch["videos"])
    extra = {"second_per_grid_ts": SECONDS[:videos]} if family == "qwen2_5_vl" else {}
    with torch.no_grad():
        return model.model.get_rope_index(
            ids, mm_token_type_ids=types, image_grid_thw=batch["images"],
            video_grid_thw=batch["videos"], attention_mask=batch["mask"] if use_mask else None,
            **extra)


def _ours_positions(batch: dict, family: str, **kwargs: object
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    videos = 0 if batch["videos"] is None else len(batch["videos"])
    seconds = SECONDS[:videos] if family == "qwen2_5_vl" and videos else None
    return mrope_positions(batch["ids"], _rule(family), batch["images"], batch["videos"],
                           second_per_grid_ts=seconds, **kwargs)


# ---- positions ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_positions_equal_get_rope_index(saved: dict, family: str) -> None:
    model, _ = saved[family]
    batch = _batch(family)
    positions, deltas = _ours_positions(batch, family, attention_mask=batch["mask"])
    ref_positions, ref_deltas = _hf_positions(model, batch, family)
    assert torch.equal(positions, ref_positions)
    assert torch.equal(deltas, ref_deltas)
    # The layout is really 3-D: images and the video spread over the axes, the spatial
    # extent (not the token count) advances the text after them, and time is scaled.
    assert not torch.equal(positions[0], positions[1])
    assert positions[0, 0].max() < batch["mask"][0].sum() - 1
    assert deltas[1, 0] == 0 and deltas[0, 0] < 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_restart_their_positions(saved: dict, family: str) -> None:
    model, _ = saved[family]
    doc_a = (2, ("image", (1, 4, 4)), 3)
    doc_b = (1, ("video", (2, 2, 4)), 2, ("image", (1, 4, 6)), 1)  # another rope delta
    alone = [_batch(family, ((doc, 0),), seed=s) for s, doc in enumerate((doc_a, doc_b))]
    lengths = [a["ids"].shape[1] for a in alone]
    ids = torch.cat([a["ids"] for a in alone] + [torch.full((1, 3), PAD)], dim=1)
    doc_ids = torch.tensor([0] * lengths[0] + [1] * lengths[1] + [-1] * 3).view(1, -1)
    grids = {k: _grid([tuple(g) for a in alone if a[k] is not None for g in a[k].tolist()])
             for k in ("images", "videos")}
    packed = {"ids": ids, **grids}
    positions, deltas = _ours_positions(packed, family, doc_ids=doc_ids)
    start = 0
    for part in alone:
        ref, ref_delta = _hf_positions(model, part, family, use_mask=False)
        n = part["ids"].shape[1]
        assert torch.equal(positions[:, :, start:start + n], ref)
        start += n
    assert torch.equal(deltas, ref_delta)  # generation continues the last document
    assert not torch.equal(deltas, _hf_positions(model, alone[0], family, use_mask=False)[1])
    assert (positions[:, :, start:] == 0).all()  # padding


def test_placeholder_runs_and_grids_must_pair_up() -> None:
    batch = _batch("qwen2_5_vl", (((2, ("image", (1, 4, 4)), 2), 0),))
    rule = _rule("qwen2_5_vl")
    with pytest.raises(ValueError, match="shorter than its grid"):
        mrope_positions(batch["ids"], rule, torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="more image placeholder runs than image grids"):
        mrope_positions(batch["ids"], rule, None)
    with pytest.raises(ValueError, match="2 image grids for 1 image placeholder runs"):
        mrope_positions(batch["ids"], rule, torch.tensor([[1, 4, 4], [1, 2, 2]]))
    with pytest.raises(ValueError, match="divisible by spatial_merge_size=2"):
        mrope_positions(batch["ids"], rule, torch.tensor([[1, 4, 3]]))


def test_rule_reads_the_full_config(saved: dict) -> None:
    for family, (_, path) in saved.items():
        rule = MRopeRule.from_hf_config(json.loads((path / "config.json").read_text()))
        assert rule == MRopeRule(family, IMAGE, VIDEO, 2, 2 if family == "qwen2_5_vl" else 1)
    with pytest.raises(ValueError, match="model_type='llava' has no M-RoPE"):
        MRopeRule.from_hf_config({"model_type": "llava"})


# ---- rotary tables -----------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tables_and_rotation_equal_the_family_rotary_embedding(saved: dict, family: str
                                                                ) -> None:
    model, path = saved[family]
    batch = _batch(family)
    positions, _ = _ours_positions(batch, family, attention_mask=batch["mask"])
    ours = build_hf_language_model(path)
    cos, sin = ours.mrope(positions)
    x = torch.randn(3, positions.shape[2], HIDDEN)
    with torch.no_grad():
        ref_cos, ref_sin = model.model.language_model.rotary_emb(x, positions)
    half = ours.head_dim // 2
    for table, ref in ((cos, ref_cos), (sin, ref_sin)):
        assert torch.equal(table.squeeze(1), ref[..., :half])
        assert torch.equal(table.squeeze(1), ref[..., half:])
    q, k = torch.randn(2, 3, 4, positions.shape[2], ours.head_dim).unbind(0)
    ref_q, ref_k = sys.modules[type(model).__module__].apply_rotary_pos_emb(
        q, k, ref_cos, ref_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k, rtol=0, atol=1e-6)


# ---- the language model ------------------------------------------------------------------


def test_spec_reads_the_text_configs(saved: dict) -> None:
    for family, (_, path) in saved.items():
        config = json.loads((path / "config.json").read_text())
        spec = LlamaFamilySpec.from_hf_config(config)
        assert spec == LlamaFamilySpec.from_hf_config(config["text_config"])
        interleaved = family == "qwen3_vl"
        assert (spec.mrope_section, spec.mrope_interleaved) == (
            (4, 4, 4) if interleaved else (2, 3, 3), interleaved)
        assert spec.qk_norm == interleaved and spec.qkv_bias and spec.out_bias == interleaved
        assert spec.rope_scaling == {"rope_type": "default"}
    # An older Qwen2.5-VL hub config: flat text keys, legacy "mrope" rope_scaling.
    flat = {**TEXT, "model_type": "qwen2_5_vl", "rope_theta": 1e6, "head_dim": 99,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {"depth": 1}, "tie_word_embeddings": True}
    spec = LlamaFamilySpec.from_hf_config(flat)
    assert (spec.rope_theta, spec.head_dim, spec.mrope_section) == (1e6, 16, (2, 3, 3))
    assert spec.tie_word_embeddings and spec.model_kwargs()["mrope_section"] == (2, 3, 3)
    with pytest.raises(ValueError, match=r"mrope_section=\[2, 3, 4\] is invalid"):
        LanguageModel(**LlamaFamilySpec.from_hf_config(
            {**flat, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}
        ).model_kwargs())


def test_weight_maps_read_both_layouts(saved: dict) -> None:
    from mimotron.config.hf_folder import tensor_files

    for family, (model, path) in saved.items():
        spec = LlamaFamilySpec.from_hf_config(json.loads((path / "config.json").read_text()))
        weight_map = decoder_weight_map(path, spec)
        assert weight_map is (QWEN_VL_HUB_WEIGHTS if family == "qwen2_5_vl"
                              else QWEN_VL_WEIGHTS)
        ours = build_hf_language_model(path)
        names = {n for n in model.state_dict() if not n.startswith("model.visual.")}
        assert {QWEN_VL_WEIGHTS.to_hf(n) for n, _ in ours.named_parameters()} == names
        assert {weight_map.to_hf(n) for n, _ in ours.named_parameters()} == {
            n for n in tensor_files(path) if not weight_map.is_ignored(n)}


def _reference(model: torch.nn.Module, embeds: torch.Tensor, positions: torch.Tensor,
               **deepstack: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' text model + head: logits and every parameter's gradient."""
    model.zero_grad()
    out = model.model.language_model(inputs_embeds=embeds, position_ids=positions, **deepstack)
    logits = model.lm_head(out.last_hidden_state)
    _loss(logits).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.grad is not None and not n.startswith("model.visual.")}
    return logits.detach(), grads


def _loss(logits: torch.Tensor) -> torch.Tensor:
    """A sum over positions (so CP ranks' losses add up to the whole row's)."""
    weights = torch.linspace(-1, 1, logits.shape[-1])
    return (logits * weights).sum() + 0.01 * (logits ** 2).sum()


def _assert_grads(ours: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor]) -> None:
    """Every parameter the loss reaches (not the embedding: both get embeddings)."""
    ours = {n: g for n, g in ours.items() if g is not None}
    assert {QWEN_VL_WEIGHTS.to_hf(n) for n in ours} == set(ref)
    assert len(ref) > 10
    for name, grad in ours.items():
        assert_close_relative(grad, ref[QWEN_VL_WEIGHTS.to_hf(name)])


def _inputs(family: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """An unpadded batch (two rows with media), its embeddings and positions."""
    rows = (ROWS[0], ((1, ("image", (1, 2, 6)), 9, ("video", (2, 4, 2)), 3), 0))
    batch = _batch(family, rows, seed=3)  # the shorter row ends in PAD text tokens
    positions, _ = _ours_positions(batch, family)
    embeds = torch.randn(*batch["ids"].shape, HIDDEN, generator=torch.Generator().manual_seed(1))
    return batch, embeds, positions


@pytest.mark.parametrize("family", list(FAMILIES))
def test_language_model_equals_the_text_model(saved: dict, family: str) -> None:
    model, path = saved[family]
    _, embeds, positions = _inputs(family)
    ref_logits, ref_grads = _reference(model, embeds, positions)
    ours = build_hf_language_model(path)
    logits = ours(embeds, position_ids=positions)
    _loss(logits).backward()
    assert_close_relative(logits.detach(), ref_logits)
    _assert_grads({n: p.grad for n, p in ours.named_parameters()}, ref_grads)
    # 1-D positions would not do: the visual positions matter.
    with torch.no_grad():
        assert not torch.allclose(ours(embeds), ref_logits, atol=1e-3)


def _deepstack(batch: dict, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    mask = (batch["ids"] == IMAGE) | (batch["ids"] == VIDEO)
    gen = torch.Generator().manual_seed(2)
    return mask, [torch.randn(int(mask.sum()), HIDDEN, generator=gen) for _ in range(count)]


def test_deepstack_equals_qwen3_vl_over_two_pipeline_stages(saved: dict) -> None:
    model, path = saved["qwen3_vl"]
    batch, embeds, positions = _inputs("qwen3_vl")
    mask, features = _deepstack(batch, 2)
    ref_leaves = [f.clone().requires_grad_() for f in features]
    ref_logits, ref_grads = _reference(model, embeds, positions, visual_pos_masks=mask,
                                       deepstack_visual_embeds=ref_leaves)
    first = build_hf_language_model(path, layer_ids=[0], post_process=False)
    last = build_hf_language_model(path, layer_ids=[1], pre_process=False)
    leaves = [f.clone().requires_grad_() for f in features]
    sent = first(embeds, position_ids=positions, deepstack=leaves, visual_mask=mask)
    received = sent.detach().requires_grad_()
    logits = last(received, position_ids=positions, deepstack=leaves, visual_mask=mask)
    _loss(logits).backward()
    sent.backward(received.grad)
    assert_close_relative(logits.detach(), ref_logits)
    grads = {n: p.grad for stage in (first, last) for n, p in stage.named_parameters()}
    _assert_grads(grads, ref_grads)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert_close_relative(leaf.grad, ref_leaf.grad)
    # Each stage added only its own layer's features: without them the logits differ.
    with torch.no_grad():
        alone = last(first(embeds, position_ids=positions, deepstack=features[:1],
                           visual_mask=mask), position_ids=positions)
    assert not torch.allclose(alone, ref_logits, atol=1e-3)


def test_packed_row_equals_each_document_alone(saved: dict) -> None:
    model, path = saved["qwen3_vl"]
    docs = [((2, ("image", (1, 4, 2)), 3), 0), ((1, ("video", (2, 2, 4)), 4), 0)]
    alone = [_batch("qwen3_vl", (doc,), seed=s) for s, doc in enumerate(docs)]
    ids = torch.cat([a["ids"] for a in alone] + [torch.full((1, 2), PAD)], dim=1)
    lengths = [a["ids"].shape[1] for a in alone]
    doc_ids = torch.tensor([0] * lengths[0] + [1] * lengths[1] + [-1] * 2).view(1, -1)
    packed = {"ids": ids, "images": alone[0]["images"], "videos": alone[1]["videos"]}
    positions, _ = _ours_positions(packed, "qwen3_vl", doc_ids=doc_ids)
    embeds = torch.randn(1, ids.shape[1], HIDDEN)
    ours = build_hf_language_model(path)
    with torch.no_grad():
        logits = ours(embeds, Documents.from_doc_ids(doc_ids), positions)
    start = 0
    for part in alone:
        n = part["ids"].shape[1]
        ref_positions, _ = _hf_positions(model, part, "qwen3_vl", use_mask=False)
        with torch.no_grad():
            out = model.model.language_model(inputs_embeds=embeds[:, start:start + n],
                                             position_ids=ref_positions)
            ref = model.lm_head(out.last_hidden_state)
        assert_close_relative(logits[:, start:start + n], ref)
        start += n


def test_kv_cache_decodes_after_the_prompt_with_rope_deltas(saved: dict) -> None:
    _, path = saved["qwen2_5_vl"]
    batch, embeds, positions = _inputs("qwen2_5_vl")
    _, deltas = _ours_positions(batch, "qwen2_5_vl")
    seq = positions.shape[2]
    new = torch.randn(2, 2, HIDDEN)
    later = decode_positions(deltas, seq, 2)
    ours = build_hf_language_model(path)
    with torch.no_grad():
        whole = ours(torch.cat([embeds, new], dim=1),
                     position_ids=torch.cat([positions, later], dim=2))
        cache = KVCache(seq + 2)
        prompt = ours(embeds, position_ids=positions, cache=cache)
        steps = [ours(new[:, i:i + 1], position_ids=later[..., i:i + 1], cache=cache)
                 for i in range(2)]
    assert_close_relative(torch.cat([prompt, *steps], dim=1), whole)
    assert torch.equal(later[0, :, 0], seq + deltas[:, 0])


# ---- context parallelism -----------------------------------------------------------------


def _cp_rank(rank: int, world: int, path: str, embeds: torch.Tensor, positions: torch.Tensor,
             doc_ids: torch.Tensor, mask: torch.Tensor, features: list[torch.Tensor]) -> dict:
    model = build_hf_language_model(path)
    model.set_context_parallel(dist.group.WORLD)
    held = load_balanced_positions(embeds.shape[1], world, rank)
    logits = model(embeds[:, held], Documents.from_doc_ids(doc_ids), positions,
                   deepstack=features, visual_mask=mask)
    _loss(logits).backward()
    return {"logits": logits.detach(), "held": held,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_context_parallel_ranks_take_their_positions(saved: dict) -> None:
    model, path = saved["qwen3_vl"]
    rows = (((2, ("image", (1, 4, 2)), 3, ("image", (1, 2, 2)), 1), 0),
            ((1, ("video", (2, 2, 4)), 4), 0))
    batch = _batch("qwen3_vl", rows, seed=5)
    seq = batch["ids"].shape[1] + (-batch["ids"].shape[1]) % 4  # CP 2: a multiple of 4
    ids = torch.cat([batch["ids"], torch.full((2, seq - batch["ids"].shape[1]), PAD)], 1)
    doc_ids = torch.zeros_like(ids)
    doc_ids[0, 7:] = 1  # two documents in row 0
    doc_ids[:, batch["ids"].shape[1]:] = -1
    positions, _ = _ours_positions({**batch, "ids": ids}, "qwen3_vl", doc_ids=doc_ids)
    embeds = torch.randn(2, seq, HIDDEN)
    mask, features = _deepstack({"ids": ids}, 2)
    ours = build_hf_language_model(path)
    ref = ours(embeds, Documents.from_doc_ids(doc_ids), positions, deepstack=features,
               visual_mask=mask)
    _loss(ref).backward()
    results = run_ranks(2, _cp_rank, str(path), embeds, positions, doc_ids, mask, features,
                        timeout_s=120)
    for res in results:
        assert_close_relative(res["logits"], ref.detach()[:, res["held"]])
    reached = [(n, p.grad) for n, p in ours.named_parameters() if p.grad is not None]
    assert len(reached) > 10
    for name, grad in reached:  # each rank's share of the row's loss
        assert_close_relative(sum(res["grads"][name] for res in results), grad)


def _sp_rank(rank: int, world: int, path: str, embeds: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor, features: list[torch.Tensor]) -> torch.Tensor:
    from torch.distributed.device_mesh import DeviceMesh

    from mimotron.parallel.tensor_parallel import apply_tensor_parallel

    model = build_hf_language_model(path)
    apply_tensor_parallel(model, DeviceMesh.from_group(dist.group.WORLD, "cpu"), True,
                          sequence_parallel=True)
    with torch.no_grad():  # this rank's vocabulary shard of the logits
        return model(embeds, position_ids=positions, deepstack=features, visual_mask=mask)


def test_sequence_parallel_ranks_add_their_positions_features(saved: dict) -> None:
    _, path = saved["qwen3_vl"]
    batch, embeds, positions = _inputs("qwen3_vl")
    if embeds.shape[1] % 2:
        embeds, positions = embeds[:, :-1], positions[..., :-1]
        batch = {"ids": batch["ids"][:, :-1]}
    mask, features = _deepstack(batch, 2)
    with torch.no_grad():
        ref = build_hf_language_model(path)(embeds, position_ids=positions,
                                            deepstack=features, visual_mask=mask)
    shards = run_ranks(2, _sp_rank, str(path), embeds, positions, mask, features,
                       timeout_s=120)
    assert_close_relative(torch.cat(shards, dim=-1), ref)
