"""`--generation-config` / `--override-generation-config`: default sampling settings, as vLLM.

vLLM reads the model's `generation_config.json` (`auto`), a folder's (a path) or none (`vllm`)
and uses its sampling fields as the defaults of requests that do not set them;
`--override-generation-config` (JSON) wins over the file. `max_new_tokens` becomes max_tokens.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("pagoda")

# generation_config.json field -> request field (the ones vLLM takes as defaults)
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' defaults: a value equal to one of these is not a choice of the model's authors
_HF_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
}


def sampling_defaults(
    mode: str, model_dir: str | None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The request fields (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
    whose default the generation config sets."""
    raw: dict[str, Any] = {}
    if mode == "auto":
        folder = model_dir if model_dir and os.path.isdir(model_dir) else None
    elif mode == "vllm":
        folder = None
    else:
        if not os.path.isdir(mode):
            raise ValueError(
                f"--generation-config {mode!r}: expected 'auto', 'vllm' or a folder holding "
                "a generation_config.json"
            )
        folder = mode
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            raise ValueError(f"--generation-config {mode!r}: no generation_config.json there")
    if folder is not None:
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
    defaults: dict[str, Any] = {}
    for key, field in _FIELDS.items():
        value = raw.get(key)
        if value is None or (key in _HF_DEFAULTS and value == _HF_DEFAULTS[key]):
            continue
        defaults[field] = value
    for key, value in (overrides or {}).items():
        if key not in _FIELDS:
            raise ValueError(
                f"--override-generation-config: {key!r} is not a sampling default pagoda "
                f"applies (it takes {', '.join(_FIELDS)})"
            )
        defaults[_FIELDS[key]] = value
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    return defaults


def apply_defaults(req: Any, defaults: dict[str, Any]) -> None:
    """Fill the request fields the client left unset (never one it set, even to null)."""
    for field, value in defaults.items():
        if field == "max_tokens":
            continue  # applied by the endpoint (it knows the prompt length)
        if field not in req.model_fields_set and getattr(req, field, None) is None:
            setattr(req, field, value)
