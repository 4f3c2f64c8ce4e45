"""lm-eval's `local-completions` model against the server: per-item log-likelihoods as transformers.

Two local tasks (tests/fixtures/lm_eval: YAML + JSONL, nothing downloaded) run through
`lm_eval.simple_evaluate` against the server (the embedded SmolLM2 engine) and with lm-eval's
own `hf` model on transformers holding the same GGUF weights. Every item's log-likelihood
(multiple-choice continuations; rolling windows over whole passages) agrees within 1e-3 and
every is_greedy flag is equal. Skipped without lm-eval (`dev` extra).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

TASK_DIR = Path(__file__).parents[2] / "fixtures" / "lm_eval"
TASKS = ["pagoda_choice", "pagoda_passages"]
# lm-eval's API models keep one token for generation and one for the rolling context: windows
# of MAX_LENGTH - 2 tokens, so the two longer passages (~80 tokens) span two windows each.
MAX_LENGTH = 48
TOL = 1e-3


def _evaluate(model, cache_dir: Path, model_args: dict | None = None) -> dict[str, list]:
    """Per task, per document (in order), per request: the answer (loglik[, is_greedy])."""
    import datasets
    import huggingface_hub
    import lm_eval
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        # Offline: a hub access fails instead of downloading. Both libraries read the variables
        # when imported (which may have happened already), hence the constants too.
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache_dir)
        mp.chdir(TASK_DIR)  # the YAMLs name their JSONL relative to the working directory
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=TASKS,
            task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
    answers = {}
    for task in TASKS:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        # resps: one list per request of the document, holding the model's one answer
        answers[task] = [[r[0] for r in s["resps"]] for s in samples]
    return answers


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The engine's tokenizer (converted from the GGUF file) saved where lm-eval can load it."""
    from pagoda.model_files import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def transformers_answers(tokenizer_dir, tmp_path_factory) -> dict[str, list]:
    """lm-eval's `hf` model on transformers' Llama with the embedded GGUF's weights."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda.model_files import default_model_path

    gguf = Path(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    # As the API model: no special tokens added; its rolling windows are max_length - 2 tokens
    # where the hf model's are max_length, so both send the same requests.
    lm = HFLM(
        pretrained=hf, tokenizer=tok, batch_size=1, max_length=MAX_LENGTH - 2, add_bos_token=False
    )
    return _evaluate(lm, tmp_path_factory.mktemp("datasets"))


def _compare(ours: dict[str, list], ref: dict[str, list]) -> dict[str, float]:
    """Max |diff| of the log-likelihoods per task; asserts the tolerance and is_greedy."""
    worst = {}
    for task in TASKS:
        assert len(ours[task]) == len(ref[task]), task
        diffs = []
        for doc, (mine, theirs) in enumerate(zip(ours[task], ref[task], strict=True)):
            assert len(mine) == len(theirs), (task, doc)
            for a, b in zip(mine, theirs, strict=True):
                if task == "pagoda_choice":  # (loglikelihood, is_greedy)
                    assert a[1] == b[1], f"{task} doc {doc}: is_greedy {a[1]} vs {b[1]}"
                    a, b = a[0], b[0]
                assert a < 0, (task, doc, a)
                diffs.append(abs(a - b))
                assert abs(a - b) <= TOL, f"{task} doc {doc}: {a} vs transformers {b}"
        worst[task] = max(diffs)
    return worst


@pytest.mark.slow  # transformers and the server each score 12 choices and 3 passages
def test_local_completions_matches_transformers(
    server, tokenizer_dir, transformers_answers, tmp_path, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)  # local-completions' bearer token
    ours = _evaluate(
        "local-completions",
        tmp_path,
        {
            "model": server.model,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer_dir),
            "max_length": MAX_LENGTH,
            "batch_size": 4,  # several token-id prompts per request
            "max_retries": 1,
        },
    )
    worst = _compare(ours, transformers_answers)
    print(f"max |diff| vs transformers: {worst}")
    greedy = [ans[1] for doc in ours["pagoda_choice"] for ans in doc]
    assert any(greedy) and not all(greedy)  # both outcomes of is_greedy were compared


@pytest.mark.slow
def test_local_completions_with_the_servers_tokenizer(server, transformers_answers, tmp_path):
    # What a user types: base_url and model only. lm-eval then finds /tokenizer_info and
    # /tokenize and tokenizes through the server; here with concurrent requests (aiohttp).
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        model=server.model,
        base_url=f"{server.url}/v1/completions",
        max_length=MAX_LENGTH,
        num_concurrent=2,
        max_retries=1,
        header=server.headers,
    )
    assert lm.tokenizer_backend == "remote"
    worst = _compare(_evaluate(lm, tmp_path), transformers_answers)
    print(f"max |diff| vs transformers (remote tokenizer): {worst}")
