"""The key/value cache of incremental decoding, and the attention that reads it.

Generation (:mod:`mimotron.generate`) runs the prompt through the language model once and
then one new token per step. Without a cache every step would recompute the keys and
values of every earlier position; with one, each attention layer stores the rotated keys
and the values of the positions it has seen, and a step computes only its own.

The cache is an optional argument of :meth:`LanguageModel.forward
<mimotron.models.language.LanguageModel.forward>`: training never passes one, so its
path (kernels, plans, context and sequence parallelism) is untouched. A cached forward
runs on one process: no tensor, sequence or context parallelism, no packed rows.

**Positions.** A cached forward of ``n`` positions holds positions ``[start, start + n)``
with ``start`` = :attr:`KVCache.length`: RoPE rotates them at those positions, each
layer appends their keys and values, and query ``start + i`` reads keys ``0 ..
start + i`` (causal, aligned at the lower right). The model advances the cache once,
after its last layer, so every layer sees the same ``start``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimotron.models.attention import attend


class KVCache:
    """Rotated keys and values of every attention layer, for ``max_len`` positions.

    Storage is allocated per layer on its first :meth:`append` (the layer's batch size,
    head count, dtype and device), ``[batch, max_len, kv heads, head_dim]``.

    Args:
        max_len: the most positions the cache can hold (prompt and generated tokens).

    Raises:
        ValueError: ``max_len`` below 1.
    """

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"max_len={max_len!r} is invalid: expected an integer >= 1")
        self.max_len = max_len
        self.length = 0
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}

    def layer(self, key: str) -> LayerCache:
        """The view one attention layer reads and appends through."""
        return LayerCache(self, key)

    def append(self, key: str, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``key``'s keys/values of the new positions; all its keys and values.

        Args:
            key: the layer (its global index).
            k: ``[batch, n, kv heads, head_dim]`` rotated keys of positions
                ``[length, length + n)``.
            v: like ``k``, the values.

        Returns:
            ``(keys, values)`` of positions ``[0, length + n)``, views of the storage.

        Raises:
            ValueError: the new positions do not fit in ``max_len``, or their shape differs
                from what the layer stored before.
        """
        start, n = self.length, k.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions: {start} cached "
                             f"plus {n} new do not fit")
        if key not in self._keys:
            shape = (k.shape[0], self.max_len, *k.shape[2:])
            self._keys[key] = k.new_empty(shape)
            self._values[key] = v.new_empty(shape)
        keys, values = self._keys[key], self._values[key]
        if (keys.shape[0], *keys.shape[2:]) != (k.shape[0], *k.shape[2:]):
            raise ValueError(f"layer {key}: keys of shape {tuple(k.shape)} do not match the "
                             f"cached [{keys.shape[0]}, S, {', '.join(map(str, keys.shape[2:]))}]")
        keys[:, start:start + n] = k
        values[:, start:start + n] = v
        return keys[:, :start + n], values[:, :start + n]

    def advance(self, n: int) -> None:
        """Count ``n`` more cached positions (after every layer appended them)."""
        assert self.length + n <= self.max_len, "advance past the cache's end"
        self.length += n


class LayerCache:
    """One attention layer's view of a :class:`KVCache` (what ``Attention`` is given).

    Args:
        cache: the model's cache.
        key: the layer's global index.
    """

    def __init__(self, cache: KVCache, key: str) -> None:
        self.cache = cache
        self.key = key

    @property
    def start(self) -> int:
        """Position of the first new query (the positions cached before this forward)."""
        return self.cache.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`KVCache.append`."""
        return self.cache.append(self.key, k, v)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the newest ``n`` positions over all ``m`` cached ones.

    Query ``i`` (position ``m - n + i``) reads keys ``0 .. m - n + i``. With nothing
    cached before (``n == m``, the prompt) this is the training kernel's causal
    attention; one new query reads every key (no mask); several new queries over a
    non-empty cache get a lower-right causal mask of ``n x m`` (a chunk of a prompt).

    Args:
        q: ``[batch, n, heads, head_dim]`` queries (after RoPE).
        k: ``[batch, m, kv heads, head_dim]`` every cached key (after RoPE), ``m >= n``.
        v: like ``k``, the values.

    Returns:
        ``[batch, n, heads, head_dim]``.
    """
    n, m = q.shape[1], k.shape[1]
    assert m >= n, "fewer keys than queries"
    if n == m:
        return attend(q, k, v, None, causal=True)
    mask = None if n == 1 else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)
