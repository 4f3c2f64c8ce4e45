"""Engine configuration: small frozen dataclasses, validated where they are built.

Each component receives only the sub-config it needs: the scheduler gets `SchedulerConfig`,
the KV cache manager `CacheConfig`, the model runner `ModelConfig` + `CacheConfig`.
Values come from the user through `LLM(...)` or the CLI, so every check names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}
LOAD_FORMATS = ("auto", "safetensors", "dummy", "gguf")


def normalize_dtype(dtype: Any) -> str:
    """Map a user dtype (string or torch.dtype) to one of `_DTYPES`."""
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    return name


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how. `hf_config` is the transformers `PretrainedConfig`, or for a
    cached GGUF conversion a `model_files.ConfigView` of one (`transformers_config()` gives
    the real one, to hand to transformers)."""

    model: str
    hf_config: Any
    dtype: str  # resolved: float32 | float16 | bfloat16
    max_model_len: int
    load_format: str = "auto"
    seed: int = 0
    gguf_file: str | None = None  # set when the model is a single GGUF file
    quantization: dict | None = None  # the checkpoint's quantization_config, if any

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"ModelConfig.dtype must be resolved, got {self.dtype!r}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r} is not supported; use one of "
                f"{', '.join(LOAD_FORMATS)}"
            )

    @property
    def text_config(self) -> Any:
        """The language-model part of the config (VL models nest it)."""
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        head_dim = getattr(cfg, "head_dim", None)
        return head_dim or cfg.hidden_size // cfg.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. `kv_cache_memory` (bytes) overrides the utilization rule."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # "auto" (the model dtype) | "fp8" / "fp8_e4m3" | "fp8_e5m2": one byte per K/V element
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(
                f"kv_cache_dtype={self.cache_dtype!r} is not supported; use auto, fp8, "
                "fp8_e4m3 or fp8_e5m2"
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(
                f"num_blocks_override must be >= 2 (one is the null block), "
                f"got {self.num_blocks_override}"
            )


_SPEC_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "adaptive",
}
SPEC_METHODS = ("ngram", "draft_model", "eagle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): n-gram prompt lookup, a draft
    model sharing the target's tokenizer, or an EAGLE head (one decoder layer trained on the
    target's own features, pagoda.models.eagle). The target verifies 1 + k positions per step."""

    method: str  # "ngram" | "draft_model" | "eagle"
    num_speculative_tokens: int
    model: str | None = None  # the draft model ("draft_model") or head directory ("eagle")
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Running + waiting requests above which a step does not speculate; None: always. Default
    # 8: on an H100 verifying k = 4 drafts costs 1.6-1.8x a plain step at batch 8 and 2.0-3.1x
    # at 32-128 (3B/7B W4A16, BENCHMARKS.md), more than the 1.1-3 tokens a step that real
    # chat and extraction prompts accept; past 8 speculation would make serving slower.
    disable_by_batch_size: int | None = 8
    # Within that limit, speculate only at batch sizes where speculating steps measure more
    # tokens a second than plain ones (pagoda/engine/spec_governor.py); False: always.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                "speculative_config.method must be one of "
                f"{', '.join(repr(m) for m in SPEC_METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in 1..16, got {k!r}"
            )
        if self.method in ("draft_model", "eagle") and not isinstance(self.model, str):
            what = "a draft 'model'" if self.method == "draft_model" else "the head's 'model'"
            raise ValueError(f"speculative_config: method {self.method!r} needs {what}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) > "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}"
            )
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an integer >= 1, got {b!r}"
            )

    @classmethod
    def from_user(cls, value: Any) -> SpeculativeConfig | None:
        """From `LLM(speculative_config=...)` / `--speculative-config` (a dict or JSON text).

        `{"model": ...}` without a method means a draft model, as in vLLM.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = set(value) - _SPEC_KEYS
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; "
                f"supported: {', '.join(sorted(_SPEC_KEYS))}"
            )
        options = dict(value)
        method = options.pop("method", None)
        if method is None:
            method = "draft_model" if "model" in options else None
        if method in ("draft", "draft_model"):
            method = "draft_model"
        if method is None:
            raise ValueError(
                "speculative_config needs 'method' ('ngram', 'eagle') or a draft 'model'"
            )
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        return cls(method=method, **options)


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step, concurrency cap and the context limit."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    max_loras: int | None = None  # distinct adapters among running requests; None: no LoRA
    # Schedule step N+1 while step N runs on the device; its sampled tokens stay on the device
    # as the next inputs. Off for requests whose sampling reads host-side token history.
    async_scheduling: bool = False
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class LoRAConfig:
    """Unmerged LoRA serving: adapter slots on the device, their rank, adapters kept on host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 8

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            # fewer would re-read active adapters from disk every time a slot changes hands
            object.__setattr__(self, "max_cpu_loras", self.max_loras)


