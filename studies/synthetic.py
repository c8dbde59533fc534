"""Seeded synthetic workloads, built from small composable parts.

A workload is an arrival process plus a mix of tenants; each tenant draws its prompt and
output lengths, its shared prefixes (system prompts, a hot spot that moves between prefix
groups, multi-turn conversations) and how well its clients guess ``max_tokens``::

    trace = generate(Gamma(rate=8, cv=3), duration_s=600, seed=1, tenants=[
        Tenant("chat", weight=3, slo_class="interactive", prefix=SharedPrefix(groups=4, prefix_tokens=1024),
               conversation=Conversation(turns_mean=3, think_s=20)),
        Tenant("batch", weight=1, priority=-1, output=LogNormal(800, 0.5), estimate=OutputEstimate(bias=2.0)),
    ])

Every random draw comes from one ``numpy.random.Generator`` seeded by ``seed``, in a fixed
order, so the same arguments give the same trace bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from studies.traces import BASE, CAP_GIVEN, CAP_NONE, NO_CAP, Trace, TraceError, encode_names

# -- arrival processes: times(rng, duration_s) -> sorted arrival times in [0, duration_s) ----


def _renewal(rng: np.random.Generator, duration_s: float, rate: float, shape: float) -> np.ndarray:
    """Arrivals whose gaps are Gamma(shape) with mean 1 / rate (shape 1 = Poisson)."""
    times = np.zeros(0)
    start = 0.0
    while True:
        batch = int(rate * (duration_s - start) * 1.1) + 16
        new = start + np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=batch))
        times = np.concatenate([times, new])
        if new[-1] >= duration_s:
            return times[times < duration_s]
        start = new[-1]


def _positive(name: str, value: float) -> None:
    if not (np.isfinite(value) and value > 0):
        raise TraceError(f"{name}={value!r}; expected a finite number > 0")


@dataclass(frozen=True)
class Poisson:
    """Exponential gaps at ``rate`` requests per second."""

    rate: float

    def __post_init__(self) -> None:
        _positive("rate", self.rate)

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        return _renewal(rng, duration_s, self.rate, 1.0)


@dataclass(frozen=True)
class Gamma:
    """Gamma-distributed gaps: mean rate ``rate``, coefficient of variation ``cv``
    (cv > 1 is burstier than Poisson, cv < 1 more regular)."""

    rate: float
    cv: float

    def __post_init__(self) -> None:
        _positive("rate", self.rate)
        _positive("cv", self.cv)

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        return _renewal(rng, duration_s, self.rate, 1.0 / self.cv**2)


@dataclass(frozen=True)
class OnOff:
    """Bursts: Poisson at ``rate_on`` during on-periods and ``rate_off`` between them;
    period lengths are exponential with means ``on_s`` and ``off_s``, starting on."""

    rate_on: float
    on_s: float
    off_s: float
    rate_off: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rate_on", "on_s", "off_s"):
            _positive(name, getattr(self, name))
        if not (np.isfinite(self.rate_off) and self.rate_off >= 0):
            raise TraceError(f"rate_off={self.rate_off!r}; expected a finite number >= 0")

    @property
    def rate(self) -> float:
        return (self.rate_on * self.on_s + self.rate_off * self.off_s) / (self.on_s + self.off_s)

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        chunks, start, on = [], 0.0, True
        while start < duration_s:
            length = rng.exponential(self.on_s if on else self.off_s)
            rate = self.rate_on if on else self.rate_off
            end = min(start + length, duration_s)
            count = rng.poisson(rate * (end - start))
            chunks.append(np.sort(rng.uniform(start, end, size=count)))
            start, on = start + length, not on
        return np.concatenate(chunks)


@dataclass(frozen=True)
class Diurnal:
    """A daily (or any period) ramp: rate ``mean_rate * (1 + amplitude * sin(2 pi (t + phase_s) / period_s))``,
    drawn as a thinned Poisson process."""

    mean_rate: float
    amplitude: float = 0.5
    period_s: float = 86400.0
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("mean_rate", self.mean_rate)
        _positive("period_s", self.period_s)
        if not 0 <= self.amplitude <= 1:
            raise TraceError(f"amplitude={self.amplitude!r}; expected 0 <= amplitude <= 1")

    @property
    def rate(self) -> float:
        return self.mean_rate

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        return self.mean_rate * (1 + self.amplitude * np.sin(2 * np.pi * (t + self.phase_s) / self.period_s))

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        peak = self.mean_rate * (1 + self.amplitude)
        candidates = _renewal(rng, duration_s, peak, 1.0)
        keep = rng.random(len(candidates)) * peak < self.rate_at(candidates)
        return candidates[keep]


# -- lengths: sample(rng, n) -> i8 token counts ------------------------------------------


@dataclass(frozen=True)
class LogNormal:
    """Log-normal token counts with the given ``mean`` and coefficient of variation ``cv``,
    rounded and clipped to ``[low, high]``."""

    mean: float
    cv: float = 1.0
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        _positive("mean", self.mean)
        if not (np.isfinite(self.cv) and self.cv >= 0):
            raise TraceError(f"cv={self.cv!r}; expected a finite number >= 0")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma2 = np.log1p(self.cv**2)
        draws = rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), size=n)
        return np.clip(np.rint(draws), self.low, self.high).astype(np.int64)

    @classmethod
    def fit(cls, values: np.ndarray, *, low: int = 1, high: int | None = None) -> LogNormal:
        """Maximum-likelihood fit (on the logs) to observed counts, e.g. a trace's column."""
        values = np.asarray(values, dtype=np.float64)
        values = values[values > 0]
        if len(values) < 2:
            raise TraceError(f"fitting a length distribution needs >= 2 positive values, got {len(values)}")
        logs = np.log(values)
        sigma2 = logs.var()
        return cls(float(np.exp(logs.mean() + sigma2 / 2)), float(np.sqrt(np.expm1(sigma2))), low, high)


