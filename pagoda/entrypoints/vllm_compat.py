"""vLLM's launch flags and `LLM(...)` keyword arguments, each implemented or refused with why.

`pagoda serve` accepts a `vllm serve` command line as it is: every flag of vLLM 0.34.0 (recorded in
tests/fixtures/vllm/serve_flags-0.34.0.json) is implemented with vLLM's meaning, accepted with the
values whose meaning pagoda has, equivalent by construction, or refused with an error naming it and
the reason. `LLM(...)` keyword arguments (vLLM's EngineArgs fields) follow the same table.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger("pagoda")

VLLM_VERSION = "0.34.0"

# Destinations (vLLM's EngineArgs / FrontendArgs field names) that `pagoda serve` defines with
# vLLM's flags and meaning.
IMPLEMENTED = frozenset(
    [
        "speculative_config",
        "kv_cache_dtype",
        "data_parallel_size",
        "tensor_parallel_size",
        "allow_credentials",
        "allowed_headers",
        "allowed_methods",
        "allowed_origins",
        "api_key",
        "async_scheduling",
        "block_size",
        "chat_template",
        "cpu_offload_gb",
        "disable_fastapi_docs",
        "disable_log_stats",
        "disable_uvicorn_access_log",
        "dtype",
        "enable_auto_tool_choice",
        "enable_chunked_prefill",
        "enable_log_requests",
        "enable_lora",
        "enable_prefix_caching",
        "enforce_eager",
        "generation_config",
        "gpu_memory_utilization",
        "host",
        "kv_cache_memory_bytes",
        "limit_mm_per_prompt",
        "load_format",
        "log_level",
        "lora_modules",
        "max_cpu_loras",
        "max_log_len",
        "max_logprobs",
        "max_lora_rank",
        "max_loras",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "mm_processor_kwargs",
        "model",
        "num_gpu_blocks_override",
        "override_generation_config",
        "port",
        "quantization",
        "reasoning_parser",
        "root_path",
        "seed",
        "served_model_name",
        "shutdown_timeout",
        "skip_tokenizer_init",
        "ssl_ca_certs",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_keyfile",
        "tokenizer",
        "tool_call_parser",
        "trust_remote_code",
        "uvicorn_log_level",
    ]
)
VALUE_CHECKED = {
    "api_server_count": ("--api-server-count -asc", "1", "one API server process per engine"),
    "chat_template_content_format": (
        "--chat-template-content-format",
        "auto string openai",
        "message content is rendered as the template expects (auto)",
    ),
    "response_role": ("--response-role", "assistant", "responses always take the assistant role"),
    "runner": (
        "--runner",
        "auto generate",
        "pagoda serves generative models only (no pooling/embedding runner)",
    ),
    "convert": (
        "--convert",
        "auto none",
        "pagoda serves generative models only (no model conversion)",
    ),
    "tokenizer_mode": (
        "--tokenizer-mode",
        "auto hf",
        "pagoda loads tokenizers with transformers (no mistral/slow modes)",
    ),
    "logprobs_mode": (
        "--logprobs-mode",
        "raw_logprobs",
        "logprobs are always those of the raw model distribution",
    ),
    "config_format": (
        "--config-format",
        "auto hf",
        "pagoda reads Hugging Face config.json (or GGUF metadata)",
    ),
    "model_impl": ("--model-impl", "auto", "pagoda runs its own model implementations"),
    "distributed_executor_backend": (
        "--distributed-executor-backend",
        "mp uni",
        "one device, one worker: there is no Ray backend",
    ),
    "pipeline_parallel_size": (
        "--pipeline-parallel-size -pp",
        "1",
        "pagoda runs a model on one device; pipeline parallelism is not implemented",
    ),
    "scheduling_policy": (
        "--scheduling-policy",
        "fcfs",
        "the scheduler admits requests first come, first served; no priorities",
    ),
}
EQUIVALENT = {
    "enable_prompt_tokens_details": (
        "--enable-prompt-tokens-details --disable-prompt-tokens-details",
        "usage.prompt_tokens_details.cached_tokens is always reported",
    ),
    "enable_tokenizer_info_endpoint": (
        "--enable-tokenizer-info-endpoint --disable-tokenizer-info-endpoint",
        "/tokenizer_info is always served",
    ),
    "use_tqdm_on_load": (
        "--use-tqdm-on-load --no-use-tqdm-on-load",
        "loading reports its progress as it always does",
    ),
    "disable_custom_all_reduce": (
        "--disable-custom-all-reduce --enable-custom-all-reduce",
        "one device: there is no all-reduce to customise",
    ),
}
REFUSED = {
    "headless": ("--headless", "no multi-node data parallelism"),
    "config": ("--config", "YAML config files are not read; pass the flags on the command line"),
    "grpc": ("--grpc", "pagoda serves HTTP only"),
    "trust_request_chat_template": (
        "--trust-request-chat-template --no-trust-request-chat-template",
        "a request's chat_template is always honoured",
    ),
    "trust_request_mm_kwargs": (
        "--trust-request-mm-kwargs --no-trust-request-mm-kwargs",
        "not implemented by pagoda's server",
    ),
    "default_chat_template_kwargs": (
        "--default-chat-template-kwargs",
        "pass chat_template_kwargs per request",
    ),
    "reasoning_effort_map": ("--reasoning-effort-map", "not implemented by pagoda's server"),
    "return_tokens_as_token_ids": (
        "--return-tokens-as-token-ids --no-return-tokens-as-token-ids",
        "tokens are returned as text (request return_token_ids for ids)",
    ),
    "exclude_tools_when_tool_choice_none": (
        "--exclude-tools-when-tool-choice-none --no-exclude-tools-when-tool-choice-none",
        "tools are always passed to the chat template",
    ),
    "tool_parser_plugin": (
        "--tool-parser-plugin",
        "tool parsers are built in (hermes, llama3_json); plugins are not loaded",
    ),
    "tool_strict_level": ("--tool-strict-level", "not implemented by pagoda's server"),
    "tool_server": ("--tool-server", "not implemented by pagoda's server"),
    "enable_per_request_metrics": (
        "--enable-per-request-metrics --disable-per-request-metrics",
        "not implemented by pagoda's server",
    ),
    "enable_server_load_tracking": (
        "--enable-server-load-tracking --disable-server-load-tracking",
        "not implemented by pagoda's server",
    ),
    "enable_force_include_usage": (
        "--enable-force-include-usage --disable-force-include-usage",
        "usage is included when a request asks for it (stream_options.include_usage)",
    ),
    "sse_keep_alive_interval": (
        "--sse-keep-alive-interval",
        "no keep-alive comments are sent on streams",
    ),
    "enable_log_outputs": (
        "--enable-log-outputs --disable-log-outputs",
        "generated text is not logged",
    ),
    "enable_log_deltas": (
        "--enable-log-deltas --disable-log-deltas",
        "not implemented by pagoda's server",
    ),
    "cohere_is_reasoning_model": (
        "--cohere-is-reasoning-model --no-cohere-is-reasoning-model",
        "not implemented by pagoda's server",
    ),
    "cohere_format": ("--cohere-format", "not implemented by pagoda's server"),
    "anthropic_disabled_thinking_effort": (
        "--anthropic-disabled-thinking-effort",
        "not implemented by pagoda's server",
    ),
    "log_error_stack": (
        "--log-error-stack --no-log-error-stack",
        "not implemented by pagoda's server",
    ),
    "tokens_only": ("--tokens-only --no-tokens-only", "not implemented by pagoda's server"),
    "enable_scale_out": (
        "--enable-scale-out --disable-scale-out",
        "not implemented by pagoda's server",
    ),
    "fingerprint_mode": ("--fingerprint-mode", "not implemented by pagoda's server"),
    "fingerprint_value": ("--fingerprint-value", "not implemented by pagoda's server"),
    "grpc_port": ("--grpc-port", "not implemented by pagoda's server"),
    "data_parallel_supervisor_port": (
        "--data-parallel-supervisor-port",
        "not implemented by pagoda's server",
    ),
    "dp_supervisor_probe_interval_s": (
        "--dp-supervisor-probe-interval-s",
        "not implemented by pagoda's server",
    ),
    "dp_supervisor_probe_timeout_s": (
        "--dp-supervisor-probe-timeout-s",
        "not implemented by pagoda's server",
    ),
    "dp_supervisor_probe_failure_threshold": (
        "--dp-supervisor-probe-failure-threshold",
        "not implemented by pagoda's server",
    ),
    "uds": ("--uds", "pagoda listens on TCP only"),
    "disable_access_log_for_endpoints": (
        "--disable-access-log-for-endpoints",
        "not implemented by pagoda's server",
    ),
    "enable_ssl_refresh": (
        "--enable-ssl-refresh --disable-ssl-refresh",
        "certificates are read once at start-up; restart to load new ones",
    ),
    "ssl_ciphers": ("--ssl-ciphers", "the ssl module's default ciphers are used"),
    "middleware": (
        "--middleware",
        "pagoda does not import user middleware; put it in a reverse proxy",
    ),
    "enable_request_id_headers": (
        "--enable-request-id-headers --disable-request-id-headers",
        "X-Request-Id headers are not added",
    ),
    "h11_max_incomplete_event_size": (
        "--h11-max-incomplete-event-size",
        "not implemented by pagoda's server",
    ),
    "h11_max_header_count": ("--h11-max-header-count", "not implemented by pagoda's server"),
    "enable_offline_docs": (
        "--enable-offline-docs --disable-offline-docs",
        "not implemented by pagoda's server",
    ),
    "enable_flash_late_interaction": (
        "--enable-flash-late-interaction --disable-flash-late-interaction",
        "not implemented by pagoda's server",
    ),
    "hf_config_path": ("--hf-config-path", "not implemented by pagoda's model loader"),
    "allowed_local_media_path": (
        "--allowed-local-media-path",
        "not implemented by pagoda's model loader",
    ),
    "allowed_media_domains": (
        "--allowed-media-domains",
        "not implemented by pagoda's model loader",
    ),
    "revision": (
        "--revision",
        "pagoda never downloads from the Hugging Face Hub: pass a local model directory",
    ),
    "code_revision": (
        "--code-revision",
        "pagoda never downloads from the Hugging Face Hub: pass a local model directory",
    ),
    "tokenizer_revision": (
        "--tokenizer-revision",
        "pagoda never downloads from the Hugging Face Hub: pass a local model directory",
    ),
    "quantization_config": (
        "--quantization-config",
        "the quantization scheme is read from the checkpoint (make one with `pagoda quantize`)",
    ),
    "allow_deprecated_quantization": (
        "--allow-deprecated-quantization --no-allow-deprecated-quantization",
        "not implemented by pagoda's model loader",
    ),
    "enable_return_routed_experts": (
        "--enable-return-routed-experts --disable-return-routed-experts",
        "not implemented by pagoda's model loader",
    ),
    "return_sampling_mask": (
        "--return-sampling-mask --no-return-sampling-mask",
        "not implemented by pagoda's model loader",
    ),
    "use_fp64_gumbel": (
        "--use-fp64-gumbel --no-use-fp64-gumbel",
        "not implemented by pagoda's model loader",
    ),
    "enable_trace_replay": (
        "--enable-trace-replay --disable-trace-replay",
        "not implemented by pagoda's model loader",
    ),
    "disable_sliding_window": (
        "--disable-sliding-window --enable-sliding-window",
        "sliding-window attention follows the model's config",
    ),
    "disable_cascade_attn": (
        "--disable-cascade-attn --enable-cascade-attn",
        "not implemented by pagoda's model loader",
    ),
    "enable_prompt_embeds": (
        "--enable-prompt-embeds --disable-prompt-embeds",
        "prompt embeddings as input are not supported",
    ),
    "hf_token": (
        "--hf-token",
        "pagoda never downloads from the Hugging Face Hub: pass a local model directory",
    ),
    "hf_overrides": (
        "--hf-overrides",
        "config overrides are not applied; edit the checkpoint's config.json",
    ),
    "model_class_overrides": (
        "--model-class-overrides",
        "not implemented by pagoda's model loader",
    ),
    "pooler_config": ("--pooler-config", "pooling models are not supported"),
    "enable_sleep_mode": (
        "--enable-sleep-mode --disable-sleep-mode",
        "sleep mode (freeing device memory while idle) is not implemented",
    ),
    "sleep_mode_backend": ("--sleep-mode-backend", "not implemented by pagoda's model loader"),
    "sleep_mode_offload_cudagraph": (
        "--sleep-mode-offload-cudagraph --no-sleep-mode-offload-cudagraph",
        "not implemented by pagoda's model loader",
    ),
    "sleep_preserve_parameter_names": (
        "--sleep-preserve-parameter-names",
        "not implemented by pagoda's model loader",
    ),
    "enable_cumem_allocator": (
        "--enable-cumem-allocator --disable-cumem-allocator",
        "not implemented by pagoda's model loader",
    ),
    "enable_nccl_comm_suspend": (
        "--enable-nccl-comm-suspend --disable-nccl-comm-suspend",
        "not implemented by pagoda's model loader",
    ),
    "checkpoint_prepare_on_startup": (
        "--checkpoint-prepare-on-startup --no-checkpoint-prepare-on-startup",
        "not implemented by pagoda's model loader",
    ),
    "logits_processors": ("--logits-processors", "custom logits processors are not loaded"),
    "io_processor_plugin": ("--io-processor-plugin", "not implemented by pagoda's model loader"),
    "renderer_num_workers": ("--renderer-num-workers", "not implemented by pagoda's model loader"),
    "download_dir": (
        "--download-dir",
        "pagoda never downloads models: pass a local model directory",
    ),
    "safetensors_load_strategy": (
        "--safetensors-load-strategy",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "safetensors_prefetch_num_threads": (
        "--safetensors-prefetch-num-threads",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "safetensors_prefetch_block_size": (
        "--safetensors-prefetch-block-size",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "model_loader_extra_config": (
        "--model-loader-extra-config",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "ignore_patterns": (
        "--ignore-patterns",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "pt_load_map_location": (
        "--pt-load-map-location",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "shuffle_safetensors_files": (
        "--shuffle-safetensors-files --no-shuffle-safetensors-files",
        "pagoda loads local safetensors/GGUF files only and never downloads",
    ),
    "attention_backend": (
        "--attention-backend",
        "pagoda chooses its attention kernels by device capability",
    ),
    "mamba_backend": ("--mamba-backend", "pagoda has no Mamba/state-space models"),
    "mamba_ssu_algorithm": ("--mamba-ssu-algorithm", "pagoda has no Mamba/state-space models"),
    "enable_mamba_cache_stochastic_rounding": (
        "--enable-mamba-cache-stochastic-rounding --disable-mamba-cache-stochastic-rounding",
        "pagoda has no Mamba/state-space models",
    ),
    "mamba_cache_philox_rounds": (
        "--mamba-cache-philox-rounds",
        "pagoda has no Mamba/state-space models",
    ),
    "reasoning_parser_plugin": (
        "--reasoning-parser-plugin",
        "reasoning parsers are built in (qwen3, deepseek_r1); plugins are not loaded",
    ),
    "master_addr": (
        "--master-addr",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "master_port": (
        "--master-port",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "nnodes": (
        "--nnodes -n",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "node_rank": (
        "--node-rank -r",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "distributed_timeout_seconds": (
        "--distributed-timeout-seconds",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "cpu_distributed_timeout_seconds": (
        "--cpu-distributed-timeout-seconds",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "numa_bind": (
        "--numa-bind --no-numa-bind",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "numa_bind_nodes": (
        "--numa-bind-nodes",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "numa_bind_cpus": (
        "--numa-bind-cpus",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "device_ids": (
        "--device-ids",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "decode_context_parallel_size": (
        "--decode-context-parallel-size -dcp",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "dcp_comm_backend": (
        "--dcp-comm-backend",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "dcp_q_replicate": (
        "--dcp-q-replicate --no-dcp-q-replicate",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "dcp_kv_cache_interleave_size": (
        "--dcp-kv-cache-interleave-size",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "cp_kv_cache_interleave_size": (
        "--cp-kv-cache-interleave-size",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "prefill_context_parallel_size": (
        "--prefill-context-parallel-size -pcp",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_rank": (
        "--data-parallel-rank -dpn",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_start_rank": (
        "--data-parallel-start-rank -dpr",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_size_local": (
        "--data-parallel-size-local -dpl",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_address": (
        "--data-parallel-address -dpa",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_rpc_port": (
        "--data-parallel-rpc-port -dpp",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_backend": (
        "--data-parallel-backend -dpb",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_hybrid_lb": (
        "--data-parallel-hybrid-lb --no-data-parallel-hybrid-lb -dph",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_external_lb": (
        "--data-parallel-external-lb --no-data-parallel-external-lb -dpe",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "data_parallel_multi_port_external_lb": (
        "--data-parallel-multi-port-external-lb -dpm",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_hc_sp": (
        "--enable-hc-sp --disable-hc-sp",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_expert_parallel": (
        "--enable-expert-parallel -ep --disable-expert-parallel",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_batch_sharded_sampling": (
        "--enable-batch-sharded-sampling --disable-batch-sharded-sampling",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_ep_weight_filter": (
        "--enable-ep-weight-filter --disable-ep-weight-filter",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "all2all_backend": (
        "--all2all-backend",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_dbo": (
        "--enable-dbo --disable-dbo",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_shm_tensor_arena": (
        "--enable-shm-tensor-arena --disable-shm-tensor-arena",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "ubatch_size": (
        "--ubatch-size",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_elastic_ep": (
        "--enable-elastic-ep --disable-elastic-ep",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "elastic_ep_max_dp_size": (
        "--elastic-ep-max-dp-size",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "dbo_decode_token_threshold": (
        "--dbo-decode-token-threshold",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "dp_sync_interval": (
        "--dp-sync-interval",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "dbo_prefill_token_threshold": (
        "--dbo-prefill-token-threshold",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "disable_nccl_for_dp_synchronization": (
        "--disable-nccl-for-dp-synchronization --enable-nccl-for-dp-synchronization",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_eplb": (
        "--enable-eplb --disable-eplb",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "eplb_config": (
        "--eplb-config",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "expert_placement_strategy": (
        "--expert-placement-strategy",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "max_parallel_loading_workers": (
        "--max-parallel-loading-workers",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "ray_workers_use_nsight": (
        "--ray-workers-use-nsight --no-ray-workers-use-nsight",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "worker_cls": (
        "--worker-cls",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "worker_extension_cls": (
        "--worker-extension-cls",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_fault_tolerance": (
        "--enable-fault-tolerance --disable-fault-tolerance",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "fault_tolerance_config": (
        "--fault-tolerance-config",
        "pagoda runs one engine on one device: no distributed or parallel execution",
    ),
    "enable_extensible_kv_cache": (
        "--enable-extensible-kv-cache --disable-extensible-kv-cache",
        "not implemented by pagoda's KV cache",
    ),
    "prefix_caching_hash_algo": (
        "--prefix-caching-hash-algo",
        "not implemented by pagoda's KV cache",
    ),
    "prefix_cache_retention_interval": (
        "--prefix-cache-retention-interval",
        "not implemented by pagoda's KV cache",
    ),
    "kv_cache_dtype_skip_layers": (
        "--kv-cache-dtype-skip-layers",
        "not implemented by pagoda's KV cache",
    ),
    "kv_sharing_fast_prefill": (
        "--kv-sharing-fast-prefill --no-kv-sharing-fast-prefill",
        "not implemented by pagoda's KV cache",
    ),
    "swa_bounded_replay": (
        "--swa-bounded-replay --no-swa-bounded-replay",
        "not implemented by pagoda's KV cache",
    ),
    "mamba_cache_dtype": ("--mamba-cache-dtype", "not implemented by pagoda's KV cache"),
    "mamba_ssm_cache_dtype": ("--mamba-ssm-cache-dtype", "not implemented by pagoda's KV cache"),
    "mamba_block_size": ("--mamba-block-size", "not implemented by pagoda's KV cache"),
    "prefix_match_unit": ("--prefix-match-unit", "not implemented by pagoda's KV cache"),
    "mamba_cache_mode": ("--mamba-cache-mode", "not implemented by pagoda's KV cache"),
    "enable_mamba_shared_prefix_checkpoint": (
        "--enable-mamba-shared-prefix-checkpoint --disable-mamba-shared-prefix-checkpoint",
        "not implemented by pagoda's KV cache",
    ),
    "replayssm_buffer_len": ("--replayssm-buffer-len", "not implemented by pagoda's KV cache"),
    "use_replayssm": ("--use-replayssm --no-use-replayssm", "not implemented by pagoda's KV cache"),
    "kv_offloading_size": ("--kv-offloading-size", "not implemented by pagoda's KV cache"),
    "kv_offloading_backend": ("--kv-offloading-backend", "not implemented by pagoda's KV cache"),
    "offload_backend": (
        "--offload-backend",
        "pagoda offloads whole layers with --cpu-offload-gb only",
    ),
    "cpu_offload_params": (
        "--cpu-offload-params",
        "pagoda offloads whole layers with --cpu-offload-gb only",
    ),
    "offload_group_size": (
        "--offload-group-size",
        "pagoda offloads whole layers with --cpu-offload-gb only",
    ),
    "offload_num_in_group": (
        "--offload-num-in-group",
        "pagoda offloads whole layers with --cpu-offload-gb only",
    ),
    "offload_prefetch_step": (
        "--offload-prefetch-step",
        "pagoda offloads whole layers with --cpu-offload-gb only",
    ),
    "offload_params": (
        "--offload-params",
        "pagoda offloads whole layers with --cpu-offload-gb only",
    ),
    "language_model_only": (
        "--language-model-only --no-language-model-only",
        "not implemented by pagoda's multimodal path",
    ),
    "enable_mm_embeds": (
        "--enable-mm-embeds --disable-mm-embeds",
        "not implemented by pagoda's multimodal path",
    ),
    "media_io_kwargs": ("--media-io-kwargs", "not implemented by pagoda's multimodal path"),
    "mm_processor_cache_gb": (
        "--mm-processor-cache-gb",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_processor_cache_type": (
        "--mm-processor-cache-type",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_hasher_algorithm": ("--mm-hasher-algorithm", "not implemented by pagoda's multimodal path"),
    "mm_shm_cache_max_object_size_mb": (
        "--mm-shm-cache-max-object-size-mb",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_encoder_only": (
        "--mm-encoder-only --no-mm-encoder-only",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_encoder_tp_mode": ("--mm-encoder-tp-mode", "not implemented by pagoda's multimodal path"),
    "mm_encoder_attn_backend": (
        "--mm-encoder-attn-backend",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_encoder_attn_dtype": (
        "--mm-encoder-attn-dtype",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_encoder_fp8_scale_path": (
        "--mm-encoder-fp8-scale-path",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_encoder_fp8_scale_save_path": (
        "--mm-encoder-fp8-scale-save-path",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_encoder_fp8_scale_save_margin": (
        "--mm-encoder-fp8-scale-save-margin",
        "not implemented by pagoda's multimodal path",
    ),
    "interleave_mm_strings": (
        "--interleave-mm-strings --no-interleave-mm-strings",
        "not implemented by pagoda's multimodal path",
    ),
    "skip_mm_profiling": (
        "--skip-mm-profiling --no-skip-mm-profiling",
        "not implemented by pagoda's multimodal path",
    ),
    "video_pruning_rate": ("--video-pruning-rate", "not implemented by pagoda's multimodal path"),
    "video_pruning_method": (
        "--video-pruning-method",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_tensor_ipc": ("--mm-tensor-ipc", "not implemented by pagoda's multimodal path"),
    "mm_processor_device": ("--mm-processor-device", "not implemented by pagoda's multimodal path"),
    "mm_ipc_gpu_memory_gb": (
        "--mm-ipc-gpu-memory-gb",
        "not implemented by pagoda's multimodal path",
    ),
    "mm_device_do_normalize": (
        "--mm-device-do-normalize --no-mm-device-do-normalize",
        "not implemented by pagoda's multimodal path",
    ),
    "lora_dtype": ("--lora-dtype", "not implemented by pagoda's LoRA path"),
    "enable_tower_connector_lora": (
        "--enable-tower-connector-lora --disable-tower-connector-lora",
        "not implemented by pagoda's LoRA path",
    ),
    "fully_sharded_loras": (
        "--fully-sharded-loras --no-fully-sharded-loras",
        "not implemented by pagoda's LoRA path",
    ),
    "lora_target_modules": ("--lora-target-modules", "not implemented by pagoda's LoRA path"),
    "default_mm_loras": ("--default-mm-loras", "not implemented by pagoda's LoRA path"),
    "specialize_active_lora": (
        "--specialize-active-lora --no-specialize-active-lora",
        "not implemented by pagoda's LoRA path",
    ),
    "enable_mixed_moe_lora_format": (
        "--enable-mixed-moe-lora-format --disable-mixed-moe-lora-format",
        "not implemented by pagoda's LoRA path",
    ),
    "enable_moe_shared_loras": (
        "--enable-moe-shared-loras --disable-moe-shared-loras",
        "not implemented by pagoda's LoRA path",
    ),
    "max_lora_cls_labels": ("--max-lora-cls-labels", "not implemented by pagoda's LoRA path"),
    "logging_config": (
        "--logging-config",
        "use --log-level (pagoda's logging is configured with it only)",
    ),
    "log_config_file": (
        "--log-config-file",
        "use --log-level (pagoda's logging is configured with it only)",
    ),
    "show_hidden_metrics_for_version": (
        "--show-hidden-metrics-for-version",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "otlp_traces_endpoint": ("--otlp-traces-endpoint", "OpenTelemetry tracing is not implemented"),
    "collect_detailed_traces": (
        "--collect-detailed-traces",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "per_request_spec_decode_metrics": (
        "--per-request-spec-decode-metrics",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "kv_cache_metrics": (
        "--kv-cache-metrics --no-kv-cache-metrics",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "kv_cache_metrics_sample": (
        "--kv-cache-metrics-sample",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "custom_histogram_buckets": (
        "--custom-histogram-buckets",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "cudagraph_metrics": (
        "--cudagraph-metrics --no-cudagraph-metrics",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "enable_layerwise_nvtx_tracing": (
        "--enable-layerwise-nvtx-tracing --disable-layerwise-nvtx-tracing",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "enable_mfu_metrics": (
        "--enable-mfu-metrics --disable-mfu-metrics",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "enable_logging_iteration_details": (
        "--enable-logging-iteration-details --disable-logging-iteration-details",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "jit_monitor_mode": (
        "--jit-monitor-mode",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "jit_monitor_verbose": (
        "--jit-monitor-verbose --no-jit-monitor-verbose",
        "pagoda exports Prometheus metrics at /metrics only (no tracing or extra metric sets)",
    ),
    "max_num_scheduled_tokens": (
        "--max-num-scheduled-tokens",
        "not implemented by pagoda's scheduler",
    ),
    "max_num_active_seqs": ("--max-num-active-seqs", "not implemented by pagoda's scheduler"),
    "max_num_inflight_kv_loads": (
        "--max-num-inflight-kv-loads",
        "not implemented by pagoda's scheduler",
    ),
    "max_num_queued_reqs": ("--max-num-queued-reqs", "not implemented by pagoda's scheduler"),
    "max_num_queued_tokens": ("--max-num-queued-tokens", "not implemented by pagoda's scheduler"),
    "long_prefill_token_threshold": (
        "--long-prefill-token-threshold",
        "not implemented by pagoda's scheduler",
    ),
    "long_prefill_token_threshold_adaptive": (
        "--long-prefill-token-threshold-adaptive --no-long-prefill-token-threshold-adaptive",
        "not implemented by pagoda's scheduler",
    ),
    "disable_chunked_mm_input": (
        "--disable-chunked-mm-input --enable-chunked-mm-input",
        "not implemented by pagoda's scheduler",
    ),
    "scheduler_cls": ("--scheduler-cls", "not implemented by pagoda's scheduler"),
    "scheduler_reserve_full_isl": (
        "--scheduler-reserve-full-isl --no-scheduler-reserve-full-isl",
        "not implemented by pagoda's scheduler",
    ),
    "watermark": ("--watermark", "not implemented by pagoda's scheduler"),
    "prefill_schedule_interval": (
        "--prefill-schedule-interval",
        "not implemented by pagoda's scheduler",
    ),
    "cache_aware_admission_window": (
        "--cache-aware-admission-window",
        "not implemented by pagoda's scheduler",
    ),
    "cache_aware_admission_threshold": (
        "--cache-aware-admission-threshold",
        "not implemented by pagoda's scheduler",
    ),
    "disable_hybrid_kv_cache_manager": (
        "--disable-hybrid-kv-cache-manager --enable-hybrid-kv-cache-manager",
        "not implemented by pagoda's scheduler",
    ),
    "stream_interval": ("--stream-interval", "not implemented by pagoda's scheduler"),
    "cudagraph_capture_sizes": (
        "--cudagraph-capture-sizes",
        "pagoda captures CUDA graphs for its own batch sizes; --enforce-eager turns them off",
    ),
    "max_cudagraph_capture_size": (
        "--max-cudagraph-capture-size",
        "pagoda captures CUDA graphs for its own batch sizes; --enforce-eager turns them off",
    ),
    "ir_op_priority": ("--ir-op-priority", "pagoda chooses kernels by device capability"),
    "enable_flashinfer_autotune": (
        "--enable-flashinfer-autotune --disable-flashinfer-autotune",
        "pagoda chooses kernels by device capability",
    ),
    "monokernel": ("--monokernel --no-monokernel", "pagoda chooses kernels by device capability"),
    "moe_backend": ("--moe-backend", "pagoda chooses kernels by device capability"),
    "linear_backend": ("--linear-backend", "pagoda chooses kernels by device capability"),
    "sparse_indexer_topk_backend": (
        "--sparse-indexer-topk-backend",
        "pagoda chooses kernels by device capability",
    ),
    "spec_method": ("--spec-method", "use --speculative-config (JSON)"),
    "spec_model": ("--spec-model", "use --speculative-config (JSON)"),
    "spec_tokens": ("--spec-tokens", "use --speculative-config (JSON)"),
    "watermark_config": ("--watermark-config", "not implemented by pagoda"),
    "diffusion_config": ("--diffusion-config -dc", "not implemented by pagoda"),
    "kv_transfer_config": (
        "--kv-transfer-config",
        "disaggregated prefill (KV transfer) is not implemented",
    ),
    "kv_events_config": ("--kv-events-config", "KV cache events are not published"),
    "ec_transfer_config": ("--ec-transfer-config", "not implemented by pagoda"),
    "ec_manager_config": ("--ec-manager-config", "not implemented by pagoda"),
    "compilation_config": (
        "--compilation-config -cc",
        "pagoda does not use torch.compile; --enforce-eager turns CUDA graphs off",
    ),
    "attention_config": ("--attention-config -ac", "not implemented by pagoda"),
    "engram_config": ("--engram-config", "not implemented by pagoda"),
    "reasoning_config": ("--reasoning-config", "not implemented by pagoda"),
    "kernel_config": ("--kernel-config", "not implemented by pagoda"),
    "additional_config": ("--additional-config", "not implemented by pagoda"),
    "structured_outputs_config": (
        "--structured-outputs-config",
        "structured outputs always use xgrammar",
    ),
    "aux_output_config": ("--aux-output-config", "not implemented by pagoda"),
    "profiler_config": ("--profiler-config", "not implemented by pagoda"),
    "watchdog_config": ("--watchdog-config", "not implemented by pagoda"),
    "optimization_level": ("--optimization-level", "not implemented by pagoda"),
    "performance_mode": ("--performance-mode", "not implemented by pagoda"),
    "weight_transfer_config": ("--weight-transfer-config", "not implemented by pagoda"),
    "aggregate_engine_logging": (
        "--aggregate-engine-logging",
        "a deployment mode pagoda does not have (one server process, one engine)",
    ),
    "fail_on_environ_validation": (
        "--fail-on-environ-validation --no-fail-on-environ-validation",
        "a deployment mode pagoda does not have (one server process, one engine)",
    ),
    "gdn_prefill_backend": (
        "--gdn-prefill-backend",
        "a deployment mode pagoda does not have (one server process, one engine)",
    ),
    "kda_prefill_backend": (
        "--kda-prefill-backend",
        "a deployment mode pagoda does not have (one server process, one engine)",
    ),
    "kda_decode_backend": (
        "--kda-decode-backend",
        "a deployment mode pagoda does not have (one server process, one engine)",
    ),
}

# EngineArgs fields of vLLM without a `vllm serve` flag (only reachable through LLM(...)).
LLM_ONLY_REFUSED = {
    "model_weights": "weights are loaded from the model directory only",
    "_api_process_count": "one API server process per engine",
    "_api_process_rank": "one API server process per engine",
    "enable_mm_processor_stats": "multimodal processor statistics are not collected",
    "mamba_config": "pagoda has no Mamba/state-space models",
}

# vLLM LLM(...) arguments that pagoda implements in `pagoda serve` only.
LLM_SERVER_ONLY = {
    "chat_template": "pass chat_template to LLM.chat(...) (the server takes --chat-template)",
    "data_parallel_size": "LLM(...) runs one engine; the server spreads requests over replicas "
    "(--data-parallel-size)",
    "generation_config": "LLM(...) samples with the SamplingParams given to generate(); the "
    "server applies generation_config.json defaults (--generation-config)",
    "override_generation_config": "LLM(...) samples with the SamplingParams given to "
    "generate(); the server takes --override-generation-config",
    "log_level": "configure Python's logging module (the server takes --log-level)",
    "max_logprobs": "LLM(...) allows up to 20 log-probs per token (the server takes "
    "--max-logprobs)",
    "reasoning_parser": "reasoning is split from content by the server (--reasoning-parser)",
    "served_model_name": "served names only exist in the server (--served-model-name)",
    "shutdown_timeout": "only the server drains requests on shutdown (--shutdown-timeout)",
}


def _flag_list(options: str) -> list[str]:
    return options.split()


class _Refuse(argparse.Action):
    """Any use of the flag is an error that names it and says why."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kw: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} (a vLLM flag) is not supported by pagoda: {self.reason}")


