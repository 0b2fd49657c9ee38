"""Rules the rank set-up enforces, checked from the config before any rank starts.

``mimotron plan`` and ``mimotron train`` accept exactly the same configs: both call
:func:`mimotron.parallel.layout.check_layout`, which ends with :func:`check_setup_rules`.
Every rule here is one that building a rank (model, tensor-parallel plan, optimizer,
schedulers, loss scaler, profiler) would otherwise apply only after the ranks have
started, where it fails on some ranks while their peers wait in a collective. Each rule
is one named function, also called by the rank-side code that relies on it, so the two
can never disagree:

* :func:`check_trainable`: something trains (a module, or an encoder's projector);
* :func:`check_weight_decay_schedule`: a weight decay that moves from start to end
  needs a ``linear`` or ``cosine`` style (the LR scheduler);
* :func:`check_loss_scale`: the dynamic loss scale's floor is positive (fp16);
* :func:`check_tensor_widths`: the tensor-parallel degree divides every width the
  column-parallel linears split (the SwiGLU and the projector's hidden width);
* :func:`check_profile_ranks`: ``profile.ranks`` name ranks of the world.

Checks that need model weights or data files stay where those are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mimotron.config.moe_config import moe_options
from mimotron.config.schema import default_ffn_hidden_size
from mimotron.names import LANGUAGE

if TYPE_CHECKING:
    from mimotron.config.schema import MimoConfig, ProfileConfig


def check_setup_rules(cfg: MimoConfig, world_size: int) -> None:
    """Every rule of this module (see the module docstring).

    Args:
        cfg: a config that passed :func:`mimotron.config.validation.validate_config`.
        world_size: the layout's number of ranks.

    Raises:
        ValueError: one line naming the field, its value and what would be valid.
    """
    check_trainable(cfg)
    check_weight_decay_schedule(cfg)
    check_loss_scale(cfg)
    for name in cfg.modules:
        check_tensor_widths(cfg, name)
    check_profile_ranks(cfg.profile, world_size)


def check_trainable(cfg: MimoConfig) -> None:
    """Raise when nothing trains: every module frozen whole (``freeze = true``).

    An encoder with ``freeze = "encoder"`` trains its projector, so a run whose other
    modules are all frozen (LLaVA's stage 1) still trains.

    Raises:
        ValueError: naming ``modules.*.freeze``.
    """
    if cfg.modules and all(m.fully_frozen for m in cfg.modules.values()):
        encoders = [n for n in sorted(cfg.modules) if cfg.modules[n].is_encoder]
        part = (f'; or freeze only an encoder\'s tower (modules.{encoders[0]}.freeze = '
                '"encoder") so its projector trains' if encoders else "")
        raise ValueError(
            f"modules.*.freeze: nothing trains: every module ({sorted(cfg.modules)}) is "
            f"frozen; unfreeze at least one{part}"
        )


def check_weight_decay_schedule(cfg: MimoConfig) -> None:
    """Raise when a module's weight decay changes over the run with ``constant`` style.

    As :func:`mimotron.optim.build.build_schedulers` reads them: with
    ``start_weight_decay`` or ``end_weight_decay`` set, the unset one is the optimizer's
    ``weight_decay``; two different values need ``weight_decay_style`` ``linear`` or
    ``cosine``.

    Raises:
        ValueError: naming the scheduler table (``scheduler`` or the module's override).
    """
    for name in cfg.modules:
        sched, opt = cfg.effective_scheduler(name), cfg.effective_optimizer(name)
        if sched.start_weight_decay is None and sched.end_weight_decay is None:
            continue
        start = opt.weight_decay if sched.start_weight_decay is None else sched.start_weight_decay
        end = opt.weight_decay if sched.end_weight_decay is None else sched.end_weight_decay
        if sched.weight_decay_style == "constant" and start != end:
            where = "scheduler" if sched == cfg.scheduler else f"modules.{name}.optimizer"
            raise ValueError(
                f"{where}.weight_decay_style='constant' is invalid with a weight decay "
                f"from {start} to {end} (start_weight_decay / end_weight_decay, an unset "
                "one being optimizer.weight_decay): use 'linear' or 'cosine', or equal values"
            )


def check_loss_scale(cfg: MimoConfig) -> None:
    """Raise when a module's ``min_loss_scale`` is not positive under fp16.

    Only fp16 builds the dynamic loss scaler that uses it
    (:class:`~mimotron.optim.loss_scaler.DynamicLossScaler`).

    Raises:
        ValueError: naming the optimizer table.
    """
    if cfg.train.precision != "fp16":
        return
    for name in cfg.modules:
        floor = cfg.effective_optimizer(name).min_loss_scale
        if floor <= 0:
            where = ("optimizer" if floor == cfg.optimizer.min_loss_scale
                     else f"modules.{name}.optimizer")
            raise ValueError(f"{where}.min_loss_scale={floor!r} is invalid: expected a "
                             "positive number (the fp16 loss scale's floor)")


def check_tensor_widths(cfg: MimoConfig, name: str) -> None:
    """Raise unless module ``name``'s TP degree divides the widths its linears split.

    The column-parallel ``w1`` / ``w3`` split the SwiGLU width of the dense layers
    (``ffn_hidden_size``, or its default; a module whose layers are all experts has
    none), an encoder's projector ``fc1`` its hidden width (``projector_hidden_size``,
    or the language model's width). The head counts and ``hidden_size`` are checked by
    the layout itself; routed and shared experts are not tensor parallel.

    Raises:
        ValueError: naming the module's ``parallel.tensor`` and the width's key.
    """
    mod = cfg.modules[name]
    tp = mod.parallel.tensor
    if tp == 1:
        return
    moe = moe_options(mod)
    widths = []
    if moe is None or not all(moe.is_moe_layer(i) for i in range(mod.num_layers)):
        widths.append(("ffn_hidden_size",
                       mod.ffn_hidden_size or default_ffn_hidden_size(mod.hidden_size)))
    if mod.is_encoder:
        widths.append(("projector_hidden_size",
                       mod.projector_hidden_size or cfg.modules[LANGUAGE].hidden_size))
    for key, width in widths:
        if width % tp:
            raise ValueError(
                f"modules.{name}.parallel.tensor={tp} is invalid: it must divide the "
                f"width {width} that the column-parallel linears split (modules.{name}.{key}"
                f"{'' if getattr(mod, key) else ', its default'})"
            )


def check_profile_ranks(profile: ProfileConfig, world_size: int) -> None:
    """Raise when profiling is on and ``profile.ranks`` names a rank outside the world.

    Args:
        profile: the ``[profile]`` table.
        world_size: the layout's number of ranks.

    Raises:
        ValueError: naming ``profile.ranks`` and the valid range.
    """
    bad = [r for r in profile.ranks if not 0 <= r < world_size]
    if profile.enabled and bad:
        raise ValueError(f"profile.ranks={profile.ranks!r} is invalid: ranks {bad} are "
                         f"outside the world of {world_size} ranks (valid: 0..{world_size - 1})")
