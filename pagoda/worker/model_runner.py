"""The model runner: the engine's only way to the device.

It loads the model, sizes and allocates the paged KV cache, and executes one scheduler step:
flat `input_ids` / `positions` / `slot_mapping` plus `AttentionMetadata` for any mix of prefill
chunks and decodes, a forward pass (a captured CUDA graph for decode-only batches on GPU), logits
for the requests that sample, and the sampler. Per-request state kept here is only what the
sampler needs across steps (seeded generators).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.config import CacheConfig, ModelConfig, RunnerConfig
from pagoda.kernels.attention.torch_paged import decode_gather_bytes
from pagoda.kernels.workspace import SplitKWorkspace
from pagoda.layers.attention import AttentionMetadata, check_kv_cache_dtype, kv_cache_torch_dtype
from pagoda.layers.embedding import LMHead
from pagoda.layers.linear import LinearBase
from pagoda.layers.rejection_sampler import RejectionOutput, num_emitted, rejection_sample
from pagoda.layers.sampler import (
    Sampler,
    SamplingMetadata,
    compute_logprobs,
    pad_grammar_rows,
    to_device,
)
from pagoda.models.llama import bind_key_centers
from pagoda.models.loader import load_model
from pagoda.platform import is_integrated_gpu, resolve_device, triton_available
from pagoda.worker.draft_model import DraftModel
from pagoda.worker.eagle import EagleDraft, EagleInputs
from pagoda.worker.host_staging import PinnedStaging
from pagoda.worker.memory import (
    MemoryReport,
    blocks_for_budget,
    kv_bytes_per_block,
    system_available_bytes,
)

if TYPE_CHECKING:
    from pagoda.sampling_params import SamplingParams
    from pagoda.step import DraftRequest, ScheduledRequest, SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Without an explicit budget a CPU run keeps its KV cache modest: enough for the configured
# concurrency, never more than this.
_CPU_DEFAULT_KV_CAP = 1 << 30
# Prompt log-probs are computed in slices of rows whose float32 logits stay under this size.
_PROMPT_LOGPROBS_SLICE_BYTES = 128 << 20
# Without Triton a captured decode gathers each row's whole block table (max_model_len): the
# graphs stop at the batch whose gather reaches this (graph memory is held for the engine's life).
_TORCH_GRAPH_BYTES = 256 << 20

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class DeviceSnapshot:
    """cudaMemGetInfo and this process's allocator figures when an engine starts (before its
    weights load): what the device already held is not this engine's to give to the KV cache."""

    free_bytes: int
    total_bytes: int
    reserved_bytes: int  # torch's caching allocator, this process

    @property
    def used_bytes(self) -> int:  # other processes, the CUDA context, earlier engines
        return self.total_bytes - self.free_bytes

    @property
    def non_torch_bytes(self) -> int:
        return max(0, self.used_bytes - self.reserved_bytes)


def take_device_snapshot(device: torch.device) -> DeviceSnapshot:
    torch.cuda.synchronize(device)
    gc.collect()  # tensors of an engine dropped without shutdown() go back before measuring
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceSnapshot(free, total, torch.cuda.memory_reserved(device))


