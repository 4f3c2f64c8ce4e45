"""SamplingParams: validation messages name the field, normalization, derived properties."""

from __future__ import annotations

import pytest

from pagoda.sampling_params import RequestOutputKind, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"output_kind": "sometimes"}, "output_kind"),
    ],
)
def test_bad_value_raises_value_error_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    # The message also shows the offending value.
    bad = kwargs[field]
    assert str(bad) in str(info.value) or repr(bad) in str(info.value)


def test_messages_state_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"top_k must be -1, 0 .* or >= 1"):
        SamplingParams(top_k=-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"n": True}, "n"),
        ({"seed": "42"}, "seed"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": ["1"]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_wrong_type_raises_type_error(kwargs: dict, field: str) -> None:
    with pytest.raises(TypeError, match=field):
        SamplingParams(**kwargs)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.detokenize and not p.ignore_eos
    assert p.output_kind == RequestOutputKind.CUMULATIVE


def test_normalization() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=1, stop_token_ids=(5, 7))
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert isinstance(p.temperature, float)
    assert p.stop_token_ids == [5, 7]
    assert p.all_stop_token_ids == {5, 7}
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(best_of=3).best_of == 3  # accepted, ignored
    assert SamplingParams(output_kind="delta").output_kind == RequestOutputKind.DELTA
    assert SamplingParams(stop=["a", "bcd"]).max_stop_str_len == 3


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_generation_config_eos_ids() -> None:
    p = SamplingParams(stop_token_ids=[9])
    p.update_from_generation_config({"eos_token_id": [151645, 151643]}, model_eos_token_id=151645)
    assert p.all_stop_token_ids == {9, 151643, 151645}
    assert sorted(p.stop_token_ids) == [9, 151643]  # model EOS is the engine's own check

    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": 2}, model_eos_token_id=1)
    assert ignoring.stop_token_ids == []


def test_clone_is_independent() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3)
    q = p.clone()
    q.stop.append("y")
    q.update_from_generation_config({}, model_eos_token_id=2)
    assert p.stop == ["x"] and p.all_stop_token_ids == {1}
    assert q.seed == 3 and q.all_stop_token_ids == {1, 2}


def test_repr_lists_settings() -> None:
    text = repr(SamplingParams(temperature=0.5, stop="END"))
    assert text.startswith("SamplingParams(")
    assert "temperature=0.5" in text and "stop=['END']" in text
    assert "output_kind=cumulative" in text and "_all_stop" not in text


def test_structured_outputs_params_need_exactly_one_constraint() -> None:
    from pagoda.sampling_params import StructuredOutputsParams as S

    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, gram"):
        S()
    with pytest.raises(ValueError, match="got regex, choice"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice must not be empty"):
        S(choice=[])
    with pytest.raises(TypeError, match="structured_outputs.choice must contain only str"):
        S(choice=["a", 1])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        S(json="{nope")
    with pytest.raises(TypeError, match="structured_outputs.json must be a JSON schema"):
        S(json="[1, 2]")
    with pytest.raises(TypeError, match="structured_outputs.regex must be a str"):
        S(regex=5)
    with pytest.raises(TypeError, match="structured_outputs.json_object must be a bool"):
        S(json_object="yes")
    assert S(json='{"type": "object", "a": 1}').key == S(json={"a": 1, "type": "object"}).key
    assert S(choice=["a"]).kind == "choice"


def test_structured_outputs_accepts_a_dict_and_rejects_other_types() -> None:
    from pagoda.sampling_params import StructuredOutputsParams as S

    p = SamplingParams(structured_outputs={"regex": "[a-z]+"})
    assert p.structured_outputs == S(regex="[a-z]+")
    with pytest.raises(TypeError, match="structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(TypeError, match="bad_words must be a list of str, not a single str"):
        SamplingParams(bad_words="bad")


def test_bad_words_tokenize_alone_and_after_a_space() -> None:
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return {"bad": [5], " bad": [6], "two words": [7, 8], " two words": [9, 8]}[text]

    p = SamplingParams(bad_words=["bad", " two words"])
    p.update_from_tokenizer(Tok(), vocab_size=10)
    assert p.bad_words_token_ids == [[5], [6], [7, 8], [9, 8]]
    with pytest.raises(ValueError, match=r"bad_words tokenize to ids \[9\] outside"):
        p.update_from_tokenizer(Tok(), vocab_size=9)
