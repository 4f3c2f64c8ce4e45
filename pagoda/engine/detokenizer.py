"""Incremental, UTF-8 safe detokenization of one request's output, with stop strings.

Each new token decodes only a short window (prefix/read offsets, as in vLLM and TGI): the text
is emitted once it no longer ends in U+FFFD, so a Korean or Chinese character whose bytes span
several byte-level BPE tokens is never emitted broken. Stop strings are searched in the new text
only; while streaming, a possible partial stop string at the end is held back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

# Prompt tokens that seed the decode window, so the first output token is decoded in context
# (SentencePiece drops the leading space of a window's first token).
INITIAL_DECODE_WINDOW = 5
REPLACEMENT_CHAR = "\ufffd"


@functools.lru_cache(maxsize=64)
def _plain_fast_decode(tokenizer_type: type) -> bool:
    """Whether `tokenizer_type.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=
    False)` is exactly its Rust tokenizer's `decode(ids, skip_special_tokens=s)`: a transformers
    fast tokenizer whose `_decode` is the backend's own (no model-specific override)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    return (
        issubclass(tokenizer_type, TokenizersBackend)
        and tokenizer_type._decode is TokenizersBackend._decode
    )


def fast_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """A decode of token ids without transformers' Python wrapper (3x cheaper per call, the
    same text), or None where the wrapper does more than call the Rust tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _plain_fast_decode(type(tokenizer)):
        return None
    rust_decode = backend.decode
    return lambda ids: rust_decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive.

    `tokenizer` is a Hugging Face tokenizer. `spaces_between_special_tokens` is accepted for
    vLLM compatibility and passed to slow tokenizers only; fast ones decode specials verbatim.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            # Cleanup rewrites text (" ." -> ".") differently depending on the window; never use it.
            "clean_up_tokenization_spaces": False,
        }
        if not getattr(tokenizer, "is_fast", True):
            self._decode_kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens

        # Decode window: the last few prompt tokens, then every output token.
        self._tokens: list[int] = list(prompt_token_ids[-INITIAL_DECODE_WINDOW:])
        self._prefix_offset = 0  # window start: text before it is already emitted
        self._read_offset = len(self._tokens)  # tokens up to here are emitted as text
        self._prefix_text: str | None = None  # decode of tokens[prefix_offset:read_offset]

        self.token_ids: list[int] = []
        self._output_text = ""
        self._last_output_text_offset = 0  # how much text get_next_output_text handed out
        self.stop_reason: str | None = None  # the stop string that matched, once one did
        # A partial stop string can be at most this long; it is held back while streaming.
        self._stop_buffer_length = (
            0 if include_stop_str_in_output or not self.stop else max(map(len, self.stop)) - 1
        )
        self._token_text_cache: dict[int, str] = {}
        self._fast = fast_decoder(tokenizer, skip_special_tokens)

    @property
    def output_text(self) -> str:
        return self._output_text

    def _decode(self, token_ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(token_ids)
        return self.tokenizer.decode(token_ids, **self._decode_kwargs)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens and extend the text; return the stop string if one now matches.

        `stop_terminated`: the last token ended the request (EOS or one of `stop_token_ids`);
        as in vLLM its text is left out unless `include_stop_str_in_output`. After a stop
        string matched, the text is final and further tokens are ignored.
        """
        if self.stop_reason is not None:
            return self.stop_reason
        self.token_ids.extend(new_token_ids)
        old_len = len(self._output_text)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self._tokens.append(token_id)
            if self._prefix_text is None:
                prefix = self._tokens[self._prefix_offset : self._read_offset]
                self._prefix_text = self._decode(prefix)
            new_text = self._decode(self._tokens[self._prefix_offset :])
            # Hold the text while it ends in an incomplete UTF-8 sequence (or adds nothing, e.g.
            # a skipped special token); the next token completes it.
            if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
                self._output_text += new_text[len(self._prefix_text) :]
                # The emitted window becomes the next prefix; its text is what we just decoded
                # minus what preceded it, so decode it lazily on the next token.
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
                self._prefix_text = None
        if len(self._output_text) > old_len:
            return self._check_stop(old_len)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        """Find the earliest stop string that ends in the new text; truncate the text there."""
        text = self._output_text
        best: tuple[int, str] | None = None
        for s in self.stop:
            # A match must end after old_len, so it cannot start before old_len - len(s) + 1.
            idx = text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self._output_text = text[: idx + len(s)] if self.include_stop_str_in_output else text[:idx]
        self.stop_reason = s
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand to the caller: all so far, or only the new part if `delta`.

        While not finished, the last `max stop length - 1` characters are held back, since
        they may be the start of a stop string that the next token completes.
        """
        held = 0 if finished or self.stop_reason is not None else self._stop_buffer_length
        length = max(0, len(self._output_text) - held)
        if not delta:
            return self._output_text[:length]
        start = self._last_output_text_offset
        if length <= start:
            return ""
        self._last_output_text_offset = length
        return self._output_text[start:length]

    def decode_token(self, token_id: int) -> str:
        """Text of one token on its own (for logprobs); byte fragments show as U+FFFD."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            # Special tokens are shown even when skipped in the output text, as vLLM does.
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text