class _Equivalent(argparse.Action):
    """A flag whose vLLM meaning pagoda has by construction: accepted and logged at start-up."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kw: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: str | None = None) -> None:
        notes = getattr(ns, "vllm_flag_notes", None) or []
        notes.append(f"{option_string}: {self.reason}")
        ns.vllm_flag_notes = notes


class _Checked(argparse.Action):
    """Accepted with the values whose meaning pagoda has; any other value is refused."""

    def __init__(
        self, option_strings: list[str], dest: str, allowed: str = "", reason: str = "", **kw: Any
    ) -> None:
        self.allowed = allowed.split()
        self.reason = reason
        super().__init__(option_strings, dest, nargs=None, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: str | None = None) -> None:
        if str(values) not in self.allowed:
            parser.error(
                f"{option_string} {values} is not supported by pagoda ({self.reason}); "
                f"accepted: {', '.join(self.allowed)}"
            )
        setattr(ns, self.dest, values)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every vLLM flag pagoda does not implement itself: checked, equivalent or refused.

    A flag the parser already defines (pagoda implements it) is left alone."""
    taken = set(parser._option_string_actions)
    g = parser.add_argument_group("vLLM flags without their own pagoda option (see docs/server.md)")

    def free(options: str) -> list[str]:
        flags = _flag_list(options)
        mine = [o for o in flags if o in taken]
        if mine:  # pagoda implements it: vLLM's other spellings name the same option
            action = parser._option_string_actions[mine[0]]
            for o in flags:
                if o not in taken:
                    action.option_strings.append(o)
                    parser._option_string_actions[o] = action
            return []
        return flags

    free("--speculative-config -sc")  # vLLM's short spelling of pagoda's option

    for dest, (options, allowed, reason) in VALUE_CHECKED.items():
        if flags := free(options):
            g.add_argument(
                *flags,
                dest=f"vllm_{dest}",
                action=_Checked,
                allowed=allowed,
                reason=reason,
                default=None,
            )
    for dest, (options, reason) in EQUIVALENT.items():
        if flags := free(options):
            g.add_argument(*flags, dest=f"vllm_{dest}", action=_Equivalent, reason=reason)
    for dest, (options, reason) in REFUSED.items():
        if flags := free(options):
            g.add_argument(*flags, dest=f"vllm_{dest}", action=_Refuse, reason=reason)


