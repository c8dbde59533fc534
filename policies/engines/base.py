"""What every target of a recommendation declares: the engine it is, the knobs it exposes,
its defaults and validity rules, and how its config file maps onto a PolicyConfig.

A target is one engine at one pinned version (``policies.engines.vllm``,
``policies.engines.sglang``) or servetune's own what-if policies
(``policies.engines.servetune``). For an engine, the search space, the baseline and the
exported file all come from its module, so they cannot disagree:

- ``defaults(ctx)``: the config the engine runs with no flags, as it resolves it for the
  GPU and model (``EngineContext``), every servetune-only knob set to what the engine does;
- ``flags``: each flag the engine exposes, the PolicyConfig knob it drives, its value
  domain and default search range;
- ``resolve(config, ctx)``: ``config`` projected onto what the engine can run: its flag
  knobs kept, every other knob at the engine's own behaviour, coupled knobs implied;
- ``violations(config, ctx)``: the engine's start-up checks, each citing its source line;
- ``to_args`` / ``from_args``: the config file's mapping and its exact inverse, so a file
  read back simulates as the config it was written from;
- ``deployment_args`` / ``deployment_from_args`` / ``layout_violations``: where the file
  runs (TP, replicas and a MoE model's expert / attention data-parallel layout) in the
  engine's flags, read back, and the layouts the engine refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from policies.config import (
    FLEET_KNOBS,
    KNOB_BY_NAME,
    LORA_KNOBS,
    SPECULATIVE_KNOBS,
    ConfigError,
    PolicyConfig,
)


class EngineError(ConfigError):
    """A config or config file that the target engine refuses, naming the rule."""


@dataclass(frozen=True)
class EngineContext:
    """What an engine's defaults and rules depend on: the GPU, the model and the KV pool.

    ``kv_tokens(utilization, profile_tokens)`` is the KV pool in tokens at a GPU-memory
    fraction after a profiling pass of ``profile_tokens`` (the cost model's sizing; the
    simulator profiles at the config's ``max_num_batched_tokens``). ``reserve_share(tokens)``
    is the share of GPU memory kept out of it besides the weights: ``reserved_fraction``
    (CUDA graphs, logits, runtime) plus ``activation_fraction_per_token`` per profiled
    token, which vLLM's utilisation includes and SGLang's static fraction does not.
    ``context_len`` is the model's ``max_position_embeddings`` (0: unknown); ``moe``
    whether it has expert layers, which changes what an engine's data parallelism is
    (``layout_violations``).
    """

    gpu: str
    gpu_memory_gib: float
    context_len: int = 0
    kv_tokens: Callable[[float, int], int] | None = None
    reserved_fraction: float = 0.0
    activation_fraction_per_token: float = 0.0
    tp: int = 1
    replicas: int = 1
    #: what the simulation's cost model assumed: weights (``bf16`` or ``fp8``) and KV cache
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    moe: bool = False
    #: whether attention is multi-head latent (MLA), which picks the engine's attention kernels
    mla: bool = False
    #: the checkpoint's own weight quantization (``costmodels.architecture.weight_quant``), "" for none
    weight_quant: str = ""

    def kv_pool_tokens(self, utilization: float, profile_tokens: int) -> int:
        if self.kv_tokens is None:
            raise EngineError("this engine context has no KV sizing (kv_tokens); build it from a cost model")
        return int(self.kv_tokens(utilization, profile_tokens))

    def reserve_share(self, profile_tokens: int) -> float:
        return self.reserved_fraction + self.activation_fraction_per_token * profile_tokens


@dataclass(frozen=True)
class Flag:
    """One engine flag: the YAML key (the long flag without ``--``), the knob it drives.

    ``kind``: ``value`` (written as ``key: value``), ``store_true`` (written ``key: true``
    only when set; ``invert`` when the flag turns the knob off, as SGLang's
    ``disable-radix-cache``), or ``bool_optional`` (argparse BooleanOptionalAction:
    ``key: true`` or ``no-key: true``; a ``key: false`` line is dropped by vLLM's loader).
    ``values`` maps knob values to the engine's spelling for enumerations: only these are
    in the domain. ``unset`` is the knob value the engine spells by leaving the flag out.
    ``search`` is the default search range (``optimizer.search.space`` settings), None when the
    knob stays at the engine's default unless a study opens it.
    """

    key: str
    knob: str
    kind: str = "value"
    invert: bool = False
    values: Mapping[Any, Any] | None = None
    unset: Any = None
    search: Mapping[str, Any] | None = None
    source: str = ""
    help: str = ""

    def __post_init__(self) -> None:
        if self.knob not in KNOB_BY_NAME:
            raise ValueError(f"flag --{self.key}: unknown knob {self.knob!r}")
        if self.kind not in ("value", "store_true", "bool_optional"):
            raise ValueError(f"flag --{self.key}: unknown kind {self.kind!r}")

    def write(self, value: Any, args: dict[str, Any]) -> None:
        """Add this knob's value to the YAML mapping in the engine's spelling."""
        if self.unset is not None and value == self.unset:
            return
        if self.kind == "store_true":
            if bool(value) != self.invert:
                args[self.key] = True
            return
        if self.kind == "bool_optional":
            args[self.key if value else f"no-{self.key}"] = True
            return
        if self.values is not None:
            if value not in self.values:
                raise EngineError(f"{self.knob}={value!r} has no --{self.key} value; accepted: "
                                  f"{sorted(map(str, self.values))}")
            value = self.values[value]
        args[self.key] = value

    def read(self, args: Mapping[str, Any], default: Any) -> Any:
        """This knob's value in a YAML mapping (``default`` where the file leaves it out)."""
        if self.kind == "store_true":
            return bool(args.get(self.key, False)) != self.invert if self.key in args else default
        if self.kind == "bool_optional":
            if args.get(f"no-{self.key}") is True:
                return False
            return True if args.get(self.key) is True else default
        if self.key not in args:
            return self.unset if self.unset is not None else default
        value = args[self.key]
        if self.values is not None:
            inverse = {v: k for k, v in self.values.items()}
            if value not in inverse:
                raise EngineError(f"--{self.key} {value!r} is not simulated; servetune reads "
                                  f"{sorted(map(str, inverse))}")
            value = inverse[value]
        return value

    def keys(self) -> tuple[str, ...]:
        return (self.key, f"no-{self.key}") if self.kind == "bool_optional" else (self.key,)


@dataclass(frozen=True)
class Deployment:
    """Where a config runs: the model name the file serves and its parallel layout.

    ``replicas`` independent engine instances of ``tp`` GPUs each; within one instance the
    layout of ``costmodels.layout.ParallelLayout``: attention in ``attention_dp`` data-
    parallel groups (one scheduler and KV pool each), experts split ``moe_ep`` ways. The
    simulator runs ``replicas x attention_dp`` schedulers; each engine module spells the
    layout in its own flags (``deployment_args``) and refuses the ones it cannot run
    (``layout_violations``).
    """

    model: str
    tp: int = 1
    replicas: int = 1
    moe_ep: int = 1
    attention_dp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise EngineError(f"deployment model must be a non-empty name, got {self.model!r}")
        for name in ("tp", "replicas", "moe_ep", "attention_dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"deployment {name} must be an integer >= 1, got {value!r}")
        for name in ("moe_ep", "attention_dp"):
            if self.tp % getattr(self, name):
                raise EngineError(f"deployment {name}={getattr(self, name)} must divide tp={self.tp}")

    @property
    def plain(self) -> bool:
        """Plain tensor parallelism in each instance (no expert or attention data parallelism)."""
        return self.moe_ep == 1 and self.attention_dp == 1


@dataclass(frozen=True)
class Target:
    """A target of a recommendation. Subclasses fill in the engine's truth."""

    name: str
    display: str
    version: str
    flags: tuple[Flag, ...] = field(default=())
    #: servetune's own target: its gains are what-ifs, never an engine's file.
    what_if: bool = False
    #: what the engine does when a step's activations exceed the memory left for them
    #: (``policies.workspace``): the end of the run a trial is pruned with
    oom_consequence: ClassVar[str] = "a CUDA out-of-memory error ends the engine and every request in flight"

    # -- the engine's truth (overridden per engine) ---------------------------------------
    def defaults(self, ctx: EngineContext) -> PolicyConfig:
        raise NotImplementedError

    def implied(self, config: PolicyConfig, ctx: EngineContext) -> dict[str, Any]:
        """Knobs the engine sets from its flags' values (e.g. the preemption victim of a queue
        order). A verify budget the engine has no flags for runs as its fixed block."""
        mode = config.speculative_mode
        return {} if mode == "off" or mode in self.speculative_modes else {"speculative_mode": "fixed"}

    def violations(self, config: PolicyConfig, ctx: EngineContext) -> list[str]:
        """The engine's start-up refusals of ``config``, each naming its rule and source."""
        return []

    def baselines(self, ctx: EngineContext) -> dict[str, PolicyConfig]:
        return {f"{self.name}-default": self.defaults(ctx)}

    # -- derived --------------------------------------------------------------------------
    @property
    def knobs(self) -> tuple[str, ...]:
        """The PolicyConfig knobs this target's flags drive."""
        return tuple(dict.fromkeys(f.knob for f in self.flags))

    def search_settings(self, ctx: EngineContext) -> dict[str, dict[str, Any]]:
        """Default search range per flag knob (``optimizer.search.space`` settings)."""
        return {f.knob: dict(f.search) for f in self.flags if f.search is not None}

    # -- LoRA adapters: searched only for a trace that asks for some ----------------------
    def lora_search_settings(self, adapters: int) -> dict[str, dict[str, Any]]:
        """Search ranges of the adapter-pool knobs for a trace asking for ``adapters``
        distinct adapters (``optimizer.search.space``; none for a target without LoRA flags)."""
        raise EngineError(f"{self.display} {self.version} has no LoRA flags in servetune")

    def resolve(self, config: PolicyConfig, ctx: EngineContext) -> PolicyConfig:
        """``config`` as this engine runs it: flag knobs kept, the rest at the engine's behaviour.

        The deployment's fleet knobs (router, pools) and the declared drafter's knobs are
        kept too: they come from the study, not from this engine's flags.
        """
        base = self.defaults(ctx)
        kept = {k: getattr(config, k) for k in (*self.knobs, *FLEET_KNOBS, *SPECULATIVE_KNOBS)}
        merged = base.replace(**kept)
        implied = self.implied(merged, ctx)
        return merged.replace(**implied) if implied else merged

    def domain_violations(self, config: PolicyConfig) -> list[str]:
        """Enumerated flags whose knob value the engine has no spelling for."""
        return [f"{f.knob}={getattr(config, f.knob)!r} is not a --{f.key} value; accepted: "
                f"{sorted(map(str, f.values))}" for f in self.flags
                if f.values is not None and getattr(config, f.knob) not in f.values]

    def check(self, config: PolicyConfig, ctx: EngineContext) -> None:
        """Raise EngineError listing every rule ``config`` breaks."""
        broken = self.domain_violations(config) + self.violations(config, ctx)
        if broken:
            raise EngineError(f"{self.display} {self.version} refuses this config: " + "; ".join(broken))

    def to_args(self, config: PolicyConfig, deployment: Deployment, ctx: EngineContext) -> dict[str, Any]:
        """The config file's mapping (hyphenated long flags); refuses what the engine would."""
        resolved = self.resolve(config, ctx)
        self.check(resolved, ctx)
        self.check_layout(deployment, ctx, resolved)
        args = {**self.deployment_args(deployment), **self.dtype_args(ctx)}
        for flag in self.flags:
            if flag.knob in LORA_KNOBS and not resolved.enable_lora:
                continue  # the pool's flags mean nothing (and are left out) without LoRA
            flag.write(self.encode(flag, resolved, ctx), args)
        return args

    def from_args(self, args: Mapping[str, Any], ctx: EngineContext) -> PolicyConfig:
        """The config a file runs: the inverse of ``to_args``; unknown keys are refused."""
        known = ({k for f in self.flags for k in f.keys()} | set(self.deployment_keys) | set(self.layout_keys)
                 | set(self.speculative_keys) | {key for key, _ in self.dtype_keys.values()})
        unknown = sorted(set(args) - known)
        if unknown:
            raise EngineError(f"{self.display} config has key(s) servetune does not simulate: {unknown}")
        mine = self.dtype_args(ctx)
        for key, _ in self.dtype_keys.values():
            if args.get(key) != mine.get(key):
                raise EngineError(f"{self.display} config sets {key}: {args.get(key)!r}, but the study simulated "
                                  f"{mine.get(key)!r} (weights {ctx.dtype}, KV {ctx.kv_dtype}); simulate the file "
                                  "with the matching --dtype / --kv-dtype")
        base = self.defaults(ctx)
        values: dict[str, Any] = {}
        values.update(self.speculative_values(args))
        for flag in self.flags:
            raw = flag.read(args, _DEFAULT)
            if raw is not _DEFAULT:
                values[flag.knob] = self.decode(flag, raw, ctx, args)
        try:
            config = self.resolve(base.replace(**values), ctx)
        except ConfigError as exc:
            raise EngineError(f"{self.display} config: {exc}") from None
        self.check(config, ctx)
        return config

    # -- speculative decoding (the drafter is the study's; the engine's verify budget) -------
    #: keys that carry speculative decoding in this engine's file
    speculative_keys = ()
    #: the ``speculative_mode`` values this engine runs (its fixed block and its own budgets)
    speculative_modes: ClassVar[tuple[str, ...]] = ("fixed",)

    def speculative_search_modes(self, drafter: Mapping[str, str | None], replicas: int = 1) -> tuple[str, ...]:
        """The verify budgets searched for ``drafter`` (keys method, model, sglang) on
        ``replicas`` replicas, besides off."""
        return ("fixed",)

    def speculative_args(self, config: PolicyConfig, drafter: Mapping[str, str | None]) -> dict[str, Any]:
        """The flags that run ``config``'s verify budget with ``drafter`` (keys method, model, sglang)."""
        raise EngineError(f"{self.display} has no speculative decoding flags in servetune")

    def speculative_values(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The speculative knobs a file's flags set (empty: speculation off)."""
        return {}

    def with_drafter(self, config: PolicyConfig) -> PolicyConfig:
        """``config`` as the engine resolves it once a drafter is on, for flags the file leaves unset."""
        return config

    def serve_env(self, config: PolicyConfig) -> dict[str, str]:
        """Environment variables the server needs to run ``config`` (flags a config file cannot hold)."""
        return {}

    def side_files(self, config: PolicyConfig, tables) -> dict[str, str]:
        """Files the config file points at, by name, built from the step-time ``tables``
        (None: not at hand; EngineError if a file needs them)."""
        return {}

    # hooks for knobs whose engine value is not the knob value (e.g. SGLang's memory fraction)
    def encode(self, flag: Flag, config: PolicyConfig, ctx: EngineContext) -> Any:
        return getattr(config, flag.knob)

    def decode(self, flag: Flag, value: Any, ctx: EngineContext, args: Mapping[str, Any]) -> Any:
        """``value`` of ``flag`` as its knob; ``args`` is the whole file, for values read
        relative to another flag."""
        return value

    #: YAML keys of the model, the TP degree and the data-parallel replicas (a class attribute)
    deployment_keys = ("model", "tensor-parallel-size", "data-parallel-size")

    #: the flags that select fp8 weights and fp8 KV: (key, value) (overridden per engine)
    dtype_keys: ClassVar[dict[str, tuple[str, str]]] = {"dtype": ("quantization", "fp8"),
                                                        "kv_dtype": ("kv-cache-dtype", "fp8")}

    def dtype_args(self, ctx: EngineContext) -> dict[str, Any]:
        """The flags that make the engine run the weights and KV dtypes the study simulated
        (none for bf16, each engine's default for a bf16 checkpoint). A checkpoint already
        quantized to FP8 runs its own method, which a ``quantization`` flag naming another
        is refused against (vllm/config/model.py:1452-1462, sglang srt/configs/
        model_config.py:2105-2148): its weights need no flag."""
        prequantized = ctx.weight_quant.startswith("fp8")
        return {key: value for field_name, (key, value) in self.dtype_keys.items()
                if getattr(ctx, field_name) == "fp8" and not (field_name == "dtype" and prequantized)}

    #: YAML keys of the expert / attention data-parallel layout (besides deployment_keys)
    layout_keys: ClassVar[tuple[str, ...]] = ()

    def deployment_args(self, deployment: Deployment) -> dict[str, Any]:
        """The model and the parallel layout in the engine's flags (plain TP x replicas here;
        engines with expert and attention data parallelism override it)."""
        model, tp, dp = self.deployment_keys
        args: dict[str, Any] = {model: deployment.model, tp: deployment.tp}
        if deployment.replicas > 1:
            args[dp] = deployment.replicas
        return args

    def deployment_from_args(self, args: Mapping[str, Any], ctx: EngineContext) -> Deployment:
        """The deployment a file describes: the inverse of ``deployment_args``."""
        model, tp, dp = self.deployment_keys
        return Deployment(str(args.get(model, "")), int_arg(args, tp), int_arg(args, dp))

    def layout_violations(self, deployment: Deployment, ctx: EngineContext) -> list[str]:
        """The engine's refusals of ``deployment``'s layout, each naming its rule and source.

        A dense model has no expert layers to split or to share between attention groups:
        its data parallelism is replicas (servetune's cost model refuses the rest too)."""
        if not ctx.moe and not deployment.plain:
            return [f"{deployment.model} has no experts: expert parallel {deployment.moe_ep} and attention data "
                    f"parallel {deployment.attention_dp} must be 1 (data parallelism of a dense model is replicas)"]
        return []

    def check_layout(self, deployment: Deployment, ctx: EngineContext, config: PolicyConfig | None = None) -> None:
        """Raise EngineError listing every layout rule ``deployment`` breaks (for ``config``, if given)."""
        broken = self.layout_violations(deployment, ctx)
        if config is not None:
            broken += self.config_layout_violations(config, deployment)
        if broken:
            raise EngineError(f"{self.display} {self.version} refuses this layout: " + "; ".join(broken))

    def config_layout_violations(self, config: PolicyConfig, deployment: Deployment) -> list[str]:
        """What ``config`` cannot run on ``deployment`` (e.g. a setting the engine drops across replicas)."""
        return []

    def replicas_per_file(self, ctx: EngineContext) -> int | None:
        """The most independent replicas one config file deploys (None: any)."""
        return None

    def attention_dp_replicas(self, ctx: EngineContext) -> bool:
        """Whether one file deploys attention DP beside several replicas."""
        return True


_DEFAULT = object()  # a flag the file leaves out


def int_arg(args: Mapping[str, Any], key: str, default: int = 1) -> int:
    """An integer flag of a file (``default`` where it is left out)."""
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineError(f"--{key} must be an integer, got {value!r}")
    return value
