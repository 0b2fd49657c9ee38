"""FSDP2 per module: ``fully_shard`` over the module's data-parallel group.

``modules.<m>.parallel.fsdp = true`` shards the module's parameters, gradients and
optimizer state over its DP group with torch's ``fully_shard`` (FSDP2), for modules
whose weights do not fit a rank even with the distributed optimizer. Composed with
tensor parallelism it runs on a 2-D ``(dp, tp)`` mesh: TP shards first (on the mesh's
``tp`` axis), FSDP then shards every TP shard along dim 0 over ``dp``. Pipeline stages
shard what they hold. What a rank keeps between steps is ``1 / dp`` of its parameters,
gradients and Adam state (fp32: 16 bytes per parameter / dp); a unit's full
parameters exist only while it runs forward or backward.

Units (:func:`fsdp_units`): every transformer block, then the other children of the
module part that hold parameters (the embedding, the output head, the final norm, an
encoder stack with its front end and position embedding, the projector). Each unit must
be called through its own ``forward`` for its parameters to be gathered, and the engine
calls several of them directly (``embed_tokens``, the projector), which is why the part
itself is not a unit.

No module above the units is sharded, so each unit is an FSDP root of its own, and
FSDP2 keeps a root's last reduce-scatter input (the unit's gradients in fp32, unsharded)
in its communication context until that context's next reduce-scatter or the end of
the backward. With a context per unit every unit's input would stay alive to the end
of the backward: the whole module's gradients in fp32, 32 GiB a rank on Llama-2-70B at
TP 8. The units of a part therefore share one context (``share_comm_ctx``, FSDP2's way
for several roots): one reduce-scatter input is in flight at a time, as under a single
root (``tests/test_memory_peak.py`` measures it). FSDP2 would initialise each root at its
first forward, re-creating the shared context's forward order midway through a step;
:func:`apply_fsdp` initialises them all up front instead (:func:`_init_roots`).

A split layout's encoder stage runs every micro-batch's backward on every DP rank, even
one with no rows of its modality there (an empty backward), because each unit's backward
gathers and reduce-scatters over the DP group (``pipeline/schedules.py``).

Semantics kept from the rest of the engine:

* **SUM, not average.** The loss each rank backpropagates is already divided by the
  global loss-token count (docs/design.md, "The parity contract"), so gradients must be
  summed over DP, as the data-parallel reduction does: every unit's gradient divide
  factor is 1 (FSDP2 averages by default).
* **Where gradients are reduced.** FSDP2 reduce-scatters each unit's gradients at the
  end of its backward, for every micro-batch, accumulating into the sharded fp32
  gradients; the step's data-parallel reduction skips the module
  (:func:`~mimotron.parallel.data_parallel.finalize_model_grads`' reduced-elsewhere set,
  as for ZeRO-1), and the optimizer's norm counts the shards once, summed over DP
  (:func:`~mimotron.optim.grads.sharded_outside`).
* **Mixed precision.** Under bf16/fp16 the gathered parameters are in the compute dtype
  (``MixedPrecisionPolicy(param_dtype=...)``, one cast per unit per gather) and
  gradients are reduced in fp32; the sharded parameters stay fp32 (the master copy).
* **Checkpoints.** Parameters and optimizer state are DTensors with their global shapes,
  so DCP saves and loads them into any layout: FSDP, ZeRO-1 or plain, other DP degrees.

Refused (:func:`check_fsdp`, before any rank starts): with ``shard_optimizer`` (FSDP
already shards the optimizer), context or sequence parallelism, mixture-of-experts
modules, frozen modules, and tied input/output embeddings. An encoder whose tower is
frozen (``freeze = "encoder"``) is sharded like any other: the tower's units are
gathered for the forward and reduce nothing (FSDP2 reduce-scatters only parameters that
require gradients), the projector's units train.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mimotron.config.hf_resolve import language_spec
from mimotron.parallel.context_parallel import moe_source
from mimotron.runtime import compute_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from mimotron.config.schema import MimoConfig


def check_fsdp(cfg: MimoConfig, name: str) -> None:
    """Raise (before any collective) unless module ``name`` can run FSDP2.

    Raises:
        ValueError: one line naming the field that conflicts and what would be valid.
    """

    mod = cfg.modules[name]
    par, p = mod.parallel, f"modules.{name}.parallel.fsdp"
    if not par.fsdp:
        return
    conflicts = [
        (par.shard_optimizer, f"modules.{name}.parallel.shard_optimizer=true",
         "FSDP already shards the optimizer state; use one of the two"),
        (par.context > 1, f"modules.{name}.parallel.context={par.context}",
         "use context=1 with FSDP"),
        (par.sequence_parallel, f"modules.{name}.parallel.sequence_parallel=true",
         "use sequence_parallel=false with FSDP"),
        (mod.fully_frozen, f"modules.{name}.freeze=true", "a frozen module has nothing to "
         "shard over data parallelism; use fsdp=false"),
    ]
    for bad, field, fix in conflicts:
        if bad:
            raise ValueError(f"{p}=true is invalid with {field}: {fix}")
    moe = moe_source(mod, name)
    if moe:
        raise ValueError(f"{p}=true is invalid with {moe}: FSDP supports dense modules only; "
                         "use fsdp=false (shard_optimizer shards an MoE module's optimizer)")
    if mod.hf_path and mod.is_language:

        spec = language_spec(mod)
        if spec.tie_word_embeddings:
            raise ValueError(f"{p}=true is invalid with hf_path {mod.hf_path!r}: it ties its "
                             "output head to the embedding (tie_word_embeddings); use fsdp=false")
        if spec.qk_norm and par.tensor > 1:
            raise ValueError(f"{p}=true is invalid with hf_path {mod.hf_path!r} and "
                             f"modules.{name}.parallel.tensor={par.tensor}: its per-head q/k "
                             "norms need a TP sum FSDP does not do; use tensor=1 or fsdp=false")


def fsdp_units(part: nn.Module) -> list[nn.Module]:
    """The modules of a part that become FSDP units, in the order to shard them.

    Every transformer block (the values of each ``layers`` ``ModuleDict``) first. Then,
    among the part's children that hold other parameters: a child without blocks is a
    unit; a child holding blocks and parameters of its own (an encoder stack's position
    embedding) is a unit over everything but its blocks, sharded after them; a child
    holding blocks and no parameter of its own is looked into the same way.
    """
    blocks: list[nn.Module] = []
    for name, sub in part.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(sub, nn.ModuleDict):
            blocks.extend(sub.values())
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    others: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child_name, child in module.named_children():
            if child_name == "layers" or all(id(p) in in_blocks for p in child.parameters()):
                continue
            holds_blocks = any(id(p) in in_blocks for p in child.parameters())
            if holds_blocks and not any(True for _ in child.parameters(recurse=False)):
                visit(child)
            else:
                others.append(child)

    visit(part)
    return blocks + others


def apply_fsdp(part: nn.Module, mesh: DeviceMesh, precision: str) -> list[nn.Module]:
    """``fully_shard`` each unit of ``part`` over ``mesh`` (its DP axis), summing gradients.

    Args:
        part: the module part this rank holds (after TP and recompute are applied).
        mesh: the DP mesh (1-D); with TP, the ``dp`` axis of the ``(dp, tp)`` mesh whose
            ``tp`` axis the TP shards live on.
        precision: ``train.precision``: under bf16/fp16 the gathered parameters are in
            the compute dtype and gradients are reduced in fp32.

    Returns:
        The units, in the order sharded.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, share_comm_ctx

    param_dtype = None if precision == "fp32" else compute_dtype(precision)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units = fsdp_units(part)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        # SUM over DP: the loss is already divided by the global token count. Forced to a
        # plain SUM collective: with a factor FSDP2 would use PREMUL_SUM, which NCCL has and
        # gloo does not.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    # One communication context for the part's units (see the module docstring): each
    # unit's reduce-scatter input is released at the next unit's, not at the backward's
    # end.
    share_comm_ctx(units)
    _init_roots(units)
    return units


def _init_roots(units: list[nn.Module]) -> None:
    """Run FSDP2's lazy initialisation of every root among ``units`` now, before any forward.

    FSDP2 initialises a root at its first forward, and that re-creates its communication
    context's lists, among them the forward order that implicit backward prefetch reads.
    With a context shared by several roots, a root first called after another has run
    would wipe the order the other recorded, leaving it an index past the end (an
    ``IndexError`` in the first backward, or a prefetch of the wrong unit). Outer units
    (an encoder stack around its blocks) come last in ``units`` and are initialised
    first, so the blocks inside them stay non-roots, as at a first forward.
    """
    for unit in reversed(units):
        unit._get_fsdp_state()._lazy_init()  # no-op for a unit already under a root


def fsdp_modules(cfg: MimoConfig) -> set[str]:
    """Modules of ``cfg`` that run FSDP2 (their gradients are reduced by FSDP itself)."""
    return {n for n, m in cfg.modules.items() if m.parallel.fsdp}
