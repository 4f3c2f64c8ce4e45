"""Train an EAGLE draft head (pagoda.models.eagle) for a target model, on the CPU.

Data: the target's own answers to chat, summarization/extraction and code prompts built from
an offline text corpus (self-distillation: EAGLE trains best on what the target generates),
plus plain windows of the corpus. The target (pagoda's forward on its weights) gives every
sequence's features f_i (what its lm_head reads). The head learns
f̂_{i+1} = head(embed(token_{i+1}), f_i) with EAGLE's loss: SmoothL1(f̂_{i+1}, f_{i+1})
+ 0.1 * cross-entropy of lm_head(f̂_{i+1}) against the target's distribution lm_head(f_{i+1})
(over a sample of positions a step: the vocabulary projection dominates the CPU cost), with
uniform noise on the input features (EAGLE's augmentation). AdamW, cosine decay.

Writes HEAD_DIR (config.json: the target's config with one layer; model.safetensors: fc.weight,
layers.0.* in HF names, no input norm on layer 0), checks that pagoda's EagleHead loaded from
it computes what was trained, and reports top-1 agreement on held-out text.

    python benchmarks/spec_decode/train_eagle.py --out /tmp/eagle-smollm2 \\
        --corpus /tmp/q46/pydocs/calib.txt --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CHAT = [
    "What are three tips for staying focused while studying?",
    "Explain how a rainbow forms.",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea.",
    "How do vaccines work? Keep it short.",
    "What should I pack for a weekend hiking trip?",
    "Explain what inflation is in simple words.",
    "Why is the sky blue?",
    "Give three ideas for a birthday party for a seven-year-old.",
    "How can I improve my handwriting?",
    "What is photosynthesis?",
    "Write a polite email asking my manager for a day off.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
    "How do I make a good cup of tea?",
    "Explain what a computer virus is.",
    "What are some good habits for saving money?",
    "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright?",
    "What is the capital of Australia and why is it not Sydney?",
    "Suggest five names for a pet cat.",
    "Explain gravity to a child.",
    "How do I prepare for a job interview?",
    "What is machine learning?",
    "Write a thank-you note to a teacher.",
    "How do plants know which way is up?",
    "What causes earthquakes?",
    "List four ways to reduce plastic waste.",
    "What is the difference between a virus and a bacterium?",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text file",
    "merges two sorted lists",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list while keeping the order",
    "parses a CSV line into a dictionary",
    "finds the most common element in a list",
    "converts Celsius to Fahrenheit",
    "flattens a nested list",
    "validates an email address with a regular expression",
    "reads a JSON file and returns the keys",
    "computes the factorial of a number iteratively",
    "groups a list of words by their first letter",
    "checks whether a string is a palindrome",
    "sorts a list of dictionaries by a key",
]
TEMPLATES = [
    "Summarize this text in two sentences:\n\n{p}",
    "Extract the key terms from this text as a list:\n\n{p}",
    "Explain this to a beginner:\n\n{p}",
    "What are the main points of this text?\n\n{p}",
]


def paragraphs(text: str, lo: int = 200, hi: int = 700) -> list[str]:
    paras = [re.sub(r"\s+", " ", p).strip() for p in text.split("\n\n")]
    return [p for p in paras if lo <= len(p) <= hi]


def build_prompts(corpus: str, n: int, rng: random.Random) -> list[str]:
    paras = paragraphs(corpus)
    prompts = list(CHAT)
    prompts += [f"Write a Python function that {t}." for t in CODE_TASKS]
    prompts += [f"Write a Python function that {t}, with type hints and a docstring." for t in
                CODE_TASKS[::2]]  # fmt: skip
    while len(prompts) < n:
        prompts.append(rng.choice(TEMPLATES).format(p=rng.choice(paras)))
    rng.shuffle(prompts)
    return prompts[:n]


class HeadTrainer(nn.Module):
    """The head in plain (differentiable) torch, HF decoder-layer names: what EagleHead runs."""

    def __init__(self, cfg: dict, qkv_bias: bool) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.nh, self.nkv = (
            cfg["num_attention_heads"],
            cfg.get("num_key_value_heads") or (cfg["num_attention_heads"]),
        )
        self.d = cfg.get("head_dim") or h // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0
        )
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.q_proj = nn.Linear(h, self.nh * self.d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=False)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # [T, n, d]
        inv = 1.0 / (self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
        ang = pos.float()[:, None] * inv[None]  # [T, d/2]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t = emb.shape[0]
        x = self.fc(torch.cat((emb, feat), dim=-1))  # [T, H]; layer 0 has no input norm
        q = self.rope(self.q_proj(x).view(t, self.nh, self.d), pos)
        k = self.rope(self.k_proj(x).view(t, self.nkv, self.d), pos)
        v = self.v_proj(x).view(t, self.nkv, self.d)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )  # [nh, T, d]
        r = x + self.o_proj(a.transpose(0, 1).reshape(t, -1))
        n = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps)
        n = n * self.post_attention_layernorm
        return r + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(self, name)
            out[f"layers.0.self_attn.{name}.weight"] = lin.weight
            if lin.bias is not None:
                out[f"layers.0.self_attn.{name}.bias"] = lin.bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"layers.0.mlp.{name}.weight"] = getattr(self, name).weight
        out["layers.0.post_attention_layernorm.weight"] = self.post_attention_layernorm
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def target_config_dict(llm) -> dict:
    cfg = llm.llm_engine.core.runner.model_config.hf_config
    if hasattr(cfg, "transformers_config"):
        cfg = cfg.transformers_config()
    d = cfg.to_dict()
    d = d.get("text_config", d) if isinstance(d.get("text_config"), dict) else d
    d.pop("quantization_config", None)
    d["num_hidden_layers"] = 1
    d["architectures"] = ["LlamaForCausalLM" if d.get("model_type") == "llama" else
                          "Qwen2ForCausalLM"]  # fmt: skip
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=None, help="model path (default: embedded SmolLM2)")
    p.add_argument("--out", required=True, help="head directory to write")
    p.add_argument("--corpus", required=True, help="text file (benchmarks/quant/prepare_...)")
    p.add_argument("--heldout", default=None, help="text file for the agreement check")
    p.add_argument("--prompts", type=int, default=160, help="self-distillation prompts")
    p.add_argument("--gen-tokens", type=int, default=192, help="max tokens per answer")
    p.add_argument("--doc-tokens", type=int, default=20000, help="plain corpus tokens")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--window", type=int, default=256, help="tokens per training step")
    p.add_argument("--ce-positions", type=int, default=48, help="CE positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.1, help="uniform feature noise (x std)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rng = random.Random(ns.seed)
    torch.manual_seed(ns.seed)
    t0 = time.perf_counter()

    from safetensors.torch import save_file

    from pagoda import LLM, SamplingParams

    llm = LLM(ns.target, max_model_len=2048, print_memory_report=False)
    target = llm.llm_engine.core.runner.model
    tok = llm.get_tokenizer()
    corpus = Path(ns.corpus).read_text(encoding="utf-8", errors="replace")

    # 1. self-distillation: the target answers; half greedy, half sampled
    prompts = build_prompts(corpus, ns.prompts, rng)
    msgs = [[{"role": "user", "content": q}] for q in prompts]
    seqs: list[list[int]] = []
    for i, temp in enumerate((0.0, 0.7)):
        part = msgs[i::2]
        params = SamplingParams(temperature=temp, max_tokens=ns.gen_tokens, seed=ns.seed)
        outs = llm.chat(part, params, use_tqdm=True)
        seqs += [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    n_gen = sum(len(s) for s in seqs)
    print(f"self-distillation: {len(seqs)} sequences, {n_gen} tokens, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    # 2. plain corpus windows
    ids = tok(corpus[: ns.doc_tokens * 8])["input_ids"][: ns.doc_tokens]
    seqs += [ids[i : i + 512] for i in range(0, len(ids) - 64, 512)]

    # 3. the target's features (post-norm: what lm_head reads)
    feats: list[torch.Tensor] = []
    with torch.no_grad():
        for j, s in enumerate(seqs):
            x = torch.tensor(s)
            feats.append(target(x, torch.arange(len(s)), None).float().clone())
            if j % 50 == 0:
                print(f"features {j}/{len(seqs)}", flush=True)
    print(f"features: {sum(len(s) for s in seqs)} tokens, {time.perf_counter() - t0:.0f} s",
          flush=True)  # fmt: skip
    emb_w = target.model.embed_tokens.weight.detach().float()
    head_w = target.lm_head.weight.detach().float() if hasattr(target.lm_head, "weight") else None
    if head_w is None:
        raise SystemExit("the target's lm_head has no dense weight")

    cfg = target_config_dict(llm)
    qkv_bias = cfg.get("model_type") == "qwen2"
    head = HeadTrainer(cfg, qkv_bias)
    with torch.no_grad():  # start near "copy the embedding": fc = [I, 0]
        h = cfg["hidden_size"]
        head.fc.weight.zero_()
        head.fc.weight[:, :h] += torch.eye(h) * 0.5
        head.fc.weight[:, h:] += torch.eye(h) * 0.5
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
    opt = torch.optim.AdamW(head.parameters(), lr=ns.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / ns.steps)),
    )
    weights = [max(0, len(s) - 2) for s in seqs]
    feat_std = float(torch.cat(feats[:50]).std())
    t_train = time.perf_counter()
    ema = None
    for step in range(ns.steps):
        i = rng.choices(range(len(seqs)), weights=weights)[0]
        s, f = seqs[i], feats[i]
        n = min(ns.window, len(s) - 1)
        a = rng.randrange(0, len(s) - n)
        tokens = torch.tensor(s[a + 1 : a + n + 1])  # token_{i+1}
        f_in = f[a : a + n - 1]  # f_i ... (the last entry has no target feature)
        f_out = f[a + 1 : a + n]  # f_{i+1}
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * ns.noise * feat_std
        pred = head(emb_w[tokens[: n - 1]], f_in, torch.arange(a, a + n - 1))
        vloss = F.smooth_l1_loss(pred, f_out)
        sel = torch.randperm(n - 1)[: ns.ce_positions]
        with torch.no_grad():
            target_p = F.softmax(f_out[sel] @ head_w.T, dim=-1)
        logp = F.log_softmax(pred[sel] @ head_w.T, dim=-1)
        ploss = -(target_p * logp).sum(-1).mean()
        loss = vloss + 0.1 * ploss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        sched.step()
        with torch.no_grad():
            acc = float((logp.argmax(-1) == target_p.argmax(-1)).float().mean())
        cur = (float(vloss), float(ploss), acc)
        ema = cur if ema is None else tuple(0.98 * e + 0.02 * c for e, c in zip(ema, cur))
        if step % 100 == 0 or step == ns.steps - 1:
            el = time.perf_counter() - t_train
            print(f"step {step}/{ns.steps} vloss {ema[0]:.4f} ploss {ema[1]:.3f} "
                  f"top1 {ema[2]:.3f} ({el:.0f} s)", flush=True)  # fmt: skip

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(head.state_dict_hf(), str(out / "model.safetensors"))
    summary = dict(
        target=ns.target or "SmolLM2-135M-Instruct (embedded GGUF)",
        sequences=len(seqs),
        tokens=sum(len(s) for s in seqs),
        self_distilled_tokens=n_gen,
        steps=ns.steps,
        final=dict(vloss=ema[0], ploss=ema[1], top1=ema[2]),
        wall_s=time.perf_counter() - t0,
    )

    # pagoda's EagleHead from the written directory computes what was trained
    from pagoda.config import ModelConfig
    from pagoda.model_files import ModelSource, load_hf_config
    from pagoda.models.eagle import load_eagle_head

    hf = load_hf_config(ModelSource("hf_dir", str(out), out.name))
    mc = ModelConfig(model=str(out), hf_config=hf, dtype="float32", max_model_len=2048)
    loaded = load_eagle_head(mc, torch.device("cpu"), None)
    s, f = seqs[0], feats[0]
    n = min(64, len(s) - 1)
    with torch.no_grad():
        tokens = torch.tensor(s[1 : n + 1])
        want = head(emb_w[tokens], f[:n], torch.arange(n))
        got = loaded(target.model.embed_tokens(tokens).float(), f[:n], torch.arange(n), None)
    err = float((want - got).abs().max())
    print(f"pagoda EagleHead vs trained module: max |diff| {err:.2e}", flush=True)
    assert err < 1e-3 * max(1.0, float(want.abs().max())), "the written head differs"

    if ns.heldout:  # top-1 agreement with the target's next-next token, held-out text
        text = Path(ns.heldout).read_text(encoding="utf-8", errors="replace")
        hids = tok(text[:40000])["input_ids"][:4096]
        hits = total = 0
        with torch.no_grad():
            for a in range(0, len(hids) - 256, 512):
                s = hids[a : a + 512]
                f = target(torch.tensor(s), torch.arange(len(s)), None).float()
                pred = loaded(target.model.embed_tokens(torch.tensor(s[1:])).float(),
                              f[:-1], torch.arange(len(s) - 1), None)  # fmt: skip
                hits += int(((pred @ head_w.T).argmax(-1) == (f[1:] @ head_w.T).argmax(-1)).sum())
                total += len(s) - 1
        summary["heldout_top1"] = hits / total
        print(f"held-out top-1 agreement with the target: {hits / total:.3f}", flush=True)
    (out / "training.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
