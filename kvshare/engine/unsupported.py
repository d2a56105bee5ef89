"""The refusal of a model the built-in engine cannot run: by name, before any weight is read."""

from __future__ import annotations

from kvshare.errors import UserError


class UnsupportedModel(UserError):
    """A model configuration uses a feature the built-in engine does not implement."""


def refuse(feature: str, detail: str) -> UnsupportedModel:
    """The error naming ``feature`` (what the engine lacks) and ``detail`` (where the configuration asks for it)."""
    return UnsupportedModel(f"the built-in engine does not support {feature} ({detail})")
