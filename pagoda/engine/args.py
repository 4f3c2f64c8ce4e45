"""User-facing engine options, shared by `LLM(...)`, the CLI and the server.

`EngineArgs` holds what a user may pass (vLLM's names); `create_configs()` validates them,
resolves the model's files and defaults (dtype, context length, device) and returns the frozen
sub-configs each component takes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagoda.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    normalize_dtype,
)
from pagoda.model_files import ModelSource, load_hf_config, quantization_config, resolve_model
from pagoda.platform import resolve_device
from pagoda.quant.fp8 import FP8_SCHEMES
from pagoda.quant.fp8 import quantization_config as fp8_quantization_config
from pagoda.quant.scheme import (
    QUANT_METHODS,
    fp8_at_load_config,
    normalize_quant_method,
    parse_quantization_config,
)

# `config:PATH.json:w4a16` dummy runs: weights in the W4A16 / W8A16 layout (group 128);
# `:w4a16-lm_head` / `:w8a16-lm_head` quantize the (untied) LM head too. Suffix -> (bits, head).
_DUMMY_QUANT = {
    "w4a16": (4, False),
    "w8a16": (8, False),
    "w4a16-lm_head": (4, True),
    "w8a16-lm_head": (8, True),
}


def _dummy_quantization_config(num_bits: int, lm_head: bool = False) -> dict[str, Any]:
    """A compressed-tensors config like `pagoda quantize` writes (symmetric, group 128).

    `lm_head`: leave lm_head out of `ignore`, so that an untied model quantizes its head too
    (a tied head stays dense whatever the config says).
    """
    weights = {
        "num_bits": num_bits,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 128,
        "actorder": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        # Vision towers stay in the model dtype, as in llmcompressor's recipes for VL models.
        "ignore": ["re:.*visual.*"] if lm_head else ["lm_head", "re:.*visual.*"],
    }


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: Any = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # "fp8" / "fp8_e4m3" / "fp8_e5m2": FP8 KV cache
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    # None: on for CUDA devices (where it hides host time behind the device), off on CPU.
    async_scheduling: bool | None = None
    seed: int = 0
    device: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    skip_tokenizer_init: bool = False
    disable_log_stats: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Vision-language models (ignored for text-only ones); see MultiModalConfig.
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    allow_remote_images: bool = False
    image_fetch_timeout: float = 10.0
    max_image_bytes: int = 20 << 20
    max_video_bytes: int = 256 << 20
    cpu_offload_gb: float = 0.0  # GiB of weights in pinned host memory, streamed per layer
    # vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, ...} or
    # {"model": DRAFT, "num_speculative_tokens": k}; a dict or its JSON text.
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = None
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each on CUDA) the model spans

    def _async_scheduling(self, device: Any) -> bool:
        """On for CUDA unless set; never with tensor parallelism, whose ranks take every input
        token from rank 0's host (an async step's input is on rank 0's device only)."""
        tp = self.tensor_parallel_size
        if tp != 1 and self.async_scheduling:
            raise ValueError(
                "async_scheduling=True cannot be combined with tensor_parallel_size > 1"
            )
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.type == "cuda" and tp == 1

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_configs(
        self,
    ) -> tuple[ModelSource, ModelConfig, CacheConfig, SchedulerConfig, RunnerConfig]:
        for name in ("max_num_seqs", "block_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        speculative = SpeculativeConfig.from_user(self.speculative_config)  # bad keys: first
        if speculative is not None and self.tensor_parallel_size != 1:
            raise ValueError(
                "speculative_config cannot be combined with tensor_parallel_size > 1 yet "
                "(verify steps are not run across ranks); use one of the two"
            )
        source = resolve_model(self.model)
        hf_config = load_hf_config(source, lazy=True)
        text_config = getattr(hf_config, "text_config", None) or hf_config
        device = resolve_device(self.device)

        dtype = normalize_dtype(self.dtype)
        if dtype == "auto":
            if device.type == "cpu":
                dtype = "float32"  # CPU kernels for half types are slow or missing
            else:
                # not `torch_dtype`: transformers prints a deprecation line when it is read
                cfg_dtype = getattr(text_config, "dtype", None) or getattr(hf_config, "dtype", None)
                dtype = normalize_dtype(cfg_dtype or "bfloat16")
                if dtype == "float32":
                    dtype = "bfloat16"

        max_pos = getattr(text_config, "max_position_embeddings", None) or 4096
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(max_pos, 32768)
        elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int):
            raise TypeError(f"max_model_len must be an integer, got {max_model_len!r}")
        elif max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={max_pos}"
            )

        load_format = self.load_format
        if source.kind == "config":
            load_format = "dummy"
        elif source.kind == "gguf":
            if load_format not in ("auto", "gguf", "dummy"):
                raise ValueError(f"load_format={load_format!r} cannot load a GGUF file")
            if load_format == "auto":
                load_format = "gguf"

        quant = _checkpoint_quantization(hf_config, source, self.quantization)

        model_config = ModelConfig(
            model=source.path,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            load_format=load_format,
            seed=self.seed,
            gguf_file=source.path if source.kind == "gguf" else None,
            quantization=quant,
        )
        draft_config = eagle_config = None
        if speculative is not None and speculative.method == "draft_model":
            draft_config = _draft_model_config(speculative.model, model_config, self.seed)
        if speculative is not None and speculative.method == "eagle":
            eagle_config = _eagle_head_config(speculative.model, model_config, self.seed)
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = 8192 if device.type == "cuda" else 2048
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=self.kv_cache_memory,
            num_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
        )
        lora_config = None
        if self.enable_lora:
            lora_config = LoRAConfig(
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras or max(8, self.max_loras),
            )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_loras=lora_config.max_loras if lora_config is not None else None,
            async_scheduling=self._async_scheduling(device),
            speculative=speculative,
        )
        mm_config = None
        if getattr(hf_config, "vision_config", None) is not None:
            mm_config = MultiModalConfig.from_user(
                self.limit_mm_per_prompt,
                self.mm_processor_kwargs,
                allow_remote_images=self.allow_remote_images,
                image_fetch_timeout_s=self.image_fetch_timeout,
                max_image_bytes=self.max_image_bytes,
                max_video_bytes=self.max_video_bytes,
            )
        runner_config = RunnerConfig(
            device=str(device),
            enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            lora=lora_config,
            multimodal=mm_config,
            cpu_offload_gb=self.cpu_offload_gb,
            tensor_parallel_size=self.tensor_parallel_size,
            draft_model=draft_config,
            eagle_head=eagle_config,
        )
        if runner_config.cpu_offload_gb and quant is not None:
            raise ValueError(
                "cpu_offload_gb works with unquantized checkpoints only; a W4A16 checkpoint "
                "already takes about a quarter of the bf16 weights"
            )
        if runner_config.cpu_offload_gb and lora_config is not None:
            raise ValueError("cpu_offload_gb cannot be combined with enable_lora yet")
        return source, model_config, cache_config, scheduler_config, runner_config


