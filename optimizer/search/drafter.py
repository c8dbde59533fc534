"""Drafter: the speculative-decoding drafter a study declares, which opens the search of
the verify-budget knobs.

A drafter is what the deployment would run besides the target model: how often the target
accepts its drafts (an acceptance profile per draft position, optionally per SLO class or
tenant: ``policies.speculative.AcceptanceModel``), what drafting costs, and which engine
drafter it is, so the exports can name it. Speculation is only searched when a study
declares one, because every speculative figure depends on these numbers.

Declared as a TOML file (``servetune tune --speculative drafter.toml``) or as the spec's
``[speculative]`` table, with the same keys::

    method = "eagle3"        # vLLM speculative_config.method (SGLang's algorithm is derived)
    model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"   # its checkpoint, if the method uses one
    acceptance = [0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]   # P(draft i accepted | 1..i-1 were)
    spread = 0.3             # per-verify variation of the true confidences (0..1)
    bias = 0.0               # the scheduler sees confidences x (1 + bias)
    draft_cost_mode = "fraction"   # or "mtp": draft_cost in ms per drafted position
    draft_cost = 0.05        # fraction: x the target's decode step per drafted position
    # max_draft_tokens = 8   # longest draft searched (default: the longest profile, at most 16)
    # by = "slo_class"       # profiles below are per SLO class, or "tenant"
    # sglang_algorithm = "EAGLE3"   # when SGLang's name is not derived from method
    # [profiles]
    # code = [0.95, 0.9, 0.85]

``method`` and ``model`` only label the exports; left out, the exported files carry a
marked placeholder for the user to fill in rather than a guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.config import KNOB_BY_NAME, ConfigError, PolicyConfig
from policies.speculative import DEFAULT_PROFILE, AcceptanceModel
from studies.tomlfile import read_toml

#: SGLang 0.5.23 ``--speculative-algorithm`` for a vLLM 0.33 ``speculative_config.method``.
SGLANG_ALGORITHMS = {"eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "NEXTN", "deepseek_mtp": "NEXTN",
                     "draft_model": "STANDALONE", "ngram": "NGRAM", "dflash": "DFLASH", "dspark": "DSPARK"}
SGLANG_ALGORITHM_NAMES = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")
#: vLLM methods that run no draft checkpoint of their own (n-gram lookup, suffix trees, the
#: target's MTP layers): a drafter without ``model`` exports none; any other gets a placeholder.
CHECKPOINT_FREE_METHODS = ("ngram", "suffix", "mtp", "deepseek_mtp")
#: Keys that only name the drafter for the exports; they change no simulated figure.
DRAFTER_LABELS = ("method", "model", "sglang_algorithm")
_KEYS = {"method", "model", "sglang_algorithm", "acceptance", "by", "profiles", "spread", "bias", "draft_cost_mode",
         "draft_cost", "max_draft_tokens"}


class DrafterError(ValueError):
    """A drafter declaration that cannot be used, naming the key and what is valid."""


@dataclass(frozen=True)
class Drafter:
    """A declared drafter; validated on construction (``DrafterError`` names the key)."""

    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    draft_cost_mode: str = "fraction"
    draft_cost: float = 0.05
    max_draft_tokens: int = 0  # 0: the longest profile, at most the knob's limit
    method: str | None = None
    model: str | None = None
    sglang_algorithm: str | None = None

    def __post_init__(self) -> None:
        try:
            PolicyConfig(speculative_draft_cost_mode=self.draft_cost_mode, speculative_draft_cost=self.draft_cost)
        except ConfigError as exc:
            raise DrafterError(str(exc).replace("speculative_", "", 1)) from None
        limit = int(KNOB_BY_NAME["num_speculative_tokens"].high)
        longest = max(len(p) for p in (self.acceptance.default, *self.acceptance.profiles.values()))
        tokens = self.max_draft_tokens or min(longest, limit)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= limit:
            raise DrafterError(f"max_draft_tokens must be an integer in [1, {limit}], got {self.max_draft_tokens!r}")
        object.__setattr__(self, "max_draft_tokens", tokens)
        for name in ("method", "model", "sglang_algorithm"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise DrafterError(f"{name} must be a non-empty name, got {value!r}")
        if self.sglang_algorithm is not None and self.sglang_algorithm not in SGLANG_ALGORITHM_NAMES:
            raise DrafterError(f"sglang_algorithm must be one of {list(SGLANG_ALGORITHM_NAMES)}, "
                               f"got {self.sglang_algorithm!r}")

    @property
    def sglang(self) -> str | None:
        """SGLang's ``--speculative-algorithm`` for this drafter, when known."""
        return self.sglang_algorithm or SGLANG_ALGORITHMS.get((self.method or "").lower())

    @property
    def names(self) -> dict[str, str | None]:
        """What the engine files name: method (vLLM), model, sglang (SGLang's algorithm)."""
        return {"method": self.method, "model": self.model, "sglang": self.sglang}

    def config_values(self) -> dict[str, Any]:
        """The PolicyConfig knobs the drafter fixes: its draft cost."""
        return {"speculative_draft_cost_mode": self.draft_cost_mode, "speculative_draft_cost": self.draft_cost}

    def to_dict(self) -> dict[str, Any]:
        """The declaration as TOML-shaped keys (None = unset); ``drafter_from_mapping`` reads it back."""
        a = self.acceptance
        return {"method": self.method, "model": self.model, "sglang_algorithm": self.sglang_algorithm,
                "acceptance": list(a.default), "by": a.by, "profiles": {k: list(v) for k, v in a.profiles.items()},
                "spread": a.spread, "bias": a.bias, "draft_cost_mode": self.draft_cost_mode,
                "draft_cost": self.draft_cost, "max_draft_tokens": self.max_draft_tokens}


def drafter_from_mapping(data: Mapping[str, Any], where: str = "[speculative]") -> Drafter:
    """A Drafter from the declaration's keys; DrafterError naming ``where`` and the key."""
    if not isinstance(data, Mapping):
        raise DrafterError(f"{where} must be a table of drafter keys, got {data!r}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise DrafterError(f"{where} has unknown key(s) {unknown}; valid: {sorted(_KEYS)}")
    given = {k: v for k, v in data.items() if v is not None}
    try:
        acceptance = AcceptanceModel(default=given.pop("acceptance", DEFAULT_PROFILE),
                                     by=given.pop("by", "slo_class"), profiles=given.pop("profiles", {}),
                                     spread=_number(given.pop("spread", 0.0), "spread"),
                                     bias=_number(given.pop("bias", 0.0), "bias"))
        return Drafter(acceptance, **given)
    except (DrafterError, ValueError, TypeError) as exc:
        raise DrafterError(f"{where}: {exc}") from None


def load_drafter(path: str | Path) -> Drafter:
    """A Drafter from a TOML file of the declaration's keys."""
    label = f"drafter file {path}"
    return drafter_from_mapping(read_toml(path, DrafterError, label), label)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DrafterError(f"{name} must be a finite number, got {value!r}")
    return float(value)
