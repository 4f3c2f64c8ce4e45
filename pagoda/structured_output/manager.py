"""Grammar compilation (off the engine loop, cached) and token bitmasks, on xgrammar.

A request's constraint is parsed at once (so a bad schema fails `add_request` with a
ValueError), compiled against the tokenizer on a thread pool (the scheduler admits the request
when it is done, without waiting), and followed token by token by a per-request matcher.
xgrammar is imported only when the first request with a constraint arrives.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagoda.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagoda")

MISSING_LIBRARY = (
    "structured outputs need the xgrammar package, which is not installed: "
    "pip install 'pagoda[structured]'"
)
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(error: BaseException) -> str:
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text).splitlines()[0] if text else type(error).__name__


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(MISSING_LIBRARY) from None
    return xgrammar


class StructuredOutputRequest:
    """One request's grammar: its compile future, then a matcher that follows its tokens.

    Siblings (`n > 1`) share the compiled grammar and each own a matcher.
    """

    def __init__(self, xgr: Any, future: Future, kind: str) -> None:
        self._xgr = xgr
        self._future = future
        self.kind = kind
        self._matcher: Any = None
        self.rejected = False  # a token the grammar does not allow was sampled (a bug)
        # The future's outcome, read once it is done (each Future call takes its lock, and the
        # bitmask asks every constrained row every step)
        self._done = False
        self._error: BaseException | None = None

    def is_ready(self) -> bool:
        """Whether compilation finished (successfully or not)."""
        if not self._done and self._future.done():
            self._error = self._future.exception()
            self._done = True
        return self._done

    @property
    def error(self) -> BaseException | None:
        return self._error if self.is_ready() else None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = self._xgr.GrammarMatcher(self._future.result())
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance the grammar by one sampled token; False if the grammar rejects it."""
        if self.rejected:
            return False
        if not self.matcher.accept_token(token_id):
            self.rejected = True
            logger.error("structured output: the grammar rejected sampled token %d", token_id)
        return not self.rejected

    def is_terminated(self) -> bool:
        """The grammar is complete (it accepted a stop token) or can accept nothing more."""
        return self.rejected or self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles, caches and follows grammars for the engine.

    `vocab_size` is the model's (the width of the logits, which may exceed the tokenizer's);
    `stop_token_ids` are the ids that end a request (EOS): the grammar allows them only where
    its output is complete.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_workers: int = 2,
        cache_size: int = 256,
        compile_threads: int | None = None,
        fill_threads: int | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (this model has none)")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        cpus = os.cpu_count() or 1
        # Leave the engine thread a core: on the 2-core CPU machine 8 compile threads made the
        # running requests' step gaps 4x longer; the GIL itself is released while compiling.
        self.compile_threads = compile_threads or max(1, min(8, cpus // 2))
        # Filling 32 JSON-schema rows of a 152k vocabulary takes ~0.2 ms on one thread; more
        # threads only pay off for many rows of expensive grammars on a many-core host.
        self.fill_threads = fill_threads or max(1, min(4, cpus // 4))
        self._max_workers = max_workers
        self._xgr: Any = None
        self._compiler: Any = None
        self._batch_matcher: Any = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.num_compiles = 0  # grammars compiled (cache misses)

    # -- requests -------------------------------------------------------------------------

    def _lib(self) -> Any:
        if self._xgr is None:
            self._xgr = _import_xgrammar()
        return self._xgr

    def grammar(self, params: StructuredOutputsParams) -> Any:
        """Parse the constraint into an (uncompiled) xgrammar Grammar; ValueError if invalid."""
        xgr = self._lib()
        kind = params.kind
        any_ws = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return xgr.Grammar.from_json_schema(schema, any_whitespace=any_ws)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws)
            if kind == "regex":
                return xgr.Grammar.from_regex(params.regex)
            if kind == "choice":
                # JSON string escapes are valid EBNF string literals for xgrammar.
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            return xgr.Grammar.from_ebnf(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(e)}") from None

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start (or reuse) the compilation of `params`; the request is ready when it is done."""
        xgr = self._lib()
        key = params.key
        future = self._cache.get(key)
        if future is not None and future.done() and future.exception() is not None:
            future = None  # a failed compile is retried, not cached
        if future is None:
            grammar = self.grammar(params)  # raises here, in the caller's add_request
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, "pagoda-grammar")
            future = self._pool.submit(self._compile, grammar)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return StructuredOutputRequest(xgr, future, params.kind)

    def _compile(self, grammar: Any) -> Any:
        """On a pool thread: build the tokenizer tables once, then compile the grammar."""
        xgr = self._xgr
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.compile_threads)
        self.num_compiles += 1
        return self._compiler.compile_grammar(grammar)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some compilation in flight finishes, at most `timeout` seconds."""
        pending = [f for f in self._cache.values() if not f.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # -- bitmasks -------------------------------------------------------------------------

    def bitmask(
        self, rows: Sequence[StructuredOutputRequest | None], pin_memory: bool = False
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The next-token bitmask of each row that follows a live grammar.

        Returns (bitmask [len(rows), ceil(V / 32)] int32 on the host, the rows filled), or
        None when no row needs one. A finished grammar's row is left unconstrained: its token
        is dropped by the scheduler anyway.
        """
        indices = [
            i
            for i, r in enumerate(rows)
            if r is not None and r.is_ready() and r.error is None and not r.is_terminated()
        ]
        if not indices:
            return None
        xgr = self._xgr
        width = (self.vocab_size + 31) // 32
        mask = torch.empty((len(rows), width), dtype=torch.int32, pin_memory=pin_memory)
        matchers = [rows[i].matcher for i in indices]
        if len(indices) == 1:
            matchers[0].fill_next_token_bitmask(mask, indices[0])
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(self.fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, mask, indices)
        return mask, indices

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
