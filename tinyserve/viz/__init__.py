"""Views over the real objects: source rendering, matplotlib drawings, ipywidgets steppers.

This is the bottom layer: it may import every other module of the package, and none of them
imports it. Names are resolved lazily from the submodules listed below, so importing
``tinyserve.viz`` stays cheap and a chapter pulls in only the drawings it uses.
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("source", "kv_cache", "blocks", "rounds", "stepper", "cache", "attention", "engine",
               "parallel", "performance", "beyond", "attention_kernel", "figures")


def __getattr__(name: str):
    for sub in _SUBMODULES:
        try:
            module = importlib.import_module(f"{__name__}.{sub}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{sub}":
                continue
            raise
        if hasattr(module, name) and not name.startswith("_"):
            return getattr(module, name)
    raise AttributeError(f"module 'tinyserve.viz' has no attribute {name!r}")
