"""LLMEngine: requests in, `RequestOutput`s out, around one `EngineCore`.

It owns what sits between users and the core: prompt processing, fan-out of `n > 1` into
sibling requests (which share prompt blocks through the prefix cache), incremental
detokenization with stop strings, logprob formatting and per-request timing. Outputs are
cumulative by default, or deltas (only what is new) for streaming.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pagoda import envs
from pagoda.config import ModelConfig, RunnerConfig
from pagoda.engine.args import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.input_processor import InputProcessor, ProcessedPrompt
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import EngineCoreOutput
from pagoda.model_files import ModelSource, eos_token_ids, load_tokenizer
from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.platform import cuda_available, triton_available
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output import StructuredOutputManager, StructuredOutputRequest
from pagoda.worker.memory import MemoryReport

logger = logging.getLogger("pagoda")


@dataclass
class _Child:
    """One sample of a request (index i of n)."""

    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    # Sample 0 only (siblings share the prompt): one entry per prompt token, filled by position
    # as prompt chunks are computed (a recompute after preemption refills the same entries).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logprobs: int = 0  # entries filled (the first token never has one)
    sent_prompt_logprobs: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    delta: bool
    metrics: RequestMetrics
    children: list[_Child] = field(default_factory=list)
    final_only: bool = False  # build a RequestOutput only once finished (offline generate)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        # Triton compiles on CUDA only (the interpreter and the CPU paths compile nothing).
        kernels_before = triton_cache_entries() if _wants_cuda(args.device) else None
        source, model_config, cache_config, sched_config, runner_config = args.create_configs()
        self.cache_config = cache_config
        self.source = source
        self.model_config = model_config
        self.scheduler_config = sched_config
        self.tokenizer = load_engine_tokenizer(args, source)
        self.eos_token_ids = eos_token_ids(source, model_config.hf_config, self.tokenizer)
        self.core = EngineCore(model_config, cache_config, sched_config, runner_config)
        self.input_processor = make_input_processor(self.tokenizer, model_config, runner_config)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        self._structured: StructuredOutputManager | None = None  # made on first use
        self._counter = itertools.count()
        self.startup_time_s = time.perf_counter() - t0
        report = self.core.memory_report
        report.startup_time_s = self.startup_time_s
        if kernels_before is not None:
            report.triton_kernels_compiled = max(0, triton_cache_entries() - kernels_before)

    def shutdown(self) -> None:
        """Abort what is queued and free every device allocation of the engine."""
        self.abort_request(list(self._parents))
        self.core.shutdown()

    @property
    def memory_report(self) -> MemoryReport:
        return self.core.memory_report

    # ------------------------------------------------------------------ requests

    def next_request_id(self) -> str:
        return str(next(self._counter))

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        delta: bool = False,
        final_only: bool = False,
        processed: ProcessedPrompt | None = None,
        lora_request: Any = None,
    ) -> None:
        """Queue a request; `lora_request` (a `pagoda.LoRARequest`) picks its adapter."""
        if self.core.closed:
            raise RuntimeError("this engine was shut down; create a new LLM to generate again")
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        truncate = params.truncate_prompt_tokens
        if processed is None:
            processed = self.input_processor.process(prompt, truncate_prompt_tokens=truncate)
        elif truncate is not None:
            ids, text = self.input_processor.truncate(
                processed.prompt_token_ids,
                processed.prompt,
                truncate,
                processed.mm_inputs is not None,
            )
            processed = ProcessedPrompt(text, ids, processed.mm_inputs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        vocab = self.model_config.text_config.vocab_size
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.allowed_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"allowed_token_ids {bad} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias keys {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (this model has none)")
            params = params.clone()  # the token ids are this engine's, not the caller's
            params.update_from_tokenizer(self.tokenizer, vocab)
        grammar: StructuredOutputRequest | None = None
        if params.structured_outputs is not None:
            # Parsed now (a bad schema fails here); compiled on the manager's thread pool.
            grammar = self.structured_output_manager().new_request(params.structured_outputs)
        lora_key = None
        if lora_request is not None:
            from pagoda.lora.request import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {lora_request!r}")
            # Read and checked here, so a bad adapter fails this call, not a later step.
            self.core.add_lora(lora_request.lora_key, lora_request.lora_path)
            lora_key = lora_request.lora_key
        arrival = arrival_time if arrival_time is not None else time.time()
        parent = _Parent(
            request_id, processed, params, delta, RequestMetrics(arrival), final_only=final_only
        )
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        extra_eos = [t for t in self.eos_token_ids[1:] if t not in (params.stop_token_ids or [])]
        for i in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if extra_eos and not params.ignore_eos:
                child_params.stop_token_ids = list(params.stop_token_ids or []) + extra_eos
            if params.seed is not None and params.n > 1:
                child_params.seed = params.seed + i  # siblings must not draw identical samples
            if i > 0:
                # The prompt's log-probs are the same for every sample: sample 0 computes them,
                # the others keep their prefix-cache hits.
                child_params.prompt_logprobs = None
            child_grammar = grammar
            if grammar is not None and i > 0:
                child_grammar = self._structured.new_request(params.structured_outputs)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                request_id=child_id,
                prompt_token_ids=list(processed.prompt_token_ids),
                sampling_params=child_params,
                eos_token_id=eos,
                arrival_time=arrival,
                lora_key=lora_key,
                mm_hashes=processed.mm_inputs.hash_ranges() if processed.mm_inputs else [],
                mm_inputs=processed.mm_inputs,
                structured_output=child_grammar,
            )
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    processed.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop or [],
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            child = _Child(
                index=i,
                request=req,
                detok=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                prompt_logprobs=(
                    [None] * len(processed.prompt_token_ids)
                    if i == 0 and params.prompt_logprobs is not None
                    else None
                ),
            )
            parent.children.append(child)
            self._child_to_parent[child_id] = (parent, child)
        self._parents[request_id] = parent
        added = []
        try:
            for child in parent.children:
                self.core.add_request(child.request)
                added.append(child.request.request_id)
        except BaseException:
            # all or nothing: a half-added request would keep the engine "busy" forever
            self.core.abort_requests(added)
            self._parents.pop(request_id, None)
            for child in parent.children:
                self._child_to_parent.pop(child.request.request_id, None)
            raise

    def structured_output_manager(self) -> StructuredOutputManager:
        """The grammar compiler and cache, created with the first constrained request."""
        if self._structured is None:
            self._structured = StructuredOutputManager(
                self.tokenizer, self.model_config.text_config.vocab_size, self.eos_token_ids
            )
            self.core.structured_output_manager = self._structured
        return self._structured

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = []
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for c in parent.children:
                child_ids.append(c.request.request_id)
                self._child_to_parent.pop(c.request.request_id, None)
        self.core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        now = time.time()
        touched: dict[str, _Parent] = {}
        stopped_by_string: list[str] = []
        for out in outputs:
            entry = self._child_to_parent.get(out.req_id)
            if entry is None:
                continue
            parent, child = entry
            if self._apply(parent, child, out, now):
                stopped_by_string.append(out.req_id)
            if out.new_token_ids or out.finish_reason is not None:
                touched[parent.request_id] = parent  # a bare prompt chunk makes no output
        if stopped_by_string:
            self.core.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)
        results = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._parents.pop(parent.request_id, None)
                for c in parent.children:
                    self._child_to_parent.pop(c.request.request_id, None)
            if finished or not parent.final_only:
                results.append(self._make_output(parent, finished))
        return results

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput, now: float) -> bool:
        """Fold one core output into the child; True if a stop string ended it."""
        if out.new_token_ids:
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
        new_ids = out.new_token_ids
        new_logprobs = out.new_logprobs
        if child.prompt_logprobs is not None and out.new_prompt_logprobs is not None:
            first, ids, lps, ranks = out.new_prompt_logprobs
            for j, (tids, tlps, rank) in enumerate(zip(ids, lps, ranks, strict=True)):
                if child.prompt_logprobs[first + j] is None:
                    child.num_prompt_logprobs += 1
                child.prompt_logprobs[first + j] = self._logprob_entry(tids, tlps, rank)
        stop_hit = False
        if child.detok is not None and new_ids and child.finish_reason is None:
            # The token that ended the request by EOS / stop_token_ids leaves no text (vLLM).
            stop_terminated = out.finish_reason == "stop"
            matched = None
            if len(new_ids) > 1 and child.detok.stop:
                # Several tokens at once (speculative decoding): a stop string ends the output
                # at the token that completes it, as if they had come one by one.
                for i in range(len(new_ids)):
                    last = i == len(new_ids) - 1
                    matched = child.detok.update(new_ids[i : i + 1], stop_terminated and last)
                    if matched is not None:
                        break
                if matched is not None and i < len(new_ids) - 1:
                    self._drop_tail(child.request, len(new_ids) - i - 1)
                    new_ids = new_ids[: i + 1]
                    new_logprobs = None if new_logprobs is None else new_logprobs[: i + 1]
                    out.finish_reason = None  # the stop string ends it, not what followed
            else:
                matched = child.detok.update(new_ids, stop_terminated=stop_terminated)
            if matched is not None and out.finish_reason is None:
                child.finish_reason, child.stop_reason = "stop", matched
                stop_hit = True
            elif matched is not None:
                child.finish_reason, child.stop_reason = "stop", matched
        if child.logprobs is not None and new_logprobs:
            for ids, lps, rank in new_logprobs:
                child.logprobs.append(self._logprob_entry(ids, lps, rank))
                child.cumulative_logprob += lps[0]
        if out.finish_reason is not None and child.finish_reason is None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        return stop_hit

    @staticmethod
    def _drop_tail(request: Request, n: int) -> None:
        """Forget the last n output tokens of a request that a stop string ends before them."""
        del request.output_token_ids[-n:]
        del request.all_token_ids[-n:]

    def _logprob_entry(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        """vLLM's shape: the token first (its own rank), then the top-k with ranks 1..k."""
        entry: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
            if tid in entry:
                continue
            entry[tid] = Logprob(
                logprob=lp, rank=rank if j == 0 else j, decoded_token=self._decode_token(tid)
            )
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        completions = []
        for c in parent.children:
            req = c.request
            done = c.finish_reason is not None
            if c.detok is not None:
                text = c.detok.get_next_output_text(done, False)
            else:
                text = ""
            tokens = list(req.output_token_ids)
            logprobs = c.logprobs
            if parent.delta:
                new_text = text[c.sent_text_len :]
                c.sent_text_len = max(c.sent_text_len, len(text))
                new_tokens = tokens[c.sent_tokens :]
                c.sent_tokens = len(tokens)
                if logprobs is not None:
                    new_lp = logprobs[c.sent_logprobs :]
                    c.sent_logprobs = len(logprobs)
                    logprobs = new_lp
                text, tokens = new_text, new_tokens
            completions.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        m = parent.metrics
        reqs = [c.request for c in parent.children]
        m.spec_num_steps = sum(r.num_spec_steps for r in reqs)
        m.spec_num_draft_tokens = sum(r.num_draft_tokens for r in reqs)
        m.spec_num_accepted_tokens = sum(r.num_accepted_tokens for r in reqs)
        first = parent.children[0]
        prompt_logprobs = None
        lead = first.prompt_logprobs
        # Complete once every prompt token after the first has its entry; a delta stream gets
        # the list once, with the first output that has it.
        complete = lead is not None and first.num_prompt_logprobs >= len(lead) - 1
        if complete and not (parent.delta and first.sent_prompt_logprobs):
            prompt_logprobs = lead
            first.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt.prompt,
            prompt_token_ids=parent.prompt.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=max(first.request.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
        )


