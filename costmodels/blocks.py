"""The non-dense blocks of a decoder, read from a HuggingFace ``config.json``: a mixture-of-
experts MLP, multi-head latent attention (MLA) and sliding-window attention layers.

Each parser returns None for a config without the block, and raises CostModelError naming
the field when the block is there but cannot be timed (a missing or non-positive field).
The spellings differ per family; the ones read here are those of the configs the
profiles ship: Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, ``decoder_sparse_step``,
``mlp_only_layers``), Mixtral and gpt-oss (``num_local_experts``, the expert width in
``intermediate_size``) and DeepSeek-V3/R1 (``n_routed_experts``, ``n_shared_experts``,
``first_k_dense_replace``, ``moe_layer_freq``, ``kv_lora_rank``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.costmodel import CostModelError

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of the MoE layers; ``dense_layers`` run a dense MLP of the model's
    ``intermediate_size`` instead (DeepSeek's first three, Qwen3's ``mlp_only_layers``)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_experts: int = 0  # always-active experts beside the routed ones (DeepSeek: 1)
    shared_intermediate_size: int = 0  # width of each shared expert
    dense_layers: tuple[int, ...] = ()

    def moe_layers(self, num_layers: int) -> int:
        return num_layers - len(self.dense_layers)


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention: K and V are cached as one compressed latent
    of ``kv_lora_rank`` plus a shared rotary key of ``qk_rope_head_dim`` per token and layer."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries projected straight from the hidden state

    @property
    def cache_width(self) -> int:
        """Elements cached per token and layer, for every head at once (vLLM's MLA head_size)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def layer_params(self, hidden: int, heads: int) -> int:
        """Projection weights and the two latent norms of one layer."""
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk_head
        else:
            q = hidden * heads * qk_head
        kv = hidden * self.cache_width + self.kv_lora_rank + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden


@dataclass(frozen=True)
class WindowSpec:
    """Layers that attend over only the last ``window`` tokens (gpt-oss alternates them with
    full layers); ``sinks``: learned attention-sink logits per head (gpt-oss)."""

    window: int
    sliding_layers: tuple[int, ...]
    sinks: bool = False


def _positive(config: dict, field: str, where: str, what: str) -> int:
    value = config.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CostModelError(f"{where}: {what} needs {field} as a positive integer, got {value!r}")
    return value


def moe_from_config(config: dict, where: str, num_layers: int) -> MoESpec | None:
    """The MoE block of ``config``, or None for a dense model."""
    count_field = next((f for f in EXPERT_COUNT_FIELDS if config.get(f)), None)
    if count_field is None:
        return None
    what = f"a mixture-of-experts model ({count_field}={config[count_field]})"
    experts = _positive(config, count_field, where, what)
    top_k = _positive(config, "num_experts_per_tok", where, what)
    width_field = "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"
    width = _positive(config, width_field, where, what)
    shared = int(config.get("n_shared_experts") or 0)
    shared_width = int(config.get("shared_expert_intermediate_size") or (width if shared else 0))
    if config.get("shared_expert_intermediate_size") and not shared:
        shared = 1  # Qwen2-MoE style: one shared expert of its own width
    dense = set(config.get("mlp_only_layers") or ())
    dense.update(range(int(config.get("first_k_dense_replace") or 0)))
    step = int(config.get("decoder_sparse_step") or config.get("moe_layer_freq") or 1)
    dense.update(i for i in range(num_layers) if (i + 1) % step)
    if top_k > experts:
        raise CostModelError(f"{where}: num_experts_per_tok={top_k} exceeds {count_field}={experts}")
    return MoESpec(experts, top_k, width, shared, shared_width, tuple(sorted(i for i in dense if i < num_layers)))


def mla_from_config(config: dict, where: str) -> MLASpec | None:
    """The MLA block of ``config``, or None for grouped-query attention."""
    if not config.get("kv_lora_rank"):
        return None
    what = f"multi-head latent attention (kv_lora_rank={config['kv_lora_rank']})"
    return MLASpec(
        kv_lora_rank=_positive(config, "kv_lora_rank", where, what),
        qk_rope_head_dim=_positive(config, "qk_rope_head_dim", where, what),
        qk_nope_head_dim=_positive(config, "qk_nope_head_dim", where, what),
        v_head_dim=_positive(config, "v_head_dim", where, what),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
    )


def window_from_config(config: dict, where: str, num_layers: int) -> WindowSpec | None:
    """Sliding-window layers of ``config`` (``layer_types`` as gpt-oss writes them, or
    Qwen's ``use_sliding_window`` from ``max_window_layers`` on), or None."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif window and config.get("use_sliding_window", True):
        sliding = tuple(range(int(config.get("max_window_layers") or 0), num_layers))
    else:
        return None
    if not sliding:
        return None
    if not isinstance(window, int) or window <= 0:
        raise CostModelError(f"{where}: sliding-window layers need sliding_window as a positive integer, "
                             f"got {window!r}")
    return WindowSpec(window, sliding, sinks=config.get("model_type") == "gpt_oss")