def per_process_memory_cap(device: torch.device, total: int) -> int | None:
    """Bytes torch's allocator may hold under `torch.cuda.set_per_process_memory_fraction`;
    None when no fraction below 1 is set (or this torch cannot tell)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is None:
        return None
    # torch wants an index here: torch.device("cuda") without one is a ValueError
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    fraction = float(get(index))
    return int(fraction * total) if fraction < 1.0 else None


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests that reached the end of their known tokens this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # req_id -> (token ids, logprobs, rank of the sampled token); the sampled token comes first.
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # req_id -> (index of the first prompt token covered, [ids], [logprobs], [rank]) per token
    # of this step's prompt chunk; ids[j][0] is the prompt token itself, then its top-k.
    prompt_logprobs: dict[str, tuple[int, list, list, list]] = field(default_factory=dict)
    # Speculative steps: req_id -> every token emitted (accepted drafts + one), and per token
    # (ids, logprobs, rank) when the request asks for logprobs.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)


class _SpecResult:
    """A verify step's rejection-sampler output, copied to the host with the step's ids."""

    def __init__(self, reqs: list[ScheduledRequest], out: RejectionOutput) -> None:
        self.reqs = reqs
        self.num_rows = [len(r.spec_token_ids) + 1 for r in reqs]
        self.out = out
        tensors = [out.token_ids, out.accepted]
        if out.logprobs is not None:
            tensors += [out.logprob_token_ids, out.logprobs, out.ranks]
        self.host = [_to_pinned(t) if t.is_cuda else t for t in tensors]

    def fill(self, result: ModelRunnerOutput) -> None:
        tokens, accepted = self.host[0].tolist(), self.host[1].tolist()
        lp = [t.tolist() for t in self.host[2:]]
        start = 0
        for r, rows, n in zip(
            self.reqs, self.num_rows, num_emitted(accepted, self.num_rows), strict=True
        ):
            result.spec_token_ids[r.req_id] = tokens[start : start + n]
            k = r.sampling_params.logprobs
            if lp and k is not None:
                ids, lps, ranks = lp
                result.spec_logprobs[r.req_id] = [
                    (ids[i][: k + 1], lps[i][: k + 1], ranks[i]) for i in range(start, start + n)
                ]
            start += rows


class PendingOutput:
    """A launched step's sampled tokens, on their way to the host.

    On CUDA the ids are copied into pinned memory behind an event, so the host can schedule and
    launch the next step before it waits here. A step with grammar-constrained rows stops at its
    logits (`awaiting_bitmask`) until `ModelRunner.sample` gets the bitmask.
    """

    def __init__(
        self,
        reqs: list[ScheduledRequest] | None = None,
        result: Any = None,
        prompt_logprobs: dict[str, tuple] | None = None,
    ) -> None:
        self.reqs = reqs or []
        self.result_: Any = None
        self.prompt_logprobs = prompt_logprobs or {}  # req_id -> (first index, tensors...)
        self.event: torch.cuda.Event | None = None
        self.host_ids: torch.Tensor | None = None
        # Set while the sampler waits for the grammar bitmask: (logits, SamplingMetadata).
        self.deferred: tuple[torch.Tensor, SamplingMetadata] | None = None
        self.eagle: EagleInputs | None = None  # an EAGLE head's inputs, run after sampling
        self.spec: _SpecResult | None = None  # the step's verified drafts
        if any(t[1].is_cuda for t in self.prompt_logprobs.values()):
            # Into pinned memory behind the event too: a plain .tolist() later would wait for
            # the step launched after this one.
            self.prompt_logprobs = {
                rid: (first, *(_to_pinned(t) for t in tensors))
                for rid, (first, *tensors) in self.prompt_logprobs.items()
            }
            self.event = torch.cuda.Event()
            self.event.record()
        if result is not None:
            self.set_result(result)

    @property
    def awaiting_bitmask(self) -> bool:
        return self.deferred is not None

    def set_spec(self, spec: _SpecResult) -> None:
        self.spec = spec
        if spec.out.token_ids.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def set_result(self, result: Any) -> None:
        self.result_ = result
        if result.sampled_token_ids.is_cuda:
            ids = result.sampled_token_ids
            self.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self.host_ids.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> ModelRunnerOutput:
        assert self.deferred is None, "the step's grammar bitmask was never supplied"
        if self.event is not None:
            self.event.synchronize()
        out = ModelRunnerOutput()
        for req_id, (first, ids, lps, ranks) in self.prompt_logprobs.items():
            out.prompt_logprobs[req_id] = (first, ids.tolist(), lps.tolist(), ranks.tolist())
        if self.spec is not None:
            self.spec.fill(out)
        res = self.result_
        if res is None:
            return out
        if self.host_ids is not None:
            sampled = self.host_ids.tolist()  # the event above covered its copy
        else:
            sampled = res.sampled_token_ids.tolist()
        sreqs = self.reqs
        out.sampled_token_ids = {r.req_id: t for r, t in zip(sreqs, sampled, strict=True)}
        if res.logprobs is not None:
            ids = res.logprob_token_ids.tolist()
            lps = res.logprobs.tolist()
            ranks = res.sampled_ranks.tolist()
            for row, r in enumerate(sreqs):
                k = r.sampling_params.logprobs
                if k is None:
                    continue
                out.logprobs[r.req_id] = (ids[row][: k + 1], lps[row][: k + 1], ranks[row])
        return out


def _penalized(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class _PendingInputs:
    """Input tokens the previous step sampled on the device and the host does not know yet."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, prev: torch.Tensor) -> None:
        self.dst = dst  # rows of the flat batch
        self.src = src  # rows of the previous step's sampled ids
        self.prev = prev

    def fill_ids(self, ids: torch.Tensor) -> None:
        ids.index_copy_(0, self.dst, self.prev.index_select(0, self.src).to(ids.dtype))

    def fill_embeds(self, embeds: torch.Tensor, ids: torch.Tensor, model: Any) -> None:
        rows = model.embed_input_ids(ids.index_select(0, self.dst))
        embeds.index_copy_(0, self.dst, rows.to(embeds.dtype))


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        runner_config: RunnerConfig,
        sharder: Any = None,
    ) -> None:
        # A tensor-parallel rank's `pagoda.distributed.sharding.ModelSharder` (None: the whole
        # model); `model_config` then holds this rank's shapes.
        self.sharder = sharder
        self.model_config = model_config
        self.cache_config = cache_config
        self.runner_config = runner_config
        self.device = resolve_device(runner_config.device)
        self.dtype = _DTYPES[model_config.dtype]
        self.kv_dtype = kv_cache_torch_dtype(cache_config.cache_dtype, self.dtype)
        self.block_size = cache_config.block_size
        self.max_num_blocks_per_seq = -(-model_config.max_model_len // self.block_size)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        # req_id -> [the scheduler's block list, its block-table row, entries copied]
        self._block_rows: dict[str, list] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.model: Any = None
        self.load_time_s = 0.0
        self.weights_bytes = 0
        self.memory_report: MemoryReport | None = None
        self.graph_runner: Any = None
        self.verify_graph_runner: Any = None  # speculative verify steps (query length 1 + k)
        self.lora_manager: Any = None  # pagoda.lora.manager.LoRAManager when LoRA is enabled
        self.encoder_runner: Any = None  # pagoda.worker.encoder_runner.EncoderRunner (VL models)
        self.draft: DraftModel | None = None  # speculative decoding's draft model
        self._pin = self.device.type == "cuda"
        # Step inputs reach the device through one persistent pinned buffer (host_staging.py).
        self.staging = PinnedStaging(self.device) if self._pin else None
        # The last launched step's sampled ids (on the device) and each sampling request's row:
        # the inputs of requests scheduled before that step's output reached the host.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.start_snapshot: DeviceSnapshot | None = None  # CUDA: the device before loading
        self.offloader: Any = None  # pagoda.worker.offload.LayerOffloader (cpu_offload_gb)
        self._offload_plan: Any = None
        self.closed = False
        if not triton_available():
            # One line per engine: everything still runs, on the slower torch paths.
            log = logger.warning if self.device.type == "cuda" else logger.info
            log(
                "Triton is not installed: attention, norms, RoPE, LoRA and quantized matmuls "
                "run on torch paths%s",
                " (CUDA graphs for small decode batches)" if self.device.type == "cuda" else "",
            )

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        torch.manual_seed(self.model_config.seed)
        if self.device.type == "cuda":
            self.start_snapshot = take_device_snapshot(self.device)
            before = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        keep_on_host = None
        if self.runner_config.cpu_offload_gb:
            from pagoda.worker.offload import decoder_layers, plan_offload

            def keep_on_host(model: Any) -> list[Any]:
                layers = decoder_layers(model)
                self._offload_plan = plan_offload(layers, self.runner_config.cpu_offload_gb)
                return [layers[i] for i in self._offload_plan.layer_indices]

        prepare = None if self.sharder is None else self.sharder.prepare
        self.model = load_model(self.model_config, self.device, keep_on_host, prepare)
        check_kv_cache_dtype(self.model.attention_layers(), self.kv_dtype, self.device)
        if self.kv_dtype.itemsize == 1:  # FP8: keys stored minus their bias's mean (llama.py)
            centered = bind_key_centers(self.model, self.model_config.max_model_len)
            if centered:
                logger.info("FP8 KV cache: keys centered on their bias in %d layers", centered)
        if keep_on_host is not None:
            from pagoda.worker.offload import LayerOffloader, decoder_layers

            self.offloader = LayerOffloader(
                decoder_layers(self.model), self._offload_plan, self.device
            )
        # Split-K kernels' scratch: one for every linear layer of this runner's stream.
        self.split_k_workspace = SplitKWorkspace()
        for module in self.model.modules():
            if isinstance(module, (LinearBase, LMHead)):
                module.split_k_workspace = self.split_k_workspace
        if self.runner_config.draft_model is not None:
            self.draft = DraftModel(
                self.runner_config.draft_model, self.device, self.kv_dtype, self.block_size
            )
            self.draft.load(self.sliding_window)
        elif self.runner_config.eagle_head is not None:
            self.draft = EagleDraft(
                self.runner_config.eagle_head, self.device, self.kv_dtype, self.block_size
            )
            self.draft.load(self.sliding_window, self.model)
        if self.runner_config.multimodal is not None:
            from pagoda.multimodal.image_processor import ImageProcessorConfig
            from pagoda.multimodal.video_processor import VideoOptions
            from pagoda.worker.encoder_runner import EncoderRunner

            mm, mc = self.runner_config.multimodal, self.model_config
            image_config = ImageProcessorConfig.from_model(
                mc.model, mc.hf_config.vision_config, mm.processor_kwargs
            )
            video_options = None
            if getattr(self.model, "supports_video", False):
                video_options = VideoOptions.from_model(
                    mc.model, mm.processor_kwargs, image_config.factor
                )
            self.encoder_runner = EncoderRunner(
                self.model,
                image_config,
                mm,
                mc.max_model_len,
                self.device,
                self.dtype,
                video_options,
            )
        if self.runner_config.lora is not None:
            from pagoda.lora.manager import LoRAManager

            # Wrapped before measuring, so the adapter slots count as weights.
            rc = self.runner_config
            self.lora_manager = LoRAManager(
                self.model,
                rc.lora,
                max(rc.max_num_batched_tokens, rc.max_num_seqs),
                self.dtype,
                self.device,
            )
            if self.sharder is not None:
                self.lora_manager.shard_tensor = self.sharder.shard
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.weights_bytes = torch.cuda.memory_allocated(self.device) - before
        else:
            self.weights_bytes = sum(
                t.numel() * t.element_size()
                for t in list(self.model.parameters()) + list(self.model.buffers())
            )
            if self.offloader is not None:  # host copies are reported apart
                self.weights_bytes += self.offloader.staging_bytes
            if self.draft is not None:
                self.weights_bytes += self.draft.weights_bytes
        self.load_time_s = time.perf_counter() - t0

    def initialize_kv_cache(self, max_num_seqs: int, max_num_batched_tokens: int) -> MemoryReport:
        """Profile the largest step, size the KV cache from what is left, allocate it."""
        mc, cc = self.model_config, self.cache_config
        per_block = self._kv_bytes_per_block(self.block_size)
        t0 = time.perf_counter()
        peak_act, non_torch, total, budget = self._profile(max_num_seqs, max_num_batched_tokens)
        profile_time = time.perf_counter() - t0
        if cc.num_blocks_override is not None:
            num_blocks = cc.num_blocks_override - 1
        elif cc.kv_cache_memory is not None:
            num_blocks = blocks_for_budget(cc.kv_cache_memory, per_block) - 1
        else:
            available = budget - self.weights_bytes - peak_act - non_torch
            num_blocks = blocks_for_budget(available, per_block) - 1
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache: weights take {self.weights_bytes / 2**30:.2f} "
                f"GiB and activations {peak_act / 2**30:.2f} GiB of a {budget / 2**30:.2f} GiB "
                "budget; raise gpu_memory_utilization, set kv_cache_memory, or lower "
                "max_num_batched_tokens"
            )
        needed = -(-mc.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={mc.max_model_len}; lower max_model_len or give the cache more "
                "memory"
            )
        self._allocate_kv_cache(num_blocks + 1)  # + the null block 0
        self._warm_up_attention()
        snap = self.start_snapshot
        self.memory_report = MemoryReport(
            device=str(self.device),
            dtype=mc.dtype,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch.")
            * (self.kv_dtype != self.dtype),
            weights_bytes=self.weights_bytes,
            peak_activation_bytes=peak_act,
            non_torch_bytes=non_torch,
            kv_cache_bytes=(num_blocks + 1) * per_block,
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_model_len=mc.max_model_len,
            total_memory_bytes=total,
            memory_budget_bytes=budget,
            load_time_s=self.load_time_s,
            profile_time_s=profile_time,
            integrated_gpu=is_integrated_gpu(self.device),
            in_use_at_start_bytes=snap.used_bytes if snap is not None else 0,
            cpu_offload_bytes=0 if self.offloader is None else self.offloader.host_bytes,
            offloaded_layers=0 if self.offloader is None else len(self.offloader.entries),
            **self._encoder_memory(),
        )
        return self.memory_report

    def _kv_bytes_per_block(self, block_size: int) -> int:
        """K and V of one block in every layer: the target's, and the draft's that shares it."""
        mc = self.model_config
        n = kv_bytes_per_block(
            mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype.itemsize
        )
        if self.draft is not None:
            n += self.draft.kv_bytes_per_block() // self.block_size * block_size
        return n

    def _encoder_memory(self) -> dict[str, Any]:
        """The vision encoder's share of the memory report (VL models)."""
        er = self.encoder_runner
        visual = getattr(self.model, "visual", None)
        if er is None or visual is None:
            return {}
        weights = sum(p.numel() * p.element_size() for p in visual.parameters())
        return dict(
            encoder_weights_bytes=weights,
            encoder_activation_bytes=er.profile_peak_bytes,
            encoder_profile_input=er.profile_description(),
        )

    def _profile(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int, int, int]:
        """(peak activation bytes, non-torch bytes, total bytes, budget bytes)."""
        util = self.cache_config.gpu_memory_utilization
        if self.device.type != "cuda":
            total = system_available_bytes() + self.weights_bytes
            # CPU: no allocator statistics; estimate activations from the largest step instead.
            hidden = self.model_config.text_config.hidden_size
            vocab = self.model_config.text_config.vocab_size
            inter = getattr(self.model_config.text_config, "intermediate_size", 4 * hidden)
            peak = max_num_batched_tokens * (6 * hidden + 3 * inter) * 4
            peak += min(max_num_seqs, max_num_batched_tokens) * vocab * 4 * 3
            if self.draft is not None:  # runs while the target's last hidden rows are alive
                peak += self.draft.activation_bytes(max_num_batched_tokens)
            if self.encoder_runner is not None:  # the largest images through the vision tower
                vision_config = self.model_config.hf_config.vision_config
                peak += self.encoder_runner.estimate_bytes(vision_config)
            budget = int(util * total)
            if self.cache_config.kv_cache_memory is None:
                # Enough for every sequence at full length, never more than the cap: CPU memory
                # is shared with everything else on the machine.
                per_token = self._kv_bytes_per_block(1)
                max_len = self.model_config.max_model_len
                full = max_num_seqs * (max_len + self.block_size) * per_token
                budget = min(budget, self.weights_bytes + peak + min(full, _CPU_DEFAULT_KV_CAP))
            return peak, 0, total, budget
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._profile_run(max_num_seqs, max_num_batched_tokens)
        if not triton_available():
            # The torch attention path runs per sequence (SDPA, with a [q, k] mask after a
            # cached prefix): its worst case is one prompt filling the whole step.
            self._profile_run(1, min(max_num_batched_tokens, self.model_config.max_model_len))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        if is_integrated_gpu(self.device):
            # Unified memory: the device total includes RAM the OS and other processes use.
            # Budget from what the system can still give, plus what this process already holds.
            budget = int(util * (system_available_bytes() + self.weights_bytes))
            return peak, 0, total, budget
        # Discrete GPU (docs/memory.md): utilization bounds what the whole device holds once
        # this engine is up, so what was already in use at start (other processes, the CUDA
        # context, an earlier engine) comes off first; non-torch memory counts only what grew
        # since (cuBLAS workspaces, loaded kernels), the rest being in `used` already.
        snap = self.start_snapshot or DeviceSnapshot(free, total, reserved)
        non_torch = max(0, (total - free - reserved) - snap.non_torch_bytes)
        budget = int(util * total) - snap.used_bytes
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={util} allows {util * total / 2**30:.2f} GiB of the "
                f"device's {total / 2**30:.2f} GiB, but {snap.used_bytes / 2**30:.2f} GiB were "
                "already in use when this engine started (other processes, or an engine of this "
                "process that was not shut down: call LLM.shutdown() or use `with LLM(...)`); "
                "raise gpu_memory_utilization or free the device"
            )
        cap = per_process_memory_cap(self.device, total)
        if cap is not None:
            # torch refuses allocations past the cap: what this process's allocator may still
            # take, plus what it holds (weights), bounds the engine's torch memory.
            budget = min(budget, cap - snap.reserved_bytes + non_torch)
        return peak, non_torch, total, budget

    @torch.inference_mode()
    def _profile_run(self, max_num_seqs: int, num_tokens: int) -> None:
        """One forward at the largest step size, with a scratch KV cache just big enough."""
        num_seqs = max(1, min(max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        blocks_per_seq = [-(-n // self.block_size) for n in lens]
        self._allocate_kv_cache(sum(blocks_per_seq) + 1)
        block_ids, next_id = [], 1
        for nb in blocks_per_seq:
            block_ids.append(list(range(next_id, next_id + nb)))
            next_id += nb
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        md = self._build_metadata([0] * num_seqs, lens, block_ids, num_tokens)
        embeds = None
        if self.encoder_runner is not None:
            # The largest allowed images go through the encoder, and their outputs stay alive
            # through the decoder forward, as in a real prefill step.
            embeds = self.encoder_runner.profile(input_ids)
        hidden = self.model(input_ids, positions, md, inputs_embeds=embeds)
        if isinstance(self.draft, EagleDraft):
            self.draft.profile(input_ids, hidden, positions, md)
        elif self.draft is not None:
            self.draft.forward(input_ids, positions, md)
        idx = torch.tensor(np.cumsum(lens) - 1, device=self.device)
        logits = self.model.compute_logits(hidden[idx])
        # The sampler's worst case: every row random with top-p (a full sort of the vocab).
        n = logits.shape[0]
        sm = SamplingMetadata(
            temperature=torch.ones(n, device=self.device),
            all_greedy=False,
            all_random=True,
            top_k=None,
            top_p=torch.full((n,), 0.9, device=self.device),
            min_p=None,
            presence_penalties=None,
            frequency_penalties=None,
            repetition_penalties=None,
            prompt_token_ids=[[] for _ in range(n)],
            output_token_ids=[[] for _ in range(n)],
            generators={},
            max_num_logprobs=None,
            min_tokens_blocked={},
        )
        self.sampler(logits, sm)
        del hidden, logits
        self._release_kv_cache()

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        layers = self.model.attention_layers()
        # Not zero-filled (that cost up to seconds per start on CPU for a 1 GiB cache): attention
        # reads only slots written before, below each sequence's seq_len, and kernels mask the
        # rest of a tile, as they must for the stale data of a freed and reused block anyway.
        # The null block 0 is the exception: nothing writes it and CUDA-graph padding rows
        # (seq_len 1, block table all 0) read it, so it holds zeros.
        self.kv_caches = [
            torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in layers
        ]
        # Without Triton the CUDA decode reads (masked) slots past each sequence: zeroed, the
        # cache never holds NaN bit patterns there (one memset at start-up). Bytes: FP8 tensors
        # have no fill kernels.
        torch_decode = self.device.type == "cuda" and not triton_available()
        for layer, cache in zip(layers, self.kv_caches, strict=True):
            if torch_decode:
                cache.view(torch.uint8).zero_()
            else:
                cache.view(torch.uint8)[:, 0].zero_()
            layer.kv_cache = cache
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, zero_all=torch_decode)

    def _warm_up_attention(self) -> None:
        """Compile the paged-attention kernel's mixed-step variants now (CUDA with Triton): a
        step needing one later would compile it while every running request waits."""
        if self.device.type != "cuda" or not triton_available():
            return
        from pagoda.kernels.attention.triton_paged_attention import warm_up_mixed_steps

        done = set()
        layers = self.model.attention_layers()
        if self.draft is not None:
            layers = [*layers, *self.draft.model.attention_layers()]
        for layer in layers:
            key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.sliding_window)
            if key in done or layer.kv_cache is None:  # no cache bound: nothing to read
                continue
            done.add(key)
            warm_up_mixed_steps(
                layer.kv_cache,
                layer.num_heads,
                layer.scale,
                self.model_config.max_model_len,
                layer.sliding_window,
                q_dtype=self.dtype,
            )

    def _release_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []
        if self.draft is not None:
            self.draft.release_kv_cache()

    # ------------------------------------------------------------------ execution

    def _prepare_arrays(
        self,
        num_computed: list[int],
        num_new: list[int],
        block_ids: list[list[int]],
        num_tokens: int,
        req_ids: list[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Host-side batch arrays: query offsets, lengths, block table, positions, slots."""
        bs = self.block_size
        num_reqs = len(num_new)
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=qsl[1:])
        seq_lens = np.asarray(num_computed, dtype=np.int32) + np.asarray(num_new, dtype=np.int32)
        max_blocks = int(-(-int(seq_lens.max()) // bs))
        if req_ids is None:
            table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
            for i, ids in enumerate(block_ids):
                n = min(len(ids), max_blocks)
                table[i, :n] = ids[:n]
        else:
            table = np.stack(
                [
                    self._block_row(r, ids)[:max_blocks]
                    for r, ids in zip(req_ids, block_ids, strict=True)
                ]
            )
        # positions of every new token, and its slot in the paged cache
        req_idx = np.repeat(np.arange(num_reqs), num_new)
        pos = (
            np.arange(num_tokens) - np.repeat(qsl[:-1], num_new) + np.repeat(num_computed, num_new)
        )
        slots = table[req_idx, pos // bs].astype(np.int64) * bs + pos % bs
        return dict(
            qsl=qsl, seq_lens=seq_lens, table=table, positions=pos.astype(np.int64), slots=slots
        )

    def _block_row(self, req_id: str, block_ids: list[int]) -> np.ndarray:
        """The request's block-table row, kept between steps and extended in place.

        Copying every request's whole block list into a fresh table each step costs more host
        time than the GPU spends on a decode step at large batch; only new blocks are copied.
        The scheduler's list object changes when the request is preempted, which resets it.
        With a sliding window the KV manager replaces leading blocks by the null block 0 in
        place; the row follows (no kernel reads them, but a freed id must not linger).
        """
        entry = self._block_rows.get(req_id)
        if entry is None or entry[0] is not block_ids:
            entry = [block_ids, np.zeros(self.max_num_blocks_per_seq, dtype=np.int32), 0, 0]
            self._block_rows[req_id] = entry
        _, row, filled, nulled = entry
        n = len(block_ids)
        if n > filled:
            row[filled:n] = block_ids[filled:n]
            entry[2] = n
        while nulled < n and block_ids[nulled] == 0:
            row[nulled] = 0
            nulled += 1
        entry[3] = nulled
        return row

    def _build_metadata(
        self,
        num_computed: list[int],
        num_new: list[int],
        block_ids: list[list[int]],
        num_tokens: int,
        arrays: dict[str, np.ndarray] | None = None,
    ) -> AttentionMetadata:
        a = arrays or self._prepare_arrays(num_computed, num_new, block_ids, num_tokens)
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=self._to_dev(a["qsl"]),
            seq_lens=self._to_dev(a["seq_lens"]),
            block_tables=self._to_dev(a["table"]),
            slot_mapping=self._to_dev(a["slots"]),
            max_query_len=int(max(num_new)),
            max_seq_len=int(a["seq_lens"].max()),
            query_start_loc_cpu=a["qsl"].tolist(),
            seq_lens_cpu=a["seq_lens"].tolist(),
        )

    def _to_dev(self, arr: np.ndarray) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.to_device(arr)
        return torch.from_numpy(arr)

    def _values_to_dev(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A list of numbers as a 1-D device tensor of `dtype` (through the staging buffer)."""
        if self.staging is None:
            return torch.tensor(values, dtype=dtype)
        return self.staging.to_device(torch.tensor(values, dtype=dtype).numpy())

    @property
    def sliding_window(self) -> int | None:
        """The window every attention layer keeps (None if some layer sees all keys): what the
        KV cache manager may free blocks by."""
        windows = [layer.sliding_window for layer in self.model.attention_layers()]
        if not windows or None in windows:
            return None
        return max(windows)

    def add_lora(self, lora_key: str, lora_path: str) -> None:
        """Register an adapter under `lora_key` (validated against the model now)."""
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need LLM(..., enable_lora=True)")
        self.lora_manager.add_adapter(lora_key, lora_path)

    def capture_cuda_graphs(self, max_num_seqs: int, verify_query_len: int | None = None) -> None:
        """Capture decode graphs (GPU, unless enforce_eager); recorded in the memory report.

        `verify_query_len` (1 + k, speculative decoding): verify graphs too, every sequence
        scoring its last token and k drafts (LoRA and image steps stay eager)."""
        if self.device.type != "cuda" or self.runner_config.enforce_eager:
            return
        if not triton_available() and self.lora_manager is not None:
            # LoRA's torch path groups tokens by adapter on the host, which a graph would keep.
            logger.info("LoRA without Triton: CUDA graphs are off (every step runs eagerly)")
            return
        if not triton_available():
            # The torch decode path gathers every graph row's whole block table: batch sizes
            # whose gather would pass _TORCH_GRAPH_BYTES run eagerly instead.
            max_num_seqs = min(max_num_seqs, self._torch_graph_max_seqs())
            if max_num_seqs < 1:
                logger.info(
                    "CUDA graphs are off: one sequence's decode gather at max_model_len "
                    "exceeds %d MiB",
                    _TORCH_GRAPH_BYTES >> 20,
                )
                return
        if self.offloader is not None:
            # Offload rebinds each streamed layer's weights from host-side hooks, which a
            # replayed graph would skip.
            logger.warning("cpu_offload_gb: CUDA graphs are off (every step runs eagerly)")
            return
        from pagoda.worker.cuda_graphs import CudaGraphRunner

        self.graph_runner = CudaGraphRunner(
            self.model,
            max_num_seqs=max_num_seqs,
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            hidden_size=self.model_config.text_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
            context_buckets=not triton_available(),
        )
        stats = self.graph_runner.capture()
        # (The torch attention path reads query lengths on the host: verify graphs need Triton.)
        if verify_query_len is not None and self.lora_manager is None and triton_available():
            self.verify_graph_runner = CudaGraphRunner(
                self.model,
                max_num_seqs=max_num_seqs,
                max_model_len=self.model_config.max_model_len,
                block_size=self.block_size,
                hidden_size=self.model_config.text_config.hidden_size,
                dtype=self.dtype,
                device=self.device,
                query_len=verify_query_len,
            )
            vstats = self.verify_graph_runner.capture()
            stats.capture_time_s += vstats.capture_time_s
            stats.memory_bytes += vstats.memory_bytes
        if self.draft is not None and self.lora_manager is None and triton_available():
            # the draft's own graphs: its proposing steps and the decode / verify steps it
            # follows (what the target replays, the draft replays too)
            q_lens = [1] if self.verify_graph_runner is None else [1, verify_query_len]
            for dstats in self.draft.capture_graphs(
                max_num_seqs, self.model_config.max_model_len, q_lens, self.dtype
            ):
                stats.capture_time_s += dstats.capture_time_s
                stats.memory_bytes += dstats.memory_bytes
        for runner in [self.graph_runner, self.verify_graph_runner, *self._draft_graphs()]:
            if runner is not None:
                runner.staging = self.staging
        if self.memory_report is not None:
            self.memory_report.cuda_graph_capture_time_s = stats.capture_time_s
            self.memory_report.cuda_graph_bytes = stats.memory_bytes
            self.memory_report.cuda_graph_sizes = stats.sizes

    def _draft_graphs(self) -> list:
        return [] if self.draft is None else list(self.draft.graphs.values())

    def _torch_graph_max_seqs(self) -> int:
        """The largest decode batch whose torch attention (Triton absent) holds at most
        _TORCH_GRAPH_BYTES of gathered keys, values and scores at max_model_len."""
        layer = self.model.attention_layers()[0]
        span = -(-self.model_config.max_model_len // self.block_size) * self.block_size
        one = decode_gather_bytes(1, span, layer.num_kv_heads, layer.head_dim, self.dtype.itemsize)
        return _TORCH_GRAPH_BYTES // one

    def shutdown(self) -> None:
        """Free every device allocation this runner made: CUDA graphs and their memory pool,
        the KV cache, the encoder's cached outputs, LoRA slots, offload buffers, the split-K
        workspace, cuBLAS's workspaces and the model. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight may still read them
        if self.graph_runner is not None:
            self.graph_runner.close()
        if self.verify_graph_runner is not None:
            self.verify_graph_runner.close()
            self.verify_graph_runner = None
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None
        if self.model is not None:
            self._release_kv_cache()
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        self.graph_runner = self.encoder_runner = self.lora_manager = self.model = None
        self.split_k_workspace = None  # the split-K kernels' scratch (the layers' went above)
        self.staging = None  # its pinned host buffer
        self.kv_caches = []
        self.generators.clear()
        self._block_rows.clear()
        self._prev_sampled, self._prev_rows = None, {}
        gc.collect()  # modules refer to each other (LoRA wrappers, tied weights)
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace per handle and stream in torch's allocator (32 MiB on
            # the H200: exactly what stayed allocated after shutdown, measured)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """Enqueue one step on the device; `.result()` of the return value waits for it."""
        for req_id in sched.finished_req_ids:
            self.generators.pop(req_id, None)
            self._block_rows.pop(req_id, None)
        if self.encoder_runner is not None:
            self.encoder_runner.free([*sched.finished_req_ids, *sched.preempted_req_ids])
        reqs = sched.scheduled
        if not reqs:
            return PendingOutput()
        if self.staging is not None:
            self.staging.next_step()
        num_computed = [r.num_computed_tokens for r in reqs]
        num_new = [r.num_new_tokens for r in reqs]
        num_tokens = sched.total_num_scheduled_tokens
        token_ids = np.empty(num_tokens, dtype=np.int64)
        offset = 0
        dst: list[int] = []
        src: list[int] = []
        for r in reqs:
            start, n = r.num_computed_tokens, r.num_new_tokens
            known = len(r.all_token_ids)
            if r.spec_token_ids:  # the last known token, then the drafts it verifies
                k = len(r.spec_token_ids)
                token_ids[offset : offset + n - k] = r.all_token_ids[start : start + n - k]
                # padding drafts (-1: verify graphs need k per sequence) go in as token 0
                token_ids[offset + n - k : offset + n] = np.maximum(r.spec_token_ids, 0)
            elif start + n <= known:
                token_ids[offset : offset + n] = r.all_token_ids[start : start + n]
            else:  # async scheduling: the last input is still on the device
                m = known - start
                assert m == n - 1, f"request {r.req_id}: {n - m} input tokens are not known"
                token_ids[offset : offset + m] = r.all_token_ids[start:known]
                token_ids[offset + m] = 0
                dst.append(offset + m)
                src.append(self._prev_rows[r.req_id])
            offset += n
        pending = None
        if dst:
            pending = _PendingInputs(
                self._to_dev(np.asarray(dst, dtype=np.int64)),
                self._to_dev(np.asarray(src, dtype=np.int64)),
                self._prev_sampled,
            )
        arrays = self._prepare_arrays(
            num_computed,
            num_new,
            [r.block_ids for r in reqs],
            num_tokens,
            req_ids=[r.req_id for r in reqs],
        )
        rope_positions, embeds = arrays["positions"], None
        if self.encoder_runner is not None:  # VL: M-RoPE positions, image embeddings
            rope_positions = self.encoder_runner.rope_positions(reqs, arrays["positions"])
            embeds = self.encoder_runner.inputs_embeds(reqs, token_ids)
        fill_ids = None if pending is None else pending.fill_ids
        graph_size = None
        graphs = self.graph_runner
        if graphs is not None and num_tokens == len(reqs) and embeds is None:
            graph_size = graphs.padded_size(len(reqs))  # decode-only step
        elif (
            self.verify_graph_runner is not None
            and embeds is None
            and pending is None
            and num_tokens == len(reqs) * self.verify_graph_runner.query_len
            and all(len(r.spec_token_ids) + 1 == r.num_new_tokens for r in reqs)
        ):
            graphs = self.verify_graph_runner  # every sequence verifies k drafts
            graph_size = graphs.padded_size(len(reqs))
        if self.lora_manager is not None:
            # Per token (graph padding included) for graph replays, per request otherwise.
            self.lora_manager.prepare([r.lora_key for r in reqs], num_new, padded=graph_size)
        md = ids = None
        if graph_size is not None:
            hidden = graphs.run(
                graph_size,
                token_ids,
                rope_positions,
                arrays["slots"],
                arrays["seq_lens"],
                arrays["table"],
                fill_ids=fill_ids,
            )
        else:
            md = self._build_metadata(num_computed, num_new, [], num_tokens, arrays)
            ids = self._to_dev(token_ids)
            if pending is not None:
                pending.fill_ids(ids)
                if embeds is not None:
                    pending.fill_embeds(embeds, ids, self.model)
            hidden = self.model(ids, self._to_dev(rope_positions), md, inputs_embeds=embeds)
        if (
            self.draft is not None
            and not self.draft.reads_target_features
            and not (
                graph_size is not None
                and self.draft.run_graph(
                    graphs.query_len,
                    token_ids,
                    arrays["positions"],
                    arrays["slots"],
                    arrays["seq_lens"],
                    arrays["table"],
                    fill_ids=fill_ids,
                )
                is not None
            )
        ):
            # The draft follows every step (a graph where the target replayed one), so its
            # cache holds what the target's does; text positions even where the target's are
            # M-RoPE.
            if md is None:
                md = self._build_metadata(num_computed, num_new, [], num_tokens, arrays)
                ids = self._to_dev(token_ids)
                if pending is not None:
                    pending.fill_ids(ids)
            self.draft.forward(ids, self._to_dev(arrays["positions"]), md)

        prompt_logprobs = self._prompt_logprobs(reqs, hidden, arrays["qsl"])
        spec = [i for i, r in enumerate(reqs) if r.spec_token_ids]
        spec_result = self._verify(reqs, spec, hidden, arrays["qsl"]) if spec else None
        sampling = [i for i, r in enumerate(reqs) if r.do_sample and not r.spec_token_ids]
        eagle = None
        if isinstance(self.draft, EagleDraft):
            if md is None:
                md = self._build_metadata(num_computed, num_new, [], num_tokens, arrays)
                ids = self._to_dev(token_ids)
                if pending is not None:
                    pending.fill_ids(ids)
            eagle = self._eagle_inputs(reqs, spec, sampling, token_ids, ids, hidden, arrays, md)
            if spec_result is not None:
                eagle.verify_tokens = spec_result.out.token_ids
        if not sampling:
            self._prev_sampled, self._prev_rows = None, {}
            pending = PendingOutput(prompt_logprobs=prompt_logprobs)
            if spec_result is not None:
                pending.set_spec(spec_result)
            if eagle is not None:
                self.draft.follow(eagle, None)
            return pending
        if len(sampling) == len(reqs) and num_tokens == len(reqs):
            last_hidden = hidden  # decode-only: every row samples
        else:
            last_idx = arrays["qsl"][1:].astype(np.int64)[sampling] - 1
            last_hidden = hidden[self._to_dev(last_idx)]
        logits = self.model.compute_logits(last_hidden)
        sreqs = [reqs[i] for i in sampling]
        smd = self._sampling_metadata(sreqs)
        pending = PendingOutput(sreqs, prompt_logprobs=prompt_logprobs)
        pending.eagle = eagle  # the head follows once the tokens are sampled
        if spec_result is not None:
            pending.spec = spec_result  # its copy is ordered before the sampled ids' event
        if any(r.structured_output is not None for r in sreqs):
            pending.deferred = (logits, smd)  # sampled by sample() once the bitmask is known
            return pending
        self._sample(pending, logits, smd)
        return pending

    @torch.inference_mode()
    def sample(
        self, pending: PendingOutput, bitmask: tuple[torch.Tensor, list[int]] | None
    ) -> None:
        """Sample a step launched up to its logits, with the grammar bitmask of its rows.

        `bitmask`: ([rows, ceil(V / 32)] int32 on the host, pinned on CUDA; the rows it
        constrains), or None when no grammar constrains a row any more.
        """
        assert pending.deferred is not None, "this step was sampled already"
        logits, smd = pending.deferred
        pending.deferred = None
        if bitmask is not None:
            mask, rows = bitmask
            smd.grammar_bitmask = mask.to(self.device, non_blocking=self._pin)
            # On CUDA the rows go as a tensor through pinned memory: xgrammar would copy a list
            # from pageable memory, which waits for the forward just launched.
            rows = pad_grammar_rows(rows)
            smd.grammar_rows = to_device(rows, torch.int32, self.device) if self._pin else rows
        self._sample(pending, logits, smd)

    def _sample(self, pending: PendingOutput, logits: torch.Tensor, smd: SamplingMetadata) -> None:
        result = self.sampler(logits, smd)
        self._prev_sampled = result.sampled_token_ids
        self._prev_rows = {r.req_id: row for row, r in enumerate(pending.reqs)}
        pending.set_result(result)
        if pending.eagle is not None:
            eagle, pending.eagle = pending.eagle, None
            self.draft.follow(eagle, result.sampled_token_ids)

    def _eagle_inputs(
        self,
        reqs: list[ScheduledRequest],
        spec: list[int],
        sampling: list[int],
        token_ids: np.ndarray,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        arrays: dict[str, np.ndarray],
        md: AttentionMetadata,
    ) -> EagleInputs:
        """The EAGLE head's inputs for this step: row j pairs the target's feature at its
        position with token position + 1 — the next input row, else the next prompt token (a
        chunk), the sampled token, or the token the rejection sampler emits for that row.
        Kept for proposing: each verify request's rows, each sampling request's last row."""
        num_tokens = len(token_ids)
        qsl = arrays["qsl"]
        next_ids = torch.roll(ids[:num_tokens], -1)  # [T]: row j + 1's input (ends fixed below)
        known_rows, known_ids = [], []
        keep: list[int] = []
        kept: dict[str, tuple[int, int, int]] = {}
        verify_rows: list[int] = []
        spec_set, sampling_set = set(spec), set(sampling)
        for i, r in enumerate(reqs):
            start, end = int(qsl[i]), int(qsl[i + 1])
            first_pos = r.num_computed_tokens
            if i in spec_set:  # the rows _verify scores: the last 1 + k
                rows = list(range(end - len(r.spec_token_ids) - 1, end))
                verify_rows.extend(rows)
            elif i in sampling_set:
                rows = [end - 1]
            else:  # a prompt chunk: its next token is known
                nxt = r.num_computed_tokens + r.num_new_tokens
                if nxt < len(r.all_token_ids):
                    known_rows.append(end - 1)
                    known_ids.append(r.all_token_ids[nxt])
                continue
            kept[r.req_id] = (len(keep), first_pos + rows[0] - start, len(rows))
            keep.extend(rows)
        if known_rows:
            next_ids[self._to_dev(np.asarray(known_rows, dtype=np.int64))] = self._to_dev(
                np.asarray(known_ids, dtype=np.int64)
            )
        last = qsl[1:].astype(np.int64) - 1
        return EagleInputs(
            features=hidden[:num_tokens],
            next_ids=next_ids,
            positions=self._to_dev(arrays["positions"]),
            md=md,
            keep=self._to_dev(np.asarray(keep, dtype=np.int64)),
            kept=kept,
            sampled_rows=self._to_dev(last[sampling]) if sampling else None,
            verify_rows=self._to_dev(np.asarray(verify_rows, dtype=np.int64)) if spec else None,
        )

    def _verify(
        self, reqs: list[ScheduledRequest], spec: list[int], hidden: torch.Tensor, qsl: np.ndarray
    ) -> _SpecResult:
        """Score the last 1 + k positions of each speculative request and keep the drafts the
        target's distribution accepts (rejection sampling; greedy: equality)."""
        sreqs = [reqs[i] for i in spec]
        rows_idx: list[int] = []
        drafts: list[int] = []
        expanded: list[tuple[ScheduledRequest, list[int]]] = []
        for i in spec:
            r = reqs[i]
            k = len(r.spec_token_ids)
            end = int(qsl[i + 1])
            rows_idx.extend(range(end - k - 1, end))
            drafts.extend(r.spec_token_ids)
            drafts.append(-1)  # the last row only emits (the bonus token)
            # Row j's target sees drafts 0..j-1 as already generated (penalties, min_tokens).
            real = [t for t in r.spec_token_ids if t >= 0]  # padding drafts (-1) come last
            expanded.extend((r, real[:j]) for j in range(k + 1))
        if len(rows_idx) == hidden.shape[0]:  # every row verifies (a verify graph's output)
            rows = hidden
        else:
            rows = hidden[self._to_dev(np.asarray(rows_idx, dtype=np.int64))]
        logits = self.model.compute_logits(rows)  # [R, V]
        smd = self._sampling_metadata([r for r, _ in expanded], [e for _, e in expanded])
        row_generators = [smd.generators.get(row) for row in range(len(expanded))]
        out = rejection_sample(
            logits, smd, self._values_to_dev(drafts, torch.int64), row_generators
        )
        return _SpecResult(sreqs, out)

    @torch.inference_mode()
    def propose_drafts(self, reqs: list[DraftRequest]) -> dict[str, list[int]]:
        """The draft model's proposals for the requests of the step just processed: each
        from its newest token (the one the next step verifies drafts after)."""
        if self.draft is None or not reqs:
            return {}
        width = max(-(-(r.position + r.num_tokens) // self.block_size) for r in reqs)
        table = np.stack([self._block_row(r.req_id, r.block_ids)[:width] for r in reqs])
        drafts = self.draft.propose(
            # the head starts from its own rows of the step; a draft model from the token
            [r.req_id for r in reqs]
            if isinstance(self.draft, EagleDraft)
            else [r.token_id for r in reqs],
            [r.position for r in reqs],
            table,
            [r.num_tokens for r in reqs],
            self._to_dev,
        )
        return {r.req_id: d for r, d in zip(reqs, drafts, strict=True)}

    def _prompt_logprobs(
        self, reqs: list[ScheduledRequest], hidden: torch.Tensor, qsl: np.ndarray
    ) -> dict[str, tuple]:
        """Log-probs of the prompt tokens that this step's chunks predict.

        The hidden row of position p gives the distribution of token p + 1; a chunk covering
        positions [start, start + n) yields prompt tokens start + 1 .. min(start + n,
        prompt_len - 1). Returned as device tensors (copied to the host with the step's output).
        """
        out: dict[str, tuple] = {}
        for i, r in enumerate(reqs):
            k = r.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = r.num_computed_tokens
            end = min(start + r.num_new_tokens, r.prompt_len - 1)  # positions start..end-1
            if end <= start:
                continue
            first_row = int(qsl[i])
            targets = torch.as_tensor(r.all_token_ids[start + 1 : end + 1], dtype=torch.int64)
            targets = targets.to(self.device, non_blocking=self._pin)
            vocab = self.model_config.text_config.vocab_size
            step = max(1, _PROMPT_LOGPROBS_SLICE_BYTES // (4 * vocab))
            parts = []
            for a in range(0, end - start, step):
                b = min(a + step, end - start)
                rows = hidden[first_row + a : first_row + b]  # [S, hidden]
                logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)  # [S, V]
                parts.append(compute_logprobs(logprobs, targets[a:b], k))
            ids, lps, ranks = (torch.cat(t) for t in zip(*parts, strict=True))
            out[r.req_id] = (start + 1, ids, lps, ranks)
        return out

    def _sampling_metadata(
        self, reqs: list[ScheduledRequest], extra: list[list[int]] | None = None
    ) -> SamplingMetadata:
        """One row per entry of `reqs` (a request may repeat: speculative rows); `extra[row]`
        are tokens treated as generated after the request's output (the drafts before it)."""
        dev = self.device
        params = [r.sampling_params for r in reqs]
        need_penalty = any(_penalized(p) for p in params)
        outputs = [r.output_token_ids for r in reqs]
        # row -> tokens generated so far (the drafts before a verify row included)
        num_done = [len(o) for o in outputs]
        if extra is not None:
            num_done = [n + len(e) for n, e in zip(num_done, extra, strict=True)]
            if need_penalty or any(p.bad_words_token_ids for p in params):
                # copies, so only where penalties or bad words read the history
                outputs = [o + e if e else o for o, e in zip(outputs, extra, strict=True)]
        temps = [0.0 if p.temperature < 1e-5 else p.temperature for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        all_random = all(t > 0.0 for t in temps)

        def opt(values: list[float], neutral: float, dtype=torch.float32) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return to_device(values, dtype, dev)

        generators: dict[int, torch.Generator] = {}
        min_blocked: dict[int, list[int]] = {}
        for row, r in enumerate(reqs):
            p = r.sampling_params
            if p.seed is not None and temps[row] > 0.0:
                gen = self.generators.get(r.req_id)
                if gen is None:
                    gen = torch.Generator(device=dev)
                    gen.manual_seed(p.seed)
                    self.generators[r.req_id] = gen
                generators[row] = gen
            if p.min_tokens and num_done[row] < p.min_tokens:
                blocked = list(p.stop_token_ids or [])
                if not p.ignore_eos and r.eos_token_id is not None:
                    blocked.append(r.eos_token_id)
                if blocked:
                    min_blocked[row] = blocked
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            # Pinned, non-blocking: a pageable copy would wait for the forward just launched,
            # and with async scheduling the host must not wait for the device here.
            temperature=self._values_to_dev(temps, torch.float32),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=opt([float(p.top_k) for p in params], 0.0, torch.int64),
            top_p=opt([p.top_p for p in params], 1.0),
            min_p=opt([p.min_p for p in params], 0.0),
            presence_penalties=opt([p.presence_penalty for p in params], 0.0),
            frequency_penalties=opt([p.frequency_penalty for p in params], 0.0),
            repetition_penalties=opt([p.repetition_penalty for p in params], 1.0),
            prompt_token_ids=[r.all_token_ids[: r.prompt_len] for r in reqs]
            if need_penalty
            else [],
            output_token_ids=outputs if need_penalty else [],
            generators=generators,
            max_num_logprobs=max(logprobs) if logprobs else None,
            min_tokens_blocked=min_blocked,
            allowed_token_ids={
                row: p.allowed_token_ids for row, p in enumerate(params) if p.allowed_token_ids
            },
            # Multi-token bad words read the output so far: such requests run in sync mode.
            bad_words={
                row: (p.bad_words_token_ids, outputs[row])
                for row, p in enumerate(params)
                if p.bad_words_token_ids
            },
            logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias},
        )
