"""`pagoda.quantizer.quantize(...)`: a model directory or GGUF file in, a compressed-tensors dir
out.

Validates the request at the edge (scheme, method, act-order, group size against every layer,
architecture, calibration data), runs the sequential pipeline, and writes config.json with
`quantization_config`, the safetensors weights, the tokenizer / processor / chat-template files
and `quantization_report.json` into a temporary directory that is renamed when complete.

Vision-language models (Qwen2.5-VL, Qwen2-VL): the text decoder is quantized with text-only
calibration, the vision tower (`visual.*`, merger included) always stays as it is (added to the
ignore list with a note when `ignore` does not cover it), tensors keep the input checkpoint's
names, and `quantization_config.ignore` lists every dense linear module by name, lm_head
included when it stays dense, as llmcompressor writes it.

lm_head is quantized like the decoder's linears when `ignore` does not cover it and the
embeddings are untied (GPTQ calibrates it on the final-norm outputs of the quantized decoder);
a tied head stays dense, with a warning, and `lm_head` is then added to the written `ignore`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.config import ModelConfig, MultiModalConfig, normalize_dtype
from pagoda.model_files import (
    load_hf_config,
    load_tokenizer,
    quantization_config,
    resolve_model,
)
from pagoda.models.registry import architectures_of, get_model_class
from pagoda.multimodal.image_processor import ImageProcessorConfig
from pagoda.multimodal.processor import MultiModalProcessor
from pagoda.platform import cpu_has_bf16_gemm, resolve_device
from pagoda.quant.formats.autoawq import quantization_config as autoawq_quant_config
from pagoda.quant.fp8 import FP8_SCHEMES, kv_cache_scheme_json
from pagoda.quant.fp8 import quantization_config as fp8_quant_config
from pagoda.quant.schemes import SCHEMES, scheme_args
from pagoda.quant.schemes import quantization_config as make_quant_config
from pagoda.quantizer.awq import AWQOptions
from pagoda.quantizer.calibration import check_calibration_file, load_calibration_data
from pagoda.quantizer.checkpoint import (
    check_output_dir,
    copy_model_files,
    save_safetensors,
    staged_directory,
    write_config,
)
from pagoda.quantizer.pipeline import (
    FORMATS,
    METHODS,
    QUANTIZABLE_ARCHITECTURES,
    PipelineOptions,
    QuantizeReport,
    WeightSource,
    check_group_size,
    check_ignore_matches,
    decoder_of,
    default_group_size,
    dense_module_names,
    is_ignored,
    layer_targets,
    linear_module_names,
    quantize_layers,
    quantizes_lm_head,
)

_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _storage_dtype(dtype: str, hf_config: Any) -> torch.dtype:
    name = normalize_dtype(dtype)
    if name == "auto":
        text = getattr(hf_config, "text_config", None) or hf_config
        cfg = None
        # VL configs keep the dtype at the top level; their text_config's is usually None.
        for c in (text, hf_config):
            # `dtype` only: reading `torch_dtype` makes transformers print a deprecation line.
            cfg = cfg or getattr(c, "dtype", None)
        name = normalize_dtype(cfg) if cfg is not None else "bfloat16"
        if name == "auto":
            name = "bfloat16"
    return getattr(torch, name)


def calibration_dtype(device: torch.device, storage_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the calibration forward passes: the checkpoint's on a GPU; on a CPU the
    checkpoint's bf16 where the CPU multiplies bf16 natively (about 4x its float32 GEMM, and
    the numerics the model is served with), else float32 (emulated half types are slower)."""
    if device.type != "cpu":
        return storage_dtype
    if storage_dtype == torch.bfloat16 and cpu_has_bf16_gemm():
        return torch.bfloat16
    return torch.float32


def dataset_record(dataset: str | os.PathLike[str]) -> dict[str, Any]:
    """Path and SHA-256 of the calibration file, for the report (fails early if missing)."""
    path = Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: calibration file not found")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"path": str(path.resolve()), "sha256": digest.hexdigest(), "bytes": path.stat().st_size}


