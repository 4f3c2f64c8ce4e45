"""A chat with image parts under a text-only chat template (one that adds `message['content']`
to a string) renders the image placeholders inline instead of failing with a TypeError."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda import LLM, SamplingParams
from tests.models.test_qwen2_5_vl import _conversation, save_tiny_vl

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen2.5-tokenizer"


def test_image_parts_under_a_text_only_template(tmp_path):
    save_tiny_vl(tmp_path / "vl")
    template = json.loads((FIXTURE / "tokenizer_config.json").read_text())["chat_template"]
    assert "+ message['content'] +" in template  # the template concatenates strings
    llm = LLM(
        str(tmp_path / "vl"),
        dtype="float32",
        device="cpu",
        max_model_len=512,
        limit_mm_per_prompt={"image": 2},
        print_memory_report=False,
    )
    conv = _conversation(["a", "b"], "What is in the pictures?")
    processor = llm.llm_engine.input_processor
    media: list = []
    text = processor.render_chat(conv, chat_template=template, media=media)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text.count(placeholder) == 2 and [kind for kind, _ in media] == ["image"] * 2
    assert text.startswith("<|im_start|>user\n" + placeholder + "\n" + placeholder)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = llm.chat(conv, greedy, chat_template=template, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    runs = "".join("x" if t == pad else " " for t in out.prompt_token_ids).split()
    assert len(runs) == 2 and all(len(r) > 1 for r in runs)  # each image expanded to its tokens
    llm.shutdown()
