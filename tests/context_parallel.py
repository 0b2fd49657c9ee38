"""Context-parallel runs for the tests: the engine recording what CP did, and its checks.

:func:`cp_engine_run` is ``tests.common.engine_run`` that also records attention's local
keys, the rows the encoders sent, and whether a custom forward step was refused;
:func:`check_cp_run` compares it with the plain loop and checks those records.
:func:`attention_rows` runs one attention layer under CP against whole-row attention with
a dense mask written here.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mimotron.models.blocks as blocks_module
from mimotron.config import load_config
from mimotron.models.attention import Documents, attention_segments
from mimotron.models.blocks import Attention, apply_rope, rope_cache
from mimotron.models.mimo import MimoModel
from mimotron.parallel.context_parallel import load_balanced_positions
from mimotron.parallel.layout import check_layout
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import default_forward_step
from tests import common as common_module
from tests.common import BASE, DIGITS, engine_run
from tests.parity import assert_matches_reference, checked_modules
from tests.reference import ReferenceRun

SEQ = 64  # data.seq_length of configs/digits.toml
HIDDEN = 64  # modules.language.hidden_size in tests.common.SMALL_MODEL


def cp_engine_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """:func:`engine_run`, also recording attention's local keys, encoder rows and sends."""
    local_keys: list[int] = []
    encoded_rows: list[int] = []
    sends: list[tuple[int, tuple[int, ...]]] = []
    gather, exchange = blocks_module.gather_kv, common_module.exchange
    encode = MimoModel.encode

    def recording_encode(self, name, batch):  # noqa: ANN001, ANN202
        out = encode(self, name, batch)
        encoded_rows.append(out.shape[0] * out.shape[1])
        return out

    def recording_gather(k, v, group, dim):  # noqa: ANN001, ANN202
        local_keys.append(k.shape[dim])
        return gather(k, v, group, dim)

    def recording_exchange(out: list, *args: object) -> list:
        sends.extend((peer, tuple(t.shape)) for peer, t in out)
        return exchange(out, *args)

    # This forked rank only. engine_run installs its own counting wrapper around
    # tests.common.exchange, so ours goes below it.
    rejections: list[str] = []
    train_step = common_module.train_step

    def custom_step_first(run):  # noqa: ANN001, ANN202
        if not rejections:  # A custom forward step is refused before any collective.
            try:
                train_step_mimo(_custom_forward_step, run.train_data_iterator, run.model,
                                run.optimizer, run.schedulers, run.global_state,
                                run.communicator, infra=run.infra)
                rejections.append("accepted")
            except ValueError as exc:
                rejections.append(str(exc))
        return train_step(run)

    blocks_module.gather_kv = recording_gather
    common_module.exchange = recording_exchange
    common_module.train_step = custom_step_first
    MimoModel.encode = recording_encode
    result = engine_run(rank, world, overrides, num_iters)
    return {**result, "local_keys": local_keys, "sends": sends, "encoded_rows": encoded_rows,
            "rejections": rejections}


def _custom_forward_step(model, batch, embeddings):  # noqa: ANN001, ANN202
    """The built-in step plus an auxiliary metric: its sum would be CP rank 0's only."""
    loss_sum, num_tokens, metrics = default_forward_step(model, batch, embeddings)
    return loss_sum, num_tokens, {**metrics, "lm_loss": torch.stack([loss_sum.detach(),
                                                                      num_tokens])}


def _check_bridge_rows(results: list[dict], overrides: list[str]) -> None:
    """Each encoder leader sent every output row exactly once, split over the CP ranks.

    The pieces are ``[n, H]`` rows (not ``[N, T, H]`` blocks), several CP ranks receive rows,
    and the rows sent add up to the rows encoded (the language side's merge checks that
    each CP rank got exactly the rows of its own placeholders).
    """
    layout = check_layout(load_config(DIGITS, BASE + overrides))
    language = layout.modules["language"]
    first_stage = {language.rank_at(tp=0, cp=r, dp=d, pp=0)
                   for r in range(language.parallel.context)
                   for d in range(language.parallel.data)}
    received = dict.fromkeys(first_stage, 0)
    for rank, res in enumerate(results):
        if layout.roles(rank)[0].module == "language":
            continue
        sent = 0
        for peer, shape in res["sends"]:
            if peer in first_stage:
                assert len(shape) == 2 and shape[-1] == HIDDEN, shape
                received[peer] += shape[0]
                sent += shape[0]
        assert sent == sum(res["encoded_rows"]) > 0, f"rank {rank}"
    # Rows go to several CP ranks (at CP 4 a rank whose chunks hold no placeholder
    # receives none: the demo's media placeholders come first in a sample).
    assert sum(n > 0 for n in received.values()) >= 2, received


def check_cp_run(results: list[dict], ref: ReferenceRun, overrides: list[str]) -> None:
    """The plain loop's numbers (:func:`tests.parity.assert_matches_reference`); every rank
    refused a custom forward step naming the CP field; attention held ``S / c`` positions;
    the encoder leaders' rows went to the CP ranks (:func:`_check_bridge_rows`)."""
    assert_matches_reference(results, ref, checked_modules(overrides))
    context = load_config(DIGITS, BASE + overrides).modules["language"].parallel.context
    for res in results:  # every rank refused the custom forward step, naming the field
        assert res["rejections"] == [res["rejections"][0]], res["rejections"]
        assert "forward_step_func" in res["rejections"][0], res["rejections"][0]
        assert f"modules.language.parallel.context={context}" in res["rejections"][0]
    keys = {k for res in results for k in res["local_keys"]}
    assert keys == {SEQ // context}, keys  # every attention held S / c positions
    _check_bridge_rows(results, overrides)


def _dense_core(doc_ids: torch.Tensor | None):
    """An attention core over whole rows with the mask written out here: causal, and
    within one document for packed rows (RoPE by the model's own function)."""
    def core(q, k, v, rope=None, plan=None):
        cos, sin = (t[:, None, :] for t in rope)  # [S, 1, d/2] for [B, S, h, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        seq = q.shape[1]
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        group = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = allowed if allowed.dim() == 2 else allowed[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    return core


def attention_rows(rank: int, world: int, packed: bool) -> dict:
    """CP attention on this rank's positions (the engine's plan and kernel) vs attention
    over the whole rows with a dense mask written in the test (same weights and input)."""
    torch.manual_seed(0)
    seq, hidden = 16, 32
    attn = Attention(hidden, num_heads=4, causal=True, num_kv_heads=2)
    x = torch.randn(2, seq, hidden)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    cos, sin = rope_cache(seq, attn.head_dim)
    full_x = x.clone().requires_grad_(True)
    with mock.patch.object(attn, "core", _dense_core(doc_ids if packed else None)):
        full = attn(full_x, (cos, sin))
    full.square().sum().backward()
    pos = load_balanced_positions(seq, world, rank)
    attn.context_parallel_group = dist.group.WORLD
    local_x = x[:, pos].clone().requires_grad_(True)
    docs = Documents.from_doc_ids(doc_ids) if packed else Documents.whole(2, seq)
    local = attn(local_x, (cos[pos], sin[pos]), attention_segments(docs, x.device, world, rank))
    local.square().sum().backward()
    return {"out_err": float((local - full[:, pos]).abs().max()),
            "grad_err": float((local_x.grad - full_x.grad[:, pos]).abs().max()),
            "scale": float(full.abs().max())}
