"""Writing a quantized checkpoint (staged directory renamed when complete, safetensors shards
with an index, config and the source's tokenizer files), and reading one back dequantized.

The packing itself is the format's (`pagoda.quant.formats.compressed_tensors`); this is the
quantizer's file handling around it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagoda.models.loader import iter_safetensors_weights
from pagoda.models.registry import architectures_of
from pagoda.quant.dequant import dequantize_weight
from pagoda.quant.formats.compressed_tensors import decompress
from pagoda.quant.scheme import parse_quantization_config

_SHARD_BYTES = 4 * 1024**3  # larger checkpoints are split, with a safetensors index
# Files a model directory needs besides weights and config (tokenizer, processor, templates).
_COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "generation_config.json",
)


def dequantized_state_dict(
    model_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized checkpoint with quantized modules turned back into `weight`.

    Used to compare a quantized model with the same weights served unquantized.
    """

    config = json.loads((Path(model_dir) / "config.json").read_text())
    plan = parse_quantization_config(config["quantization_config"])
    raw = dict(iter_safetensors_weights(model_dir))
    suffixes = (
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_g_idx",
    )
    modules = {name.rsplit(".", 1)[0] for name in raw if name.endswith(".weight_scale")}
    result = {
        name: t.to(dtype) if t.is_floating_point() else t
        for name, t in raw.items()
        if name.rsplit(".", 1)[0] not in modules or not name.endswith(suffixes + ("weight",))
    }
    for module in sorted(modules):
        choice = plan.args_for(module)
        if choice is None:
            raise ValueError(f"{model_dir}: {module} has quantized tensors but no config group")
        args, fmt = choice
        local = {k.rsplit(".", 1)[1]: v for k, v in raw.items() if k.rsplit(".", 1)[0] == module}
        qw, g_idx = decompress(local, args, fmt)
        result[f"{module}.weight"] = dequantize_weight(
            qw.qweight, qw.scale, qw.zero_point, qw.group_size, g_idx, dtype
        )
    return result


# ---------------------------------------------------------------- writing


def check_output_dir(out_dir: str | os.PathLike[str]) -> Path:
    """`out_dir` resolved; an error if it exists and is not an empty directory."""
    out = Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not empty; choose another output directory")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_stale_staging(parent: Path) -> list[Path]:
    """Remove `.NAME.incomplete-PID` directories whose process is gone (a run killed hard)."""
    removed = []
    for d in parent.glob(".*.incomplete-*"):
        pid = d.name.rpartition(".incomplete-")[2]
        if d.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            print(f"note: removed {d} (left by an interrupted run)", file=sys.stderr)
    return removed


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def staged_directory(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary sibling of `out_dir`, renamed to it only if the block completes.

    SIGTERM unwinds like Ctrl-C while the block runs, so the temporary directory is removed;
    ones left by a process killed harder (SIGKILL, power loss) are swept on the next run.
    """
    out = check_output_dir(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_staging(out.parent)
    tmp = out.parent / f".{out.name}.incomplete-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if on_main else None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)


def save_safetensors(
    tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = _SHARD_BYTES
) -> list[str]:
    """Write `tensors` as model.safetensors, or shards plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    total = 0
    for file, shard in zip(names, shards):
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def copy_model_files(source_dir: str | os.PathLike[str] | None, directory: Path) -> list[str]:
    """Copy tokenizer / processor / chat-template / generation files that exist in the source."""
    copied = []
    if source_dir is None:
        return copied
    for name in _COPIED_FILES:
        src = Path(source_dir) / name
        if src.is_file() and not (directory / name).exists():
            shutil.copy2(src, directory / name)
            copied.append(name)
    return copied


def write_config(
    hf_config: Any, quant_config: dict[str, Any], directory: Path, dtype: torch.dtype
) -> None:
    """config.json of the source model with `quantization_config` and the stored dtype."""

    config = hf_config.to_dict()
    if not config.get("architectures"):  # GGUF configs have none; transformers needs it
        config["architectures"] = architectures_of(hf_config)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config["quantization_config"] = quant_config
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
