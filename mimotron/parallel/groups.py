"""Process-group bundles: one per module (``ProcessGroupCollection``) and per rank.

SKELETON: field set is fixed; builders are filled in by the grid work.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup


@dataclass
class ProcessGroupCollection:
    """The process groups of one module on this rank; ``None`` = not present."""

    tp: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    dp_cp: ProcessGroup | None = None
    tp_cp: ProcessGroup | None = None
    ep: ProcessGroup | None = None
    expt_tp: ProcessGroup | None = None
    expt_dp: ProcessGroup | None = None
    tp_ep: ProcessGroup | None = None
    tp_ep_pp: ProcessGroup | None = None
    mp: ProcessGroup | None = None  # tp x pp: where a module's parameters are split
    embd: ProcessGroup | None = None
    pos_embd: ProcessGroup | None = None