def _keep_vision_dense(skeleton: torch.nn.Module, arch: str, ignore: list[str]) -> list[str]:
    """`ignore` plus the vision linears it does not cover, with a note saying so.

    The pipeline quantizes the text decoder; the vision tower is never quantized (as in
    llmcompressor's Qwen2.5-VL examples, which all ignore `re:.*visual.*`). Without an ignore
    rule for it the tower would still be left dense, but a checkpoint whose config claimed it
    quantized would not load, so the rule is added for the user.
    """
    _, decoder_name = decoder_of(skeleton)
    outside = [
        n
        for n in linear_module_names(skeleton)
        if n != "lm_head" and not n.startswith(f"{decoder_name}.")
    ]
    missing = [n for n in outside if not is_ignored(skeleton, n, ignore)]
    if not missing:
        return ignore
    print(
        f"note: {arch}: the vision tower is kept unquantized; "
        f"{len(missing)} of its {len(outside)} linear modules were not matched by the ignore "
        "list, so they are ignored too (pass --ignore 're:.*visual.*' to say so explicitly)",
        file=sys.stderr,
    )
    return [*ignore, *missing]


def _modules_to_not_convert(skeleton: torch.nn.Module, ignore: list[str]) -> list[str] | None:
    """AutoAWQ's `modules_to_not_convert` (matched as substrings of module names by vLLM,
    transformers and pagoda): every dense linear by name, lm_head left implicit (AutoAWQ never
    quantizes it) and a vision tower as the one entry "visual", as AutoAWQ writes it."""
    names = [n for n in dense_module_names(skeleton, ignore) if n != "lm_head"]
    short = [n for n in names if ".visual." not in f".{n}"]
    if len(short) < len(names):
        short.append("visual")
    return short or None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _image_config(model_path: str, hf_config: Any) -> ImageProcessorConfig:
    return ImageProcessorConfig.from_model(model_path, hf_config.vision_config, {})


