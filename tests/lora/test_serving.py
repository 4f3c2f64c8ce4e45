"""Unmerged LoRA serving: one batch mixing two adapters and the base model equals merged models.

References are transformers' greedy outputs of the directories `merge_lora` writes (themselves
checked against PEFT in test_merge.py). Variants force one device slot (adapters evicted and
reloaded between steps) and chunked prefill; identical prompts under different adapters must
not share prefix-cache blocks. Also: the scheduler's adapter limit and bad-input errors.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("peft")

from pagoda import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagoda.lora.merge import merge_lora  # noqa: E402
from tests.helpers import hf_greedy, save_tiny_model  # noqa: E402
from tests.lora.adapters import make_adapter  # noqa: E402

MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("serve")
    base = save_tiny_model("qwen2", root / "base")
    make_adapter(base, root / "a1", seed=11)
    make_adapter(
        base,
        root / "a2",
        seed=12,
        r=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )
    for name in ("a1", "a2"):
        merge_lora(base, root / name, root / f"merged-{name}", progress=False)
    rng = random.Random(0)
    shared = [rng.randrange(3, 384) for _ in range(20)]  # > one 16-token block
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 23, 9, 31)]
    prompts += [shared, shared, shared]
    adapters = [None, "a1", "a2", "a1", "a1", "a2", None]
    references = {}
    for name, path in ((None, base), ("a1", root / "merged-a1"), ("a2", root / "merged-a2")):
        mine = [p for p, a in zip(prompts, adapters, strict=True) if a == name]
        references[name] = iter(hf_greedy(path, mine, MAX_NEW)[0])
    expected = [next(references[a]) for a in adapters]
    return root, base, prompts, adapters, expected


VARIANTS = {
    "two-slots": dict(max_loras=2),
    "one-slot-chunked": dict(max_loras=1, max_num_batched_tokens=16),
    # Triton kernels, CUDA-graph decode (per-token slots, padded batch) and eager prefill
    "cuda": dict(max_loras=2, device="cuda"),
}


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=[pytest.mark.gpu] if v == "cuda" else []) for v in VARIANTS]
)
def test_mixed_batch_equals_merged_models(setup, variant: str) -> None:
    root, base, prompts, adapters, expected = setup
    options = {"device": "cpu", **VARIANTS[variant]}
    llm = LLM(
        str(base),
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        print_memory_report=False,
        gpu_memory_utilization=0.3,
        **options,
    )
    requests = {
        "a1": LoRARequest("a1", 1, str(root / "a1")),
        "a2": LoRARequest("a2", 2, str(root / "a2")),
        None: None,
    }
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=[requests[a] for a in adapters],
    )
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    # the three copies of the shared prompt run under three different adapters
    assert len({tuple(t) for t in got[4:]}) == 3


def test_errors(setup, tmp_path: Path) -> None:
    root, base, *_ = setup
    params = SamplingParams(max_tokens=2)
    plain = LLM(str(base), device="cpu", dtype="float32", print_memory_report=False)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[5, 6, 7]], params, lora_request=LoRARequest("a1", 1, str(root / "a1")))

    llm = LLM(
        str(base),
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_lora_rank=4,
        print_memory_report=False,
    )
    with pytest.raises(ValueError, match="rank 8.*max_lora_rank=4"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("a2", 2, str(root / "a2")))
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 lora requests for 1 prompts"):
        llm.generate([[5, 6, 7]], params, lora_request=[None, None])
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate([[5, 6, 7]], params, lora_request=str(root / "a1"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("x", 3, str(tmp_path / "x")))

    make_adapter(
        base, tmp_path / "head", seed=13, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    with pytest.raises(ValueError, match="pagoda lora merge"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("h", 4, str(tmp_path / "head")))
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("zero", 0, str(root / "a1"))
    # the same id under another path is a different adapter: refused
    llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("a1", 1, str(root / "a1")))
    with pytest.raises(ValueError, match="already registered"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("a1", 1, str(tmp_path)))


def test_scheduler_admits_at_most_max_loras_adapters() -> None:
    from pagoda.config import SchedulerConfig
    from pagoda.engine.kv_cache_manager import KVCacheManager
    from pagoda.engine.request import Request
    from pagoda.engine.scheduler import Scheduler

    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, max_loras=2
    )
    scheduler = Scheduler(config, KVCacheManager(num_blocks=64, block_size=16, enable_caching=True))
    keys = ["lora:1", None, "lora:2", "lora:1", "lora:3", None]
    for i, key in enumerate(keys):
        scheduler.add_request(
            Request(str(i), [3, 4, 5], SamplingParams(max_tokens=4), lora_key=key)
        )
    out = scheduler.schedule()
    # request 4 (a third adapter) waits, and so does everything behind it (FCFS)
    assert [s.req_id for s in out.scheduled] == ["0", "1", "2", "3"]
    assert [s.lora_key for s in out.scheduled] == ["lora:1", None, "lora:2", "lora:1"]
    assert scheduler.num_waiting == 2