@dataclass(frozen=True, eq=False)
class Empirical:
    """Resample observed token counts (with replacement)."""

    values: np.ndarray

    def __post_init__(self) -> None:
        values = np.asarray(self.values, dtype=np.int64)
        if len(values) == 0:
            raise TraceError("an empirical length distribution needs at least one value")
        object.__setattr__(self, "values", values)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.values[rng.integers(0, len(self.values), size=n)]


def lengths_like(trace: Trace, how: str = "fit") -> dict:
    """Prompt and output length models taken from a trace: ``fit`` (log-normal) or
    ``resample``; pass as ``Tenant(..., **lengths_like(trace))``."""
    if how == "fit":
        high_p, high_o = int(trace.prompt_tokens.max()), int(trace.output_tokens.max())
        return {"prompt": LogNormal.fit(trace.prompt_tokens, high=high_p),
                "output": LogNormal.fit(trace.output_tokens, high=high_o)}
    if how == "resample":
        return {"prompt": Empirical(trace.prompt_tokens), "output": Empirical(trace.output_tokens)}
    raise TraceError(f"lengths_like how={how!r}; expected 'fit' or 'resample'")


# -- prefixes, conversations, max_tokens ---------------------------------------------------


@dataclass(frozen=True)
class SharedPrefix:
    """Requests start with one of ``groups`` shared prompts of ``prefix_tokens`` (system
    prompts, few-shot templates). Group popularity falls as ``1 / rank**zipf``; a
    ``hot_share`` of requests instead go to a hot group that moves to the next group every
    ``hot_shift_s`` seconds (a hot spot that shifts)."""

    groups: int
    prefix_tokens: int
    zipf: float = 0.0
    hot_share: float = 0.0
    hot_shift_s: float = np.inf

    def __post_init__(self) -> None:
        if self.groups < 1 or self.prefix_tokens < 1:
            raise TraceError(f"SharedPrefix needs groups >= 1 and prefix_tokens >= 1, got {self.groups}, "
                             f"{self.prefix_tokens}")
        if not 0 <= self.hot_share <= 1:
            raise TraceError(f"hot_share={self.hot_share!r}; expected 0 <= hot_share <= 1")
        if not self.hot_shift_s > 0:
            raise TraceError(f"hot_shift_s={self.hot_shift_s!r}; expected seconds > 0 (inf = never shifts)")

    def choose(self, rng: np.random.Generator, arrival_s: np.ndarray) -> np.ndarray:
        weights = 1.0 / np.arange(1, self.groups + 1) ** self.zipf
        group = rng.choice(self.groups, size=len(arrival_s), p=weights / weights.sum())
        hot = rng.random(len(arrival_s)) < self.hot_share
        shift = np.floor(arrival_s / self.hot_shift_s).astype(np.int64) if np.isfinite(self.hot_shift_s) \
            else np.zeros(len(arrival_s), dtype=np.int64)
        return np.where(hot, shift % self.groups, group)