def _calibration_processor(model_path: str, hf_config: Any, tokenizer: Any) -> MultiModalProcessor:
    """The serving path's image / video processor, with no per-prompt media limit (a
    calibration record holds what it holds; `max_seq_len` truncates the sample)."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    limit = 1 << 16
    mm_config = MultiModalConfig(limit_per_prompt=limit, video_limit_per_prompt=limit)
    max_len = getattr(text_config, "max_position_embeddings", None) or 1 << 20
    return MultiModalProcessor.from_model(model_path, hf_config, tokenizer, mm_config, max_len)


def quantize(
    model: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    scheme: str | None = None,
    method: str | None = None,
    group_size: int | None = None,
    ignore: list[str] | None = None,
    dataset: str | os.PathLike[str] | None = None,
    num_samples: int = 256,
    max_seq_len: int = 2048,
    seed: int = 0,
    dampening: float = 0.01,
    block_size: int = 128,
    actorder: str | None = "static",
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
    gptq_scales: str = "first_touch",
    format: str = "compressed-tensors",
    kv_cache_dtype: str | None = None,
    text_only_calibration: bool = False,
    awq_clip: bool = False,
    loss_weighted_hessians: bool = False,
    refine_steps: int = 0,
) -> QuantizeReport:
    """Quantize `model` (HF directory, .gguf file, or None for the embedded SmolLM2).

    `ignore`: module names or `re:` patterns (matched at the start of the dotted name) kept
    unquantized (default `["lm_head"]`). `lm_head` is quantized too when `ignore` does not
    cover it, unless it is tied to the embeddings (then it stays dense, with a warning on
    stderr and a note in the report). For vision-language models names match in
    either spelling (`model.language_model.layers.0...` / `model.layers.0...`, `model.visual...`
    / `visual...`) and the vision tower is always kept (see `_keep_vision_dense`).
    `dataset="random"` draws random token ids (timing runs); a `config:PATH.json` model gets
    deterministic random weights. `group_size`: None takes 128, or the largest of 64 / 32
    that divides every quantized layer's input (a note on stderr says so). `dtype`: what the
    checkpoint stores (scales, unquantized tensors); "auto" takes the model's dtype (bfloat16
    when it has none). `gptq_scales`:
    "first_touch" (a group's scale from the error-updated weights when GPTQ reaches it) or
    "upfront" (from the original weights). `scheme`: default W4A16 (symmetric) for GPTQ
    and RTN, W4A16_ASYM for AWQ (scales and clipping, then RTN). `format`:
    "compressed-tensors", or "autoawq" (AutoAWQ's GEMM layout, 4-bit, lm_head dense, float16
    scales). FP8 schemes: "FP8_DYNAMIC" (no calibration data needed) and "FP8" (static
    activation scales from `dataset`), min-max rounded as llmcompressor's QuantizationModifier
    does (`method` "rtn", the default for them). `kv_cache_dtype="fp8"`: calibrate per-layer
    K / V scales on `dataset` and write compressed-tensors' `kv_cache_scheme`.
    Vision-language models see the images and videos of `dataset`'s chats through their
    (unquantized) vision tower, so the decoder's statistics include the image tokens;
    `text_only_calibration` drops them and calibrates on the text alone. `awq_clip`: AWQ
    also searches per-group weight clipping (see `AWQOptions.clip` for why it is off).
    `loss_weighted_hessians` (GPTQ, text samples): each calibration token's term in a linear's
    Hessian is weighted by ||dL/dy||², the float model's next-token loss gradient at that
    linear's output (`pagoda.quantizer.guided`; one transformers backward pass per sample,
    the whole model in memory).
    `refine_steps` (GPTQ or RTN, calibration data): after a layer's linears are rounded, that
    many signed-gradient steps on each weight's rounding against the float layer's output
    (`pagoda.quantizer.refine`), kept only where the layer's output error falls.
    """
    start = time.perf_counter()
    fp8 = scheme is not None and scheme.upper() in FP8_SCHEMES
    if method is None:
        method = "rtn" if fp8 else "gptq"
    if fp8 and method != "rtn":
        raise ValueError(
            f"scheme {scheme} is min-max rounded (as llmcompressor's QuantizationModifier); "
            f"method={method!r} does not apply to it: use method 'rtn' or leave it unset"
        )
    if loss_weighted_hessians and (method != "gptq" or dataset in (None, "random")):
        raise ValueError("loss_weighted_hessians applies to method 'gptq' with a text dataset")
    if refine_steps < 0:
        raise ValueError(f"refine_steps must be >= 0, got {refine_steps}")
    if refine_steps and (method == "awq" or fp8 or dataset is None):
        raise ValueError(
            "refine_steps applies to methods 'gptq' and 'rtn' of integer schemes with a dataset"
        )
    if awq_clip and method != "awq":
        raise ValueError(f"awq_clip applies to method 'awq', not {method!r}")
    if fp8 and format != "compressed-tensors":
        raise ValueError(f"scheme {scheme} is written as compressed-tensors only")
    if kv_cache_dtype not in (None, "fp8", "fp8_e4m3"):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: pagoda calibrates 'fp8' (e4m3) K/V scales only"
        )
    if kv_cache_dtype is not None and (dataset is None or format != "compressed-tensors"):
        raise ValueError(
            "kv_cache_dtype='fp8' calibrates K/V scales: pass dataset, compressed-tensors format"
        )
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not supported; use one of {', '.join(METHODS)}")
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not supported; use one of {', '.join(FORMATS)}")
    awq = method == "awq"
    if scheme is None:
        scheme = "W4A16_ASYM" if awq else "W4A16"
    if scheme.upper() not in SCHEMES and not fp8:
        names = ", ".join([*SCHEMES, *FP8_SCHEMES])
        raise ValueError(f"scheme {scheme!r} is not supported; use one of {names}")
    if actorder in ("none", "None", ""):
        actorder = None
    auto_group = group_size is None
    if auto_group:
        group_size = 128  # until the model's shapes are known (below)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an integer or None (auto), got {group_size!r}")
    if not 0 <= dampening < 1:
        raise ValueError(f"dampening must be in [0, 1), got {dampening}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    # Act-order changes the order GPTQ visits columns; RTN has no order.
    if fp8:
        args = FP8_SCHEMES[scheme.upper()]
        if args.static_input and dataset is None:
            raise ValueError(
                "scheme FP8 has static activation scales: pass dataset to calibrate them "
                "(or use FP8_DYNAMIC, which needs none)"
            )
    else:
        args = scheme_args(scheme, group_size, actorder if method == "gptq" else None)
    ignore = list(ignore if ignore is not None else ["lm_head"])
    user_ignore = list(ignore)
    if method == "gptq" and dataset is None:
        raise ValueError("GPTQ needs calibration data: pass dataset (a .json, .jsonl or .txt file)")
    if awq and dataset is None:
        raise ValueError("AWQ needs calibration data: pass dataset (a .json, .jsonl or .txt file)")
    if format == "autoawq" and args.num_bits != 4:
        raise ValueError(f"format='autoawq' stores 4-bit weights only; scheme {scheme} has 8")
    # Cheap checks first: a wrong --out or --dataset must not cost a model load.
    check_output_dir(out_dir)
    dataset_info = None
    remote_images = 0
    if dataset is not None and dataset != "random":
        dataset_info = dataset_record(dataset)
        # format, a usable sample, decodable images: before the model costs a load
        remote_images = check_calibration_file(dataset).images_remote

    source = resolve_model(model)
    hf_config = load_hf_config(source)
    architectures = architectures_of(hf_config)
    arch = architectures[0] if architectures else getattr(hf_config, "model_type", "?")
    if arch not in QUANTIZABLE_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch} cannot be quantized yet; supported: "
            f"{', '.join(QUANTIZABLE_ARCHITECTURES)}"
        )
    if quantization_config(hf_config) is not None:
        raise ValueError(f"{source.path} is already quantized (it has a quantization_config)")
    dev = resolve_device(device)
    storage_dtype = _storage_dtype(dtype, hf_config)
    compute_dtype = calibration_dtype(dev, storage_dtype)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    model_config = ModelConfig(
        model=source.path,
        hf_config=hf_config,
        dtype=str(compute_dtype).removeprefix("torch."),
        max_model_len=getattr(text_config, "max_position_embeddings", None) or 4096,
        load_format="gguf" if source.kind == "gguf" else "safetensors",
        gguf_file=source.path if source.kind == "gguf" else None,
    )
    model_cls = get_model_class(architectures)
    with _default_dtype(compute_dtype), torch.device("meta"):
        skeleton = model_cls(hf_config)
    vision_language = hasattr(skeleton, "visual")
    if vision_language:
        if source.kind == "gguf":
            raise ValueError(f"{arch} from a GGUF file cannot be quantized; use the HF directory")
        ignore = _keep_vision_dense(skeleton, arch, ignore)
    check_ignore_matches(skeleton, ignore, user_ignore)
    if fp8:
        if quantizes_lm_head(skeleton, ignore):
            raise ValueError(f"scheme {scheme} keeps lm_head dense; drop --quantize-lm-head")
    else:
        if auto_group:
            group_size = default_group_size(skeleton, ignore)
            if group_size != 128:
                # e.g. SmolLM2's hidden size 576 = 9 x 64: 128 does not divide it
                print(
                    f"note: {arch}: group size {group_size}, the largest of 128/64/32 that "
                    "divides every quantized layer's input (pass --group-size to choose)",
                    file=sys.stderr,
                )
                args = scheme_args(scheme, group_size, actorder if method == "gptq" else None)
        check_group_size(skeleton, args, ignore)
    if format == "autoawq" and quantizes_lm_head(skeleton, ignore):
        raise ValueError(
            "format='autoawq' keeps lm_head unquantized (AutoAWQ checkpoints never quantize "
            "it); drop --quantize-lm-head or use the compressed-tensors format"
        )
    for i in range(len(decoder_of(skeleton)[0].layers)):
        for t in layer_targets(skeleton, i, ignore):
            if len(set(t.quantized)) > 1:
                raise ValueError(
                    f"--ignore keeps only some of {', '.join(t.hf_names)} unquantized; pagoda "
                    "serves them as one fused layer, so ignore all of them or none"
                )

    tokenizer = load_tokenizer(source)
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        # VL releases keep the chat template in chat_template.json (the processor's), which
        # AutoTokenizer does not read; serving uses it, so calibration renders chats with it.
        from pagoda.multimodal.processor import _processor_chat_template

        template = _processor_chat_template(source.path if source.kind == "hf_dir" else None)
        if template:
            tokenizer.chat_template = template
    samples: list[torch.Tensor] = []
    num_tokens = num_vision_tokens = 0
    mm_inputs: list[Any] = []
    if dataset == "random":
        # Random token ids: for timing runs (e.g. dummy `config:` models), not for quality.
        g = torch.Generator().manual_seed(seed)
        vocab = text_config.vocab_size
        samples = [torch.randint(0, vocab, (max_seq_len,), generator=g) for _ in range(num_samples)]
        num_tokens = num_samples * max_seq_len
    elif dataset is not None:
        if tokenizer is None:
            raise ValueError(f"{source.path} has no tokenizer to read the calibration data")
        mm_processor = None
        if vision_language and not text_only_calibration:
            if remote_images:
                raise ValueError(
                    f"{dataset}: {remote_images} image(s) are http(s) URLs, which calibration "
                    "does not fetch: save them beside the file and reference the files, or "
                    "pass --text-only-calibration"
                )
            mm_processor = _calibration_processor(source.path, hf_config, tokenizer)
        data = load_calibration_data(
            dataset, tokenizer, num_samples, max_seq_len, seed, mm_processor
        )
        samples, num_tokens = data.samples, data.num_tokens
        mm_inputs, num_vision_tokens = data.mm_inputs, data.num_vision_tokens
    if source.kind == "config":
        weights = WeightSource.dummy(skeleton, seed)
    else:
        # VL release checkpoints name tensors `visual.*` / `model.layers.*`: the pipeline works
        # in module names and writes every tensor back under its checkpoint name.
        rename = getattr(model_cls, "checkpoint_to_module_name", None)
        weights = WeightSource.from_model_config(model_config, rename)

    report = QuantizeReport(
        method=method,
        scheme=scheme.upper(),
        group_size=-1 if fp8 else group_size,
        num_samples=len(samples),
        num_tokens=num_tokens,
        num_vision_tokens=num_vision_tokens,
        device=str(dev),
        calibration_dtype=str(compute_dtype).removeprefix("torch."),
        dataset=dataset_info or ({"path": "random"} if dataset == "random" else None),
        ignore=list(user_ignore),
        seed=seed,
    )
    options = PipelineOptions(
        method=method,
        block_size=block_size,
        dampening=dampening,
        device=dev,
        compute_dtype=compute_dtype,
        storage_dtype=storage_dtype,
        progress=progress,
        gptq_scales=gptq_scales,
        awq=AWQOptions(clip=awq_clip),
        format=format,
        refine_steps=refine_steps,
    )
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    quantize_head = quantizes_lm_head(skeleton, ignore)
    # Text models keep the user's patterns; VL configs list module names, as llmcompressor
    # (compressed-tensors) does, which pagoda and transformers both match against the
    # transformers-5 module names whatever the tensors are called on disk.
    config_ignore = dense_module_names(skeleton, ignore) if vision_language else ignore
    if not quantize_head and not is_ignored(skeleton, "lm_head", ignore):
        # Tied: lm_head is the embedding table, which stays dense; the config must say so,
        # or loaders (pagoda's, compressed-tensors') would look for a quantized lm_head.
        note = (
            f"{arch}: lm_head is tied to the embeddings (tie_word_embeddings), so it is kept "
            "unquantized and listed in quantization_config.ignore"
        )
        print(f"warning: {note}", file=sys.stderr)
        report.notes.append(note)
        if "lm_head" not in config_ignore:
            config_ignore = ["lm_head", *config_ignore]
    token_weights = None
    if loss_weighted_hessians:
        if any(mm is not None for mm in mm_inputs):
            raise ValueError("loss_weighted_hessians supports text-only calibration")
        from pagoda.quantizer.guided import hf_token_weights

        gguf = source.kind == "gguf"
        token_weights = hf_token_weights(
            str(Path(source.path).parent) if gguf else source.path,
            Path(source.path).name if gguf else None,
            samples,
            compute_dtype,
            dev,
        )
    with staged_directory(out_dir) as tmp:
        compressed = quantize_layers(
            skeleton,
            weights,
            samples,
            args,
            ignore,
            options,
            report,
            lm_head=quantize_head,
            kv_cache_scales=kv_cache_dtype is not None,
            mm_inputs=mm_inputs,
            image_config=_image_config(source.path, hf_config) if mm_inputs else None,
            token_weights=token_weights,
        )
        quantized_modules = {name.rsplit(".", 1)[0] for name in compressed}
        state: dict[str, torch.Tensor] = {}
        for name in weights.names():
            if name.endswith(_SKIPPED) or (tied and name.startswith("lm_head.")):
                continue
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in quantized_modules:
                continue
            tensor = weights.get(name)
            stored = tensor.to(storage_dtype) if tensor.is_floating_point() else tensor
            state[weights.checkpoint_name(name)] = stored
        for name, tensor in compressed.items():
            module, _, key = name.rpartition(".")
            # The packed tensors sit where the checkpoint had the module's weight.
            stored_module = weights.checkpoint_name(f"{module}.weight").removesuffix(".weight")
            state[f"{stored_module}.{key}"] = tensor
        save_safetensors(state, tmp)
        if format == "autoawq":
            quant_config = autoawq_quant_config(
                args.group_size, True, _modules_to_not_convert(skeleton, ignore)
            )
        elif fp8:
            quant_config = fp8_quant_config(args, config_ignore)
        else:
            quant_config = make_quant_config(args, config_ignore)
        if kv_cache_dtype is not None:
            quant_config["kv_cache_scheme"] = kv_cache_scheme_json()
        write_config(hf_config, quant_config, tmp, storage_dtype)
        if source.kind == "hf_dir":
            copy_model_files(source.path, tmp)
        if tokenizer is not None and not (tmp / "tokenizer_config.json").exists():
            tokenizer.save_pretrained(str(tmp))  # GGUF sources have no tokenizer files
        report.seconds = time.perf_counter() - start
        (Path(tmp) / "quantization_report.json").write_text(
            json.dumps(report.to_dict(), indent=2) + "\n"
        )
    return report