def _checkpoint_quantization(
    hf_config: Any, source: ModelSource, requested_name: str | None
) -> dict | None:
    """The quantization_config to load with: the checkpoint's, a dummy run's, or FP8 at load;
    every bad field is one clear ValueError now."""
    quant = quantization_config(hf_config)
    requested = normalize_quant_method(requested_name)
    if requested == "fp8" and quant is None:
        quant = fp8_at_load_config()  # vLLM's meaning: FP8_DYNAMIC, quantized while loading
    if requested is not None and quant is None and source.quant_override is None:
        raise ValueError(
            f"quantization={requested_name!r} was requested but the checkpoint has no "
            "quantization_config (pagoda serves pre-quantized checkpoints; make one with "
            "`pagoda quantize`, or quantization='fp8' to quantize to FP8 at load)"
        )
    if quant is None and source.quant_override == "fp8":
        # `config:...:fp8`: random FP8_DYNAMIC weights stored as llmcompressor writes them
        quant = fp8_quantization_config(FP8_SCHEMES["FP8_DYNAMIC"], ["lm_head", "re:.*visual.*"])
    if quant is None and source.quant_override in _DUMMY_QUANT:
        quant = _dummy_quantization_config(*_DUMMY_QUANT[source.quant_override])
    if quant is None and source.quant_override == "awq":
        from pagoda.quant.formats.autoawq import quantization_config as awq_config

        quant = awq_config(group_size=128, zero_point=True)
    if quant is not None:
        method = quant.get("quant_method")
        method = method.lower() if isinstance(method, str) else method
        if method not in QUANT_METHODS:
            raise ValueError(
                f"the checkpoint's quant_method={method!r} is not supported; pagoda serves "
                "compressed-tensors (pagoda quantize, llmcompressor), gptq and awq (AutoAWQ "
                "GEMM) checkpoints"
            )
        if requested not in (None, method):
            raise ValueError(
                f"quantization={requested_name!r} was requested but the checkpoint is {method!r}"
            )
        try:
            parse_quantization_config(quant)  # every bad field: one clear error, now
        except NotImplementedError as e:
            raise ValueError(str(e)) from None
    return quant