@dataclass(frozen=True)
class Adapters:
    """Requests ask for one of ``count`` LoRA adapters (``lora-0`` ...), a ``base_share`` of
    them for the base model instead. Popularity falls as ``1 / rank**zipf``; every
    ``shift_s`` seconds the ranking rotates by ``shift_by`` adapters (default half of
    them), so the hot set turns cold and cold adapters turn hot (an adapter pool that
    held the old hot set must load the new one). A conversation keeps its adapter."""

    count: int
    zipf: float = 1.0
    base_share: float = 0.0
    shift_s: float = np.inf
    shift_by: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int | np.integer) or self.count < 1:
            raise TraceError(f"Adapters count={self.count!r}; expected an integer >= 1")
        if not (np.isfinite(self.zipf) and self.zipf >= 0):
            raise TraceError(f"Adapters zipf={self.zipf!r}; expected a finite number >= 0")
        if not 0 <= self.base_share <= 1:
            raise TraceError(f"Adapters base_share={self.base_share!r}; expected 0 <= base_share <= 1")
        if not self.shift_s > 0:
            raise TraceError(f"Adapters shift_s={self.shift_s!r}; expected seconds > 0 (inf = never shifts)")
        if self.shift_by is not None and not 0 <= self.shift_by < self.count:
            raise TraceError(f"Adapters shift_by={self.shift_by!r}; expected 0 <= shift_by < count ({self.count})")

    def names(self) -> list[str]:
        return [f"lora-{k}" for k in range(self.count)]

    def choose(self, rng: np.random.Generator, arrival_s: np.ndarray) -> np.ndarray:
        """Adapter index per arrival, -1 for the base model."""
        weights = 1.0 / np.arange(1, self.count + 1) ** self.zipf
        rank = rng.choice(self.count, size=len(arrival_s), p=weights / weights.sum())
        base = rng.random(len(arrival_s)) < self.base_share
        epoch = (np.floor(arrival_s / self.shift_s).astype(np.int64) if np.isfinite(self.shift_s)
                 else np.zeros(len(arrival_s), dtype=np.int64))
        step = self.count // 2 if self.shift_by is None else self.shift_by
        return np.where(base, -1, (rank + epoch * step) % self.count)


@dataclass(frozen=True)
class Conversation:
    """Each arrival starts a session of ``turns_mean`` turns on average (geometric); the
    next turn comes an exponential ``think_s`` later, and its prompt is the whole history
    (previous prompt and answer) plus a new message, so it reuses the history's blocks."""

    turns_mean: float
    think_s: float

    def __post_init__(self) -> None:
        if not self.turns_mean >= 1:
            raise TraceError(f"turns_mean={self.turns_mean!r}; expected >= 1")
        _positive("think_s", self.think_s)


@dataclass(frozen=True)
class OutputEstimate:
    """How a client sets ``max_tokens`` from the true output length: ``bias`` x output
    (bias < 1 underestimates and truncates, > 1 over-reserves) times log-normal noise
    of coefficient of variation ``cv``, at least 1 and at most ``cap``."""

    bias: float = 1.0
    cv: float = 0.0
    cap: int | None = None

    def __post_init__(self) -> None:
        _positive("bias", self.bias)
        if not (np.isfinite(self.cv) and self.cv >= 0):
            raise TraceError(f"cv={self.cv!r}; expected a finite number >= 0")

    def max_tokens(self, rng: np.random.Generator, output_tokens: np.ndarray) -> np.ndarray:
        sigma2 = np.log1p(self.cv**2)
        noise = rng.lognormal(-sigma2 / 2, np.sqrt(sigma2), size=len(output_tokens))
        guess = np.ceil(np.maximum(output_tokens, 1) * self.bias * noise)
        return np.clip(guess, 1, self.cap).astype(np.int64)