@dataclass(frozen=True)
class MultiModalConfig:
    """Image and video inputs of vision-language models: how many, how large, from where."""

    limit_per_prompt: int = 4  # images per prompt (vLLM's limit_mm_per_prompt={"image": N})
    video_limit_per_prompt: int = 1  # videos per prompt (limit_mm_per_prompt={"video": N})
    # min_pixels / max_pixels (images and video frames); fps, min_frames, max_frames,
    # total_pixels (videos)
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    allow_remote_images: bool = False  # fetch http(s) media URLs (off: servers must opt in)
    image_fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20  # encoded size, for URLs, data URLs, files and bytes
    max_image_pixels: int = 1 << 26  # decoded width * height (a video: per frame)
    max_video_bytes: int = 256 << 20  # encoded size of one video

    def __post_init__(self) -> None:
        for name, modality in (("limit_per_prompt", "image"), ("video_limit_per_prompt", "video")):
            limit = getattr(self, name)
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {limit!r}"
                )
        unknown = set(self.processor_kwargs) - set(MM_PROCESSOR_KWARGS)
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: unknown key(s) {', '.join(sorted(unknown))}; "
                f"supported: {', '.join(MM_PROCESSOR_KWARGS)}"
            )
        for key, value in self.processor_kwargs.items():
            number = (int, float) if key == "fps" else int
            if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
                kind = "a number" if key == "fps" else "an integer"
                raise ValueError(f"mm_processor_kwargs[{key!r}] must be {kind} > 0, got {value!r}")
        for lo_key, hi_key in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
            lo, hi = self.processor_kwargs.get(lo_key), self.processor_kwargs.get(hi_key)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"mm_processor_kwargs: {lo_key} ({lo}) > {hi_key} ({hi})")
        if not self.image_fetch_timeout_s > 0:
            raise ValueError(f"image_fetch_timeout must be > 0 s, got {self.image_fetch_timeout_s}")
        for name in ("max_image_bytes", "max_image_pixels", "max_video_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_user(
        cls,
        limit_mm_per_prompt: dict[str, int] | None,
        mm_processor_kwargs: dict[str, Any] | None,
        **options: Any,
    ) -> MultiModalConfig:
        """Validate vLLM-style options (`{"image": N, "video": M}`)."""
        limits = dict(limit_mm_per_prompt or {})
        unknown = set(limits) - {"image", "video"}
        if unknown:
            raise ValueError(
                f"limit_mm_per_prompt: unsupported modality {', '.join(sorted(unknown))}; "
                "pagoda accepts {'image': N, 'video': M}"
            )
        if "image" in limits:
            options["limit_per_prompt"] = limits["image"]
        if "video" in limits:
            options["video_limit_per_prompt"] = limits["video"]
        return cls(processor_kwargs=dict(mm_processor_kwargs or {}), **options)


# Keys of mm_processor_kwargs: pixel bounds (images and video frames), then video sampling.
MM_PROCESSOR_KWARGS = (
    "min_pixels",
    "max_pixels",
    "fps",
    "min_frames",
    "max_frames",
    "total_pixels",
)


@dataclass(frozen=True)
class RunnerConfig:
    """Execution options of the model runner."""

    device: str = "cpu"
    enforce_eager: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    cuda_graph_sizes: tuple[int, ...] = field(default_factory=tuple)
    lora: LoRAConfig | None = None  # None: LoRA serving off
    multimodal: MultiModalConfig | None = None  # None: a text-only model
    # GiB of decoder-layer weights kept in pinned host memory, streamed per layer (offload.py)
    cpu_offload_gb: float = 0.0
    # Ranks the model is split over (pagoda.worker.tp_executor); 1: this process alone.
    tensor_parallel_size: int = 1
    # Speculative decoding with a draft model: its config (the target's dtype and context);
    # the runner loads it next to the target (pagoda.worker.draft_model).
    draft_model: ModelConfig | None = None
    # Speculative decoding with an EAGLE head: its config (the decoder layer's; the target's
    # dtype and context); the runner loads it next to the target (pagoda.worker.eagle).
    eagle_head: ModelConfig | None = None

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp > 1 and self.cpu_offload_gb:
            raise ValueError("cpu_offload_gb cannot be combined with tensor_parallel_size > 1")
        if tp > 1 and (self.draft_model is not None or self.eagle_head is not None):
            raise ValueError(
                "a speculative draft model or EAGLE head cannot be combined with "
                "tensor_parallel_size > 1"
            )
        if self.draft_model is not None and self.eagle_head is not None:
            raise ValueError("speculative decoding takes a draft model or an EAGLE head, not both")
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb >= 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {gb!r}")
