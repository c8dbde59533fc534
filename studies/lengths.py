"""What a scheduler may know about a request's output: its cap and a predicted length.

A request's true output length (``Trace.output_tokens``) is revealed only as tokens are
generated; no scheduling decision may read it. Two things stand in for it:

* The cap (``Trace.max_tokens``): what the client sent. Most trace files carry none; a
  real client that sends no ``max_tokens`` gets the engine's default, the model's
  context less the prompt (vLLM and SGLang both do this). ``with_client_caps`` applies
  that study-level default, or a constant, to every request without a cap.
* The estimate (``Trace.output_estimate``): the length SJF orders by. A ``Predictor``
  sets it: ``cap`` (the default; the scheduler knows only the cap), ``noisy:SIGMA`` (a
  learned length predictor with a stated error) or ``oracle`` (the true length: an upper
  bound on what any predictor could give, never a default).

Typical use, before a trace is simulated::

    trace = prepare_lengths(load_trace(path), context_len=32768, predictor="noisy:0.5", seed=1)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from studies.traces import (
    CAP_DEFAULT,
    CAP_GIVEN,
    ESTIMATE_IS_CAP,
    MAX_TOKENS,
    Trace,
    TraceError,
    TraceWarning,
)

PREDICTOR_MODES = ("cap", "noisy", "oracle")


def _token_count(name: str, value) -> int:
    """A context length or cap: an integer in [1, MAX_TOKENS]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_TOKENS:
        hint = " (0: the model's context is unknown; could its config be loaded?)" if value == 0 else ""
        raise TraceError(f"{name}={value!r}; expected an integer >= 1 and at most {MAX_TOKENS}{hint}")
    return int(value)


def with_client_caps(trace: Trace, *, context_len: int, max_tokens: int | None = None,
                     override: bool = False) -> Trace:
    """``trace`` with a real cap on every request, as a client and engine would set it.

    Caps the trace was given (``max_tokens_source == CAP_GIVEN``) are kept. Every other
    request (no cap, or an earlier study default, so this can be re-applied with a new
    context) gets ``max_tokens`` if given, else ``max(1, context_len - prompt_tokens)``:
    what vLLM and SGLang use when a request has no ``max_tokens``. A prompt at or over
    the context is not an error here; its cap is 1, and the engine rejects the request as
    the engine would. ``override=True`` makes the constant ``max_tokens`` replace the
    trace's own caps too (a study that imposes one cap on every client). The caps set are
    marked ``CAP_DEFAULT``; an estimate that is the cap follows them.
    """
    context_len = _token_count("context_len", context_len)
    if max_tokens is not None:
        max_tokens = _token_count("max_tokens", max_tokens)
    elif override:
        raise TraceError("override=True needs a constant max_tokens to replace the trace's caps with")
    fill = ~trace.max_tokens_given if not override else np.ones(trace.n, dtype=bool)
    if max_tokens is not None:
        default = np.full(trace.n, max_tokens, dtype=np.int64)
    else:
        default = np.maximum(context_len - trace.prompt_tokens, 1)
    caps = np.where(fill, default, trace.max_tokens)
    source = np.where(fill, CAP_DEFAULT, CAP_GIVEN).astype(np.int8)
    meta = {**trace.meta, "client_caps": {
        "context_len": context_len, "max_tokens": max_tokens, "override": bool(override),
        "defaulted": int(fill.sum()), "kept": int(trace.n - fill.sum()),
        "beyond_context": _warn_beyond_context(trace, caps, context_len),
    }}
    return trace.replace(max_tokens=caps, max_tokens_source=source, meta=meta)


def _warn_beyond_context(trace: Trace, caps: np.ndarray, context_len: int) -> int:
    """Say how many requests the model's context cannot hold as the trace recorded them
    (prompt + output beyond it), and how their caps stand; returns that count."""
    prompt_over = trace.prompt_tokens >= context_len
    past = ~prompt_over & (trace.prompt_tokens + np.minimum(trace.output_tokens, caps) > context_len)
    fitted = ~prompt_over & ~past & (trace.prompt_tokens + trace.output_tokens > context_len)
    beyond = prompt_over | past | fitted
    count = int(np.count_nonzero(beyond))
    if count:
        kinds = ((prompt_over, "a prompt of the context or more"), (fitted, "their output cut by their cap to fit"),
                 (past, "a cap past it"))
        parts = "; ".join(f"{int(mask.sum())} with {what}" for mask, what in kinds if mask.any())
        warnings.warn(
            f"{trace.source or 'trace'}: {count} request(s) need more than the model's context of "
            f"{context_len:,} tokens (prompt + recorded output; {_named(np.flatnonzero(beyond))}): {parts}",
            TraceWarning, stacklevel=3)
    return count


#: How many request indices a warning names before it counts the rest.
NAMED_REQUESTS = 20


