"""Model architecture of a decoder, read from a HuggingFace ``config.json``.

Only the shapes that set memory and step time matter here: layers, hidden size, query
and KV heads, head dim, MLP width, vocabulary, tied embeddings, and the blocks of
``costmodels.blocks`` where the model has them: mixture-of-experts MLPs, multi-head
latent attention, sliding-window layers. Built-in entries cover the models whose configs
ship with the profiles; any other model of these kinds comes in through its own
``config.json``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from costmodels.blocks import (
    MLASpec,
    MoESpec,
    WindowSpec,
    mla_from_config,
    moe_from_config,
    window_from_config,
)
from costmodels.costmodel import CostModelError, read_json_file

MODELS_DIR = Path(__file__).resolve().parent / "data" / "models"

#: Bytes per element. NVFP4: 4 bits and one FP8 scale per block of 16.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4, "nvfp4": 0.5 + 1 / 16}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float8": "fp8", "fp8_e4m3": "fp8", "auto": "bf16"}

# canonical name -> bundled config file; aliases map every accepted spelling onto it.
BUILTIN = {
    "meta-llama/Llama-3.1-8B": "meta-llama--Meta-Llama-3.1-8B_config.json",
    "meta-llama/Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B_config.json",
    "Qwen/Qwen3-8B": "Qwen--Qwen3-8B_config.json",
    "Qwen/Qwen3-32B": "Qwen--Qwen3-32B_config.json",
    "Qwen/Qwen3-32B-FP8": "Qwen--Qwen3-32B-FP8_config.json",
    "meta-llama/Llama-3.1-405B": "meta-llama--Meta-Llama-3.1-405B_config.json",
    "Qwen/Qwen3-30B-A3B": "Qwen--Qwen3-30B-A3B_config.json",
    "Qwen/Qwen3-30B-A3B-FP8": "Qwen--Qwen3-30B-A3B-FP8_config.json",
    "Qwen/Qwen3-235B-A22B": "Qwen--Qwen3-235B-A22B_config.json",
    "Qwen/Qwen3-235B-A22B-FP8": "Qwen--Qwen3-235B-A22B-FP8_config.json",
    "mistralai/Mixtral-8x7B-v0.1": "mistralai--Mixtral-8x7B-v0.1_config.json",
    "openai/gpt-oss-20b": "openai--gpt-oss-20b_config.json",
    "openai/gpt-oss-120b": "openai--gpt-oss-120b_config.json",
    "deepseek-ai/DeepSeek-V3": "deepseek-ai--DeepSeek-V3_config.json",
    "deepseek-ai/DeepSeek-R1": "deepseek-ai--DeepSeek-R1_config.json",
}


def _aliases() -> dict[str, str]:
    out = {}
    for name, fname in BUILTIN.items():
        org, short = name.split("/")
        meta = short.replace("Llama-", "Meta-Llama-")
        for spelling in (name, short, f"{name}-Instruct", f"{short}-Instruct", f"{org}/{meta}",
                         f"{org}/{meta}-Instruct", fname, fname.removesuffix("_config.json")):
            out[spelling.lower()] = name
    return out


ALIASES = _aliases()

# Config fields of architectures no op table times, with what they mean.
UNTIMED_FIELDS = {
    "index_topk": "DeepSeek sparse attention",
    "linear_attn_config": "linear attention",
    "linear_num_value_heads": "gated DeltaNet linear attention",
    "mamba_d_ssm": "Mamba state-space layers",
    "ssm_cfg": "state-space layers",
}


def normalize_dtype(dtype: str) -> str:
    """Canonical short dtype name ("bf16", "fp8", ...) or CostModelError."""
    key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if key not in DTYPE_BYTES:
        raise CostModelError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    return key


def weight_quant(config: dict) -> str:
    """How the checkpoint's weights are quantized: "fp8_block" (128x128 scales, DeepSeek and
    Qwen FP8), "fp8" (per tensor), another ``quant_method`` as named, or "" for none."""
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method") or "")
    if method == "fp8" and quant.get("weight_block_size"):
        return "fp8_block"
    return method


@dataclass(frozen=True)
class ModelArch:
    """Shapes of a decoder-only transformer: grouped-query or latent attention, dense or
    mixture-of-experts MLP."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bf16"
    gated_mlp: bool = True
    context_len: int = 0  # max_position_embeddings: the engines' default longest sequence (0: unknown)
    family: str = ""  # HF model_type (llama, qwen3, ...): a calibration fallback between models
    moe: MoESpec | None = None  # None: every layer has the dense MLP
    mla: MLASpec | None = None  # None: grouped-query attention
    window: WindowSpec | None = None  # None: every layer attends over the whole context
    quant: str = ""  # the checkpoint's weight quantization (``weight_quant``), "" for none

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise CostModelError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CostModelError(f"{self.name}: num_attention_heads={self.num_heads} is not a multiple "
                                 f"of num_key_value_heads={self.num_kv_heads}")

    @property
    def kind(self) -> str:
        """Its architecture class, "dense", "moe", "mla" or "moe+mla": models of one class run the
        same kernels, so a calibration entry is lent only within a class."""
        parts = [name for name, has in (("moe", self.moe), ("mla", self.mla)) if has is not None]
        return "+".join(parts) or "dense"

    @property
    def mlp_width(self) -> int:
        """The MLP width TP splits: the dense MLP's, or for an MoE model without dense
        layers each expert's."""
        if self.moe is not None and not self.moe.dense_layers:
            return self.moe.expert_intermediate_size
        return self.intermediate_size

    def kv_heads_per_gpu(self, attention_tp: int) -> int:
        """KV heads each GPU of an attention TP group holds: a share of them, or, past one
        per GPU, a replica of one (vLLM replicates KV heads when TP exceeds them)."""
        return max(1, self.num_kv_heads // attention_tp)

    def _kv_heads_split(self, tp: int) -> bool:
        """Whether ``tp`` splits the KV heads, or replicates them within one node (8 GPUs);
        MLA caches one latent for all heads, which every GPU holds whole."""
        heads = self.num_kv_heads
        return self.mla is not None or heads % tp == 0 or (tp % heads == 0 and tp <= 8)

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` splits the query heads, the KV heads (``_kv_heads_split``) and
        the MLP evenly."""
        if not isinstance(tp, int) or tp < 1:
            raise CostModelError(f"tp must be a positive integer, got {tp!r}")
        valid = [t for t in (1, 2, 4, 8, 16) if self.num_heads % t == 0 and self._kv_heads_split(t)
                 and self.mlp_width % t == 0]
        if tp not in valid:
            raise CostModelError(f"{self.name}: tp={tp} does not divide num_attention_heads={self.num_heads}, "
                                 f"num_key_value_heads={self.num_kv_heads} and the MLP width "
                                 f"{self.mlp_width}; valid tp: {valid}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_params(self) -> int:
        """Attention weights of one layer and its two RMSNorms."""
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.layer_params(h, self.num_heads) + 2 * h
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h

    def mlp_params(self) -> int:
        """MLP weights of all layers: every expert of every MoE layer (all are resident),
        their routers and shared experts, and the dense MLP of the other layers."""
        h, mats = self.hidden_size, 3 if self.gated_mlp else 2
        dense = mats * h * self.intermediate_size
        if self.moe is None:
            return self.num_layers * dense
        m = self.moe
        per_moe = (m.num_experts * m.expert_intermediate_size + m.shared_experts * m.shared_intermediate_size) * mats * h
        per_moe += h * m.num_experts  # router
        return len(m.dense_layers) * dense + m.moe_layers(self.num_layers) * per_moe

    def num_params(self) -> int:
        """All parameters: layers, embedding, lm-head (unless tied) and the final norm."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.attention_params() + self.mlp_params() + embed + head + self.hidden_size

    def weight_bytes(self, tp: int = 1, dtype: str | None = None, attention_dp_size: int = 1) -> float:
        """Weight bytes per GPU. Layers, embedding and lm-head are split TP ways; with attention
        data parallelism each of the ``attention_dp_size`` groups holds its own copy of the
        attention weights, split only ``tp / attention_dp_size`` ways (experts stay split over
        all ``tp`` GPUs, by TP or EP alike)."""
        self.check_tp(tp)
        attention = self.num_layers * self.attention_params()
        per_gpu = (self.num_params() - attention) / tp + attention * attention_dp_size / tp
        return per_gpu * DTYPE_BYTES[normalize_dtype(dtype or self.dtype)]

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype: str = "bf16", attention_dp_size: int = 1) -> int:
        """KV-cache bytes of all layers for one token on one GPU.

        GQA: K and V, 2 * L * ``kv_heads_per_gpu`` * head_dim * bytes. MLA: one latent
        of kv_lora_rank + qk_rope_head_dim for all heads, L * (kv_lora_rank + qk_rope_head_dim)
        * bytes, the same on every TP rank: vLLM sizes an MLA layer's cache page with one KV
        head (``ModelConfig.get_num_kv_heads`` returns 1 under MLA) of head size
        kv_lora_rank + qk_rope_head_dim (``ModelConfig.get_head_size`` in
        vllm/config/model.py), not split by TP (``MLAAttentionSpec``,
        vllm/v1/kv_cache_interface.py). Sliding-window layers are counted whole, as vLLM
        does without its hybrid KV-cache manager.
        """
        self.check_tp(tp)
        nbytes = DTYPE_BYTES[normalize_dtype(kv_dtype)]
        if self.mla is not None:
            return self.num_layers * self.mla.cache_width * nbytes
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp // attention_dp_size) * self.head_dim * nbytes

    @classmethod
    def from_hf_config(cls, config: dict | str | Path, name: str | None = None) -> ModelArch:
        """Read a HuggingFace config.json (path or parsed dict); CostModelError naming the field
        for a decoder it cannot time."""
        where = str(config) if not isinstance(config, dict) else (name or "config")
        if not isinstance(config, dict):
            config = read_json_file(config, "model config")
        config = config.get("text_config", config)
        for field in UNTIMED_FIELDS:
            if config.get(field):
                raise CostModelError(f"{where}: {field}={config[field]!r} ({UNTIMED_FIELDS[field]}) has no "
                                     "cost model; supported: GQA or MLA attention, dense or MoE MLP")
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in config]
        if missing:
            raise CostModelError(f"{where}: missing keys {missing} (need a HuggingFace config.json of a decoder)")
        heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        mla = mla_from_config(config, where)
        if mla is not None:  # the tables' head_dim: the query/key width of one head
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        return cls(
            name=name or config.get("_name_or_path") or Path(where).stem,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=normalize_dtype(str(config.get("torch_dtype") or config.get("dtype") or "bf16")),
            context_len=int(config.get("max_position_embeddings") or 0),
            family=str(config.get("model_type") or ""),
            moe=moe_from_config(config, where, layers),
            mla=mla,
            window=window_from_config(config, where, layers),
            quant=weight_quant(config),
        )


def load_model(model: str, model_config: str | Path | None = None) -> ModelArch:
    """A built-in model by any accepted spelling, the model described by ``model_config``,
    or, when ``model`` is itself a HuggingFace ``config.json`` path, that model (named by
    its folder)."""
    if model_config is not None:
        return ModelArch.from_hf_config(model_config, name=model)
    if model.lower() not in ALIASES and (model.endswith(".json") or Path(model).is_file()):
        path = Path(model)
        if not path.is_file():
            raise CostModelError(f"model config {path} does not exist")
        return ModelArch.from_hf_config(path, name=path.resolve().parent.name)
    canonical = ALIASES.get(model.lower())
    if canonical is None:
        near = difflib.get_close_matches(model.lower(), [m.lower() for m in BUILTIN], n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(next(m for m in BUILTIN if m.lower() == n) for n in near)}? " if near else ""
        raise CostModelError(f"unknown model {model!r}; {hint}built-in: {', '.join(BUILTIN)} "
                             "(or give its HuggingFace config.json: --model-config PATH)")
    return ModelArch.from_hf_config(MODELS_DIR / BUILTIN[canonical], name=canonical)
