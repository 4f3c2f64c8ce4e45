"""StructuredOutputManager on the Qwen2.5 tokenizer (no model): parsing errors, the compile
cache and thread pool, bitmasks and matcher termination."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar")

from pagoda.sampling_params import StructuredOutputsParams  # noqa: E402
from pagoda.structured_output import StructuredOutputManager  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "qwen2.5-tokenizer"
VOCAB = 151936  # Qwen2.5's lm_head, wider than the tokenizer (151665)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def manager(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mgr = StructuredOutputManager(tokenizer, VOCAB, [eos])
    yield mgr
    mgr.shutdown()


def _ready(req):
    req._future.result(timeout=120)
    return req


def _allowed(mask: torch.Tensor, row: int) -> set[int]:
    bits = (mask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    ids = bits.flatten().nonzero().flatten()
    return {int(i) for i in ids if i < VOCAB}


def test_choice_bitmask_allows_only_the_choices_then_eos(manager, tokenizer):
    so = StructuredOutputsParams(choice=["yes", "no"])
    req = _ready(manager.new_request(so))
    mask, rows = manager.bitmask([None, req])
    assert rows == [1] and mask.shape == (2, (VOCAB + 31) // 32) and mask.dtype == torch.int32
    allowed = _allowed(mask, 1)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    for t in tokenizer.encode("yes"):
        assert req.accept_token(t)
    assert not req.is_terminated()
    mask, _ = manager.bitmask([req])
    eos = manager.stop_token_ids[0]
    assert _allowed(mask, 0) == {eos}  # complete: only the stop token may follow
    assert req.accept_token(eos) and req.is_terminated()
    assert manager.bitmask([req]) is None  # a finished grammar constrains nothing


def test_a_rejected_token_terminates(manager, tokenizer):
    req = _ready(manager.new_request(StructuredOutputsParams(regex="[0-9]+")))
    assert not req.accept_token(tokenizer.encode("abc")[0])
    assert req.rejected and req.is_terminated()


def test_same_constraint_compiles_once_on_the_pool(manager):
    threads = []
    original = manager._compile

    def spy(grammar):
        threads.append(threading.current_thread().name)
        return original(grammar)

    manager._compile = spy
    try:
        schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
        a = manager.new_request(StructuredOutputsParams(json=schema))
        # Same schema, other key order and as JSON text: the same cache entry.
        b = manager.new_request(
            StructuredOutputsParams(
                json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'
            )
        )
        _ready(a), _ready(b)
        assert a._future is b._future and a.matcher is not b.matcher
        c = _ready(
            manager.new_request(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
        )
        assert c._future is not a._future
    finally:
        manager._compile = original
    assert len(threads) == 2 and all(t.startswith("pagoda-grammar") for t in threads)


@pytest.mark.parametrize(
    ("so", "field"),
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
        (dict(regex="a{2,1}"), "regex"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar='root ::= "a" | undefined'), "grammar"),
        (dict(grammar="this is not ebnf"), "grammar"),
    ],
)
def test_invalid_constraints_raise_value_error_naming_the_field(manager, so, field):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} is invalid: \S"):
        manager.new_request(StructuredOutputsParams(**so))


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="need a tokenizer"):
        StructuredOutputManager(None, VOCAB, [2])
