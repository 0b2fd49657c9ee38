"""Reading a Hugging Face ``config.json`` dict: picking the tower's part, defaults, checks."""

from __future__ import annotations

from typing import Any


def select_config(
    config: dict[str, Any], own_types: tuple[str, ...], full_types: tuple[str, ...], sub_key: str
) -> dict[str, Any]:
    """The tower's own config: ``config`` itself, or ``config[sub_key]`` of a full model.

    Args:
        config: the parsed ``config.json``.
        own_types: ``model_type`` values of the tower's own config (``clip_vision_model``).
        full_types: ``model_type`` values of a full model holding it (``clip``).
        sub_key: the key of the nested tower config in a full model (``vision_config``).

    Returns:
        The tower's config dict.

    Raises:
        ValueError: a ``model_type`` of another family.
    """
    model_type = config.get("model_type")
    if model_type in own_types:
        return config
    if model_type in full_types:
        sub = config.get(sub_key)
        if not isinstance(sub, dict):
            raise ValueError(f"config.json of model_type={model_type!r} has no {sub_key!r} dict")
        return sub
    raise ValueError(
        f"config.json model_type={model_type!r} is not supported here; expected one of "
        f"{sorted(own_types + full_types)}"
    )


def read_keys(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` overridden by the values ``config`` sets (the ``transformers`` defaults).

    Args:
        config: the tower's config dict.
        defaults: key -> the value ``transformers`` uses when the key is absent.

    Returns:
        key -> value for every key of ``defaults``.
    """
    return {key: config.get(key, default) for key, default in defaults.items()}


def reject_set(config: dict[str, Any], keys: tuple[str, ...], why: str) -> None:
    """Raise ``ValueError`` naming the first of ``keys`` that ``config`` sets to a truthy value.

    Args:
        config: the tower's config dict.
        keys: options mimotron does not implement (dropout rates, layer drop, ...).
        why: what would be valid, for the message.

    Raises:
        ValueError: one of ``keys`` is set (non-zero, non-empty, True).
    """
    for key in keys:
        if config.get(key):
            raise ValueError(f"config.json {key}={config[key]!r} is not supported; {why}")
