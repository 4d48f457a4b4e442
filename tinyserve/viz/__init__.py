"""Views over the real objects: source rendering, matplotlib drawings, ipywidgets steppers.

This is the bottom layer: it may import every other module of the package, and none of them
imports it. Names are resolved lazily from the submodules listed below, so importing
``tinyserve.viz`` stays cheap and a chapter pulls in only the drawings it uses.
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("source", "kv_cache", "blocks", "rounds", "stepper", "cache", "attention", "engine",
               "parallel", "performance", "beyond", "attention_kernel", "figures")


def lazy_getattr(package: str, submodules: tuple[str, ...], name: str):
    """Find ``name`` in the first of ``package``'s submodules that defines it (importing as it goes)."""
    for sub in submodules:
        try:
            module = importlib.import_module(f"{package}.{sub}")
        except ModuleNotFoundError as e:
            if e.name == f"{package}.{sub}":
                continue
            raise
        if hasattr(module, name) and not name.startswith("_"):
            return getattr(module, name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def __getattr__(name: str):
    return lazy_getattr(__name__, _SUBMODULES, name)
