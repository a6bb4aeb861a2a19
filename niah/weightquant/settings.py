"""The ``weightquant:`` section of a config (its settings and defaults: :data:`niah.schema.WEIGHTQUANT`)."""

from __future__ import annotations

from ..schema import section


def settings(cfg: dict) -> dict:
    """The config's ``weightquant`` section over its defaults (:data:`niah.schema.WEIGHTQUANT`); unknown keys are errors."""
    return section(cfg, "weightquant")