def log_flag_notes(ns: argparse.Namespace) -> None:
    for note in getattr(ns, "vllm_flag_notes", None) or []:
        logger.info("accepted without a separate effect: %s", note)


def check_llm_kwargs(kwargs: dict[str, Any], supported: set[str]) -> dict[str, Any]:
    """`LLM(...)`'s keyword arguments: those pagoda implements are returned; vLLM's others are
    accepted when their value has a meaning here, else a ValueError names them and says why."""
    kept: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in supported:
            kept[name] = value
        elif name in VALUE_CHECKED:
            options, allowed, reason = VALUE_CHECKED[name]
            if value is not None and str(value) not in allowed.split():
                raise ValueError(
                    f"LLM({name}={value!r}) is not supported by pagoda ({reason}); "
                    f"accepted: {', '.join(allowed.split())}"
                )
        elif name in EQUIVALENT:
            logger.info("LLM(%s=...): %s", name, EQUIVALENT[name][1])
        elif name in REFUSED or name in LLM_ONLY_REFUSED or name in LLM_SERVER_ONLY:
            reason = (
                REFUSED[name][1]
                if name in REFUSED
                else LLM_ONLY_REFUSED.get(name) or LLM_SERVER_ONLY[name]
            )
            raise ValueError(
                f"LLM({name}=...) (a vLLM argument) is not supported by pagoda: {reason}"
            )
        else:
            raise TypeError(
                f"LLM() got an unknown argument {name!r} "
                f"(neither pagoda's nor vLLM {VLLM_VERSION}'s)"
            )
    return kept
