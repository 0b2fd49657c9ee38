"""One optimizer per module, one global view: grad norm, clipping, found-inf, success.

Modules live on different (or shared) ranks with different layouts, yet clipping must
use the norm over *all* parameters and every rank must take the same branch (skip or
step). The trick (docs/design.md, "Optimizer semantics"): modules are ordered by name
and slot ``i`` of every world vector belongs to module ``i``. A module's ranks fill its
slot with a value that is identical on all of them, every other rank puts 0 there, and a
world MAX gives every rank the whole vector. Found-inf is a MAX slot of the same vector:
:meth:`MimoOptimizer.step` agrees on found-inf, the norm and the zero count (and any
sums the caller adds, such as the step's loss sums) in one world collective with one
host sync. Success needs no vote: every rank skips or steps on the same found-inf.

Collective discipline: world collectives are issued by every rank; a module's group
collectives by every rank *in the module* (``ModuleOptimizerInfo.in_module``), whether
or not it holds parameters, in module-name order, before any early return.

A module may shard its optimizer over its DP group (``ModuleOptimizerInfo.zero``, ZeRO-1,
:mod:`mimotron.parallel.zero`): its ``params`` are then this rank's row fragments, its
gradients are reduce-scattered in :meth:`MimoOptimizer.prepare_grads`, its squared norm
and zero count are summed over the DP group (fragments are disjoint, so nothing is
counted twice) and then over ``mp`` like any module's (with TP a fragment of a
replicated parameter counts on TP rank 0 only), and its parameters are all-gathered
after the inner step.

Expert parallelism (:mod:`mimotron.parallel.expert_parallel`): a module's expert shards
(DTensors ``Shard(0)`` over its ``ep`` axis) are summed over ``tp_ep_pp`` — every
expert shard of every stage once, while their ``expt_dp`` replicas (equal after the
``expt_dp`` reduction) and TP peers are not added — and the rest over ``mp`` as usual;
both sums are identical on all of the module's ranks, so the world MAX slot still holds
the module's value. Under ZeRO-1 the expert rows are summed over ``expt_dp`` first.

Per-module settings (Megatron semantics):

* **Clipping**: every module clips against the *global* grad norm (all modules) with its
  own threshold: module ``m``'s grads are multiplied by ``clip_m / (norm + 1e-6)`` when
  that is below 1; ``clip_m = 0`` leaves the module unclipped.
* **fp16 loss scaling**: every module has its own dynamic scaler (initial scale, growth
  window, hysteresis, floor), all updated from the one *world* found-inf flag, so an
  overflow anywhere skips the step everywhere and every scaler backs off by its own
  rules. The loss is a single tensor, so backward can apply only one factor to all
  modules: :meth:`MimoOptimizer.get_loss_scale` returns the *minimum* scale over the
  trainable modules (no module's gradients are scaled beyond what its scaler allows),
  and :meth:`MimoOptimizer.prepare_grads` divides every module's gradients by that same
  common scale (what actually multiplied them). Scalers live on every rank and see the
  same flag, so the minimum is the same on every rank.

Frozen modules and modules frozen when a checkpoint was written: see
:meth:`MimoOptimizer.load_state_dict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from mimotron import host_sync
from mimotron.config.schema import OptimizerConfig
from mimotron.optim.grads import (
    collective_device,
    counted_local_grad,
    counted_on_rank,
    grads_of,
    non_finite_flag,
    reduced_grads,
    scale_,
    sharded_outside,
    usable,
)
from mimotron.optim.loss_scaler import ConstantLossScaler, LossScaler
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.zero import ExpertSplitShards, ZeroShards

_PREFIX = "optimizer"
# ``optimizer.<module>.has_state``: True when saved; the loading placeholder is False, so
# it is still False after a (partial) DCP load when the checkpoint has no optimizer state
# for the module (it was frozen when saved).
_HAS_STATE = "has_state"


@dataclass
class ModuleOptimizerInfo:
    """Optimizer info for one module on this rank.

    Attributes:
        optimizer: the module's torch optimizer; ``None`` when inactive here.
        grid: the module's ``HyperCommGrid`` (informational).
        pg_collection: the module's groups on this rank; ``None`` when this rank holds
            no part of the module. ``mp`` (tp x pp) sums the squared norm, ``dp`` (or
            ``dp_cp``) sums the part of DTensor grads sharded over data parallelism.
        is_active: this rank steps an optimizer for the module.
        params: ``(name, parameter)`` pairs; optimizer state is keyed by these names so
            checkpoints do not depend on the layout. Empty = index names (``"0"``, ...).
        loss_scaler: the module's scaler (its own fp16 settings, the world's found-inf).
        clip_grad: the module's clipping threshold against the global norm; ``None`` =
            the optimizer config's ``clip_grad``; 0 = the module is not clipped.
        frozen: the module is frozen everywhere, so its ranks skip its collectives.
        zero: the row shards when the module's optimizer is sharded over its DP group;
            ``params`` and ``optimizer`` then hold this rank's fragments.
    """

    optimizer: torch.optim.Optimizer | None = None
    grid: Any | None = None
    pg_collection: ProcessGroupCollection | None = None
    is_active: bool = False
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    loss_scaler: LossScaler = field(default_factory=ConstantLossScaler)
    frozen: bool = False
    zero: ZeroShards | ExpertSplitShards | None = None
    clip_grad: float | None = None

    @property
    def in_module(self) -> bool:
        """Whether this rank computes the module's slot (and joins its group collectives).

        An active module without groups is a one-rank module: it counts locally only.
        """
        return (self.pg_collection is not None or self.is_active) and not self.frozen


class MimoOptimizer:
    """Optimizer for a multi-module model with a parallel layout per module.

    Args:
        module_infos: module name -> info; every rank passes every module name.
        config: global optimizer settings (``clip_grad`` for modules whose info has
            none; 0 = off).
        world_group: group spanning all ranks; ``None`` = the default group (or no
            collectives at all when torch.distributed is not initialised).
        overlap_param_gather: sharded modules only launch their all-gather after the step.
        hooks: the forward pre-hooks that land that gather (kept so :meth:`close` can
            remove them).

    Raises:
        ValueError: an active module without an optimizer, or a parameter of an inner
            optimizer that ``params`` does not name.
    """

    def __init__(
        self,
        module_infos: dict[str, ModuleOptimizerInfo],
        config: OptimizerConfig,
        world_group: dist.ProcessGroup | None = None,
        overlap_param_gather: bool = False,
        hooks: list[RemovableHandle] | None = None,
    ) -> None:
        self.config = config
        self.hooks = list(hooks or [])
        """The modules' gather pre-hooks (``overlap_param_gather``); :meth:`close` removes them."""
        self.overlap_param_gather = overlap_param_gather
        """Sharded modules only launch their all-gather after the step; see
        :meth:`finish_param_gather`."""
        self.module_infos = {name: module_infos[name] for name in sorted(module_infos)}
        self._world = world_group
        self._distributed = dist.is_available() and dist.is_initialized()
        # The parameters' device: NCCL reduces device tensors (None: no parameters here).
        param_device = next((p.device for info in self.module_infos.values()
                             for _, p in info.params), None)
        self._device = (collective_device(world_group, param_device) if self._distributed
                        else torch.device("cpu"))
        self._rank = dist.get_rank() if self._distributed else 0
        # Parameter names in the inner optimizer's index order, per active module.
        self._order: dict[str, list[str]] = {}
        for name, info in self.module_infos.items():
            if info.is_active:
                self._order[name] = _index_names(name, info)
                for group in info.optimizer.param_groups:
                    group["module"] = name

    # ---- collectives ------------------------------------------------------------------
    def _world_reduce(
        self, max_slots: torch.Tensor, sum_slots: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """World MAX of ``max_slots`` and world SUM of ``sum_slots``: one collective.

        One all-gather of every rank's row (``max_slots`` then ``sum_slots``, float64, the
        same length on every rank) and a reduction of each column with its own op, on
        the collective device, then the one host sync. Why a gather and not an
        all-reduce: the flag and module slots need MAX (every rank of a module fills its
        slot with the same value, the rest 0), per-rank addends such as the step's loss
        sums need SUM, and encoding the sums for a MAX (one slot per DP replica, 0
        elsewhere) would turn a NaN loss into 0 (gloo's max keeps the first operand).
        MAX is exact in any order, so the slots are bitwise what a MAX all-reduce gives;
        the sums add at most a handful of nonzero float64 addends that are short sums of
        fp32 losses and integer counts, which is exact in any order too.

        Returns:
            ``(max_result, sum_result)`` on the CPU (``sum_result`` empty without sums).
        """
        dev, f64 = self._device, torch.float64
        sums = sum_slots if sum_slots is not None else torch.zeros(0, dtype=f64, device=dev)
        row = torch.cat([max_slots.to(device=dev, dtype=f64), sums.to(device=dev, dtype=f64)])
        if self._distributed:
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self._world))]
            dist.all_gather(rows, row, group=self._world)
            table = torch.stack(rows)
        else:
            table = row.unsqueeze(0)
        n = max_slots.numel()
        out = torch.cat([table[:, :n].amax(dim=0), table[:, n:].sum(dim=0)])
        host = torch.tensor(host_sync.to_host(out, host_sync.WORLD_SUMS), dtype=f64)
        return host[:n], host[n:]

    def _active(self) -> list[ModuleOptimizerInfo]:
        return [i for i in self.module_infos.values() if i.is_active]

    # ---- gradients --------------------------------------------------------------------
    def _unscale_and_check(self) -> torch.Tensor:
        """Reduce-scatter sharded modules, unscale every module, flag non-finite grads.

        Every module's gradients are divided by the common loss scale
        (:meth:`get_loss_scale` before this step's update: the factor backward applied
        to all of them). Sharded modules reduce-scatter their gradients first
        (collective over each one's DP group, in module order).

        Returns:
            This rank's found-inf flag, ``[0.0]`` or ``[1.0]`` on the collective device.
        """
        self.finish_param_gather()  # the step below writes the rows in place
        for info in self._active():
            if info.zero is not None:
                info.zero.reduce_grads()
        inv_scale = 1.0 / float(self.get_loss_scale())
        flag = torch.zeros(1, dtype=torch.float64, device=self._device)
        for info in self._active():
            grads = reduced_grads(info.params)
            if inv_scale != 1.0:
                scale_(grads, inv_scale)
            flag = torch.maximum(flag, non_finite_flag(grads, self._device))
        return flag

    def _update_scalers(self, found_inf: bool) -> None:
        """Every module's scaler, by its own rules, from the one world flag."""
        for info in self.module_infos.values():
            info.loss_scaler.update(found_inf)

    def prepare_grads(self) -> bool:
        """Unscale, check for non-finite grads, agree on it world-wide (one collective).

        See :meth:`_unscale_and_check`; then every module's loss scaler is updated, by
        its own rules, from the world flag. :meth:`step` does this in the same world
        collective as the grad norm.

        Returns:
            found_inf, identical on every rank.
        """
        flag, _ = self._world_reduce(self._unscale_and_check())
        found_inf = bool(flag.item() > 0)
        self._update_scalers(found_inf)
        return found_inf

    def _stat_slots(self) -> torch.Tensor:
        """This rank's ``[sq norm, zeros]`` slot pairs, module ``i`` at ``2i`` (0 if not in it).

        Collective over each module's groups (ranks in the module); no world collective.
        """
        slots = torch.zeros(2 * len(self.module_infos), dtype=torch.float64, device=self._device)
        for i, (name, info) in enumerate(self.module_infos.items()):
            if info.in_module:
                slots[2 * i : 2 * i + 2] = self._module_stats(name, info)
        return slots

    def _global_stats(self) -> tuple[float, int]:
        """(grad norm, zero count) over all modules: one world collective of 2n slots."""
        slots, _ = self._world_reduce(self._stat_slots())
        return _norm_and_zeros(slots)

    def _module_stats(self, name: str, info: ModuleOptimizerInfo) -> torch.Tensor:
        """[squared norm, zeros] of one module (float64), identical on all of its ranks.

        Expert-parallel shards are summed over ``tp_ep_pp`` (every expert shard of every
        stage once; ``expt_dp`` replicas are equal and not added), the rest over ``mp``.
        """
        pg = info.pg_collection or ProcessGroupCollection()
        mp, dp = pg.mp, pg.dp_cp if usable(pg.dp_cp) else pg.dp
        if info.zero is not None:
            dp = info.zero.group  # the group the fragments are sharded over
        mp_ranks = set(dist.get_process_group_ranks(mp)) if usable(mp) else {self._rank}
        dp_ranks = set(dist.get_process_group_ranks(dp)) if usable(dp) else {self._rank}
        tp_rank = dist.get_rank(pg.tp) if usable(pg.tp) else 0
        own = torch.zeros(2, dtype=torch.float64, device=self._device)
        shared = torch.zeros(2, dtype=torch.float64, device=self._device)
        expert = torch.zeros(2, dtype=torch.float64, device=self._device)
        expert_rows = torch.zeros(2, dtype=torch.float64, device=self._device)
        expert_fragments = getattr(info.zero, "expert_names", set())
        any_shared = info.zero is not None
        for pname, p in info.params:
            if is_expert_param(p):
                _add_stats(expert, p.grad.to_local() if p.grad is not None else None)
                continue
            if pname in expert_fragments:  # ZeRO rows of expert shards: over expt_dp
                _add_stats(expert_rows, p.grad)
                continue
            if info.zero is not None:  # a fragment counts where its parameter's shard would
                counted = counted_on_rank(info.zero.model_param(pname), mp_ranks, tp_rank)
                _add_stats(shared, p.grad if counted else None)
                continue
            over_dp = sharded_outside(p, mp_ranks, dp_ranks, name)
            any_shared = any_shared or over_dp
            _add_stats(shared if over_dp else own, counted_local_grad(p, mp_ranks, tp_rank))
        # Placements (and sharding) are the same on all DP replicas: they agree here.
        if any_shared and usable(dp):
            dist.all_reduce(shared, group=dp)
        total = own + shared
        if usable(mp):
            dist.all_reduce(total, group=mp)
        if expert_fragments and usable(info.zero.expert_group):
            dist.all_reduce(expert_rows, group=info.zero.expert_group)
        expert += expert_rows
        if pg.tp_ep_pp is not None:
            # Every rank of a module with an expert view joins, experts held or not.
            if usable(pg.tp_ep_pp):
                dist.all_reduce(expert, group=pg.tp_ep_pp)
            total = total + expert
        return total

    def get_grad_norm(self) -> float:
        """Global L2 norm of all modules' gradients (world collective)."""
        return self._global_stats()[0]

    def count_zeros(self) -> int:
        """Number of zero gradient entries over all modules (world collective)."""
        return self._global_stats()[1]

    def clip_grad_norm(
        self, clip_grad: float | None = None, grad_norm: float | None = None
    ) -> float:
        """Scale each module's grads by ``clip_m / (norm + 1e-6)`` when that is below 1.

        ``norm`` is the *global* norm over all modules; ``clip_m`` is the module's own
        threshold (``ModuleOptimizerInfo.clip_grad``, else ``config.clip_grad``), so
        modules with different thresholds are scaled by different factors.

        Args:
            clip_grad: max norm for every module, overriding the per-module thresholds;
                ``None`` = each module's own; 0 = no clipping.
            grad_norm: a global norm already computed this step (skips the collective).

        Returns:
            The global grad norm before clipping.
        """
        norm = self.get_grad_norm() if grad_norm is None else grad_norm
        for info in self._active():
            clip = self.module_clip(info) if clip_grad is None else clip_grad
            coeff = clip / (norm + 1.0e-6)
            if clip > 0 and coeff < 1.0:
                scale_(grads_of(info.params), coeff)
        return norm

    def module_clip(self, info: ModuleOptimizerInfo) -> float:
        """The clipping threshold of one module (its own, else ``config.clip_grad``)."""
        return self.config.clip_grad if info.clip_grad is None else info.clip_grad

    # ---- stepping ---------------------------------------------------------------------
    def step(self) -> tuple[bool, float | None, int | None]:
        """Prepare, clip with the global norm, count zeros, and step every module.

        One world collective: see :meth:`step_with_world_sums`.

        Returns:
            ``(success, grad_norm, num_zeros)``, identical on every rank;
            ``(False, None, None)`` when any rank found a non-finite gradient.
        """
        success, norm, zeros, _ = self.step_with_world_sums()
        return success, norm, zeros

    def step_with_world_sums(
        self, world_sums: torch.Tensor | None = None
    ) -> tuple[bool, float | None, int | None, list[float]]:
        """:meth:`step`, also summing ``world_sums`` over all ranks in its one collective.

        Found-inf, the norm and zero slots (computed on the unscaled gradients whether
        or not they are finite, so both are known after one collective) and the sums
        travel together; zeros are always counted, they come out of the same pass as
        the norm. A rank with nothing to add passes zeros.

        Args:
            world_sums: this rank's float64 addends (e.g. the step's loss sums), the
                same length on every rank; ``None`` = none.

        Returns:
            ``(success, grad_norm, num_zeros, sums)``, identical on every rank; the first
            three are ``(False, None, None)`` when any rank found a non-finite gradient.
        """
        local = torch.cat([self._unscale_and_check(), self._stat_slots()])
        reduced, sums = self._world_reduce(local, world_sums)
        found_inf = bool(reduced[0].item() > 0)
        self._update_scalers(found_inf)
        if found_inf:
            return False, None, None, sums.tolist()
        norm, zeros = _norm_and_zeros(reduced[1:])
        self.clip_grad_norm(grad_norm=norm)
        return self.step_with_ready_grads(), norm, zeros, sums.tolist()

    def step_with_ready_grads(self) -> bool:
        """Step every active inner optimizer; a sharded module then all-gathers its params.

        The all-gather is collective over each sharded module's DP group. No world
        collective: the skip decision was agreed (found-inf) before this is called, and
        an inner step that fails raises rather than returning a verdict to agree on.

        Returns:
            True.
        """
        for info in self._active():
            info.optimizer.step()
            if info.zero is not None:
                info.zero.gather_params(async_op=self.overlap_param_gather)
        return True

    def finish_param_gather(self) -> None:
        """Land every sharded module's pending parameter all-gather (idempotent).

        With ``overlap_param_gather`` the all-gather of :meth:`step_with_ready_grads`
        is only launched; the model holds its rows once this ran. The modules' forward
        pre-hooks and ``state_dict`` call it, and so do this optimizer's methods that
        read or write parameters, checkpoint save and load, and the end of the loop:
        call it before reading the weights in any other way.
        """
        for info in self._active():
            if info.zero is not None:
                info.zero.finish_gather()

    def close(self) -> None:
        """Land pending gathers and remove the modules' gather pre-hooks (idempotent)."""
        self.finish_param_gather()
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every active module (model and fragment gradients)."""
        for info in self._active():
            info.optimizer.zero_grad(set_to_none=set_to_none)
            if info.zero is not None:
                info.zero.zero_model_grads(set_to_none)

    def prepare_model_params_for_param_sync(self) -> None:
        """All-gather sharded modules' parameters from the ranks that own their rows.

        :meth:`step_with_ready_grads` already does this after every step; call it after
        changing fragments outside a step. Collective over each sharded module's DP
        group; a no-op for unsharded modules (updated in place).
        """
        self.finish_param_gather()
        for info in self._active():
            if info.zero is not None:
                info.zero.gather_params()

    def reload_model_params(self, state_dict: dict[str, Any] | None = None) -> None:
        """Re-view sharded fragments into the parameters' current storage.

        Needed after a model load that replaced parameter storage (``assign=True``); an
        in-place ``load_state_dict`` keeps them valid. A sharded module with 16-bit
        weights refreshes its fp32 masters from the model instead (to the 16-bit
        precision the model holds; checkpoints load the masters themselves). Unsharded
        modules have no separate main parameters (weights are fp32 under autocast).
        """
        del state_dict
        for info in self._active():
            if info.zero is not None:
                info.zero.repoint()

    def master_weights(self) -> dict[int, torch.Tensor]:
        """``id(model parameter)`` -> its fp32 master rows (a DTensor of its global shape).

        For the active sharded modules with 16-bit weights: what a checkpoint stores as
        their model weights (see :meth:`~mimotron.parallel.zero.ZeroShards.master_weights`).
        """
        return {id(p): m for info in self._active() if info.zero is not None
                for p, m in info.zero.master_weights()}

    def load_master_weights(self) -> None:
        """Cast the (just loaded) fp32 masters into the 16-bit model parameters.

        Collective over each such module's DP group (an all-gather); a no-op for the
        other modules.
        """
        self.finish_param_gather()
        for info in self._active():
            if info.zero is not None and info.zero.has_master:
                info.zero.gather_params()

    def get_loss_scale(self) -> torch.Tensor:
        """The scale to multiply the loss by before backward (1.0 without fp16 scaling).

        The minimum of the trainable modules' scales (every module when all are frozen):
        one loss feeds every module's gradients, so one factor applies to all of them,
        and the smallest keeps each module within its own scaler's limit. Identical on
        every rank (every rank holds every scaler, updated from the same world flag).
        """
        scalers = [i.loss_scaler for i in self.module_infos.values() if not i.frozen]
        scalers = scalers or [i.loss_scaler for i in self.module_infos.values()]
        if not scalers:
            return torch.tensor(1.0)
        return min((s.scale for s in scalers), key=float)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All active modules' param groups, each tagged with ``"module": name``."""
        return [g for info in self._active() for g in info.optimizer.param_groups]

    # ---- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{module: {"state", "param_groups", "loss_scaler"}}`` with state by name.

        Inactive modules carry only their loss scaler, so every rank (including one
        that holds no part of a module) can restore every scaler. A sharded module's
        state holds this rank's rows only (same-layout round trips; reshard through
        :meth:`sharded_state_dict`).
        """
        out: dict[str, dict[str, Any]] = {}
        for name, info in self.module_infos.items():
            entry: dict[str, Any] = {"loss_scaler": info.loss_scaler.state_dict()}
            if info.is_active:
                order = self._order[name]
                inner = info.optimizer.state_dict()
                entry["state"] = {order[i]: v for i, v in inner["state"].items()}
                entry["param_groups"] = [
                    {**g, "params": [order[i] for i in g["params"]]} for g in inner["param_groups"]
                ]
            out[name] = entry
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output, or a loaded :meth:`sharded_state_dict`.

        Unfreezing on resume: a module that was frozen (or had no parameters) when the
        checkpoint was written has an entry without ``param_groups``; if it trains now,
        it starts from *fresh* optimizer state (Adam moments and step count empty, like a
        new module) while every other module resumes exactly. Its schedule restarts too
        (see ``load_schedulers_state_dict``). Freezing on resume simply ignores the saved
        state of the now-frozen module.

        A sharded module accepts its own rows (same layout) or full parameter-shaped
        state (an unsharded optimizer's state dict: each rank slices its rows out).

        Raises:
            ValueError: an active module missing from the checkpoint, a checkpoint param
                group holding different parameters, state for unknown parameters, or a
                state tensor whose shape fits neither the parameter nor its shard.
        """
        self.finish_param_gather()  # a late gather would overwrite the loaded rows
        if any(isinstance(k, str) and k.startswith(_PREFIX + ".") for k in state_dict):
            state_dict = self._unflatten(state_dict)
        for name, info in self.module_infos.items():
            entry = state_dict.get(name)
            if entry is None:
                if info.is_active:
                    raise ValueError(f"optimizer checkpoint has no state for module {name!r}")
                continue
            if "loss_scaler" in entry:
                info.loss_scaler.load_state_dict(entry["loss_scaler"])
            if not info.is_active:
                continue
            if "param_groups" not in entry:
                info.optimizer.state.clear()  # frozen when saved: start fresh
                continue
            info.optimizer.load_state_dict(self._to_indexed(name, info, entry))
            for group in info.optimizer.param_groups:
                group["module"] = name

    def _to_indexed(self, name: str, info: ModuleOptimizerInfo, entry: dict) -> dict:
        """Name-keyed entry -> torch's index-keyed optimizer state dict."""
        order = self._order[name]
        index = {n: i for i, n in enumerate(order)}
        saved_groups = entry.get("param_groups", [])
        current = info.optimizer.state_dict()["param_groups"]
        if len(saved_groups) != len(current):
            raise ValueError(
                f"module {name!r}: checkpoint has {len(saved_groups)} param groups, "
                f"the optimizer has {len(current)}"
            )
        groups = []
        for saved, cur in zip(saved_groups, current, strict=True):
            want = sorted(order[i] for i in cur["params"])
            if sorted(saved["params"]) != want:
                raise ValueError(
                    f"module {name!r}: checkpoint param group {saved['params']} does not "
                    f"match the optimizer's {want}"
                )
            # Keep the current index order: torch pairs saved and current params by position.
            groups.append({**saved, "params": cur["params"]})
        unknown = sorted(set(entry.get("state", {})) - set(index))
        if unknown:
            raise ValueError(f"module {name!r}: checkpoint state for unknown params {unknown}")
        params = dict(info.params)
        state = {
            index[n]: {k: _state_value(info, n, params[n], k, v) for k, v in st.items()}
            for n, st in entry.get("state", {}).items()
        }
        return {"state": state, "param_groups": groups}

    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, Any] | None = None, is_loading: bool = False
    ) -> dict[str, Any]:
        """Flat dict for ``torch.distributed.checkpoint``.

        Keys: ``optimizer.<module>.state.<param>.<key>`` (tensors; DTensors for DTensor
        parameters and for sharded modules, whose rows become a ``Shard`` of the
        parameter's global shape, so DCP reshards both), ``optimizer.<module>.param_groups``,
        ``optimizer.<module>.has_state`` and ``optimizer.<module>.loss_scaler`` (plain
        objects written by whichever rank holds the module, so they survive when global
        rank 0 is not in it).

        Args:
            model_sharded_state_dict: accepted for Megatron parity; DTensor parameters
                carry their own sharding, so it is not needed.
            is_loading: create the optimizer state first (a zero-lr step on zero grads)
                so DCP has tensors to load into; pass the loaded dict to
                :meth:`load_state_dict`. A module the checkpoint has no state for (frozen
                when saved; load with DCP's ``allow_partial_load``) then starts fresh.

        Returns:
            The flat state dict.
        """
        del model_sharded_state_dict
        self.finish_param_gather()
        if is_loading:
            self._init_state_for_loading()
        flat: dict[str, Any] = {}
        for name, entry in self.state_dict().items():
            info, prefix = self.module_infos[name], f"{_PREFIX}.{name}."
            flat[prefix + "loss_scaler"] = entry["loss_scaler"]
            if "param_groups" in entry:
                flat[prefix + "param_groups"] = entry["param_groups"]
                flat[prefix + _HAS_STATE] = not is_loading
            for pname, st in entry.get("state", {}).items():
                for key, value in st.items():
                    if info.zero is not None:
                        value = info.zero.to_dtensor(pname, value)
                    flat[f"{prefix}state.{pname}.{key}"] = value
        return flat

    def _unflatten(self, flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in self.module_infos:
            prefix = f"{_PREFIX}.{name}."
            entry: dict[str, Any] = {}
            if prefix + "loss_scaler" in flat:
                entry["loss_scaler"] = flat[prefix + "loss_scaler"]
            if prefix + "param_groups" in flat and flat.get(prefix + _HAS_STATE, True):
                entry["param_groups"] = flat[prefix + "param_groups"]
                entry["state"] = {}
                for key, value in flat.items():
                    if key.startswith(prefix + "state."):
                        # State keys (exp_avg, step, ...) have no dots; parameter names do.
                        pname, skey = key[len(prefix + "state.") :].rsplit(".", 1)
                        entry["state"].setdefault(pname, {})[skey] = value
            if entry:
                out[name] = entry
        return out

    def _init_state_for_loading(self) -> None:
        """Materialise lazy optimizer state with a zero-lr step on zero gradients."""
        for info in self._active():
            opt = info.optimizer
            params = [p for g in opt.param_groups for p in g["params"]]
            if all(p in opt.state and opt.state[p] for p in params):
                continue
            lrs = [g["lr"] for g in opt.param_groups]
            grads = [p.grad for p in params]
            for g in opt.param_groups:
                g["lr"] = 0.0
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            for g, lr in zip(opt.param_groups, lrs, strict=True):
                g["lr"] = lr
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad


def _add_stats(target: torch.Tensor, local: torch.Tensor | None) -> None:
    """Add a local gradient's squared norm and zero count to ``target`` (in place)."""
    if local is not None:
        target[0] += torch.linalg.vector_norm(local, dtype=torch.float64).to(target) ** 2
        target[1] += local.numel() - torch.count_nonzero(local).to(target)


def _norm_and_zeros(slots: torch.Tensor) -> tuple[float, int]:
    """(sqrt of the summed squared norms, summed zeros) of world-reduced slot pairs."""
    pairs = slots.view(-1, 2)
    return math.sqrt(pairs[:, 0].sum().item()), int(round(pairs[:, 1].sum().item()))


def _index_names(module: str, info: ModuleOptimizerInfo) -> list[str]:
    """Parameter names in the inner optimizer's index order (index names if unnamed)."""
    if info.optimizer is None:
        raise ValueError(f"module {module!r} is active but has no optimizer")
    ordered = [p for g in info.optimizer.param_groups for p in g["params"]]
    if not info.params:
        info.params = [(str(i), p) for i, p in enumerate(ordered)]
    names = {id(p): n for n, p in info.params}
    missing = [i for i, p in enumerate(ordered) if id(p) not in names]
    if missing:
        raise ValueError(f"module {module!r}: optimizer params {missing} are not named in params")
    return [names[id(p)] for p in ordered]


def _state_value(info: ModuleOptimizerInfo, pname: str, param: torch.Tensor, key: str,
                 value: Any) -> Any:
    """A saved state value checked (and, for a sharded module, sliced) for ``param``."""
    if info.zero is not None:
        return info.zero.local_state(pname, value)
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
        raise ValueError(
            f"optimizer state {pname}.{key} has shape {tuple(value.shape)}, the parameter "
            f"{tuple(param.shape)}: a sharded optimizer's state loads into an unsharded one "
            "only through sharded_state_dict (DCP)"
        )
    return value
