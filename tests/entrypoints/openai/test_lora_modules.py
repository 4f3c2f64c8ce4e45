"""`pagoda serve --lora-modules`: the `model` field picks an adapter, served unmerged.

A tiny random Qwen2 with two PEFT adapters: greedy completions through the app equal
transformers on the merged models, /v1/models lists base and adapters, unknown names get 404.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("peft")

from fastapi.testclient import TestClient  # noqa: E402

from pagoda.engine.args import EngineArgs  # noqa: E402
from pagoda.engine.engine_process import start_engine  # noqa: E402
from pagoda.entrypoints.openai.cli import parse_lora_modules  # noqa: E402
from pagoda.entrypoints.openai.server import build_app  # noqa: E402
from pagoda.lora.merge import merge_lora  # noqa: E402
from tests.helpers import hf_greedy, save_tiny_model  # noqa: E402
from tests.lora.adapters import make_adapter  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = save_tiny_model("qwen2", root / "base")
    make_adapter(base, root / "a1", seed=21)
    make_adapter(base, root / "a2", seed=22, r=8, target_modules=["q_proj", "down_proj"])
    refs = {"tiny": hf_greedy(base, [PROMPT], 8)[0][0]}
    for name in ("a1", "a2"):
        merge_lora(base, root / name, root / f"m-{name}", progress=False)
        refs[name] = hf_greedy(root / f"m-{name}", [PROMPT], 8)[0][0]
    engine = start_engine(
        EngineArgs(
            model=str(base),
            skip_tokenizer_init=True,
            max_model_len=128,
            enable_lora=True,
            max_loras=2,
            device="cpu",
        )
    )
    modules = parse_lora_modules([f"a1={root / 'a1'}", f"a2={root / 'a2'}"])
    app = build_app(engine, "tiny", lora_modules=modules)
    with TestClient(app) as c:
        yield c, refs
    engine.shutdown()


def test_model_field_selects_the_adapter(client):
    c, refs = client
    for name in ("tiny", "a1", "a2"):
        r = c.post(
            "/v1/completions",
            json={
                "model": name,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == refs[name], name
    assert refs["a1"] != refs["tiny"]  # the adapters change the answer


def test_models_list_and_unknown_model(client):
    c, _ = client
    data = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny", "a1", "a2"]
    assert data[1]["parent"] == "tiny"
    r = c.post("/v1/completions", json={"model": "a3", "prompt": PROMPT})
    assert r.status_code == 404 and "'a1'" in r.json()["error"]["message"]


def test_bad_lora_module_specs():
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["a1"])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=x", "a=y"])