def load_engine_tokenizer(args: EngineArgs, source: ModelSource) -> Any | None:
    """The tokenizer `args` ask for: the model's, `args.tokenizer`'s, or none."""
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer)
    return None if args.skip_tokenizer_init else load_tokenizer(source)


def make_input_processor(
    tokenizer: Any | None, model_config: ModelConfig, runner_config: RunnerConfig
) -> InputProcessor:
    """Prompt processing for this model (with its image processor for a vision-language one).

    Shared with the server's front end when the engine runs in its own process, so that both
    sides turn prompts into the same token ids.
    """
    mm_processor = None
    if runner_config.multimodal is not None:  # a vision-language model
        from pagoda.multimodal.processor import MultiModalProcessor

        mm_processor = MultiModalProcessor.from_model(
            model_config.model,
            model_config.hf_config,
            tokenizer,
            runner_config.multimodal,
            model_config.max_model_len,
        )
    return InputProcessor(
        tokenizer, model_config.text_config.vocab_size, model_config.max_model_len, mm_processor
    )


def _wants_cuda(device: str) -> bool:
    if device == "auto":
        return cuda_available()
    return device.startswith("cuda")


def triton_cache_entries() -> int | None:
    """Compiled kernels in Triton's cache (one directory each); None without Triton."""
    kernels = triton_cache_kernels()
    return None if kernels is None else len(kernels)


def triton_cache_kernels() -> dict[str, str] | None:
    """Triton's cache: {entry directory: kernel name} (the name of its `<name>.json`, not the
    `__grp__` index); None without Triton. Two snapshots tell which kernels compiled between."""
    if not triton_available():
        return None
    out: dict[str, str] = {}
    try:
        entries = [e for e in os.scandir(envs.triton_cache_dir()) if e.is_dir()]
    except OSError:
        return out
    for e in entries:
        try:
            names = [f[:-5] for f in os.listdir(e.path) if f.endswith(".json")]
        except OSError:
            continue
        kernels = [n for n in names if not n.startswith("__grp__")]
        out[e.name] = kernels[0] if kernels else "?"
    return out
