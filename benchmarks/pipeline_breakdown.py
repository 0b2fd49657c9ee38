"""Where one pipeline step's time goes on each rank, ours vs torch's (measured).

Used by the interleaved comparison: after the timed repetitions, a few more steps of each
side run with timers wrapped around (and restored after) the calls that make it up:

* ``forward_s``: the language model's forward (``model.language_model``), both sides;
* ``backward_s``: ours every ``torch.autograd.backward`` (what ``Tensor.backward``
  calls), torch's each stage's ``backward_one_chunk`` (its receives are waited outside);
* ``transfer_s``: time inside the transfer calls, sends posted, receives posted and
  waited (ours ``transfer`` + ``finish``; torch's ``_batch_p2p`` + ``_wait_batch_p2p``),
  of which the blocked part is ours ``send_wait_s`` (``PendingSends.wait``; receives are
  waited inside ``exchange``), torch's ``wait_s`` (``_wait_batch_p2p``: receives, and
  sends before they are reused or at the end);
* ``optimizer_s``: grad norm, clip, the world all_reduce, AdamW (ours
  ``step_with_world_sums``; torch's :class:`~benchmarks.torch_side.Finisher`);
* ours also ``exchange_s`` (the part of ``transfer_s`` inside ``p2p.exchange``),
  ``isend_s`` and ``irecv_post_s`` (posting costs of ``dist.isend`` / ``dist.irecv``);
* ``messages``: point-to-point payloads posted (sends + receives); ``step_s``;
  ``other_s`` = ``step_s`` minus the parts (Python bookkeeping, loss, scheduling).

The wrappers add a few microseconds per call, the same on both sides.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

STEPS = 3  # instrumented steps per side (their mean is reported)

# (object, attribute, key of the time it accumulates, messages per call or None)
Target = tuple[Any, str, str, "Callable[..., int] | None"]


@contextlib.contextmanager
def _timed_calls(targets: list[Target], tally: dict[str, float]) -> Iterator[None]:
    """Wrap each ``object.attribute`` with a timer adding to ``tally``; restore after."""
    saved = []
    for obj, attr, key, count in targets:
        orig = getattr(obj, attr)

        def wrapped(*a: Any, _f: Any = orig, _k: str = key, _c: Any = count, **kw: Any
                    ) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                tally[_k] += time.perf_counter() - t0
                if _c is not None:
                    tally["messages"] += _c(*a, **kw)

        saved.append((obj, attr, orig, attr in vars(obj)))
        setattr(obj, attr, wrapped)
    try:
        yield
    finally:
        for obj, attr, orig, own in reversed(saved):
            if own:
                setattr(obj, attr, orig)
            else:  # an instance's method: drop the shadowing attribute
                delattr(obj, attr)


def _steps(targets: list[Target], step: Callable[[], Any], parts: tuple[str, ...],
           num_steps: int = STEPS) -> dict[str, float]:
    """Per-step means over ``num_steps`` instrumented steps (each after a barrier)."""
    tally: dict[str, float] = defaultdict(float)
    with _timed_calls(targets, tally):
        for _ in range(num_steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            tally["step_s"] += time.perf_counter() - t0
    tally["other_s"] = tally["step_s"] - sum(tally[k] for k in parts)
    return {k: round(v / num_steps, 6) for k, v in sorted(tally.items())}


def ours_breakdown(run: Any, step: Callable[[], Any]) -> dict[str, float]:
    """One engine step, broken down on this rank (see the module docstring)."""
    from mimotron.pipeline import communicator, p2p

    comm = run.communicator
    targets: list[Target] = [
        (run.model.language_model, "forward", "forward_s", None),
        (torch.autograd, "backward", "backward_s", None),
        (comm, "transfer", "transfer_s", None),
        (comm, "finish", "transfer_s", None),
        (communicator, "exchange", "exchange_s", lambda s, r, *_a, **_k: len(s) + len(r)),
        (p2p.PendingSends, "wait", "send_wait_s", None),
        (dist, "isend", "isend_s", None),
        (dist, "irecv", "irecv_post_s", None),
        (run.optimizer, "step_with_world_sums", "optimizer_s", None),
    ]
    headers = comm.counts.headers_sent
    out = _steps(targets, step, ("forward_s", "backward_s", "transfer_s", "optimizer_s"))
    out["headers_sent"] = (comm.counts.headers_sent - headers) / STEPS
    return out


def torch_breakdown(run: Any, stages: list[Any], finish: Any, step: Callable[[], Any]
                    ) -> dict[str, float]:
    """One torch schedule step, broken down on this rank (see the module docstring)."""
    from torch.distributed.pipelining import schedules

    targets: list[Target] = [
        (run.model.language_model, "forward", "forward_s", None),
        *[(s, "backward_one_chunk", "backward_s", None) for s in stages],
        (schedules, "_batch_p2p", "post_s", lambda ops, *_a, **_k: len(ops)),
        (schedules, "_wait_batch_p2p", "wait_s", None),
        (finish, "apply", "optimizer_s", None),
    ]
    out = _steps(targets, step, ("forward_s", "backward_s", "post_s", "wait_s",
                                    "optimizer_s"))
    out["transfer_s"] = round(out.pop("post_s", 0.0) + out.get("wait_s", 0.0), 6)
    return out


def gather(local: dict[str, dict[str, float]]) -> list[dict[str, dict[str, float]]]:
    """Every rank's breakdowns, indexed by rank (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def breakdown_note(per_rank: list[dict[str, dict[str, float]]]) -> str:
    """One line per side: per rank, ms of each part and the message count."""
    def ms(d: dict[str, float], k: str) -> str:
        return f"{d.get(k, 0.0) * 1e3:.0f}"

    lines = []
    for side in ("ours", "torch"):
        ranks = []
        for r, both in enumerate(per_rank):
            d = both[side]
            wait = d.get("recv_wait_s", 0.0) + d.get("send_wait_s", d.get("wait_s", 0.0))
            ranks.append(
                f"rank {r}: step {ms(d, 'step_s')} = fwd {ms(d, 'forward_s')} + bwd "
                f"{ms(d, 'backward_s')} + p2p {ms(d, 'transfer_s')} (blocked "
                f"{wait * 1e3:.0f}) + opt {ms(d, 'optimizer_s')} + other "
                f"{ms(d, 'other_s')} ms, {int(d.get('messages', 0))} msgs")
        lines.append(f"{side}: " + "; ".join(ranks))
    return (f"interleaved step breakdown (mean of {STEPS} instrumented steps): "
            + " | ".join(lines))
