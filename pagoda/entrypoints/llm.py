"""The offline API: `LLM(...).generate(...)` and `.chat(...)`, a drop-in for vLLM's.

A vLLM script works by changing its import. Prompts are submitted together and run with
continuous batching; results come back in input order. `memory_report()` returns what the
engine measured at start-up (weights, activations, KV cache, capacity, load time).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from pagoda.engine.args import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.memory import MemoryReport

logger = logging.getLogger("pagoda")


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = (
            set(kwargs) - EngineArgs.field_names() - {"trust_remote_code", "print_memory_report"}
        )
        if unknown:
            raise TypeError(
                f"LLM() got unknown argument(s) {', '.join(sorted(unknown))}; supported: "
                f"{', '.join(sorted(EngineArgs.field_names()))}"
            )
        kwargs.pop("trust_remote_code", None)
        show = kwargs.pop("print_memory_report", True)
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        if show:
            print(
                f"pagoda: {self.llm_engine.source.name} ready in "
                f"{self.llm_engine.startup_time_s:.1f} s\n{self.memory_report()}",
                file=sys.stderr,
            )

    def shutdown(self) -> None:
        """Free every device allocation of this engine (CUDA graphs, KV cache, workspaces, the
        model), so that another engine can start in this process. Idempotent; the LLM cannot
        generate afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def memory_report(self) -> MemoryReport:
        return self.llm_engine.memory_report

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one `LoRARequest` for all prompts, or a list (None = base model)."""
        prompt_list = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        loras = _lora_list(lora_request, len(prompt_list))
        # Offline: images may be local paths (a server never passes allow_local_paths).
        processor = self.llm_engine.input_processor
        processed = [
            processor.process(
                p, allow_local_paths=True, truncate_prompt_tokens=sp.truncate_prompt_tokens
            )
            for p, sp in zip(prompt_list, params, strict=True)
        ]
        items = list(zip(prompt_list, processed, strict=True))
        return self._run(items, params, use_tqdm, loras)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of message dicts")
        conversations = messages if isinstance(messages[0], list) else [messages]
        params = self._params_list(sampling_params, len(conversations))
        processed = [
            self.llm_engine.input_processor.process_chat(
                conv,
                allow_local_paths=True,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                truncate_prompt_tokens=sp.truncate_prompt_tokens,
            )
            for conv, sp in zip(conversations, params, strict=True)
        ]
        loras = _lora_list(lora_request, len(conversations))
        return self._run([(None, p) for p in processed], params, use_tqdm, loras)

    def stream(
        self, prompt: Any, sampling_params: SamplingParams | None = None, lora_request: Any = None
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding delta outputs as tokens arrive."""
        engine = self.llm_engine
        params = sampling_params or SamplingParams()
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, params, delta=True, lora_request=lora_request)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        yield out
        finally:
            engine.abort_request(rid)

    def _params_list(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(
                f"got {len(params)} sampling params for {n} prompts; pass one, or one per prompt"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params entries must be SamplingParams, got {p!r}")
        return params

    def _run(
        self, items: list, params: list[SamplingParams], use_tqdm: bool, loras: list | None = None
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        limit = engine.model_config.max_model_len
        for (_, processed), p in zip(items, params, strict=True):
            _check_context(len(processed.prompt_token_ids), p.max_tokens, limit)
        ids = []
        loras = loras or [None] * len(items)
        try:
            for (prompt, processed), p, lora in zip(items, params, loras, strict=True):
                rid = engine.next_request_id()
                engine.add_request(
                    rid, prompt, p, processed=processed, lora_request=lora, final_only=True
                )
                ids.append(rid)
        except BaseException:
            engine.abort_request(ids)  # a bad adapter must not leave earlier prompts queued
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", file=sys.stderr)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _check_context(prompt_len: int, max_tokens: int | None, limit: int) -> None:
    """max_tokens beyond the context is an error, as on the server (a 400 there), not a
    silent stop at max_model_len; None means "up to the context limit"."""
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise ValueError(
            f"max_tokens={max_tokens} does not fit: the prompt has {prompt_len} tokens and the "
            f"context (max_model_len) is {limit}, so at most {limit - prompt_len} can be "
            "generated; lower max_tokens, pass max_tokens=None (up to the limit), or raise "
            "max_model_len"
        )


def _lora_list(lora_request: Any, n: int) -> list[Any]:
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(
            f"got {len(lora_request)} lora requests for {n} prompts; pass one, or one per prompt"
        )
    return list(lora_request)


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("prompts is empty")
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of prompts or token ids; got {prompts!r}")
