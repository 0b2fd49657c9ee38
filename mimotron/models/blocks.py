"""Transformer building blocks: RMSNorm, rotary embeddings, attention, SwiGLU, block.

Every block is written so that tensor parallelism can be applied from the outside with
DTensor plans (column-wise ``wq``/``wk``/``wv``/``w1``/``w3``, row-wise ``wo``/``w2``,
local outputs): nothing here stores a head count that a sharded layer would contradict.
Attention derives the number of *local* heads from the width its projections return,
so a column-sharded ``wq`` that returns ``hidden / tp`` features simply runs
``num_heads / tp`` heads, and the row-wise ``wo`` sums the partial outputs.

Linear layers whose output is added straight onto the residual stream (``wo``, ``w2``)
carry an ``init_std`` attribute scaled by the depth of the stack; see
:mod:`mimotron.models.init`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mimotron.config.schema import default_ffn_hidden_size
from mimotron.models.attention import AttentionSegments, attend
from mimotron.models.kv_cache import LayerCache, attend_cached
from mimotron.parallel.context_attention import gather_kv

# GPT-2's std, used for embeddings and (divided by sqrt(2 * num_layers)) for projections
# that write onto the residual stream, so a pre-norm stack starts near the identity.
INIT_STD = 0.02


def residual_init_std(num_layers: int) -> float:
    """Init std of projections that write onto the residual stream (GPT-2 scaling).

    Each of the ``2 * num_layers`` residual branches adds variance; dividing their std by
    ``sqrt(2 * num_layers)`` keeps the residual stream's variance independent of depth.

    Args:
        num_layers: total number of layers of the stack (not of one pipeline stage, so
            the value is layout independent).

    Returns:
        The standard deviation.
    """
    return INIT_STD / math.sqrt(2 * max(num_layers, 1))


def compute_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x``'s device run in: autocast's where it is on, else ``x``'s."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def to_residual_dtype(x: torch.Tensor, fp32_residual: bool = False) -> torch.Tensor:
    """Cast a stack's input to the residual stream's dtype.

    Under autocast the residual stream runs in the compute dtype (bf16/fp16), as
    Megatron's does with 16-bit parameters: the stream, the norms' saved inputs and the
    pipeline stage links then take 2 bytes per value instead of 4. ``fp32_residual``
    keeps it in fp32 (Megatron's ``fp32_residual_connection``). Without autocast (fp32
    training) this is the identity.
    """
    if fp32_residual:
        return x.float() if x.is_floating_point() else x
    return x.to(compute_dtype_of(x))


def linear_on_rows(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply ``linear`` to ``[..., in]`` as one ``[rows, in]`` matrix: ``[..., out]``.

    A DTensor (tensor-parallel) linear given a 3-D input flattens it, multiplies, and
    views the product back to 3-D inside the sharded op. With zero rows (an encoder's
    data-parallel slice that holds no sample of its modality) DTensor cannot place that
    view when the token count does not divide by the TP degree (a CLIP tower's 577
    positions at TP 8) and raises. Here the reshapes act on the plain tensors around the
    layer, so the sharded op only ever sees a matrix. For contiguous inputs both are views.

    Args:
        linear: a ``nn.Linear``, plain or parallelised with a column-/row-wise plan whose
            input and output are local tensors.
        x: ``[..., in]``, any number of leading dims (sizes may be 0).

    Returns:
        ``[..., out]`` (``out`` = this rank's output width under column-wise TP).
    """
    out = linear(x.flatten(0, -2))
    # An explicit width: view(..., -1) is ambiguous when there are no rows.
    return out.view(*x.shape[:-1], out.shape[-1])


