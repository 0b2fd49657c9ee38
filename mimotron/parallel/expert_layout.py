"""Expert layouts from the config alone: validation and the ``mimotron plan`` expert table.

Pure functions (no process group), called by :func:`mimotron.parallel.layout.check_layout`
before any process starts, so an invalid expert layout fails with one line naming the
field on every rank alike and in ``mimotron plan``.

A module's expert view is ``[expert_tensor, expert, expt_dp, pipeline]`` over its ranks
(``expert_tensor`` fastest, ``pipeline`` shared with the base grid,
:func:`mimotron.parallel.groups.build_module_grid`); the rank at ``ep`` coordinate ``r``
holds the global experts ``[r * E / expert, (r + 1) * E / expert)`` of every MoE layer
of its stage (with ``expert_tensor > 1``, its ``expt_tp`` slice of their width).
"""

from __future__ import annotations

from mimotron.config.schema import MimoConfig, ModuleConfig, default_ffn_hidden_size


def num_experts_of(mod: ModuleConfig) -> int:
    """``modules.<m>.num_experts`` (0 = dense)."""
    return int(getattr(mod, "num_experts", 0) or 0)


def expert_width(mod: ModuleConfig) -> int:
    """``F`` of a routed expert: ``moe_ffn_hidden_size``, else the dense width."""
    width = getattr(mod, "moe_ffn_hidden_size", 0) or mod.ffn_hidden_size
    return width or default_ffn_hidden_size(mod.hidden_size)


def check_expert_layout(cfg: MimoConfig, name: str) -> None:
    """Raise for an expert layout no rank can build.

    Raises:
        ValueError: one line naming the field and what would be valid.
    """
    mod = cfg.modules[name]
    par, p = mod.parallel, f"modules.{name}.parallel"
    experts = num_experts_of(mod)
    top_k = int(getattr(mod, "top_k", 1) or 1)
    if experts and top_k > experts:
        raise ValueError(f"modules.{name}.top_k={top_k} is invalid: it must be at most "
                         f"modules.{name}.num_experts={experts}")
    if par.expert <= 1 and par.expert_tensor <= 1:
        return
    if mod.hf_path:  # its experts come from config.json; the meta-device load path lacks EP
        raise ValueError(f"{p}.expert={par.expert} x expert_tensor={par.expert_tensor} with "
                         "hf_path is not supported yet; use 1")
    if not experts:
        key = "expert" if par.expert > 1 else "expert_tensor"
        raise ValueError(f"{p}.{key}={getattr(par, key)} is invalid: modules.{name}."
                         "num_experts is 0 (a dense module has no experts to spread); use 1")
    width = expert_width(mod)
    if width % par.expert_tensor:
        raise ValueError(f"{p}.expert_tensor={par.expert_tensor} is invalid: it must divide "
                         f"the expert width {width} (modules.{name}.moe_ffn_hidden_size)")
    if experts % par.expert:
        raise ValueError(f"{p}.expert={par.expert} is invalid: it must divide "
                         f"modules.{name}.num_experts={experts}")
    per_stage = par.expert * par.expert_tensor * par.pipeline
    if par.size % per_stage:
        raise ValueError(f"{p}.expert={par.expert} is invalid: expert x expert_tensor x "
                         f"pipeline ({per_stage}) must divide the module's {par.size} ranks")


def expert_coordinate(local_rank: int, mod: ModuleConfig) -> dict[str, int]:
    """Expert-view coordinates of a module-local rank (``expert_tensor`` fastest)."""
    par = mod.parallel
    expt_dp = par.size // (par.expert * par.expert_tensor * par.pipeline)
    coord = {}
    for dim, size in (("expt_tp", par.expert_tensor), ("ep", par.expert),
                      ("expt_dp", expt_dp), ("pp", par.pipeline)):
        coord[dim] = local_rank % size
        local_rank //= size
    return coord


def format_expert_layout(cfg: MimoConfig) -> str:
    """Which global experts each rank holds, per MoE module; empty without MoE modules."""
    lines = []
    for name, mod in cfg.modules.items():
        experts = num_experts_of(mod)
        if not experts:
            continue
        par = mod.parallel
        per = experts // par.expert
        lines.append(f"experts of {name}: {experts} per MoE layer, expert={par.expert}, "
                     f"{per} per rank")
        for local in range(par.size):
            c = expert_coordinate(local, mod)
            start = c["ep"] * per
            cols = (f"  F cols {c['expt_tp'] + 1}/{par.expert_tensor}"
                    if par.expert_tensor > 1 else "")
            lines.append(f"  rank {par.rank_offset + local:>3}  ep {c['ep']}  expt_dp "
                         f"{c['expt_dp']}  pp {c['pp']}  experts {start}-{start + per - 1}{cols}")
    return "\n".join(lines)