def _draft_model_config(draft: str, target: ModelConfig, seed: int) -> ModelConfig:
    """The draft model's config: any format the target could be (safetensors, W4A16, GGUF),
    loaded in the target's dtype for the target's context. Its token ids must mean what the
    target's do: a vocabulary no larger than the target's and the same special-token ids, else
    a ValueError naming both models before either loads."""
    source = resolve_model(draft)
    hf_config = load_hf_config(source, lazy=True)
    if getattr(hf_config, "vision_config", None) is not None:
        raise ValueError(
            f"speculative draft model {source.path!r} is a vision-language model; the draft "
            "must be a text-only model (it reads the image placeholder ids as text)"
        )
    text, draft_text = target.text_config, hf_config
    mismatches = []
    # A smaller draft vocabulary is the padded-embedding case (Qwen2.5-7B pads 151,936 ids to
    # 152,064, its 0.5B draft does not): the draft proposes ids the target has; a target id past
    # the draft's table (a padding id) reaches the draft clamped, which only costs acceptance.
    if draft_text.vocab_size > text.vocab_size:
        mismatches.append(
            f"vocab_size {draft_text.vocab_size} (draft) > {text.vocab_size} (target)"
        )
    for name in ("bos_token_id", "eos_token_id"):
        a = _token_ids(draft_text, name)
        b = _token_ids(text, name) or _token_ids(target.hf_config, name)
        if a and b and not (a & b):
            mismatches.append(f"{name} {sorted(a)} (draft) vs {sorted(b)} (target)")
    if mismatches:
        raise ValueError(
            f"speculative draft model {source.path!r} does not share the tokenizer of the "
            f"target {target.model!r}: {'; '.join(mismatches)}"
        )
    max_pos = getattr(draft_text, "max_position_embeddings", None) or 4096
    if max_pos < target.max_model_len:
        raise ValueError(
            f"speculative draft model {source.path!r} has max_position_embeddings={max_pos}, "
            f"less than the target's max_model_len={target.max_model_len}; lower max_model_len"
        )
    load_format = {"config": "dummy", "gguf": "gguf"}.get(source.kind, "auto")
    return ModelConfig(
        model=source.path,
        hf_config=hf_config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        load_format=load_format,
        seed=seed,
        gguf_file=source.path if source.kind == "gguf" else None,
        quantization=_checkpoint_quantization(hf_config, source, None),
    )


def _eagle_head_config(head: str, target: ModelConfig, seed: int) -> ModelConfig:
    """The EAGLE head's config (pagoda.models.eagle): a head directory (config.json and its
    tensors) or `config:FILE.json` (random weights), in the target's dtype for the target's
    context. It must be trained for this target's feature size and vocabulary, on a text-only
    target: else one ValueError naming the head and the mismatch, before anything loads."""
    source = resolve_model(head)
    where = f"speculative EAGLE head {source.path!r}"
    if source.kind not in ("hf_dir", "config"):
        raise ValueError(
            f"{where}: expected a directory with config.json and the head's tensors (EAGLE "
            "layout: fc.weight, layers.0.*), not a GGUF file"
        )
    if getattr(target.hf_config, "vision_config", None) is not None:
        raise ValueError(f"{where}: EAGLE heads are supported for text-only targets")
    hf_config = load_hf_config(source, lazy=True)
    text = target.text_config
    problems = []
    for name in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(getattr(hf_config, name, None), int):
            problems.append(f"config.json has no integer {name}")
    if not problems and hf_config.hidden_size != text.hidden_size:
        problems.append(
            f"hidden_size {hf_config.hidden_size} (head) != {text.hidden_size} (target): the "
            "head reads the target's features, so it must be trained for this target"
        )
    vocab = getattr(hf_config, "vocab_size", None)
    if isinstance(vocab, int) and vocab != text.vocab_size:
        problems.append(
            f"vocab_size {vocab} (head) != {text.vocab_size} (target): trained for another model"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf_config.hidden_act!r} (only 'silu' is supported)")
    if problems:
        raise ValueError(f"{where} does not fit the target {target.model!r}: {'; '.join(problems)}")
    return ModelConfig(
        model=source.path,
        hf_config=hf_config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        load_format="dummy" if source.kind == "config" else "auto",
        seed=seed,
    )


def _token_ids(config: Any, name: str) -> set[int]:
    """A config's special-token id(s) as a set (empty when unset)."""
    value = getattr(config, name, None)
    if value is None:
        return set()
    return {
        v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)
    }