# Elements per chunk of RMSNorm's backward (16 MiB of fp32 per temporary).
_NORM_CHUNK_ELEMENTS = 1 << 22


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that saves only its input and the per-token ``1 / rms`` for backward.

    Composed of plain ops, autograd would also keep the normalised tensor (for the
    weight's gradient) and an fp32 copy of a 16-bit input; fused norms (Apex, Transformer
    Engine) recompute both in backward instead, and so does this. All arithmetic is fp32.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,  # noqa: ANN001
                out_dtype: torch.dtype) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        x2, g2, r2 = x.reshape(-1, dim), grad.reshape(-1, dim), rstd.reshape(-1, 1)
        w = weight.float()
        grad_x = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(dim, dtype=torch.float32, device=x.device)
        # In chunks of rows: the fp32 temporaries then stay a few MiB, where whole they
        # would be several times the layer's hidden states (a fused kernel has none).
        rows = max(1, _NORM_CHUNK_ELEMENTS // dim)
        for lo in range(0, x2.shape[0], rows):
            normed = x2[lo:lo + rows].float() * r2[lo:lo + rows]
            # A copy: the incoming gradient may also flow elsewhere (the residual path).
            g = g2[lo:lo + rows].to(torch.float32, copy=True)
            if ctx.needs_input_grad[1]:
                grad_w += (g * normed).sum(0)
            if grad_x is not None:
                gn = g.mul_(w)
                # d/dx of x * r(x): r * (gn - normed * mean(gn * normed)) over the last dim.
                dot = (gn * normed).mean(-1, keepdim=True)
                grad_x[lo:lo + rows] = gn.sub_(normed.mul_(dot)).mul_(r2[lo:lo + rows])
        grad_weight = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return (None if grad_x is None else grad_x.view_as(x)), grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, computed in fp32.

    Args:
        x: the input, any float dtype.
        weight: the learned scale, ``[x.shape[-1]]``.
        eps: added to the mean square.
        out_dtype: the result's dtype (``None``: ``x``'s).

    Returns:
        The normalised tensor; backward recomputes what it needs from ``x``.
    """
    return _RMSNormFunction.apply(x, weight, eps, out_dtype or x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias.

    The output is in the compute dtype (:func:`compute_dtype_of`): under autocast the
    q/k/v (w1/w3) projections that read it then share one 16-bit tensor instead of each
    casting its own copy.

    Args:
        dim: size of the normalised last dimension.
        eps: added to the mean square for numerical safety.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension (fp32 arithmetic, compute-dtype result)."""
        return rms_norm(x, self.weight, self.eps, compute_dtype_of(x))