def misestimate(trace: Trace, estimate: OutputEstimate, seed: int = 0) -> Trace:
    """Replace a trace's ``max_tokens`` with a client's estimate of each output length."""
    capped = estimate.max_tokens(np.random.default_rng(seed), trace.output_tokens)
    return trace.replace(max_tokens=capped, meta={**trace.meta, "max_tokens": str(estimate)})


# -- tenants and the generator ---------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    """One class of traffic in a mix: its share of arrivals (``weight``), priority, SLO
    class, lengths, prefixes, patience (``deadline_s`` after arrival, None = none) and the
    LoRA adapters it asks for (``adapters``; None = the base model only)."""

    name: str = "default"
    weight: float = 1.0
    priority: int = 0
    slo_class: str = "default"
    prompt: LogNormal | Empirical = field(default_factory=lambda: LogNormal(1024, 1.0))
    output: LogNormal | Empirical = field(default_factory=lambda: LogNormal(256, 1.0))
    prefix: SharedPrefix | None = None
    conversation: Conversation | None = None
    estimate: OutputEstimate | None = None
    deadline_s: float | None = None
    adapters: Adapters | None = None

    def __post_init__(self) -> None:
        if not (np.isfinite(self.weight) and self.weight >= 0):
            raise TraceError(f"tenant {self.name!r}: weight={self.weight!r}; expected >= 0")


def generate(arrivals: Poisson | Gamma | OnOff | Diurnal, *, duration_s: float,
             tenants: Sequence[Tenant] = (Tenant(),), seed: int = 0, block_tokens: int = 512) -> Trace:
    """A synthetic trace of ``duration_s`` seconds; arrivals are split among tenants by
    weight (for a conversational tenant an arrival starts a session, and its later turns
    may fall after ``duration_s``)."""
    _positive("duration_s", duration_s)
    weights = np.array([t.weight for t in tenants], dtype=np.float64)
    if len(tenants) == 0 or weights.sum() <= 0:
        raise TraceError("generate needs at least one tenant with weight > 0")
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise TraceError(f"tenant names must be distinct, got {names}")
    rng = np.random.default_rng(seed)
    starts = arrivals.times(rng, duration_s)
    if len(starts) == 0:
        raise TraceError(f"no arrivals in {duration_s} s at this rate; expected a longer duration or higher rate")
    owner = rng.choice(len(tenants), size=len(starts), p=weights / weights.sum())
    parts = [_tenant_requests(rng, tenant, starts[owner == k]) for k, tenant in enumerate(tenants)]
    parts = [part for part in parts if len(part["arrival_s"])]
    for key in ("group", "stream"):  # tenants never share prefixes or sessions by accident
        _globalise(parts, key)
    columns = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    order = np.argsort(columns["arrival_s"], kind="stable")
    columns = {key: values[order] for key, values in columns.items()}
    offsets, hashes = _blocks(columns["prompt_tokens"], columns["shared_tokens"], columns["group"],
                              columns["stream"], block_tokens)
    tenant, tenant_names = encode_names(columns["tenant"])
    slo_class, slo_names = encode_names(columns["slo_class"])
    adapter, adapter_names = encode_names(np.concatenate([[BASE], columns["adapter"]]))
    return Trace(
        arrival_s=columns["arrival_s"], prompt_tokens=columns["prompt_tokens"],
        output_tokens=columns["output_tokens"], max_tokens=columns["max_tokens"],
        max_tokens_source=columns["max_tokens_source"], tenant=tenant,
        priority=columns["priority"], slo_class=slo_class, deadline_s=columns["deadline_s"],
        block_offsets=offsets, block_hashes=hashes, block_tokens=block_tokens,
        tenant_names=tenant_names, slo_class_names=slo_names, source=f"synthetic(seed={seed})",
        adapter=adapter[1:], adapter_names=adapter_names,
        meta={"synthetic": {"arrivals": repr(arrivals), "duration_s": duration_s, "seed": seed,
                            "tenants": [repr(t) for t in tenants]}},
    )


def _tenant_requests(rng: np.random.Generator, tenant: Tenant, starts: np.ndarray) -> dict:
    """Columns for one tenant's requests (unsorted across sessions)."""
    sessions = len(starts)
    if tenant.conversation is None:
        turns = np.ones(sessions, dtype=np.int64)
    else:
        turns = rng.geometric(1.0 / tenant.conversation.turns_mean, size=sessions).astype(np.int64)
    n = int(turns.sum())
    session = np.repeat(np.arange(sessions), turns)
    first = np.r_[0, np.cumsum(turns)[:-1]]
    turn = np.arange(n) - np.repeat(first, turns)
    message = tenant.prompt.sample(rng, n)
    output = tenant.output.sample(rng, n)
    if tenant.conversation is None:
        arrival, prompt = starts, message
    else:
        think = rng.exponential(tenant.conversation.think_s, size=n) * (turn > 0)
        arrival = starts[session] + _session_cumsum(think, first, turns)
        # the prompt of turn j is every earlier message and answer plus message j
        prompt = _session_cumsum(message + output, first, turns) - output
    group = -np.ones(n, dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    if tenant.prefix is not None:
        group = tenant.prefix.choose(rng, starts)[session]
        shared = np.minimum(tenant.prefix.prefix_tokens, prompt)
    adapter = np.full(n, BASE, dtype=object)
    if tenant.adapters is not None:  # drawn last: a trace without adapters draws what it always drew
        index = tenant.adapters.choose(rng, starts)[session]
        adapter = np.where(index >= 0, np.asarray(tenant.adapters.names(), dtype=object)[index], BASE)
    return {
        "arrival_s": arrival,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "max_tokens": (np.full(n, NO_CAP, dtype=np.int64) if tenant.estimate is None
                       else tenant.estimate.max_tokens(rng, output)),
        # without a client estimate the tenant sends no cap (the study's default: studies.lengths)
        "max_tokens_source": np.full(n, CAP_NONE if tenant.estimate is None else CAP_GIVEN, dtype=np.int8),
        "tenant": np.full(n, tenant.name, dtype=object),
        "priority": np.full(n, tenant.priority, dtype=np.int32),
        "slo_class": np.full(n, tenant.slo_class, dtype=object),
        "deadline_s": arrival + (np.nan if tenant.deadline_s is None else tenant.deadline_s),
        "adapter": adapter.astype(object),
        "shared_tokens": shared,
        "group": group,
        "stream": session,
    }


def _globalise(parts: list[dict], key: str) -> None:
    """Shift each part's non-negative ``key`` ids past the previous parts' ids."""
    base = 0
    for part in parts:
        local = part[key]
        part[key] = np.where(local >= 0, local + base, -1)
        base += int(local.max()) + 1 if np.any(local >= 0) else 0


def _session_cumsum(values: np.ndarray, first: np.ndarray, turns: np.ndarray) -> np.ndarray:
    """Running sum of ``values`` restarting at each session's first turn."""
    total = np.cumsum(values)
    before = np.repeat(total[first] - values[first], turns)
    return total - before


def _blocks(prompt: np.ndarray, shared: np.ndarray, group: np.ndarray, stream: np.ndarray,
            block_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix-block ids as CSR. Block b of a request is a full block of its group's shared
    prompt (same id for the whole group), else a full block of its session's token stream
    (same id for every turn that contains it), else its partial last block (unique)."""
    n = len(prompt)
    counts = -(-prompt // block_tokens)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    row = np.repeat(np.arange(n), counts)
    b = np.arange(offsets[-1]) - offsets[:-1][row]
    width = int(counts.max())
    groups = int(group.max()) + 1
    streams = int(stream.max()) + 1
    in_group = b < (shared // block_tokens)[row]
    full = b < (prompt // block_tokens)[row]
    ids = np.where(in_group, group[row] * width + b,
                   np.where(full, (groups + stream[row]) * width + b, (groups + streams) * width + row))
    return offsets, ids.astype(np.int64)
