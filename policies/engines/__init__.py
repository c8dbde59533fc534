"""The targets a recommendation is for: one module per engine at its pinned version
(``vllm``, ``sglang``), and servetune's own what-if policies (``servetune``).

``target(name)`` returns the module's ``ENGINE``; ``ENGINES`` are the deployable ones.
"""

from __future__ import annotations

from policies.engines.base import Deployment, EngineContext, EngineError, Flag, Target

ENGINES = ("vllm", "sglang")
TARGETS = (*ENGINES, "servetune")
#: The engines' defaults by name: every recommendation's baselines.
PRESETS = tuple(f"{name}-default" for name in ENGINES)


def target(name: str) -> Target:
    """The target named ``name``; raises EngineError naming the valid ones."""
    from policies.engines import servetune, sglang, vllm

    by_name = {"vllm": vllm.ENGINE, "sglang": sglang.ENGINE, "servetune": servetune.ENGINE}
    if name not in by_name:
        raise EngineError(f"unknown engine {name!r}; valid: {list(TARGETS)}")
    return by_name[name]


def preset(name: str, ctx: EngineContext):
    """The named engine's defaults (``vllm-default``, ``sglang-default``) for ``ctx``."""
    if name not in PRESETS:
        raise EngineError(f"unknown preset {name!r}; valid: {list(PRESETS)}")
    return target(name.removesuffix("-default")).defaults(ctx)


__all__ = ["PRESETS", "preset", "ENGINES", "TARGETS", "Deployment", "EngineContext", "EngineError", "Flag", "Target", "target"]
