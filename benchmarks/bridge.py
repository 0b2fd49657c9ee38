"""Case 3 - the bridge: bytes the communicator sends, and the bandwidth it achieves.

**Bytes.** Two non-colocated layouts of the three-module digits model train a few steps
on 4 forked ranks (DP fan-in: ``vision`` DP 2 -> ``language`` DP 1; DP fan-out:
``vision``, ``audio`` DP 1 -> ``language`` DP 2), and the fan-in layout once more with
every sample carrying both modalities (``bridge_fixed_shape_headers``: the bridges'
row counts are then known to both ends from the config, so no shape header travels).
Every point-to-point byte is counted by wrapping ``ProcessGroup.send`` / ``recv``
inside the rank processes (this catches ``isend``, ``send`` and ``batch_isend_irecv``
alike; collectives such as the gradient all-reduce do not go through them). The
analytic minimum is each encoder output row once forward and its gradient once
backward: ``2 * present samples * tokens * hidden * bytes`` per edge and micro-batch,
from the ``has_<modality>`` masks of the global micro-batches (each sample belongs to
exactly one DP lane). ``bridge_bytes_ratio`` = sent / minimum; anything above 1 is
metadata (shape headers) or duplication.

**Bandwidth.** On 2 ranks (``vision`` on rank 0, ``language`` on rank 1) the bridge moves
one micro-batch's embeddings forward and their gradient back, with no compute in
between, for payloads from one real micro-batch up to a few MB; the raw side does
blocking gloo ``send``/``recv`` of tensors of the same sizes. ``bridge_bandwidth_ratio``
= bridge bandwidth / raw bandwidth at the largest payload (per size in the JSON).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    CaseResult,
    Figure,
    Options,
    digits_raw,
    engine_stepper,
    interleave,
    make_config,
    parallel,
    precompute_steps,
    ratio_figure,
    setup_run,
    summarize,
    timed,
)
from mimotron.forked_ranks import run_ranks

# The default model's widths (the bridge carries [present, tokens, 128] fp32 rows).
SMALL = [
    "modules.vision.num_layers=1",
    "modules.language.num_layers=1",
    "train.global_batch_size=32",
    "train.micro_batch_size=16",
]
EVERY_SAMPLE_BOTH = ["data.p_image=0", "data.p_audio=0", "data.p_both=1", "data.p_text=0"]
LAYOUTS = {
    "fan_in": (
        parallel("vision", data=2, rank_offset=0)
        + parallel("audio", data=1, rank_offset=2)
        + parallel("language", data=1, rank_offset=3)
    ),
    "fan_out": (
        parallel("vision", data=1, rank_offset=0)
        + parallel("audio", data=1, rank_offset=1)
        + parallel("language", data=2, rank_offset=2)
    ),
}


class ByteCounter:
    """Counts bytes and messages through ``ProcessGroup.send`` / ``recv`` while installed."""

    def __init__(self) -> None:
        self.sent = self.received = self.num_sends = 0
        self.metadata = 0  # sent bytes of non-floating tensors (shape headers)
        self._orig: dict[str, Any] = {}

    def __enter__(self) -> ByteCounter:
        pg = torch._C._distributed_c10d.ProcessGroup
        self._orig = {"send": pg.send, "recv": pg.recv}
        counter = self

        def send(self: Any, tensors: list[torch.Tensor], *args: Any, **kw: Any) -> Any:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            counter.sent += nbytes
            counter.num_sends += 1
            if not any(t.is_floating_point() for t in tensors):
                counter.metadata += nbytes
            return counter._orig["send"](self, tensors, *args, **kw)

        def recv(self: Any, tensors: list[torch.Tensor], *args: Any, **kw: Any) -> Any:
            counter.received += sum(t.numel() * t.element_size() for t in tensors)
            return counter._orig["recv"](self, tensors, *args, **kw)

        pg.send, pg.recv = send, recv
        return self

    def __exit__(self, *exc: Any) -> None:
        pg = torch._C._distributed_c10d.ProcessGroup
        pg.send, pg.recv = self._orig["send"], self._orig["recv"]


def minimum_bytes(cfg: Any, steps: list[Any]) -> int:
    """Analytic minimum bytes for this language rank's slices of ``steps`` (fp32 rows).

    Each language DP replica sees its own slice of every micro-batch, so the minima of
    the language ranks add up to the whole batch's.
    """
    hidden = cfg.modules["language"].hidden_size
    total = 0
    for step in steps:
        for mb in step:
            batch = mb["language"]
            for name in cfg.encoder_names:
                mod = cfg.modules[name]
                present = int(batch[f"has_{mod.modality}"].sum())
                total += 2 * present * mod.num_output_tokens * hidden * 4  # fp32
    return total


def _bytes_rank(rank: int, world: int, overrides: list[str], num_steps: int) -> dict[str, int]:
    del rank, world
    cfg = make_config(digits_raw(), SMALL + overrides)
    run = setup_run(cfg)
    steps = precompute_steps(run, num_steps)
    step = engine_stepper(run, steps)
    with ByteCounter() as counter:
        for _ in range(num_steps):
            step()
    # Language ranks hold disjoint DP slices of each micro-batch: their minima add up.
    minimum = minimum_bytes(cfg, steps) if "language" in run.infra.module_names else 0
    return {
        "sent": counter.sent,
        "received": counter.received,
        "metadata": counter.metadata,
        "messages": counter.num_sends,
        "minimum": minimum,
    }


def measure_bytes(layout: list[str], num_steps: int) -> dict[str, Any]:
    per_rank = run_ranks(4, _bytes_rank, layout, num_steps, timeout_s=300)
    sent = sum(r["sent"] for r in per_rank)
    minimum = sum(r["minimum"] for r in per_rank)
    return {
        "sent_bytes": sent,
        "received_bytes": sum(r["received"] for r in per_rank),
        "messages": sum(r["messages"] for r in per_rank),
        "minimum_bytes": minimum,
        "metadata_bytes": sum(r["metadata"] for r in per_rank),
        "ratio": sent / minimum,
        "steps": num_steps,
        "per_rank_sent": [r["sent"] for r in per_rank],
    }


# ---- bandwidth ------------------------------------------------------------------------


def _bridge_round_trip(comm: Any, rank: int, out: torch.Tensor, mask: torch.Tensor) -> None:
    """Embeddings rank 0 -> rank 1 and their gradient back, through the communicator.

    ``out`` doubles as the gradient rank 1 sends back (same shape), so neither side
    allocates anything the raw side does not.
    """
    if hasattr(comm, "communicate"):  # the plan-driven communicator (1F1B engine)
        if rank == 0:
            comm.communicate(send_forward=(0, out, mask))
            comm.communicate(recv_backward=0)
        else:
            got, _ = comm.communicate(recv_forward=0)
            comm.communicate(send_backward=(0, dict.fromkeys(got, out)))
        comm.finish()
        return
    edge = comm.edges[0]  # the per-edge communicator of the first engine version
    if rank == 0:
        comm.forward(edge, out, mask, None)
        comm.backward(edge, out, None, mask, None)
    else:
        got = comm.forward(edge, None, None, mask)
        got.grad = out
        comm.backward(edge, None, got, None, mask)


def _raw_round_trip(rank: int, buf: torch.Tensor) -> None:
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _bandwidth_rank(
    rank: int, world: int, mbs_list: list[int], reps: int, iters: int
) -> dict[str, Any]:
    del world
    raw = digits_raw()
    del raw["modules"]["audio"]
    layout = parallel("vision", data=1, rank_offset=0) + parallel("language", data=1, rank_offset=1)
    out: dict[str, Any] = {}
    for mbs in mbs_list:
        cfg = make_config(
            raw,
            layout
            + [
                "modules.vision.hidden_size=32",
                "modules.vision.num_layers=1",
                "modules.language.num_layers=1",
                f"train.micro_batch_size={mbs}",
                f"train.global_batch_size={mbs}",
            ],
        )
        run = setup_run(cfg)
        shape = (mbs, cfg.modules["vision"].num_output_tokens, cfg.modules["language"].hidden_size)
        emb, mask = torch.randn(shape), torch.ones(mbs, dtype=torch.bool)
        buf = torch.empty(shape)

        def bridge(
            comm: Any = run.communicator, e: torch.Tensor = emb, m: torch.Tensor = mask
        ) -> float:
            dist.barrier()
            return timed(lambda: _bridge_round_trip(comm, rank, e, m), iters)

        def raw_pair(b: torch.Tensor = buf) -> float:
            dist.barrier()
            return timed(lambda: _raw_round_trip(rank, b), iters)

        bridge(), raw_pair()  # warm-up (connections, allocator)
        times = interleave(reps, {"bridge": bridge, "raw": raw_pair})
        out[mbs] = {"payload_bytes": emb.numel() * 4, **times}
    return out


def measure_bandwidth(mbs_list: list[int], reps: int, iters: int) -> dict[int, Any]:
    return run_ranks(2, _bandwidth_rank, mbs_list, reps, iters, timeout_s=300)[0]


def run_case(opts: Options) -> CaseResult:
    """``bridge_bytes_ratio`` (target 1.00) and ``bridge_bandwidth_ratio`` (bridge / raw)."""
    num_steps = 1 if opts.tiny else 2
    out = CaseResult("bridge")
    layouts = {"fan_in": LAYOUTS["fan_in"]} if opts.tiny else LAYOUTS
    counts = {name: measure_bytes(layout, num_steps) for name, layout in layouts.items()}
    sent = sum(c["sent_bytes"] for c in counts.values())
    minimum = sum(c["minimum_bytes"] for c in counts.values())
    per_layout = ", ".join(
        f"{n} {c['sent_bytes'] / 1e6:.3f}/{c['minimum_bytes'] / 1e6:.3f} MB"
        for n, c in counts.items()
    )
    headers = sum(c["metadata_bytes"] for c in counts.values())
    out.figures.append(
        Figure(
            "bridge_bytes_ratio",
            sent / minimum,
            "<= 1.00",
            None,
            f"sent/minimum per {num_steps} steps: {per_layout} (of which {headers} B shape "
            f"headers, {sum(c['messages'] for c in counts.values())} messages)",
        )
    )
    # Every sample with both modalities: both ends know each bridge's row count from the
    # config (mimotron.pipeline.shapes), so no shape header should travel.
    fixed = measure_bytes(LAYOUTS["fan_in"] + EVERY_SAMPLE_BOTH, num_steps)
    out.figures.append(
        Figure(
            "bridge_fixed_shape_headers",
            fixed["metadata_bytes"],
            "<= 0",
            None,
            f"shape-header bytes per {num_steps} steps, fan_in with every sample carrying "
            f"both modalities (sent/minimum {fixed['ratio']:.2f}, {fixed['messages']} "
            "messages); the mixed data above keeps its headers (row counts vary)",
        )
    )
    mbs_list = [8] if opts.tiny else ([16, 256] if opts.quick else [16, 128, 1024])
    iters = 5 if opts.tiny else 20
    bw = measure_bandwidth(mbs_list, opts.reps, iters)
    sizes = {}
    for r in bw.values():
        payload = 2 * r["payload_bytes"]  # forward and back
        sizes[f"{r['payload_bytes']}B"] = {
            "payload_bytes": r["payload_bytes"],
            "bridge_round_trip_s": summarize(r["bridge"]),
            "raw_round_trip_s": summarize(r["raw"]),
            "bridge_GBps": payload / statistics.median(r["bridge"]) / 1e9,
            "raw_GBps": payload / statistics.median(r["raw"]) / 1e9,
        }
    largest = bw[max(bw)]
    big = sizes[f"{largest['payload_bytes']}B"]
    # Bandwidth ratio = raw time / bridge time for the same bytes.
    fig = ratio_figure(
        "bridge_bandwidth_ratio",
        largest["raw"],
        largest["bridge"],
        "",
        f"{largest['payload_bytes'] / 1e6:.2f} MB each way: bridge "
        f"{big['bridge_GBps']:.2f} GB/s vs raw gloo {big['raw_GBps']:.2f} GB/s",
    )
    out.figures.append(fig)
    out.measurements = {
        "bytes": counts,
        "bytes_fixed_shapes": fixed,
        "bandwidth": sizes,
        "iters_per_rep": iters,
        "bridge_api": "communicate" if _new_api() else "forward/backward",
    }
    return out


def _new_api() -> bool:
    from mimotron.pipeline.communicator import MultiModulePipelineCommunicator

    return hasattr(MultiModulePipelineCommunicator, "communicate")