def default_inv_freq(head_dim: int, base: float = 10000.0,
                     device: torch.device | None = None) -> torch.Tensor:
    """The toy model's RoPE inverse frequencies ``base ** -(2i / head_dim)``, fp32
    ``[head_dim // 2]`` (a Hugging Face decoder's come from
    :func:`~mimotron.models.rope_scaling.rope_inv_freq`)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return base**-exponents


def rope_cache(
    seq_len: int,
    head_dim: int,
    base: float = 10000.0,
    device: torch.device | None = None,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of rotary position embeddings.

    Args:
        seq_len: number of positions.
        head_dim: per-head width; must be even.
        base: frequency base (ignored when ``inv_freq`` is given).
        device: where the tables live.
        inv_freq: ``[head_dim // 2]`` fp32 inverse frequencies to use instead of
            ``base ** -(2i / head_dim)`` (scaled RoPE, see
            :mod:`mimotron.models.rope_scaling`).

    Returns:
        ``(cos, sin)``, each ``[seq_len, head_dim // 2]`` in fp32.

    Raises:
        ValueError: if ``head_dim`` is odd or ``inv_freq`` has the wrong length.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    if inv_freq is None:
        inv_freq = default_inv_freq(head_dim, base, device)
    elif inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"inv_freq has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},)"
        )
    else:
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., :d/2], x[..., d/2:])`` of ``x`` by position-dependent angles.

    Args:
        x: ``[..., head_dim]``, e.g. ``[batch, num_heads, seq, head_dim]``.
        cos: ``[seq, head_dim // 2]`` from :func:`rope_cache`, or any shape that
            broadcasts against ``x[..., :head_dim // 2]`` (``[seq, 1, head_dim // 2]`` for
            ``[batch, seq, heads, head_dim]``).
        sin: like ``cos``.

    Returns:
        The rotated tensor, same shape and dtype as ``x``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    # Rotation in the plane of each (x1_i, x2_i) pair; the half-split layout (as in
    # GPT-NeoX / Llama in HF) needs no interleaving reshapes.
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


def _seq_major(table: torch.Tensor) -> torch.Tensor:
    """A RoPE table for ``[batch, seq, heads, head_dim]`` tensors.

    ``[seq, d/2]`` becomes ``[seq, 1, d/2]``; a per-row ``[batch, 1, seq, d/2]`` (packed
    rows, context parallelism) becomes ``[batch, seq, 1, d/2]``.
    """
    return table.unsqueeze(-2) if table.dim() == 2 else table.transpose(-3, -2)


class Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v/o projections.

    The defaults are the toy model's attention (as many key/value heads as query heads,
    ``head_dim = hidden / heads``, no biases, no q/k norm). The keyword options give the
    Llama / Qwen2 / Qwen3 variants: grouped-query attention (``num_kv_heads`` key/value
    heads, each shared by ``num_heads / num_kv_heads`` consecutive query heads, as
    ``transformers``' ``repeat_kv``), an explicit ``head_dim``, q/k/v and output biases,
    and a per-head RMSNorm of queries and keys before RoPE (Qwen3).

    Args:
        hidden_size: model width.
        num_heads: total number of query heads.
        causal: mask future positions (decoder) or not (encoder).
        num_layers: depth of the whole stack; scales the init of ``wo``.
        num_kv_heads: total key/value heads (``None`` = ``num_heads``); must divide
            ``num_heads``.
        head_dim: per-head width (``None`` = ``hidden_size / num_heads``).
        qkv_bias: biases on ``wq``, ``wk``, ``wv``.
        out_bias: bias on ``wo``.
        qk_norm: RMSNorm over ``head_dim`` of every query and key head (``q_norm``,
            ``k_norm``).
        norm_eps: epsilon of the q/k norms.

    Raises:
        ValueError: on a head layout that does not fit (named in the message).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        causal: bool,
        num_layers: int = 1,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_heads < 1 or (head_dim is None and hidden_size % num_heads):
            raise ValueError(
                f"num_heads={num_heads} is invalid: expected a divisor of hidden_size={hidden_size}"
            )
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if kv_heads < 1 or num_heads % kv_heads:
            raise ValueError(
                f"num_kv_heads={kv_heads} is invalid: expected a divisor of num_heads={num_heads}"
            )
        if head_dim is not None and head_dim < 1:
            raise ValueError(f"head_dim={head_dim} is invalid: expected >= 1")
        self.head_dim = head_dim or hidden_size // num_heads
        # Totals of the whole layer (validation and TP plans only): forward derives the
        # local head counts from its projections' widths.
        self.num_heads = num_heads
        self.num_kv_heads = kv_heads
        self.causal = causal
        q_width, kv_width = num_heads * self.head_dim, kv_heads * self.head_dim
        self.wq = nn.Linear(hidden_size, q_width, bias=qkv_bias)
        self.wk = nn.Linear(hidden_size, kv_width, bias=qkv_bias)
        self.wv = nn.Linear(hidden_size, kv_width, bias=qkv_bias)
        self.wo = nn.Linear(q_width, hidden_size, bias=out_bias)
        self.wo.init_std = residual_init_std(num_layers)
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        # Context parallelism (set by LanguageModel.set_context_parallel): x holds this
        # rank's positions only; keys/values are all-gathered over this group and the
        # caller's attention plan reads them by global position (mimotron.models.attention).
        self.context_parallel_group: dist.ProcessGroup | None = None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        plan: AttentionSegments | None = None, cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Attend over the sequence.

        Args:
            x: ``[batch, seq, hidden]``.
            rope: ``(cos, sin)`` for the sequence, or ``None`` for no rotary embedding.
            plan: packed documents or context-parallel chunks: which keys each query
                reads (:func:`~mimotron.models.attention.attention_segments`; required under
                context parallelism); ``None`` = plain causal (or bidirectional)
                attention over the row.
            cache: incremental decoding only (:mod:`mimotron.models.kv_cache`): ``x``
                holds the positions after the cached ones (``rope`` at those
                positions), which attend causally to every cached key; training passes
                ``None``.

        Returns:
            ``[batch, seq, hidden]``.
        """
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Local heads from the projections' widths: under column-wise TP these are
        # num_heads / tp and num_kv_heads / tp, and nothing else here needs to know.
        num_q = q.shape[-1] // self.head_dim
        num_kv = k.shape[-1] // self.head_dim
        q = q.view(batch, seq, num_q, self.head_dim)
        k, v = (t.view(batch, seq, num_kv, self.head_dim) for t in (k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is None:
            out = self.core(q, k, v, rope, plan)
        else:
            out = self.cached_core(q, k, v, rope, cache)
        return self.wo(out.reshape(batch, seq, num_q * self.head_dim))

    def cached_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None, cache: LayerCache,
    ) -> torch.Tensor:
        """:meth:`core` of incremental decoding: RoPE, append to the cache, attend to it.

        One process only (no context parallelism, no plan); see
        :mod:`mimotron.models.kv_cache`.
        """
        assert self.context_parallel_group is None, "a KV cache under context parallelism"
        assert self.causal, "a KV cache in bidirectional attention"
        if rope is not None:
            cos, sin = (_seq_major(t) for t in rope)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.append(k, v)
        return attend_cached(q, k, v)

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        plan: AttentionSegments | None = None,
    ) -> torch.Tensor:
        """The attention core between the projections and ``wo``: RoPE, the
        context-parallel key/value gather and the kernel (:func:`~mimotron.models.
        attention.attend`).

        It holds no parameters, which is what lets selective recompute
        (:mod:`mimotron.models.recompute`) run it again in backward from its inputs.

        Args:
            q: ``[batch, seq, local heads, head_dim]`` queries (after the q norm, if any).
            k: ``[batch, seq, local kv heads, head_dim]`` keys (after the k norm).
            v: like ``k``, values.
            rope: ``(cos, sin)`` as in :meth:`forward`, or ``None``.
            plan: as in :meth:`forward`.

        Returns:
            ``[batch, seq, local heads, head_dim]`` (without a plan, a transposed view of
            SDPA's output).
        """
        if rope is not None:
            # Rotated in [batch, seq, heads, head_dim] order: SDPA's output then comes
            # back in that order too, so the heads merge for wo is a view of the tensor
            # attention saved, not a second copy.
            cos, sin = (_seq_major(t) for t in rope)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context_parallel_group is not None:
            if plan is None:
                raise ValueError("context-parallel attention needs an attention plan over "
                                 "global positions (attention_segments); got plan=None")
            # After RoPE (keys carry their global positions): gathers the fewer
            # key/value heads of grouped-query attention.
            k, v = gather_kv(k, v, self.context_parallel_group, dim=1)
        # Grouped-query attention without expanding K/V: query head h reads key/value
        # head h // (num_q / num_kv); contiguous TP shards of q and of k/v hold matching
        # groups because tp divides num_kv_heads.
        return attend(q, k, v, plan, causal=self.causal)


