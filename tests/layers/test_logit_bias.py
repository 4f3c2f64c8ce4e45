"""`logit_bias`: added to the logits before sampling; log-probs stay the raw model's."""

import pytest
import torch

from pagoda.layers.sampler import Sampler, SamplingMetadata
from pagoda.sampling_params import SamplingParams


def _sample(logits: torch.Tensor, params: list[SamplingParams]):
    md = SamplingMetadata.from_sampling_params(params, [[1]] * len(params), [[]] * len(params))
    return Sampler()(logits, md)


def test_bias_moves_the_greedy_choice_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])  # [2, V=4]
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 2.5}, logprobs=1),  # 1 + 2.5 > 3
        SamplingParams(temperature=0.0, logit_bias={1: -100.0}, logprobs=1),  # 3 is next
    ]
    out = _sample(logits, params)
    assert out.sampled_token_ids.tolist() == [2, 3]
    raw = logits.log_softmax(-1)
    # column 0 is the sampled token's raw log-prob (the bias does not change log-probs)
    assert torch.allclose(out.logprobs[:, 0], raw[[0, 1], [2, 3]])


def test_no_bias_leaves_rows_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert _sample(logits, [SamplingParams(temperature=0.0)]).sampled_token_ids.tolist() == [1]


@pytest.mark.parametrize(
    "bias,error",
    [({0: 101.0}, "must be in \\[-100, 100\\]"), ({-1: 1.0}, "token ids >= 0"), ([1], "dict")],
)
def test_bad_bias_is_a_clear_error(bias, error):
    with pytest.raises((ValueError, TypeError), match=error):
        SamplingParams(logit_bias=bias)
