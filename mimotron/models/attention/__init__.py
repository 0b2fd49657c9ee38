"""The language model's attention backend: which kernel runs, over which documents.

One place decides how causal attention is computed, for every model family:

* an unpacked row without context parallelism: ``scaled_dot_product_attention`` with
  ``is_causal=True`` (the flash kernel on a GPU, the CPU's own flash kernel);
* packed documents and context-parallel chunks: an attention *plan* of segments
  (:mod:`~mimotron.models.attention.documents`), each a run of queries of one document
  attending to its document's keys up to the run's end, run by a variable-length
  kernel (:mod:`~mimotron.models.attention.kernels`). No ``[S, S]`` mask exists.
"""

from mimotron.models.attention.documents import (
    AttentionSegments,
    Documents,
    attention_segments,
    document_args,
)
from mimotron.models.attention.kernels import attend, attention_kernel

__all__ = ["AttentionSegments", "Documents", "attend", "attention_kernel", "document_args",
           "attention_segments"]