def _named(indices: np.ndarray) -> str:
    """``requests 11, 57, 103`` (trace order, 0-based), the first ``NAMED_REQUESTS`` and a count of the rest."""
    shown = ", ".join(str(int(i)) for i in indices[:NAMED_REQUESTS])
    rest = len(indices) - NAMED_REQUESTS
    return f"request{'s' if len(indices) > 1 else ''} {shown}" + (f" and {rest} more" if rest > 0 else "")


@dataclass(frozen=True)
class Predictor:
    """The output-length estimate the scheduler orders by (``Trace.output_estimate``).

    * ``cap``: the estimate is ``max_tokens``; the scheduler knows only the cap. The default.
    * ``noisy:SIGMA``: ``round(true * exp(e))`` with ``e ~ N(0, SIGMA)`` per request from a
      seeded ``numpy.random.Generator``, clipped to ``[1, max_tokens]``. It stands for a
      learned length predictor whose log-error ``log(estimate / true)`` has standard
      deviation SIGMA (before the clip), unbiased in the log.
    * ``oracle``: the true length, clipped to ``[1, max_tokens]``. An UPPER BOUND on what
      length prediction could buy, for comparison only; never use it as a default.
    """

    mode: str = "cap"
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in PREDICTOR_MODES:
            raise TraceError(f"predictor mode {self.mode!r}; expected one of {list(PREDICTOR_MODES)}")
        if self.mode == "noisy":
            if isinstance(self.sigma, bool) or not (isinstance(self.sigma, (int, float)) and math.isfinite(self.sigma)
                                                    and self.sigma >= 0):
                raise TraceError(f"noisy predictor sigma={self.sigma!r}; expected a finite number >= 0")
        elif self.sigma != 0:
            raise TraceError(f"the {self.mode!r} predictor takes no sigma (got {self.sigma!r}); "
                             f"expected 'noisy:SIGMA' for a noisy one")

    @classmethod
    def parse(cls, spec: str | Predictor) -> Predictor:
        """From ``"cap"``, ``"oracle"`` or ``"noisy:SIGMA"`` (e.g. ``"noisy:0.5"``)."""
        if isinstance(spec, Predictor):
            return spec
        if not isinstance(spec, str):
            raise TraceError(f"predictor {spec!r}; expected 'cap', 'noisy:SIGMA' or 'oracle'")
        mode, sep, arg = spec.strip().partition(":")
        mode = mode.strip().lower()
        if mode == "noisy":
            try:
                sigma = float(arg)
            except ValueError:
                raise TraceError(f"predictor {spec!r}; expected 'noisy:SIGMA' with SIGMA a number >= 0, "
                                 f"e.g. 'noisy:0.5'") from None
            return cls("noisy", sigma)
        if mode in PREDICTOR_MODES and not sep:
            return cls(mode)
        if mode in PREDICTOR_MODES:
            raise TraceError(f"predictor {spec!r}: {mode!r} takes no argument; expected {mode!r}")
        raise TraceError(f"unknown predictor {spec!r}; expected 'cap', 'noisy:SIGMA' or 'oracle'")

    def __str__(self) -> str:
        return f"noisy:{self.sigma:g}" if self.mode == "noisy" else self.mode

    def estimate(self, trace: Trace, seed: int = 0) -> np.ndarray:
        """The per-request estimate (i8, in ``[1, max_tokens]``) for ``trace``."""
        if self.mode == "cap":
            return trace.max_tokens.copy()
        true = trace.output_tokens.astype(np.float64)
        if self.mode == "noisy":
            true = np.rint(true * np.exp(np.random.default_rng(seed).normal(0.0, self.sigma, trace.n)))
        return np.clip(true, 1, trace.max_tokens).astype(np.int64)

    def apply(self, trace: Trace, seed: int = 0) -> Trace:
        """``trace`` with this predictor's ``output_estimate`` (``output_estimator`` = the spec).

        The trace must have real caps first (``with_client_caps``): an estimate clipped to
        ``NO_CAP`` would say nothing about the request.
        """
        if not trace.caps_known:
            raise TraceError("the trace has requests without a cap (max_tokens NO_CAP); apply "
                             "with_client_caps(trace, context_len=...) first")
        if self.mode == "cap":
            return trace.replace(output_estimator=ESTIMATE_IS_CAP)
        meta = {**trace.meta, "output_estimate": {"predictor": str(self), "seed": int(seed)}}
        return trace.replace(output_estimate=self.estimate(trace, seed), output_estimator=str(self), meta=meta)


def prepare_lengths(trace: Trace, *, context_len: int, max_tokens: int | None = None,
                    override_caps: bool = False, predictor: str | Predictor = "cap", seed: int = 0) -> Trace:
    """The trace as the scheduler should see it: ``with_client_caps`` then the predictor."""
    capped = with_client_caps(trace, context_len=context_len, max_tokens=max_tokens, override=override_caps)
    return Predictor.parse(predictor).apply(capped, seed)