class SwiGLU(nn.Module):
    """Gated feed-forward ``w2(silu(w1 x) * w3 x)``.

    Args:
        hidden_size: model width.
        ffn_hidden_size: inner width; 0 picks :func:`default_ffn_hidden_size`.
        num_layers: depth of the whole stack; scales the init of ``w2``.
        bias: biases on all three projections (Llama's ``mlp_bias``).
    """

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int = 0, num_layers: int = 1, bias: bool = False
    ) -> None:
        super().__init__()
        inner = ffn_hidden_size or default_ffn_hidden_size(hidden_size)
        self.w1 = nn.Linear(hidden_size, inner, bias=bias)  # gate
        self.w3 = nn.Linear(hidden_size, inner, bias=bias)  # up
        self.w2 = nn.Linear(inner, hidden_size, bias=bias)  # down
        self.w2.init_std = residual_init_std(num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``[..., hidden]``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Args:
        hidden: model width.
        num_heads: attention heads.
        ffn_hidden: SwiGLU inner width (0 = default).
        causal: causal attention (decoder) or bidirectional (encoder).
        num_layers: depth of the whole stack the block belongs to (init scaling only).
        num_kv_heads: key/value heads (``None`` = ``num_heads``), see :class:`Attention`.
        head_dim: per-head width (``None`` = ``hidden / num_heads``).
        qkv_bias: biases on the q/k/v projections.
        out_bias: bias on the attention output projection.
        qk_norm: per-head RMSNorm of queries and keys.
        mlp_bias: biases on the SwiGLU projections.
        norm_eps: epsilon of every RMSNorm in the layer.
        mlp: a feed-forward module to use instead of the SwiGLU (an MoE block,
            :class:`~mimotron.models.moe.MoEFeedForward`); ``None`` = the SwiGLU.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        ffn_hidden: int,
        causal: bool,
        num_layers: int = 1,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        mlp_bias: bool = False,
        norm_eps: float = 1e-6,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden, norm_eps)
        self.attn = Attention(
            hidden,
            num_heads,
            causal,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            qk_norm=qk_norm,
            norm_eps=norm_eps,
        )
        self.mlp_norm = RMSNorm(hidden, norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(hidden, ffn_hidden, num_layers=num_layers,
                                                      bias=mlp_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        plan: AttentionSegments | None = None, cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Run the layer on ``[batch, seq, hidden]``; ``rope``/``plan``/``cache`` as in
        :class:`Attention`."""
        if cache is None:
            # Training: three arguments, the input sequence parallelism's
            # PrepareModuleInput on ``attn`` lays out (mimotron.parallel.sequence_parallel).
            x = x + self.attn(self.attn_norm(x), rope, plan)
        else:
            x = x + self.attn(self.attn_norm(x), rope, plan, cache)
        return x + self.mlp(self.mlp_norm(x))


def make_layers(
    layer_ids: list[int] | None,
    num_layers: int,
    build: type[nn.Module] | None = None,
    mlp_factory: Callable[[int], nn.Module | None] | None = None,
    **block_kwargs: int | float | bool | None,
) -> nn.ModuleDict:
    """Build the layers one pipeline stage holds, keyed by their *global* index.

    Keying by global index keeps parameter names (``layers.7.attn.wq.weight``) the same
    whatever the pipeline split, which is what makes init and checkpoints layout
    independent.

    Args:
        layer_ids: global indices to build; ``None`` = all of ``range(num_layers)``.
        num_layers: layers in the whole stack.
        build: block class (default :class:`TransformerBlock`).
        mlp_factory: global layer index -> the layer's feed-forward module, or ``None``
            for the block's own (how MoE layers are placed, ``moe_layer_freq``).
        **block_kwargs: passed to the block constructor, plus ``num_layers``.

    Returns:
        A ``ModuleDict`` from ``str(global_index)`` to block, in ascending index order.

    Raises:
        ValueError: on an index outside ``[0, num_layers)`` or a repeated index.
    """
    ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"layer_ids={ids} is invalid: expected distinct indices in [0, {num_layers})"
        )
    cls = build or TransformerBlock
    layers = {}
    for i in sorted(ids):
        mlp = mlp_factory(i) if mlp_factory is not None else None
        extra = {} if mlp is None else {"mlp": mlp}
        layers[str(i)] = cls(**block_kwargs, **extra, num_layers=num_layers)
    return nn.ModuleDict(layers)


def chunk_modules(layers: nn.ModuleDict, layer_chunks: list[list[int]] | None,
                  chunk: int | None) -> list[nn.Module]:
    """The layers of model chunk ``chunk`` (interleaved pipelines), or all of them.

    Args:
        layers: a stage's layers keyed by global index (:func:`make_layers`).
        layer_chunks: global indices of each chunk the stage holds, or ``None``.
        chunk: which chunk to run; ``None`` = every layer in order.
    """
    if chunk is None:
        return list(layers.values())
    assert layer_chunks is not None, "chunk given to a module without layer_chunks"
    return [layers[str(i)] for i in layer_chunks[chunk]]


def is_last_chunk(layer_chunks: list[list[int]] | None, chunk: int | None) -> bool:
    """Whether ``chunk`` is the last model chunk held (``None``: the whole stage is)."""
    return chunk is None or chunk == len(layer_chunks or []) - 1
