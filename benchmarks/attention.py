"""Attention of packed rows: memory kept and time, per sequence length, against a dense mask.

``python benchmarks/attention.py [--seq 1024 2048 ...] [--heads H --head-dim D]
[--doc-tokens N] [--reps R] [--fake]``

Rows of ``--seq`` tokens packed with documents of ``--doc-tokens`` tokens on average
(lengths drawn with a fixed seed), queries/keys/values of ``H`` heads of ``D`` (fp32, the
CPU). Two ways to attend causally within documents:

* **plan**: mimotron's attention backend (:func:`mimotron.models.attention.attend`
  over :func:`~mimotron.models.attention.attention_segments`'s segments; on the CPU one SDPA
  per document);
* **dense**: what packing did before, ``scaled_dot_product_attention`` with a bool
  ``[B, 1, S, S]`` block-diagonal causal mask.

Printed per length: the bytes autograd keeps for backward (distinct saved storages,
:func:`mimotron.dryrun.saved_bytes.saved_bytes`) and the largest tensor made, for each;
and the median forward + backward wall time over ``--reps``. ``--fake`` adds the
plan's kept bytes at the Llama-2-7B shape (32 heads of 128, bf16) on the fake
accelerator (the variable-length kernel) next to ``mimotron plan``'s attention term,
for 32k and 128k tokens, packed and under context parallelism 8.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mimotron.config import load_config  # noqa: E402
from mimotron.dryrun.saved_bytes import saved_bytes  # noqa: E402
from mimotron.estimate.activation_terms import attention_bytes_per_sample  # noqa: E402
from mimotron.models.attention import Documents, attend, attention_segments  # noqa: E402

LLAVA_7B = ROOT / "configs" / "llava15_7b_8gpu.toml"


def doc_ids(seq: int, mean: int, seed: int = 0) -> torch.Tensor:
    """``[1, seq]`` document ids: lengths uniform in ``[mean / 2, 3 mean / 2]``."""
    gen = torch.Generator().manual_seed(seed)
    ids, doc, used = [], 0, 0
    while used < seq:
        n = min(int(torch.randint(mean // 2, 3 * mean // 2 + 1, (1,), generator=gen)),
                seq - used)
        ids.append(torch.full((n,), doc))
        doc, used = doc + 1, used + n
    return torch.cat(ids)[None]


def _plan_run(q, k, v, ids):  # noqa: ANN001, ANN202
    plan = attention_segments(Documents.from_doc_ids(ids), q.device)
    return lambda: attend(q * 1, k * 1, v * 1, plan)


def _dense_run(q, k, v, ids):  # noqa: ANN001, ANN202
    def run() -> torch.Tensor:
        seq = ids.shape[-1]
        mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(
            seq, seq, dtype=torch.bool).tril()
        qt, kt, vt = ((t * 1).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None])
    return run


def _largest(run: Callable[[], torch.Tensor]) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            sizes = [t.untyped_storage().nbytes() for t in tree_leaves(out)
                     if isinstance(t, torch.Tensor)]
            self.most = max([self.most, *sizes])
            return out

    mode = Largest()
    with mode:
        run().square().sum().backward()
    return mode.most


def _time(run: Callable[[], torch.Tensor], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run().square().sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_rows(seqs: list[int], heads: int, head_dim: int, doc_tokens: int, reps: int) -> None:
    print(f"packed rows, {heads} heads of {head_dim}, documents of ~{doc_tokens} tokens, "
          f"fp32 CPU, {torch.get_num_threads()} thread(s)")
    print(f"{'seq':>6} | {'plan kept':>10} {'largest':>9} {'time':>8} | "
          f"{'dense kept':>10} {'largest':>9} {'time':>8}")
    for seq in seqs:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, seq, heads, head_dim, requires_grad=True) for _ in range(3))
        ids = doc_ids(seq, doc_tokens)
        row = [f"{seq:>6} |"]
        for make in (_plan_run, _dense_run):
            run = make(q, k, v, ids)
            kept = saved_bytes(run)
            row.append(f"{kept / 2**20:>8.1f}Mi {_largest(run) / 2**20:>7.1f}Mi "
                       f"{_time(run, reps) * 1e3:>6.0f}ms |")
        print(" ".join(row)[:-2])


def fake_rows() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    print("Llama-2-7B attention (32 heads of 128, bf16) on the fake accelerator, per "
          "layer and sample: measured / plan")
    for seq in (32768, 131072):
        for context in (1, 8):
            cfg = load_config(LLAVA_7B, [f"data.seq_length={seq}", "train.precision=bf16",
                                         "modules.language.parallel.tensor=1",
                                         f"modules.language.parallel.context={context}"])
            docs = Documents.from_doc_ids(doc_ids(seq, seq // 4)) if context == 1 else \
                Documents.whole(1, seq)
            device = torch.device("meta")
            with FakeTensorMode():
                plan = attention_segments(docs, device, context, context - 1)
                q = torch.empty(1, seq // context, 32, 128, dtype=torch.bfloat16,
                                device=device, requires_grad=True)
                k, v = (torch.empty(1, seq, 32, 128, dtype=torch.bfloat16, device=device,
                                    requires_grad=True) for _ in range(2))
                kept = saved_bytes(lambda: attend(q * 1, k * 1, v * 1, plan))  # noqa: B023
            est = attention_bytes_per_sample(cfg, "language")
            what = "packed" if context == 1 else f"CP {context}"
            print(f"  {seq:>6} {what:<7} {kept / 2**20:>8.1f} MiB / {est / 2**20:>8.1f} MiB "
                  f"({est / kept:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fake", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    cpu_rows(args.seq, args.heads, args.head_dim, args.doc_tokens, args.reps)
    if args.fake:
        fake_rows()


if __name__ == "__main__":
    main()
