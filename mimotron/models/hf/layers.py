"""Pre-LayerNorm encoder layers with biases, as in CLIP, SigLIP and the Whisper encoder.

Names follow :mod:`mimotron.models.blocks` (``attn.wq/wk/wv/wo``, ``mlp.w1/w2``,
``attn_norm``, ``mlp_norm``) so the tensor-parallel plan shards them like the toy blocks:
``wq/wk/wv/w1`` column-wise (their biases sharded with them), ``wo/w2`` row-wise (their
biases whole, added once). Attention derives the local head count from the width its
projections return, so nothing here contradicts a sharded layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mimotron.config.hf_specs import ACTIVATION_NAMES, check_activation
from mimotron.models.blocks import compute_dtype_of, linear_on_rows, residual_init_std


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, written out so results match it exactly.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
}
# The config checks accept the names in specs (no torch.nn there); both lists must agree.
assert set(ACTIVATIONS) == set(ACTIVATION_NAMES), (sorted(ACTIVATIONS), ACTIVATION_NAMES)


class BiasedAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased q/k/v/o projections.

    Args:
        hidden_size: model width.
        num_heads: heads; must divide ``hidden_size``.
        num_layers: depth of the whole stack (scales the init of ``wo``).
        key_bias: whether ``wk`` has a bias (Whisper's has none).

    Raises:
        ValueError: if ``num_heads`` does not divide ``hidden_size``.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_layers: int = 1, key_bias: bool = True
    ) -> None:
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads:
            raise ValueError(
                f"num_heads={num_heads} is invalid: expected a divisor of hidden_size={hidden_size}"
            )
        self.head_dim = hidden_size // num_heads
        # Total head counts, as ``blocks.Attention`` states them: the TP check reads them
        # (encoders have no grouped-query attention, so key/value heads = query heads).
        self.num_heads = self.num_kv_heads = num_heads
        self.wq = nn.Linear(hidden_size, hidden_size)
        self.wk = nn.Linear(hidden_size, hidden_size, bias=key_bias)
        self.wv = nn.Linear(hidden_size, hidden_size)
        self.wo = nn.Linear(hidden_size, hidden_size)
        self.wo.init_std = residual_init_std(num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden] -> [batch, seq, hidden]``."""
        batch, seq = x.shape[0], x.shape[1]
        # As matrices: a sharded linear cannot view zero rows back (linear_on_rows).
        q, k, v = (linear_on_rows(w, x) for w in (self.wq, self.wk, self.wv))
        # Under column-wise TP the projections return num_heads / tp heads.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = self.core(q, k, v)
        return linear_on_rows(self.wo,
                              out.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core between the projections and ``wo``: SDPA over
        ``[batch, local heads, seq, head_dim]`` inputs, output alike. No parameters, so
        selective recompute (:mod:`mimotron.models.recompute`) can run it again."""
        return F.scaled_dot_product_attention(q, k, v)


class FeedForward(nn.Module):
    """Two-layer MLP ``w2(act(w1 x))`` with biases (CLIP's ``fc1``/``fc2``).

    Args:
        hidden_size: model width.
        ffn_hidden_size: inner width.
        activation: a key of :data:`ACTIVATIONS`.
        num_layers: depth of the whole stack (scales the init of ``w2``).
    """

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, activation: str, num_layers: int = 1
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[check_activation("activation", activation)]
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size)
        self.w2.init_std = residual_init_std(num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``[..., hidden]``."""
        return linear_on_rows(self.w2, self.act(linear_on_rows(self.w1, x)))


class CastLayerNorm(nn.LayerNorm):
    """LayerNorm on the residual stream's own dtype, output in the compute dtype.

    Under autocast ``layer_norm`` would upcast a 16-bit input to fp32 (and keep that copy
    for backward) and return fp32, which each following linear casts back on its own.
    Here the norm runs on the input as it is (fp32 statistics inside the kernel, fp32
    weights) and its output is cast once to the compute dtype (bf16 under autocast), a
    tensor the q/k/v projections (or ``fc1``) then share. Identical to ``nn.LayerNorm``
    in fp32. The parameter names are ``nn.LayerNorm``'s, so checkpoints map as before.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over the last dimension(s); compute-dtype result."""
        out_dtype = compute_dtype_of(x)
        device_type = x.device.type
        if torch.amp.is_autocast_available(device_type):
            with torch.autocast(device_type, enabled=False):
                y = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        else:
            y = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return y.to(out_dtype)


class PreLNEncoderLayer(nn.Module):
    """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, LayerNorms with biases.

    Args:
        hidden: model width.
        num_heads: attention heads.
        ffn_hidden: MLP inner width.
        activation: MLP activation (a key of :data:`ACTIVATIONS`).
        eps: LayerNorm epsilon.
        key_bias: whether the key projection has a bias.
        clamp_fp16: clamp fp16 outputs to the finite range (as Whisper's layer does).
        num_layers: depth of the whole stack (init scaling only).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        ffn_hidden: int,
        activation: str,
        eps: float,
        key_bias: bool = True,
        clamp_fp16: bool = False,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        self.clamp_fp16 = clamp_fp16
        self.attn_norm = CastLayerNorm(hidden, eps=eps)
        self.attn = BiasedAttention(hidden, num_heads, num_layers, key_bias=key_bias)
        self.mlp_norm = CastLayerNorm(hidden, eps=eps)
        self.mlp = FeedForward(hidden, ffn_hidden, activation, num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the layer on ``[batch, seq, hidden]``."""
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        if self.clamp_fp16 and x.dtype == torch.float16:
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-limit, limit)
        return x
