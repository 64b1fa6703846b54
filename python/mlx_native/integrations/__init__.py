"""Where users already are: backends of other libraries over mlx_native's front door.

- :mod:`mlx_native.integrations.transformers`: a Hugging Face transformers attention
  backend, ``attn_implementation=mn.integrations.transformers.register()``.

Each submodule imports its library (torch, transformers) when it is first used, as an
attribute of this package or by its own import; ``import mlx_native`` imports none of them,
and nothing in the core imports this package."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["transformers"]


def __getattr__(name: str) -> Any:
    # PEP 562: the submodule (and its library) loads on first use.
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
