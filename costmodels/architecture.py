"""Model architecture of a dense decoder, read from a HuggingFace ``config.json``.

Only the shapes that set memory and step time matter here: layers, hidden size, query
and KV heads, head dim, MLP width, vocabulary, tied embeddings. Built-in entries cover
the models whose configs ship with the profiles; any other dense GQA model comes in
through its own ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from costmodels.costmodel import CostModelError, read_json_file

MODELS_DIR = Path(__file__).resolve().parent / "data" / "models"

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float8": "fp8", "fp8_e4m3": "fp8", "auto": "bf16"}

# canonical name -> bundled config file; aliases map every accepted spelling onto it.
BUILTIN = {
    "meta-llama/Llama-3.1-8B": "meta-llama--Meta-Llama-3.1-8B_config.json",
    "meta-llama/Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B_config.json",
    "Qwen/Qwen3-8B": "Qwen--Qwen3-8B_config.json",
    "Qwen/Qwen3-32B": "Qwen--Qwen3-32B_config.json",
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


def normalize_dtype(dtype: str) -> str:
    """Canonical short dtype name ("bf16", "fp8", ...) or CostModelError."""
    key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if key not in DTYPE_BYTES:
        raise CostModelError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    return key


@dataclass(frozen=True)
class ModelArch:
    """Shapes of a dense decoder-only transformer with grouped-query attention."""

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

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise CostModelError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CostModelError(f"{self.name}: num_attention_heads={self.num_heads} is not a multiple "
                                 f"of num_key_value_heads={self.num_kv_heads}")

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` splits the query heads, the KV heads and the MLP evenly."""
        if not isinstance(tp, int) or tp < 1:
            raise CostModelError(f"tp must be a positive integer, got {tp!r}")
        valid = [t for t in (1, 2, 4, 8, 16) if self.num_heads % t == 0 and self.num_kv_heads % t == 0
                 and self.intermediate_size % t == 0]
        if tp not in valid:
            raise CostModelError(f"{self.name}: tp={tp} does not divide num_attention_heads={self.num_heads}, "
                                 f"num_key_value_heads={self.num_kv_heads} and intermediate_size="
                                 f"{self.intermediate_size}; valid tp: {valid}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        h, mlp_mats = self.hidden_size, 3 if self.gated_mlp else 2
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        return attention + mlp_mats * h * self.intermediate_size + 2 * h  # + two RMSNorm weights

    def num_params(self) -> int:
        """All parameters: layers, embedding, lm-head (unless tied) and the final norm."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.layer_params() + embed + head + self.hidden_size

    def weight_bytes(self, tp: int = 1, dtype: str | None = None) -> float:
        """Weight bytes per GPU; layers, embedding and lm-head are all split TP ways."""
        self.check_tp(tp)
        return self.num_params() * DTYPE_BYTES[normalize_dtype(dtype or self.dtype)] / tp

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype: str = "bf16") -> int:
        """K and V of all layers for one token on one GPU: 2 * L * (kv_heads / tp) * head_dim * bytes."""
        self.check_tp(tp)
        return 2 * self.num_layers * (self.num_kv_heads // tp) * self.head_dim * DTYPE_BYTES[normalize_dtype(kv_dtype)]

    @classmethod
    def from_hf_config(cls, config: dict | str | Path, name: str | None = None) -> ModelArch:
        """Read a HuggingFace config.json (path or parsed dict); refuse what is not a dense GQA decoder."""
        where = str(config) if not isinstance(config, dict) else (name or "config")
        if not isinstance(config, dict):
            config = read_json_file(config, "model config")
        config = config.get("text_config", config)
        for moe_key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if config.get(moe_key):
                raise CostModelError(f"{where}: {moe_key}={config[moe_key]}; only dense models are supported")
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in config]
        if missing:
            raise CostModelError(f"{where}: missing keys {missing} (need a HuggingFace config.json of a decoder)")
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
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
        raise CostModelError(f"unknown model {model!r}; built-in: {', '.join(BUILTIN)} "
                             "(or pass model_config=PATH to a HuggingFace config.json)")
    return ModelArch.from_hf_config(MODELS_DIR / BUILTIN[canonical], name=canonical)
