"""Layout-independent deterministic parameter initialisation.

docs/design.md ("The parity contract") requires that any parallel layout trains exactly
like one process. The first half of that is the weights: every parameter is drawn from
its own ``torch.Generator`` seeded by a stable hash of ``(seed, full parameter name)``,
on the parameter's FULL shape, on the CPU. So:

- a pipeline stage that holds only layers 4..7 gets exactly the values those layers have
  in the full model (names carry global layer indices, and no draw depends on any other
  parameter's existence or order);
- a tensor- or data-sharded parameter (a DTensor) gets the slice of the full tensor that
  its placement assigns to this rank, without communication;
- CPU and accelerator runs start from identical values.

Standard deviations (chosen by measurement on the digits task, see below):

- Linear weights: ``1 / sqrt(fan_in)`` (LeCun normal). Inputs of q/k/v, the SwiGLU gates,
  the projectors and the output head are RMS-normalised, so this gives unit-scale
  activations: attention can turn sharp early and the LM picks up the placeholder
  positions quickly. The output head then starts with logits of std ~1 (initial loss
  slightly above ``ln(vocab)``).
- Projections that write onto the residual stream (``wo``, ``w2``): ``0.02 /
  sqrt(2 * num_layers)`` (GPT-2), read from the layer's ``init_std`` attribute set by
  :mod:`mimotron.models.blocks`: every block starts close to the identity and depth
  does not grow the residual variance.
- Embeddings and learned position embeddings: 0.02 (GPT-2).
- Convolutions (patch embedding, audio front end): ``1 / sqrt(fan_in)`` as well, so
  features of raw pixels / log spectra come out with unit scale.
- Norm weights 1, all biases 0.

Measured (single process, the ~650k-parameter digits model, sklearn digit images, lr
2e-3 with 50 warm-up steps, batch 64, two data orders): held-out image-to-digit accuracy
after 25 steps was 0.55-0.62 with this scheme versus 0.21-0.23 with GPT-2's 0.02 for
every Linear; both reach ~0.82 by step 150.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mimotron.models.blocks import INIT_STD, RMSNorm

_NORMS = (RMSNorm, nn.LayerNorm)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def parameter_seed(seed: int, name: str) -> int:
    """Stable 63-bit generator seed for one parameter.

    ``hashlib`` rather than ``hash()``: Python salts ``hash`` of strings per process, and
    every rank (and every later run) must derive the same seed.

    Args:
        seed: run seed (``train.seed``).
        name: full parameter name, e.g. ``language_model.layers.1.attn.wq.weight``.

    Returns:
        A non-negative integer below ``2**63``.
    """
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _std_for(owner: nn.Module, local_name: str, shape: torch.Size) -> float | None:
    """The normal std for a parameter, ``None`` for a constant (see module docstring)."""
    if local_name == "bias" or isinstance(owner, _NORMS):
        return None
    # Modules holding several stacked matrices (MoE experts) give one std per parameter.
    per_parameter = getattr(owner, "init_stds", None)
    if per_parameter is not None and local_name in per_parameter:
        return float(per_parameter[local_name])
    if isinstance(owner, _CONVS):
        fan_in = math.prod(shape[1:])
        return 1.0 / math.sqrt(fan_in)
    if isinstance(owner, nn.Linear):
        # Residual output projections carry an explicit (depth-scaled) init_std.
        return float(getattr(owner, "init_std", 1.0 / math.sqrt(shape[1])))
    if isinstance(owner, nn.Embedding):
        return float(getattr(owner, "init_std", INIT_STD))
    if len(shape) >= 2:
        # Free-standing parameters such as learned position embeddings.
        return float(getattr(owner, "init_std", INIT_STD))
    raise ValueError(
        f"init_parameters_: no rule for 1-D parameter {local_name!r} of "
        f"{type(owner).__name__}; name it 'bias', use a norm class, or make it >= 2-D"
    )


def full_init_value(
    owner: nn.Module, local_name: str, full_name: str, shape: torch.Size, seed: int
) -> torch.Tensor:
    """The fp32 CPU value a parameter gets, on its full (unsharded) shape.

    Args:
        owner: the module the parameter is registered on (its type picks the rule).
        local_name: the attribute name on ``owner`` (``weight``, ``bias``, ...).
        full_name: the name the hash is taken of.
        shape: full shape of the parameter.
        seed: run seed.

    Returns:
        A new fp32 tensor on the CPU.
    """
    std = _std_for(owner, local_name, shape)
    if std is None:
        fill = 1.0 if isinstance(owner, _NORMS) and local_name == "weight" else 0.0
        return torch.full(tuple(shape), fill, dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(parameter_seed(seed, full_name))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std


@torch.no_grad()
def init_parameters_(module: nn.Module, seed: int, prefix: str = "") -> nn.Module:
    """Initialise every parameter of ``module`` in place from ``(seed, prefix + name)``.

    Parameters on the ``meta`` device are skipped (they have no storage; building on meta
    is how parameter counts are taken). DTensor parameters receive their local slice of
    the full value. Shared (tied) parameters are initialised once, under their first name.

    Args:
        module: the module to initialise.
        seed: run seed (``train.seed``).
        prefix: prepended to local names so they equal the names inside the full model,
            e.g. ``"language_model."`` or ``"modality_submodules.vision."``.

    Returns:
        ``module``, for chaining.
    """
    seen: set[int] = set()
    for mod_name, owner in module.named_modules():
        for local_name, param in owner.named_parameters(recurse=False):
            if id(param) in seen or param.is_meta:
                continue
            seen.add(id(param))
            full_name = f"{prefix}{mod_name}.{local_name}" if mod_name else prefix + local_name
            value = full_init_value(owner, local_name, full_name, param.shape, seed)
            _assign(param, value)
    return module


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the full ``value`` into ``param``, keeping only this rank's shard of a DTensor."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank computed the same full value, so each just slices
        # its own shard, with no collective (ranks may initialise at different times).
        local = distribute_tensor(
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(value)
