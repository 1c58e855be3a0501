#!/usr/bin/env python3
"""Generate the committed parity fixtures under tests/data (tokenizer, tiny models, adapters,
quantized checkpoints and their Hugging Face / PEFT reference outputs).

Why this exists: the C++ engine is checked against transformers + PEFT run in fp32 on the very
same weights. Nothing is downloaded: every model is a tiny random model built from a config, every
tokenizer is trained here on an inline corpus, everything is seeded, so the script runs offline on
the GPU host (torch 2.11, transformers 5.17, peft 0.21) as well as on a CPU-only workstation.
tests/data/README.md documents every file this script writes.

Usage:
    python3 scripts/make_reference.py --out tests/data [--only NAME] [--threads N] [--twins-dir D]

NAME is one of: tokenizer, qwen3_moe, deepseek_v3, kimi_like, qwen3_5_moe, fp8, nvfp4 (repeatable).
The qwen3_moe, qwen3_5_moe and nvfp4 stages copy the tokenizer written by the tokenizer stage, so run that stage first (a full
run does). All computation is fp32 on the CPU, also on a GPU host.
"""

import argparse
import copy
import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata

import torch

STAGES = ["tokenizer", "qwen3_moe", "deepseek_v3", "kimi_like", "qwen3_5_moe", "fp8", "nvfp4"]
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=False)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# Tokenizer (FORMATS.md §5.2, §6.7)
# ---------------------------------------------------------------------------------------------

# Qwen2/Qwen3 pre-tokenisation regex (transformers models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2
THINK_TOKEN = "<think>"                                              # non-special added token
TOKENIZER_VOCAB = 500

# ChatML template in the style of Qwen (without tools), used for chat_cases.json.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Training corpus: varied scripts, digits, code, whitespace runs, contractions and combining marks.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog doesn't care; I'LL say it's fine.",
    "We're here, they've gone, you'd think she'll stay. It's 10:45 and I'm late!",
    "Mixture-of-experts models route every token to a few experts out of many.",
    "A LoRA adapter adds a low-rank update B·A to a frozen weight matrix W.",
    "the of and to in is that for it as with was on be by at this have from",
    "Die Größe der Übungen hängt von der Schwierigkeit ab. Äpfel, Öl und Füße.",
    "Straße, Mädchen, schön, über, für, Grüße aus München und Köln.",
    "Café, naïve, résumé, coöperate, façade, jalapeño, São Paulo, Zürich.",
    "日本語のテキストも少し入れておきます。東京は日本の首都です。",
    "中文文本：我们今天去北京。人工智能和机器学习。",
    "한국어 문장도 있습니다. 안녕하세요, 세계!",
    "Emoji: 😀 😃 🚀 🎉 👍🏽 ❤️ 👨‍👩‍👧‍👦 🇩🇪 🇯🇵",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159 1,000,000 -17 +8 1e-6 0x1F",
    "Phone 555-0199, date 2026-08-19, time 23:59:59, price $19.99 or €5,50.",
    "def forward(self, x):\n    return self.down(F.silu(self.gate(x)) * self.up(x))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "    indented    text   with   runs   of   spaces    \n\n\n  and blank lines\r\n",
    "Tabs\tseparate\tcolumns\tin\tthis\tline\t\t\tend",
    "<html><body><p class=\"x\">Hello &amp; welcome</p></body></html>",
    "{\"key\": [1, 2, 3], \"name\": \"value\", \"nested\": {\"a\": null, \"b\": true}}",
    "SHOUTING IN CAPITALS DOESN'T HELP, WE'VE TRIED. YOU'RE RIGHT, THEY'D AGREE.",
    "Русский текст: привет, как дела? Москва и Санкт-Петербург.",
    "Ελληνικά: γεια σου κόσμε. Αθήνα.",
    "Combining: e\u0301 a\u0300 o\u0308 n\u0303 c\u0327 and precomposed é à ö ñ ç.",
    "Punctuation!!! ??? ... --- *** ### @@@ ((())) [[[]]] {{{}}} ;;; ::: ,,,",
    "Hello world. Hello again, world. Hello, hello, hello.",
    "question: what is the capital of France? answer: Paris.",
    "user: explain mixture of experts\nassistant: each token picks experts\n",
]


def build_tokenizer():
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)
    tk = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tk.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                             use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB - 1,      # the last id is the added "<think>"
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        show_progress=False)
    # The corpus is repeated with small variations so that frequent pairs are clearly ranked.
    lines = []
    for rep in range(3):
        for i, line in enumerate(CORPUS):
            lines.append(line if rep == 0 else f"{line} {i * 7 + rep}")
    tk.train_from_iterator(lines, trainer)
    tk.add_tokens([AddedToken(THINK_TOKEN, special=False, normalized=False)])
    return tk


# Strings whose ids are recorded in cases.json.
TOKENIZER_CASES = [
    "",
    "Hello world",
    "Hello world ",
    " Hello world",
    "  Hello   world  ",
    "   ",
    " ",
    "\n",
    "\n\n\n",
    "line one\nline two\n\nline four",
    "windows\r\nline\r\nendings\r\n",
    "\r\n\r\n",
    "tab\tseparated\t\tvalues\t",
    "\t\t  \t mixed",
    "trailing newline and spaces  \n  ",
    "don't I'LL we've they'D you're SHE'S it'S I'm",
    "'s 's's ''s",
    "12345678901234567890",
    "3.14159265358979 and 1,000,000 and -42",
    "x1y22z333",
    "Die Größe der Übungen hängt ab. Äpfel, Öl und Füße.",
    "Café naïve résumé",
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301",
    "e\u0301",
    "\u212b",
    "\u1100\u1161\u11a8",
    "q\u0307\u0323",
    "ﬁ ligature stays (NFC, not NFKC)",
    "日本語のテキスト、東京。",
    "中文：人工智能和机器学习。",
    "안녕하세요, 세계!",
    "ภาษาไทยง่ายนิดเดียว",
    "مرحبا بالعالم",
    "שלום עולם",
    "हिन्दी भाषा",
    "Emoji 😀🚀 and skin tone 👍🏽",
    "Family 👨‍👩‍👧‍👦 ZWJ sequence",
    "Flags 🇩🇪🇯🇵 and heart ❤️",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "before<|endoftext|>after",
    "<|endoftext|><|endoftext|>",
    "text <|im_end|> with spaces around <|im_start|> tokens",
    "<think>\nLet me think.\n</think>\n\nAnswer: 42",
    "a<think>b",
    "<think",
    "<|im_start",
    "def forward(self, x):\n    return self.down(F.silu(self.gate(x)) * self.up(x))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "<html><p class=\"x\">Hi &amp; bye</p></html>",
    "!!! ??? ... --- *** ### @@@",
    "SHOUTING DOESN'T HELP",
    "Русский текст: привет!",
    "Ελληνικά γεια",
    "unseen words: zyxwvut qqqq jjjj",
    "mixed日本English中文123",
    "a\u00a0non-breaking\u2003em-space\u3000ideographic",
    "zero\u200bwidth space",
    "\u00ad soft hyphen",
    "ends with combining a\u0301",
    "$19.99 €5,50 ¥100 £7",
    "email@example.com https://example.org/path?q=1&r=2",
]


def stage_tokenizer(out):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok_dir = os.path.join(out, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tk = build_tokenizer()
    log(f"tokenizer: trained byte-level BPE, vocab {tk.get_vocab_size()}")
    assert tk.get_vocab_size() <= 512, tk.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tk.token_to_id(t) == i, (t, tk.token_to_id(t))
    assert tk.token_to_id(THINK_TOKEN) == TOKENIZER_VOCAB - 1, tk.token_to_id(THINK_TOKEN)

    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", bos_token=None, unk_token=None,
                                 model_max_length=512)
    hf.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            shutil.copy(os.path.join(tmp, name), os.path.join(tok_dir, name))
    # The authoritative tokenizer.json is the one written by the tokenizers library itself.
    tk.save(os.path.join(tok_dir, "tokenizer.json"), pretty=True)
    # The Python ByteLevel decoder serialises its (unused) options as true; write Qwen's values so
    # the file looks like a real Qwen tokenizer.json. Decoding does not depend on them.
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                     "use_regex": False}
    with open(os.path.join(tok_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, indent=2, ensure_ascii=False)
        f.write("\n")

    reloaded = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    from transformers import AutoTokenizer
    hf2 = AutoTokenizer.from_pretrained(tok_dir)
    cases = []
    for text in TOKENIZER_CASES:
        enc = reloaded.encode(text, add_special_tokens=False)
        ids = enc.ids
        hf_ids = hf2(text, add_special_tokens=False)["input_ids"]
        assert hf_ids == ids, (text, ids, hf_ids)
        decoded = reloaded.decode(ids, skip_special_tokens=False)
        assert decoded == hf2.decode(ids, skip_special_tokens=False)
        # Byte-level BPE is lossless up to NFC (added tokens are matched before normalisation).
        assert decoded == unicodedata.normalize("NFC", text), (text, decoded)
        cases.append({"text": text, "ids": ids, "tokens": enc.tokens, "decoded": decoded})
    write_json(os.path.join(tok_dir, "cases.json"), cases)
    log(f"tokenizer: {len(cases)} cases written")

    chats = [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Größe von 12345?"},
         {"role": "assistant", "content": "<think>\nok\n</think>\n\n42"},
         {"role": "user", "content": "日本語 😀"}],
    ]
    chat_cases = []
    for msgs in chats:
        for gen in (False, True):
            text = hf2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            ids = reloaded.encode(text, add_special_tokens=False).ids
            chat_cases.append({"messages": msgs, "add_generation_prompt": gen, "text": text,
                               "ids": ids})
    write_json(os.path.join(tok_dir, "chat_cases.json"), chat_cases)

    # Same tokenizer with merges in the legacy "a b" string form.
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    merges = tj["model"]["merges"]
    assert merges and isinstance(merges[0], list), "tokenizers wrote merges in an unexpected form"
    assert all(" " not in a and " " not in b for a, b in merges)
    tj["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    legacy_path = os.path.join(tok_dir, "tokenizer_legacy_merges.json")
    with open(legacy_path, "w", encoding="utf-8") as f:
        json.dump(tj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    legacy = Tokenizer.from_file(legacy_path)
    for c in cases:
        assert legacy.encode(c["text"], add_special_tokens=False).ids == c["ids"], c["text"]
    log(f"tokenizer: legacy-merges file verified ({len(merges)} merges)")
    return {"vocab_size": tk.get_vocab_size(), "merges": len(merges), "cases": len(cases)}


# ---------------------------------------------------------------------------------------------
# Common model helpers
# ---------------------------------------------------------------------------------------------

BATCH, PROMPT_LEN, NEW_TOKENS = 2, 12, 16
MARGIN_MIN = 1e-3          # minimal router top-k margin (FORMATS.md §6.8 item 3)
GREEDY_MARGIN_MIN = 1e-3   # minimal top-1 minus top-2 logit gap at every greedy step
ADAPTER_VISIBLE = 0.05     # an adapter must move some logit by more than this
MERGE_TOL = 1e-5           # merge_and_unload / manual merge vs. unmerged adapter logits, relative
                           # to max(1, max |logits|) (fp32 summation order differs)
INPUT_SEED_TRIES = 200


def load_kwargs():
    return dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")


def load_model(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    m = AutoModelForCausalLM.from_pretrained(path, **load_kwargs()).eval()
    m.generation_config.eos_token_id = None   # greedy references always produce NEW_TOKENS tokens
    return m


def is_norm_weight(name):
    return name.endswith("norm.weight")


def init_model_(model, gen, router_std, bias_std=0.0):
    """Randomise what the default init leaves trivial: norm weights (ones by default, which would
    hide a missing norm multiply), router sharpness (near-uniform routing gives fragile top-k) and the
    DeepSeek e_score_correction_bias (zero by default). Then round every parameter to bf16 values."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_norm_weight(n):
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5) * 2)
            elif n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (router_std / math.sqrt(p.shape[1])))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * bias_std)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def save_bf16(model, path, **save_kwargs):
    """Save `model` (fp32 holding bf16-representable values) as a BF16 checkpoint. The DeepSeek
    e_score_correction_bias stays F32, as on the hub (_keep_in_fp32_modules_strict)."""
    m = copy.deepcopy(model)
    keep = {n: b.detach().clone() for n, b in m.named_buffers()
            if n.endswith("e_score_correction_bias")}
    m.to(torch.bfloat16)
    for n, b in keep.items():
        parent, attr = n.rsplit(".", 1)
        setattr(m.get_submodule(parent), attr, b)
    if os.path.isdir(path):
        shutil.rmtree(path)
    m.save_pretrained(path, **save_kwargs)
    return path


def st_keys(path):
    """{tensor name: (dtype string, shape)} of a safetensors file or a checkpoint directory."""
    out = {}
    files = [path] if path.endswith(".safetensors") else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    for fpath in files:
        with open(fpath, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (v["dtype"], v["shape"])
    return out


def forward_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def moe_layer_of(name):
    m = re.search(r"layers\.(\d+)\.mlp\.gate$", name)
    return int(m.group(1)) if m else None


class RouterRecorder:
    """Forward hooks on every MoE router (`...layers.L.mlp.gate`); records each call's
    (router_logits, weights, indices) per layer."""

    def __init__(self, model):
        self.calls = {}
        self.handles = []
        for name, mod in model.named_modules():
            L = moe_layer_of(name)
            if L is None:
                continue
            self.handles.append(mod.register_forward_hook(self._hook(L, mod)))

    def _hook(self, L, mod):
        def hook(_m, _inp, out):
            logits, w, idx = out
            self.calls.setdefault(L, []).append(
                (logits.detach().float().clone(), w.detach().float().clone(), idx.detach().clone(),
                 getattr(mod, "e_score_correction_bias", None)))
        return hook

    def clear(self):
        self.calls = {}

    def remove(self):
        for h in self.handles:
            h.remove()


def softmax_router_check(logits, idx, k):
    """Qwen3-MoE router: softmax, then top-k. Returns the minimal margin between the k-th and
    (k+1)-th probability and checks that HF's selection is the top-k set."""
    p = torch.softmax(logits.float(), dim=-1)
    s, order = p.sort(dim=-1, descending=True)
    mine = order[:, :k].sort(dim=-1).values
    assert torch.equal(mine, idx.sort(dim=-1).values), "router selection differs from top-k"
    return float((s[:, k - 1] - s[:, k]).min())


def deepseek_router_check(logits, idx, bias, k, n_group, topk_group):
    """DeepSeek-V3 noaux_tc router (FORMATS.md §1.6). Returns (group margin, expert margin, number
    of tokens whose selection the correction bias changes) and checks HF's selection."""
    s = torch.sigmoid(logits.float())
    b = s + bias.float()
    T, E = b.shape
    gs = b.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    gsorted, gorder = gs.sort(dim=-1, descending=True)
    group_margin = float("inf")
    if topk_group < n_group:
        group_margin = float((gsorted[:, topk_group - 1] - gsorted[:, topk_group]).min())
    keep = torch.zeros(T, n_group, dtype=torch.bool)
    keep.scatter_(1, gorder[:, :topk_group], True)
    keep = keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    masked = b.masked_fill(~keep, float("-inf"))
    bs, border = masked.sort(dim=-1, descending=True)
    mine = border[:, :k].sort(dim=-1).values
    assert torch.equal(mine, idx.sort(dim=-1).values), "DeepSeek router selection differs"
    expert_margin = float((bs[:, k - 1] - bs[:, k]).min())
    # Selection without the bias (same group logic) to show the bias matters.
    gs0 = s.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    keep0 = torch.zeros(T, n_group, dtype=torch.bool)
    keep0.scatter_(1, gs0.topk(topk_group, dim=-1).indices, True)
    keep0 = keep0[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    sel0 = s.masked_fill(~keep0, float("-inf")).topk(k, dim=-1).indices.sort(-1).values
    changed = int((sel0 != mine).any(-1).sum())
    return group_margin, expert_margin, changed


class MoeSpec:
    """What the margin checks need to know about a model's routers."""

    def __init__(self, kind, k, n_group=1, topk_group=1):
        self.kind, self.k, self.n_group, self.topk_group = kind, k, n_group, topk_group

    def margins(self, recorder):
        """Minimal margins over all recorded router calls: {"expert": m, "group": m, ...}."""
        out = {"expert": float("inf"), "group": float("inf"), "bias_changed_tokens": 0}
        for L, calls in recorder.calls.items():
            for logits, w, idx, bias in calls:
                if self.kind == "softmax":
                    out["expert"] = min(out["expert"], softmax_router_check(logits, idx, self.k))
                else:
                    g, e, c = deepseek_router_check(logits, idx, bias, self.k, self.n_group,
                                                    self.topk_group)
                    out["expert"] = min(out["expert"], e)
                    out["group"] = min(out["group"], g)
                    out["bias_changed_tokens"] += c
        return out


def greedy(model, ids):
    """HF generate, greedy with the KV cache; returns (tokens [B, P+N], min top1-top2 logit gap).
    Also checks that no logits processor changed the choice and that a cache-free loop (full
    recompute per step) picks the same tokens."""
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=None, eos_token_id=None, pad_token_id=0, use_cache=True,
                          temperature=None, top_p=None, top_k=None,
                          return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=gc)
    seq = out.sequences
    assert seq.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS), seq.shape
    raw = torch.stack(out.logits, dim=1).float()                      # [B, N, V]
    assert torch.equal(raw.argmax(-1), seq[:, ids.shape[1]:]), "a logits processor changed greedy"
    top2 = raw.topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    cur = ids
    for _ in range(NEW_TOKENS):
        nxt = forward_logits(model, cur)[:, -1].argmax(-1, keepdim=True)
        cur = torch.cat([cur, nxt], dim=1)
    assert torch.equal(cur, seq), "cache-free greedy differs from generate"
    return seq, margin


def jsonable(x):
    import enum
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, set):
        return sorted(jsonable(v) for v in x)
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, float) and math.isinf(x):
        return None
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return str(x)


# ---------------------------------------------------------------------------------------------
# Adapters (FORMATS.md §3, §6.4)
# ---------------------------------------------------------------------------------------------

ADAPTER_STD = 0.05   # LoRA A and B entries ~ N(0, ADAPTER_STD)
PREFIX = "base_model.model."


class no_peft_v5_conversion:
    """Context manager: replace peft.utils.transformers_weight_conversion.
    convert_peft_config_for_transformers with a no-op (FORMATS.md §3.3 workaround), so that
    gate_proj/up_proj/down_proj targets stay on the dense MLP and shared-expert nn.Linear modules
    instead of being moved to the fused expert parameters. PEFT imports it at call time."""

    def __init__(self, active=True):
        self.active = active

    def __enter__(self):
        import peft.utils.transformers_weight_conversion as twc
        self.twc, self.orig = twc, twc.convert_peft_config_for_transformers
        if self.active:
            twc.convert_peft_config_for_transformers = lambda peft_config, model, conversions=None: None
        return self

    def __exit__(self, *exc):
        self.twc.convert_peft_config_for_transformers = self.orig
        return False


def fix_adapter_config(out_dir, **updates):
    """Make adapter_config.json independent of where it was generated (base path) and stable
    (sorted target lists)."""
    path = os.path.join(out_dir, "adapter_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = "../base"
    for key in ("target_modules", "target_parameters"):
        if isinstance(cfg.get(key), list):
            cfg[key] = sorted(cfg[key])
    cfg.update(updates)
    write_json(path, cfg)
    return cfg


def peft_adapter(base_dir, out_dir, seed, target_modules, target_parameters=None, r=4, alpha=8,
                 rank_pattern=None, alpha_pattern=None, use_rslora=False, disable_conversion=False):
    """Create a LoRA with PEFT's get_peft_model, fill A and B with N(0, ADAPTER_STD) and save it the
    way PEFT saves it (3-D target_parameters layout for the experts)."""
    from peft import LoraConfig, get_peft_model
    base = load_model(base_dir)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", use_rslora=use_rslora,
                     target_modules=target_modules, target_parameters=target_parameters,
                     rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                     init_lora_weights=False, task_type="CAUSAL_LM")
    with no_peft_v5_conversion(disable_conversion):
        pm = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters(), key=lambda t: t[0]):
            if ".lora_A." in n or ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * ADAPTER_STD)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    pm.save_pretrained(out_dir)
    readme = os.path.join(out_dir, "README.md")     # PEFT's generic model card: not needed
    if os.path.exists(readme):
        os.remove(readme)
    fix_adapter_config(out_dir)


def write_adapter(out_dir, tensors, r, alpha, target_modules, use_rslora=False):
    """Write a hand-made adapter: adapter_model.safetensors (F32) + adapter_config.json written by
    PEFT's LoraConfig."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", use_rslora=use_rslora,
               target_modules=target_modules, init_lora_weights=False,
               task_type="CAUSAL_LM").save_pretrained(out_dir)
    fix_adapter_config(out_dir)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen) * ADAPTER_STD


def module_lora(gen, model, module_paths, r):
    """2-D LoRA tensors for nn.Linear modules: A [r, in], B [out, r]."""
    sd = {}
    for path in module_paths:
        w = model.get_submodule(path).weight
        sd[f"{PREFIX}{path}.lora_A.weight"] = randn(gen, r, w.shape[1])
        sd[f"{PREFIX}{path}.lora_B.weight"] = randn(gen, w.shape[0], r)
    return sd


def per_expert_lora(gen, moe_layers, E, H, I, r):
    """v4-style per-expert tensors (FORMATS.md §3.1)."""
    sd = {}
    for L in moe_layers:
        for e in range(E):
            for proj, (din, dout) in (("gate_proj", (H, I)), ("up_proj", (H, I)),
                                      ("down_proj", (I, H))):
                pre = f"{PREFIX}model.layers.{L}.mlp.experts.{e}.{proj}"
                sd[f"{pre}.lora_A.weight"] = randn(gen, r, din)
                sd[f"{pre}.lora_B.weight"] = randn(gen, dout, r)
    return sd


def shared_outer_lora(gen, moe_layers, E, H, I, r):
    """Shared-outer 3-D tensors (FORMATS.md §3.5): gate/up A [1, r, H] shared, B [E, I, r];
    down A [E, r, I], B [1, H, r] shared."""
    sd = {}
    for L in moe_layers:
        pre = f"{PREFIX}model.layers.{L}.mlp.experts"
        for proj in ("gate_proj", "up_proj"):
            sd[f"{pre}.{proj}.lora_A.weight"] = randn(gen, 1, r, H)
            sd[f"{pre}.{proj}.lora_B.weight"] = randn(gen, E, I, r)
        sd[f"{pre}.down_proj.lora_A.weight"] = randn(gen, E, r, I)
        sd[f"{pre}.down_proj.lora_B.weight"] = randn(gen, 1, H, r)
    return sd


def shared_outer_to_per_expert(sd, E):
    """The per-expert (v4) adapter that is mathematically identical to a shared-outer one."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.lora_(A|B)\.weight$", k)
        if not m:
            out[k] = v
            continue
        for e in range(E):
            out[f"{m.group(1)}.{e}.{m.group(2)}.lora_{m.group(3)}.weight"] = \
                v[0 if v.shape[0] == 1 else e].clone()
    return out


def read_adapter(adapter_dir):
    from safetensors.torch import load_file
    with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


def lora_scaling(cfg, name):
    """PEFT's scaling for module or parameter `name` (FORMATS.md §3.4): first rank_pattern /
    alpha_pattern key (dict order) whose regex (.*\\.)?(key)$ matches, else r / lora_alpha;
    alpha / r, or alpha / sqrt(r) with use_rslora."""

    def lookup(pattern, default):
        for key, val in (pattern or {}).items():
            if re.match(rf"(.*\.)?({key})$", name):
                return val
        return default
    r = lookup(cfg.get("rank_pattern"), cfg["r"])
    alpha = lookup(cfg.get("alpha_pattern"), cfg["lora_alpha"])
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def manual_merge_(model, adapter_dir):
    """Independent oracle: add scaling * B @ A to the base weights of `model`, reading the adapter
    files with the layout rules that tests/data/README.md documents (not with PEFT). Returns the
    list of merged targets."""
    cfg, sd = read_adapter(adapter_dir)
    merged = []
    groups = {}
    for k, v in sd.items():
        assert k.startswith(PREFIX), k
        groups.setdefault(k[len(PREFIX):].rsplit(".lora_", 1)[0], {})[k.rsplit(".lora_", 1)[1]] = v
    with torch.no_grad():
        for target, t in sorted(groups.items()):
            A, B = t["A.weight"].double(), t["B.weight"].double()
            m_pe = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$", target)
            m_3d = re.match(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$", target)
            m_pw = re.match(r"^(.*\.mlp\.experts)(\.base_layer)?$", target)
            if m_pe or m_3d:
                ex = model.get_submodule((m_pe or m_3d).group(1))
                proj = (m_pe or m_3d).group(3 if m_pe else 2)
                I = ex.down_proj.shape[2]
                E = ex.down_proj.shape[0]
                experts = [int(m_pe.group(2))] if m_pe else range(E)
                sc = lora_scaling(cfg, target)
                for e in experts:
                    a = A if m_pe else A[0 if A.shape[0] == 1 else e]
                    b = B if m_pe else B[0 if B.shape[0] == 1 else e]
                    delta = (sc * (b @ a)).float()
                    if proj == "gate_proj":
                        ex.gate_up_proj[e, :I] += delta
                    elif proj == "up_proj":
                        ex.gate_up_proj[e, I:] += delta
                    else:
                        ex.down_proj[e] += delta
            elif m_pw:
                # PEFT target_parameters layout: with both parameters targeted, gate_up_proj is the
                # inner wrapper (".base_layer") and down_proj the outer one.
                targets = cfg.get("target_parameters") or []
                both = any(x.endswith("gate_up_proj") for x in targets) and \
                    any(x.endswith("down_proj") for x in targets)
                if m_pw.group(2) or (not both and any(x.endswith("gate_up_proj") for x in targets)):
                    pname = "gate_up_proj"
                else:
                    pname = "down_proj"
                ex = model.get_submodule(m_pw.group(1))
                param = getattr(ex, pname)                                   # [E, out, in]
                E = param.shape[0]
                R = A.shape[0] // E
                assert A.shape[0] == E * R and B.shape[1] == E * R, (target, A.shape, B.shape)
                sc = lora_scaling(cfg, f"{m_pw.group(1)}.{pname}")
                a = A.view(E, R, A.shape[1])                                 # row e*R + k
                b = B.view(B.shape[0], R, E)                                 # column k*E + e
                for e in range(E):
                    param[e] += (sc * (b[:, :, e] @ a[e])).float()
                target = f"{m_pw.group(1)}.{pname}"
            else:
                w = model.get_submodule(target).weight
                w += (lora_scaling(cfg, target) * (B @ A)).float()
            merged.append(target)
    return merged


def adapted_targets(pm):
    """Modules / parameters that carry a LoRA in a PeftModel, with rank and scaling."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    out = []
    for name, mod in pm.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            short = name[len(PREFIX):] if name.startswith(PREFIX) else name
            entry = {"module": short, "type": type(mod).__name__,
                     "r": int(mod.r["default"]), "scaling": float(mod.scaling["default"])}
            if isinstance(mod, ParamWrapper):
                entry["parameter"] = mod.parameter_name
                entry["lora_A_shape"] = list(mod.lora_A["default"].weight.shape)
                entry["lora_B_shape"] = list(mod.lora_B["default"].weight.shape)
            out.append(entry)
    return out


def peft_oracle(base_dir, adapter_dir, disable_conversion=False):
    from peft import PeftModel
    with no_peft_v5_conversion(disable_conversion):
        pm = PeftModel.from_pretrained(load_model(base_dir), adapter_dir).eval()
    return pm


TEMP_DIRS = []


def temp_dir():
    d = tempfile.mkdtemp(prefix="moelora_ref_")
    TEMP_DIRS.append(d)
    return d


def equivalent_oracle(base, adapter_dir, sd, r, alpha, target_modules, notes, use_rslora=False):
    tmp = os.path.join(temp_dir(), "adapter")
    write_adapter(tmp, sd, r=r, alpha=alpha, target_modules=target_modules, use_rslora=use_rslora)
    return {"dir": adapter_dir, "oracle": lambda: peft_oracle(base, tmp), "notes": notes}


def per_expert_oracle(base, adapter_dir, sd):
    """Oracle for a hand-written per-expert (v4-style) adapter: PeftModel.from_pretrained, which
    converts it to the 3-D layout, if that agrees with the per-expert meaning (checked against
    manual_merge_). PEFT 0.19-0.21 turns each expert's gate and up LoRAs into one rank-2r LoRA with
    alpha 2*alpha; that keeps alpha/r but under use_rslora scales gate/up by 2a/sqrt(2r) =
    sqrt(2)*a/sqrt(r) instead of a/sqrt(r). For that case the oracle is PEFT on a copy whose gate/up
    lora_B are divided by sqrt(2), i.e. every expert projection scaled by lora_alpha/sqrt(r)."""
    with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        ids = probe_ids(json.load(f)["vocab_size"], 7)
    manual = load_model(base)
    manual_merge_(manual, adapter_dir)
    want = forward_logits(manual, ids)
    tol = MERGE_TOL * max(1.0, float(want.abs().max()))
    d = float((forward_logits(peft_oracle(base, adapter_dir), ids) - want).abs().max())
    if d <= tol:
        return {"dir": adapter_dir, "oracle": lambda: peft_oracle(base, adapter_dir),
                "notes": "PeftModel.from_pretrained on the adapter as written"}
    assert cfg.get("use_rslora"), f"PEFT differs from the per-expert meaning by {d} (tol {tol})"
    fixed = {k: (v / math.sqrt(2.0) if ("gate_proj.lora_B" in k or "up_proj.lora_B" in k) else v)
             for k, v in sd.items()}
    entry = equivalent_oracle(
        base, adapter_dir, fixed, r=cfg["r"], alpha=cfg["lora_alpha"],
        target_modules=cfg["target_modules"], use_rslora=True,
        notes=f"PEFT {__import__('peft').__version__} converts per-expert gate/up LoRAs to one "
              "rank-2r LoRA with alpha 2a; with use_rslora that scales gate/up by 2a/sqrt(2r) "
              f"(logits off by {d:.3g} from the per-expert meaning). Oracle: PeftModel on a copy "
              "whose gate_proj/up_proj lora_B are divided by sqrt(2), i.e. every expert projection "
              "scaled by lora_alpha/sqrt(r) as in the per-expert (v4) semantics.")
    d_fixed = float((forward_logits(entry["oracle"](), ids) - want).abs().max())
    assert d_fixed <= tol, f"corrected per-expert rsLoRA oracle still differs by {d_fixed}"
    entry["peft_rslora_gate_up_deviation"] = d
    log(f"  per-expert rsLoRA: PEFT deviates by {d:.3g}; oracle uses the corrected copy")
    return entry


# ---------------------------------------------------------------------------------------------
# Reference outputs (FORMATS.md §6.5)
# ---------------------------------------------------------------------------------------------

def probe_ids(vocab, seed, length=PROMPT_LEN):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (BATCH, length), generator=g)


def run_checked(model, ids, spec):
    """Forward + greedy with router recording. Returns dict with logits, routing of the forward,
    greedy tokens and all margins."""
    rec = RouterRecorder(model)
    try:
        logits = forward_logits(model, ids).float()
        route = {L: calls[0] for L, calls in rec.calls.items()}
        fwd_margins = spec.margins(rec) if spec else {}
        rec.clear()
        seq, greedy_margin = greedy(model, ids)
        gen_margins = spec.margins(rec) if spec else {}
    finally:
        rec.remove()
    return {"logits": logits, "route": route, "greedy": seq, "greedy_margin": greedy_margin,
            "router_margins_forward": fwd_margins, "router_margins_greedy": gen_margins}


def margins_ok(res, margin_min=MARGIN_MIN):
    for key in ("router_margins_forward", "router_margins_greedy"):
        m = res[key]
        if m and (m["expert"] < margin_min or m["group"] < margin_min):
            return False
    return res["greedy_margin"] >= GREEDY_MARGIN_MIN


def build_references(root, base_dir, spec, vocab, adapters, meta, seed0, extra_checks=True,
                     extra=None, prompt_len=PROMPT_LEN, margin_min=MARGIN_MIN):
    """Write root/reference.safetensors and root/metadata.json.

    adapters: {name: {"oracle": zero-arg callable returning the oracle model (a PeftModel),
                      "dir": adapter directory, "peft": bool (merge_and_unload check),
                      "notes": str}}
    """
    from safetensors.torch import save_file
    base = load_model(base_dir)
    oracles = {name: a["oracle"]() for name, a in adapters.items()}
    models = {"base": base, **oracles}

    chosen = None
    for attempt in range(INPUT_SEED_TRIES):
        seed = seed0 + attempt
        ids = probe_ids(vocab, seed, prompt_len)
        results = {}
        ok = True
        for name, m in models.items():
            results[name] = run_checked(m, ids, spec)
            if not margins_ok(results[name], margin_min):
                ok = False
                break
        if ok:
            chosen = (seed, ids, results)
            break
        log(f"  input seed {seed} rejected (margin too small for {name})")
    assert chosen is not None, "no input seed with safe margins found"
    seed, ids, results = chosen
    log(f"  input seed {seed} accepted")

    ref = {"input_ids": ids.to(torch.int32)}
    summary = {"input_seed": seed, "models": {}}
    base_logits = results["base"]["logits"]
    for name, res in results.items():
        ref[f"logits.{name}"] = res["logits"].contiguous()
        ref[f"greedy.{name}"] = res["greedy"].to(torch.int32)
        entry = {"greedy_min_top1_top2_gap": res["greedy_margin"],
                 "router_margins_forward": res["router_margins_forward"],
                 "router_margins_greedy": res["router_margins_greedy"]}
        if name != "base":
            delta = float((res["logits"] - base_logits).abs().max())
            entry["max_abs_delta_logits_vs_base"] = delta
            assert delta > ADAPTER_VISIBLE, f"adapter {name} barely changes logits ({delta})"
            entry["greedy_differs_from_base"] = bool(
                not torch.equal(res["greedy"], results["base"]["greedy"]))
        summary["models"][name] = entry
        log(f"  {name}: greedy gap {res['greedy_margin']:.4g}, router margins "
            f"{res['router_margins_forward']} / greedy {res['router_margins_greedy']}"
            + (f", max|dlogits| {entry.get('max_abs_delta_logits_vs_base', 0):.4g}"
               if name != "base" else ""))

    # Routing of the base model's forward on input_ids.
    routing = {}
    for L, (logits, w, idx, _bias) in sorted(results["base"]["route"].items()):
        ref[f"route_idx.layer{L}"] = idx.to(torch.int32).contiguous()
        ref[f"route_w.layer{L}"] = w.float().contiguous()
        routing[f"layer{L}"] = {
            "sorted_by_weight_desc": bool((w[:, :-1] >= w[:, 1:]).all()),
            "sorted_by_expert_id": bool((idx[:, :-1] < idx[:, 1:]).all()),
        }
        if spec.kind == "deepseek":
            b = torch.sigmoid(logits) + _bias.float()
            bsel = b.gather(1, idx)
            routing[f"layer{L}"]["sorted_by_biased_score_desc"] = \
                bool((bsel[:, :-1] >= bsel[:, 1:]).all())
    summary["routing_order"] = routing

    # Hidden states of the base model (embedding output, then after each decoder layer).
    with torch.no_grad():
        out = base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                   output_hidden_states=True)
        last = base.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                          use_cache=False).last_hidden_state
    hs = out.hidden_states
    for i, h in enumerate(hs):
        ref[f"hidden.base.{i}"] = h.float().contiguous()
    summary["hidden_states"] = {
        "count": len(hs),
        "last_equals_final_norm_output": bool(torch.equal(hs[-1], last)),
    }

    if extra_checks:
        # Rows are independent: each row alone gives the batch logits.
        for r in range(ids.shape[0]):
            solo = forward_logits(base, ids[r:r + 1]).float()
            d = float((solo - base_logits[r:r + 1]).abs().max())
            assert d <= MERGE_TOL * max(1.0, float(base_logits.abs().max())), \
                f"row {r} alone differs from the batch by {d}"
        # Oracles vs. merge_and_unload and vs. the manual merge from the adapter files.
        checks = {}
        for name, a in adapters.items():
            c = {}
            manual = load_model(base_dir)
            c["manual_merge_targets"] = len(manual_merge_(manual, a["dir"]))
            want = results[name]["logits"]
            tol = MERGE_TOL * max(1.0, float(want.abs().max()))
            d = float((forward_logits(manual, ids).float() - want).abs().max())
            c["manual_merge_max_abs_diff"] = d
            assert d <= tol, f"{name}: manual merge differs from the oracle by {d} (tol {tol})"
            pm = oracles[name]
            c["adapted"] = adapted_targets(pm)
            c["resolved_peft_config"] = jsonable(pm.peft_config["default"].to_dict())
            with no_peft_v5_conversion(a.get("disable_conversion", False)):
                merged = pm.merge_and_unload()
            d = float((forward_logits(merged, ids).float() - want).abs().max())
            c["merge_and_unload_max_abs_diff"] = d
            c["tolerance"] = tol
            assert d <= tol, f"{name}: merge_and_unload differs by {d} (tol {tol})"
            c["notes"] = a.get("notes", "")
            checks[name] = c
            log(f"  {name}: manual merge diff {c['manual_merge_max_abs_diff']:.3g}, "
                f"merge_and_unload diff {d:.3g}, {len(c['adapted'])} adapted targets")
        summary["adapters"] = checks

    ref.update(extra or {})
    save_file({k: v.contiguous() for k, v in sorted(ref.items())},
              os.path.join(root, "reference.safetensors"), metadata={"format": "pt"})
    meta = {**meta, **summary, "versions": versions()}
    meta["reference_tensors"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)]
                                 for k, v in sorted(ref.items())}
    write_json(os.path.join(root, "metadata.json"), jsonable(meta))
    return meta


def check_reload(model, dirs, vocab):
    """Every saved base reloads (fp32) to logits identical to the in-memory model."""
    ids = probe_ids(vocab, 999)
    want = forward_logits(model, ids)
    for d in dirs:
        got = forward_logits(load_model(d), ids)
        assert torch.equal(got, want), f"{d}: reloaded logits differ by {(got - want).abs().max()}"
        log(f"  reload check OK: {os.path.relpath(d)}")


def copy_tokenizer(out, dst):
    src = os.path.join(out, "tokenizer")
    assert os.path.exists(os.path.join(src, "tokenizer.json")), "run the tokenizer stage first"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def fresh_dir(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE (FORMATS.md §1.3, §6.2)
# ---------------------------------------------------------------------------------------------

def qwen3_moe_config(**over):
    from transformers import Qwen3MoeConfig
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[1], max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.1,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
              bos_token_id=0, eos_token_id=2, pad_token_id=0,
              attn_implementation="eager", experts_implementation="eager")
    kw.update(over)
    return Qwen3MoeConfig(**kw)


def stage_qwen3_moe(out):
    from transformers import Qwen3MoeForCausalLM
    root = fresh_dir(os.path.join(out, "parity", "qwen3_moe"))
    cfg = qwen3_moe_config()
    torch.manual_seed(1001)
    model = Qwen3MoeForCausalLM(cfg).eval()
    init_model_(model, torch.Generator().manual_seed(1002), router_std=2.0)
    H, I, E, k, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, \
        cfg.num_experts_per_tok, cfg.vocab_size
    moe_layers = [L for L in range(cfg.num_hidden_layers) if L not in cfg.mlp_only_layers]

    base = save_bf16(model, os.path.join(root, "base"))
    fused = save_bf16(model, os.path.join(root, "base_fused"), save_original_format=False)
    sharded = save_bf16(model, os.path.join(root, "base_sharded"), max_shard_size="150KB")
    for d in (base, fused, sharded):
        copy_tokenizer(out, d)

    # base_sharded carries a hub-style config.json (as Qwen3-30B-A3B ships it): top-level
    # rope_theta / rope_scaling instead of rope_parameters, and num_experts instead of the
    # num_local_experts alias that transformers 5 writes.
    def to_legacy(c):
        rp = c.pop("rope_parameters")
        c["rope_theta"] = rp["rope_theta"]
        c["rope_scaling"] = None
        c["num_experts"] = c.pop("num_local_experts")
        return c
    rewrite_config(sharded, to_legacy)
    check_reload(model, [base, fused, sharded], V)
    assert any(k_.endswith("experts.0.gate_proj.weight") for k_ in st_keys(base))
    assert any(k_.endswith("experts.gate_up_proj") for k_ in st_keys(fused))
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    n_shards = len([f for f in os.listdir(sharded) if f.endswith(".safetensors")])
    assert n_shards >= 3, n_shards
    log(f"  bases written: per-expert, fused, {n_shards} shards")

    attn = [f"model.layers.{L}.self_attn.{p}" for L in range(cfg.num_hidden_layers)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    adapters = {}

    # (1) PEFT-saved 3-D layout with a rank/alpha pattern on one module.
    d = os.path.join(root, "lora_peft3d")
    peft_adapter(base, d, seed=2001, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 rank_pattern={"layers.2.self_attn.o_proj": 6},
                 alpha_pattern={"layers.2.self_attn.o_proj": 3})
    adapters["lora_peft3d"] = {"dir": d, "oracle": lambda d=d: peft_oracle(base, d),
                               "notes": "saved by PEFT get_peft_model/save_pretrained"}

    # (2) Hand-written per-expert (v4) adapter with rsLoRA.
    d = os.path.join(root, "lora_per_expert")
    gen = torch.Generator().manual_seed(2002)
    sd = per_expert_lora(gen, moe_layers, E, H, I, 4)
    sd.update(module_lora(gen, model, attn, 4))
    write_adapter(d, sd, r=4, alpha=8, use_rslora=True,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"])
    adapters["lora_per_expert"] = per_expert_oracle(base, d, sd)

    # (3) Shared-outer layout; PEFT cannot load it, the oracle is the equivalent per-expert adapter.
    d = os.path.join(root, "lora_shared_outer")
    gen = torch.Generator().manual_seed(2003)
    sd = shared_outer_lora(gen, moe_layers, E, H, I, 4)
    sd.update(module_lora(gen, model, attn, 4))
    write_adapter(d, sd, r=4, alpha=8,
                  target_modules=["gate_proj", "up_proj", "down_proj", "q_proj", "k_proj",
                                  "v_proj", "o_proj"])
    adapters["lora_shared_outer"] = equivalent_oracle(
        base, d, shared_outer_to_per_expert(sd, E), r=4, alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj", "q_proj", "k_proj", "v_proj",
                        "o_proj"],
        notes="oracle: the equivalent per-expert (v4) adapter (shared factor copied to every "
              "expert) loaded by PeftModel.from_pretrained")

    meta = {"model": "qwen3_moe", "config": jsonable(cfg.to_dict()), "moe_layers": moe_layers,
            "dense_layers": list(cfg.mlp_only_layers), "k": k, "num_experts": E,
            "router": "softmax(fp32) -> top-k (torch.topk, sorted) -> renormalise (norm_topk_prob)"}
    build_references(root, base, MoeSpec("softmax", k), V, adapters, meta, seed0=3000)
    return {"dir": root}


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 and a Kimi-K2-like variant (FORMATS.md §1.6, §6.3)
# ---------------------------------------------------------------------------------------------

def deepseek_config(**over):
    from transformers import DeepseekV3Config
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
              num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
              norm_topk_prob=True, rope_interleave=True, max_position_embeddings=512,
              rms_norm_eps=1e-6, initializer_range=0.2,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 128, "beta_fast": 32.0,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0,
              attn_implementation="eager", experts_implementation="eager")
    kw.update(over)
    return DeepseekV3Config(**kw)


def rope_facts(model):
    """What transformers actually computes for the rope of `model` (first layer)."""
    rot = model.model.rotary_emb
    attn = model.model.layers[0].self_attn
    facts = {"rope_parameters": dict(model.config.rope_parameters),
             "rope_dim": int(rot.inv_freq.numel() * 2),
             "inv_freq": [float(x) for x in rot.inv_freq],
             "attention_scaling_applied_to_cos_sin": float(rot.attention_scaling)}
    if hasattr(attn, "scaling"):
        facts["attention_softmax_scale"] = float(attn.scaling)
        if hasattr(attn, "qk_head_dim"):
            facts["qk_head_dim_pow_minus_half"] = float(attn.qk_head_dim ** -0.5)
    return facts


def rewrite_config(path, fn):
    cpath = os.path.join(path, "config.json")
    with open(cpath, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg = fn(cfg)
    write_json(cpath, cfg)
    return cfg


def deepseek_stage(out, name, cfg, model_seed, adapters_fn, legacy_config=False):
    from transformers import DeepseekV3ForCausalLM
    root = fresh_dir(os.path.join(out, "parity", name))
    torch.manual_seed(model_seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    init_model_(model, torch.Generator().manual_seed(model_seed + 1), router_std=2.0,
                bias_std=0.05)
    base = save_bf16(model, os.path.join(root, "base"))
    legacy = None
    if legacy_config:
        # Hub-style config.json: legacy rope_theta + rope_scaling{"type": "yarn"} instead of
        # rope_parameters, plus DeepSeek's scoring_func / topk_method fields.
        def to_legacy(c):
            rp = c.pop("rope_parameters")
            c["rope_theta"] = rp.pop("rope_theta")
            rp["type"] = rp.pop("rope_type")
            c["rope_scaling"] = rp
            c["scoring_func"] = "sigmoid"
            c["topk_method"] = "noaux_tc"
            return c
        legacy = rewrite_config(base, to_legacy)
    check_reload(model, [base], cfg.vocab_size)
    keys = st_keys(base)
    bias_keys = [k for k in keys if k.endswith("e_score_correction_bias")]
    assert bias_keys and all(keys[k][0] == "F32" for k in bias_keys), bias_keys
    assert all(v[0] == "BF16" for k, v in keys.items() if k not in bias_keys)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    moe_layers = list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    adapters = adapters_fn(root, base, model, cfg, moe_layers)
    meta = {"model": name, "config": jsonable(cfg.to_dict()), "config_json_style":
            "legacy hub style (rope_theta + rope_scaling)" if legacy else "transformers 5",
            "moe_layers": moe_layers, "dense_layers": list(range(cfg.first_k_dense_replace)),
            "k": k, "num_experts": E, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "router": "sigmoid(fp32 logits); selection on sigmoid + e_score_correction_bias with "
                      "group-limited top-k (torch.topk sorted=False); weights = unbiased sigmoid, "
                      "renormalised (+1e-20), times routed_scaling_factor",
            "rope": rope_facts(load_model(base))}
    m = build_references(root, base, MoeSpec("deepseek", k, cfg.n_group, cfg.topk_group),
                         cfg.vocab_size, adapters, meta, seed0=model_seed + 100)
    changed = m["models"]["base"]["router_margins_forward"]["bias_changed_tokens"]
    log(f"  e_score_correction_bias changes the selection of {changed} token-layers")
    assert changed > 0, "the correction bias never changes the routing; raise bias_std"
    return {"dir": root}


def deepseek_v3_adapters(root, base, model, cfg, moe_layers):
    L_all = range(cfg.num_hidden_layers)
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    adapters = {}
    d = os.path.join(root, "lora_peft3d")
    peft_adapter(base, d, seed=5001,
                 target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                 "o_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 rank_pattern={"mlp.experts.down_proj": 2},
                 alpha_pattern={"mlp.experts.down_proj": 6})
    adapters["lora_peft3d"] = {"dir": d, "oracle": lambda d=d: peft_oracle(base, d),
                               "notes": "saved by PEFT; rank_pattern/alpha_pattern give the expert "
                                        "down_proj rank 2 and alpha 6"}

    d = os.path.join(root, "lora_dense_shared")
    dense_regex = (r"model\.layers\.\d+\.(mlp|mlp\.shared_experts)\.(gate_proj|up_proj|down_proj)"
                   r"|model\.layers\.\d+\.self_attn\.o_proj")
    peft_adapter(base, d, seed=5002, target_modules=dense_regex, disable_conversion=True)
    pm = peft_oracle(base, d, disable_conversion=True)
    got = sorted(t["module"] for t in adapted_targets(pm))
    want = sorted([f"model.layers.{L}.mlp.{p}" for L in range(cfg.first_k_dense_replace)
                   for p in ("gate_proj", "up_proj", "down_proj")]
                  + [f"model.layers.{L}.mlp.shared_experts.{p}" for L in moe_layers
                     for p in ("gate_proj", "up_proj", "down_proj")]
                  + [f"model.layers.{L}.self_attn.o_proj" for L in L_all])
    assert got == want, (got, want)
    adapters["lora_dense_shared"] = {
        "dir": d, "disable_conversion": True,
        "oracle": lambda d=d: peft_oracle(base, d, disable_conversion=True),
        "notes": "target_modules is a regex over dense-MLP, shared-expert and o_proj modules; "
                 "created and loaded with peft.utils.transformers_weight_conversion."
                 "convert_peft_config_for_transformers replaced by a no-op (otherwise PEFT moves "
                 "gate_proj/up_proj/down_proj targets to the routed-expert parameters)"}

    d = os.path.join(root, "lora_per_expert")
    gen = torch.Generator().manual_seed(5003)
    sd = per_expert_lora(gen, moe_layers, E, H, I, 4)
    sd.update(module_lora(gen, model, [f"model.layers.{L}.self_attn.{p}" for L in L_all
                                       for p in ("q_a_proj", "kv_b_proj")], 4))
    write_adapter(d, sd, r=4, alpha=8,
                  target_modules=["q_a_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"])
    adapters["lora_per_expert"] = per_expert_oracle(base, d, sd)
    return adapters


def kimi_like_adapters(root, base, model, cfg, moe_layers):
    d = os.path.join(root, "lora_peft3d")
    peft_adapter(base, d, seed=6001,
                 target_modules=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return {"lora_peft3d": {"dir": d, "oracle": lambda: peft_oracle(base, d),
                            "notes": "saved by PEFT get_peft_model/save_pretrained"}}


def stage_deepseek_v3(out):
    return deepseek_stage(out, "deepseek_v3", deepseek_config(), 4001, deepseek_v3_adapters)


def stage_kimi_like(out):
    cfg = deepseek_config(num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None,
                          n_routed_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1,
                          routed_scaling_factor=2.827,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0,
                                           "factor": 8.0, "original_max_position_embeddings": 64,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                           "mscale_all_dim": 1.0})
    return deepseek_stage(out, "kimi_like", cfg, 4501, kimi_like_adapters, legacy_config=True)


# ---------------------------------------------------------------------------------------------
# Qwen3.5-MoE (FORMATS.md §1.4, §1.5): Gated DeltaNet + gated full attention
# ---------------------------------------------------------------------------------------------

# Longer than the 64-token chunk of transformers' chunked gated delta rule, so the prefill
# references cross a chunk boundary.
QWEN35_PROMPT_LEN = 72
QWEN35_MARGIN_MIN = 1e-4
QWEN35_LINEAR = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def qwen3_5_moe_config(**over):
    from transformers import Qwen3_5MoeTextConfig
    kw = dict(vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
              # dk = dv = 64: the smallest head dims the GPU's Gated DeltaNet kernels serve
              linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
              linear_num_value_heads=4, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.1,
              # rotary_dim = 32 * 0.25 = 8; the M-RoPE sections cover its 4 frequencies
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                               "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                               "mrope_interleaved": True},
              # no pad token: nn.Embedding would zero its row, and a zero embedding makes the
              # Gated DeltaNet output exactly 0 (its output gate silu(z) = 0), hence exact router
              # ties in the following layers whenever greedy decoding emits that token
              bos_token_id=0, eos_token_id=2, pad_token_id=None,
              attn_implementation="eager", experts_implementation="eager")
    kw.update(over)
    return Qwen3_5MoeTextConfig(**kw)


def stage_qwen3_5_moe(out):
    from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeForConditionalGeneration)
    root = fresh_dir(os.path.join(out, "parity", "qwen3_5_moe"))
    cfg = qwen3_5_moe_config()
    # default layer_types (full_attention_interval 4): 3 linear, 1 full, 1 linear
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    torch.manual_seed(5001)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(5002)
    init_model_(model, gen, router_std=2.0)
    with torch.no_grad():
        for n, p_ in model.named_parameters():
            if n.endswith("norm.weight") and ".linear_attn." not in n:
                # zero-centred (1 + w) RMSNorms: w around 0, so that a missing "1 +" shows
                p_.copy_(0.4 * (torch.rand(p_.shape, generator=gen) - 0.5))
            elif n.endswith("A_log"):
                # decay exp(g) = exp(-A softplus(a + dt_bias)) mostly in (0.3, 1): the recurrent
                # state carries over many tokens (transformers' init, A up to 16, forgets at once)
                p_.copy_(torch.log(0.02 + 0.5 * torch.rand(p_.shape, generator=gen)))
            elif n.endswith("dt_bias"):
                p_.copy_(2.0 * torch.rand(p_.shape, generator=gen) - 1.0)
            p_.copy_(p_.to(torch.bfloat16).to(torch.float32))
    V, k = cfg.vocab_size, cfg.num_experts_per_tok

    base = save_bf16(model, os.path.join(root, "base"))
    copy_tokenizer(out, base)
    check_reload(model, [base], V)
    keys = st_keys(base)
    assert any(k_.endswith("linear_attn.in_proj_qkv.weight") for k_ in keys)
    log(f"  base written ({'fused' if any(k_.endswith('experts.gate_up_proj') for k_ in keys) else 'per-expert'} experts)")

    # The published form: Qwen3_5MoeForConditionalGeneration with the decoder under
    # model.language_model and a (tiny) vision tower that text-only input never touches.
    vcfg = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=cfg.hidden_size,
                num_position_embeddings=16)
    vlm_cfg = Qwen3_5MoeConfig(text_config=cfg.to_dict(), vision_config=vcfg,
                               tie_word_embeddings=False)
    torch.manual_seed(5003)
    vlm = Qwen3_5MoeForConditionalGeneration(vlm_cfg).eval()
    with torch.no_grad():
        vlm.model.language_model.load_state_dict(model.model.state_dict())
        vlm.lm_head.weight.copy_(model.lm_head.weight)
        for p_ in vlm.model.visual.parameters():
            p_.copy_(p_.to(torch.bfloat16).to(torch.float32))
    base_vlm = save_bf16(vlm, os.path.join(root, "base_vlm"), save_original_format=False)
    copy_tokenizer(out, base_vlm)
    ids = probe_ids(V, 998, QWEN35_PROMPT_LEN)
    with torch.no_grad():
        want = forward_logits(model, ids)
        got = vlm(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    d = float((got - want).abs().max())
    assert d <= MERGE_TOL * max(1.0, float(want.abs().max())), f"VLM text logits differ by {d}"
    vlm_keys = st_keys(base_vlm)
    assert any(k_.startswith("model.language_model.layers.") for k_ in vlm_keys)
    assert any(k_.startswith("model.visual.") for k_ in vlm_keys)
    assert any(k_.endswith("mlp.experts.gate_up_proj") for k_ in vlm_keys)  # fused, as released
    log(f"  base_vlm written: text-only logits equal the text model's (max diff {d:.3g})")

    adapters = {}
    # (1) PEFT-saved: every target PEFT can name in this architecture (gated attention q/k/v/o,
    # the Gated DeltaNet projections, the shared expert's gate/up/down as plain linears, the
    # routed experts as 3-D parameters), with rank / alpha patterns on a linear-attention module.
    d = os.path.join(root, "lora_all")
    peft_adapter(base, d, seed=5101,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *QWEN35_LINEAR,
                                 "gate_proj", "up_proj", "down_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 rank_pattern={"layers.0.linear_attn.in_proj_qkv": 6},
                 alpha_pattern={"layers.0.linear_attn.in_proj_qkv": 3})
    adapters["lora_all"] = {"dir": d, "oracle": lambda d=d: peft_oracle(base, d),
                            "notes": "saved by PEFT get_peft_model/save_pretrained"}
    # (2) PEFT-saved, linear attention and the shared expert only, rsLoRA, rank 8.
    d = os.path.join(root, "lora_linear")
    peft_adapter(base, d, seed=5102, r=8, alpha=16, use_rslora=True,
                 target_modules=[*QWEN35_LINEAR, "shared_expert.gate_proj",
                                 "shared_expert.up_proj", "shared_expert.down_proj"])
    adapters["lora_linear"] = {"dir": d, "oracle": lambda d=d: peft_oracle(base, d),
                               "notes": "saved by PEFT get_peft_model/save_pretrained"}

    meta = {"model": "qwen3_5_moe", "config": jsonable(cfg.to_dict()),
            "layer_types": list(cfg.layer_types), "k": k, "num_experts": cfg.num_experts,
            "prompt_len": QWEN35_PROMPT_LEN,
            "router": "softmax(fp32) -> top-k (torch.topk, sorted) -> renormalise (always)",
            "gated_delta_rule": "forward: torch_chunk_gated_delta_rule (chunk 64); greedy: chunked "
                                "prefill, then torch_recurrent_gated_delta_rule per token"}
    # 2 x 88 tokens through 5 MoE layers are ~900 routing decisions per model, too many for every
    # top-k margin to clear 1e-3; 1e-4 still leaves a hundred times the fp32 differences between
    # implementations (router probabilities agree to ~1e-6).
    meta["router_margin_min"] = QWEN35_MARGIN_MIN
    build_references(root, base, MoeSpec("softmax", k), V, adapters, meta, seed0=5200,
                     prompt_len=QWEN35_PROMPT_LEN, margin_min=QWEN35_MARGIN_MIN)
    return {"dir": root}


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints written by hand (FORMATS.md §4, §6.6)
# ---------------------------------------------------------------------------------------------

QUANT_LINEAR = (r"^model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|k_proj|v_proj|"
                r"kv_a_proj_with_mqa|kv_b_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj)|"
                r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)|"
                r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$")


def fp8_block_quantize(w, bs=128):
    """DeepSeek-style block FP8: weight_scale_inv[nb, kb] = amax(block) / 448 (the dequant
    multiplier), q = e4m3(w / scale) (torch's round-to-nearest-even cast), partial edge blocks use
    the amax of their valid part. Returns (q [N, K] float8_e4m3fn, scale_inv [nb, kb] f32,
    dequantized [N, K] f32 = float(q) * scale_inv[n // 128, k // 128])."""
    N, K = w.shape
    nb, kb = -(-N // bs), -(-K // bs)
    wp = torch.zeros(nb * bs, kb * bs)
    wp[:N, :K] = w.float()
    blk = wp.view(nb, bs, kb, bs)
    s = blk.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blk / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = q.view(nb * bs, kb * bs)[:N, :K].contiguous()
    s_full = s.repeat_interleave(bs, 0)[:N].repeat_interleave(bs, 1)[:, :K]
    deq = q.float() * s_full
    return q, s.float().contiguous(), deq


E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0]
E2M1_BOUNDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def e2m1_codes(x):
    """Round to E2M1 codes (round to nearest, ties to even mantissa, like ModelOpt's _cast_fp4):
    |x| on a boundary goes down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5; |x| > 5 -> 6;
    sign bit 3 set for x < 0 (so -0.1 gives code 8, i.e. -0)."""
    bounds = torch.tensor(E2M1_BOUNDS)
    a = x.abs()
    code = torch.searchsorted(bounds, a.contiguous(), right=False)     # ties -> lower
    up = (a == 0.75) | (a == 1.75) | (a == 3.5)                         # ties -> even (upper)
    code = code + up.long()
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def nvfp4_quantize(w, gs=16):
    """ModelOpt NVFP4: weight_scale_2 = amax(W) / (6*448); weight_scale[n, b] =
    e4m3(amax(block) / (6*weight_scale_2)) (1.0 where that is 0); codes = e2m1(W / (weight_scale *
    weight_scale_2)); two codes per byte, low nibble = even column. Returns (packed U8 [N, K/2],
    weight_scale e4m3 [N, K/16], weight_scale_2 f32 scalar, dequantized f32 [N, K] computed as
    (E2M1 value * weight_scale) * weight_scale_2)."""
    N, K = w.shape
    assert K % gs == 0
    w = w.float()
    s2 = w.abs().amax() / (6.0 * 448.0)
    blk = w.view(N, K // gs, gs)
    sb = blk.abs().amax(-1) / (6.0 * s2)
    sb[sb == 0] = 1.0
    sb = sb.to(torch.float8_e4m3fn)
    den = sb.float() * s2
    code = e2m1_codes(blk / den[..., None]).view(N, K)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous()
    lut = torch.tensor(E2M1_VALUES)
    # E2M1 value * weight_scale is exact in fp32, so this is the correctly rounded exact product.
    deq = ((lut[code.long()].view(N, K // gs, gs) * sb.float()[..., None]) * s2).view(N, K)
    return packed, sb.contiguous(), s2.reshape(()), deq


def nvfp4_dequantize(packed, sb, s2):
    """Independent unpacking of the stored tensors (for the checks)."""
    lut = torch.tensor(E2M1_VALUES)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    vals = lut[codes]
    N, K = vals.shape
    return ((vals.view(N, K // 16, 16) * sb.float()[..., None]) * s2.float().reshape(())).view(N, K)


def read_checkpoint(path):
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    return sd


def write_checkpoint(path, tensors, config, extra_files=None):
    from safetensors.torch import save_file
    fresh_dir(path)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"), config)
    for name, obj in (extra_files or {}).items():
        write_json(os.path.join(path, name), obj)


def hf_tensor(model, key):
    """The in-memory tensor of a loaded transformers model that holds on-disk tensor `key`
    (per-expert keys map to slices of the fused expert parameters)."""
    m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
    if m:
        ex = model.get_submodule(m.group(1))
        e, I = int(m.group(2)), ex.down_proj.shape[2]
        if m.group(3) == "gate_proj":
            return ex.gate_up_proj[e, :I]
        if m.group(3) == "up_proj":
            return ex.gate_up_proj[e, I:]
        return ex.down_proj[e]
    parent, attr = key.rsplit(".", 1)
    return getattr(model.get_submodule(parent), attr)


def base_tensors_and_config(model):
    """The BF16 on-disk tensors (per-expert keys) and config.json transformers writes for `model`."""
    tmp = os.path.join(temp_dir(), "base")
    save_bf16(model, tmp)
    with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return read_checkpoint(tmp), cfg


def twin_dir(name):
    """Where a dequantized-weight twin goes: --twins-dir if given, else a temporary directory."""
    return os.path.join(TWINS_DIR[0] or temp_dir(), name)


TWINS_DIR = [None]


def stage_fp8(out):
    from transformers import DeepseekV3ForCausalLM
    root = fresh_dir(os.path.join(out, "parity", "fp8"))
    cfg = deepseek_config(hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                          num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                          num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=64,
                          kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                          v_head_dim=32, num_attention_heads=2, num_key_value_heads=2,
                          initializer_range=0.1)
    torch.manual_seed(7001)
    model = DeepseekV3ForCausalLM(cfg).eval()
    init_model_(model, torch.Generator().manual_seed(7002), router_std=2.0, bias_std=0.05)
    sd, config = base_tensors_and_config(model)

    qsd, tsd, quantized = {}, {}, []
    for key, t in sd.items():
        if re.match(QUANT_LINEAR, key):
            q, s, deq = fp8_block_quantize(t.float())
            qsd[key] = q
            qsd[key[:-len("weight")] + "weight_scale_inv"] = s
            tsd[key] = deq
            quantized.append(key)
        else:
            qsd[key] = t
            tsd[key] = t
    qconfig = dict(config)
    qconfig["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    qdir = os.path.join(root, "deepseek_v3_fp8")
    write_checkpoint(qdir, qsd, qconfig)
    tdir = twin_dir("deepseek_v3_fp8_dequant")
    write_checkpoint(tdir, tsd, config)
    log(f"  fp8: {len(quantized)} quantized linears; twin at {tdir}")
    kv_a = st_keys(qdir)["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a == ("F8_E4M3", [48, 256]), kv_a

    # Checks: the twin loads in transformers with exactly the hand-dequantized values, and
    # transformers' own FP8 dequantization of the FP8 checkpoint gives the same values.
    twin = load_model(tdir)
    for key in quantized:
        assert torch.equal(hf_tensor(twin, key).float(), tsd[key]), key
    unquantized_equal = all(torch.equal(hf_tensor(twin, k).float(), sd[k].float())
                            for k in sd if k not in quantized)
    assert unquantized_equal
    hf_deq = fp8_transformers_dequant_check(qdir, tsd, quantized)
    meta = {"model": "deepseek_v3_fp8", "config": jsonable(cfg.to_dict()),
            "quantized_tensors": sorted(quantized),
            "scale_grids": {k: list(qsd[k[:-len("weight")] + "weight_scale_inv"].shape)
                            for k in sorted(quantized)},
            "transformers_fp8_dequantize_check": hf_deq,
            "twin": "deepseek_v3_fp8_dequant (not committed): same tensors, quantized weights "
                    "replaced by float(q) * weight_scale_inv in F32, no quantization_config",
            "moe_layers": [1], "dense_layers": [0], "k": cfg.num_experts_per_tok,
            "num_experts": cfg.n_routed_experts, "rope": rope_facts(twin)}
    samples = ["model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
               "model.layers.1.self_attn.kv_b_proj.weight",
               "model.layers.1.self_attn.q_b_proj.weight",
               "model.layers.1.mlp.experts.3.up_proj.weight"]
    build_references(root, tdir, MoeSpec("deepseek", cfg.num_experts_per_tok, 1, 1),
                     cfg.vocab_size, {}, meta, seed0=7100,
                     extra={f"dequant.{k}": tsd[k] for k in samples})
    return {"dir": root}


def fp8_transformers_dequant_check(qdir, tsd, quantized):
    """Load the FP8 checkpoint with transformers' FineGrainedFP8Config(dequantize=True) (CPU, no
    kernel download) and compare its weights with the hand dequantization."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    try:
        m = AutoModelForCausalLM.from_pretrained(
            qdir, quantization_config=FineGrainedFP8Config(dequantize=True), **load_kwargs())
    except Exception as exc:      # recorded, not fatal: the twin is the oracle
        log(f"  transformers could not dequantize the FP8 checkpoint: {exc!r}")
        return {"loaded": False, "error": repr(exc)[:300]}
    worst = 0.0
    for key in quantized:
        got = hf_tensor(m, key).float()
        worst = max(worst, float((got.detach() - tsd[key]).abs().max()))
    log(f"  transformers FineGrainedFP8Config(dequantize=True): max diff vs hand dequant {worst}")
    assert worst == 0.0, worst
    return {"loaded": True, "max_abs_diff": worst}


NVFP4_TIE_VALUES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                    -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]


def e2m1_rounding_table():
    """Inputs (in units of the block scale) and the codes nvfp4_quantize assigns; includes every
    rounding boundary and both signs."""
    xs = [0.0, -0.0, 0.1, 0.25, 0.26, 0.5, 0.74, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75,
          3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0, -0.1, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
          -5.0, -6.0, -8.0]
    codes = e2m1_codes(torch.tensor(xs))
    return [{"x": x, "code": int(c), "value": E2M1_VALUES[int(c)]} for x, c in zip(xs, codes)]


def stage_nvfp4(out):
    from transformers import Qwen3MoeForCausalLM
    root = fresh_dir(os.path.join(out, "parity", "nvfp4"))
    cfg = qwen3_moe_config(hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[])
    torch.manual_seed(8001)
    model = Qwen3MoeForCausalLM(cfg).eval()
    init_model_(model, torch.Generator().manual_seed(8002), router_std=2.0)
    # Plant every E2M1 rounding tie in row 0, block 0 of layer 0 / expert 0 / gate_proj: values
    # t * 2^-3 with 6 * 2^-3 the tensor's amax, so weight_scale * weight_scale_2 is exactly 2^-3 and
    # W / (weight_scale * weight_scale_2) hits the ties exactly.
    tie_key = "model.layers.0.mlp.experts.0.gate_proj.weight"
    with torch.no_grad():
        gu = model.model.layers[0].mlp.experts.gate_up_proj
        gu[0, :cfg.moe_intermediate_size].clamp_(-0.7, 0.7)
        gu[0, 0, :16] = torch.tensor(NVFP4_TIE_VALUES) * 0.125
    sd, config = base_tensors_and_config(model)

    # Activation amax per quantized linear on a calibration batch, for input_scale.
    act_amax = nvfp4_calibrate(model, cfg)

    quant_re = (r"^model\.layers\.(\d+)\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|"
                r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight$")
    qsd, tsd, quantized, scale2 = {}, {}, [], {}
    for key, t in sd.items():
        m = re.match(quant_re, key)
        if not m:
            qsd[key] = t
            tsd[key] = t
            continue
        packed, sb, s2, deq = nvfp4_quantize(t.float())
        assert torch.equal(nvfp4_dequantize(packed, sb, s2), deq), key
        layer = int(m.group(1))
        mod = key[:-len(".weight")]
        inp = (act_amax[mod] / (6.0 * 448.0)).float()
        # Scalar shapes: layer 0 writes weight_scale_2 as [] and input_scale as [1]; layer 1 the
        # other way round (both occur in real exports).
        s2_shape, in_shape = ((), (1,)) if layer == 0 else ((1,), ())
        qsd[key] = packed
        qsd[mod + ".weight_scale"] = sb
        qsd[mod + ".weight_scale_2"] = s2.reshape(s2_shape).clone()
        qsd[mod + ".input_scale"] = inp.reshape(in_shape).clone()
        tsd[key] = deq
        quantized.append(key)
        scale2[mod] = float(s2)
    for L in range(cfg.num_hidden_layers):
        for e in range(cfg.num_experts):
            g = scale2[f"model.layers.{L}.mlp.experts.{e}.gate_proj"]
            u = scale2[f"model.layers.{L}.mlp.experts.{e}.up_proj"]
            assert g != u, (L, e)
    # The planted ties round to even.
    codes = e2m1_codes(sd[tie_key].float()[0, :16] / 0.125)
    want = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    tie_packed = qsd[tie_key][0, :8]
    got_codes = torch.stack([tie_packed & 0xF, tie_packed >> 4], -1).reshape(-1).tolist()
    assert codes.tolist() == want and got_codes == want, (codes.tolist(), got_codes)
    den = qsd[tie_key.replace("weight", "weight_scale")][0, 0].float() * \
        qsd[tie_key.replace("weight", "weight_scale_2")].float().reshape(())
    assert float(den) == 0.125, float(den)          # fp32 product, as the quantizer divides by it

    hf_quant = {"producer": {"name": "modelopt", "version": "0.0.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                 "group_size": 16,
                                 "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}
    qdir = os.path.join(root, "qwen3_moe_nvfp4")
    write_checkpoint(qdir, qsd, config, {"hf_quant_config.json": hf_quant})
    copy_tokenizer(out, qdir)
    tdir = twin_dir("qwen3_moe_nvfp4_dequant")
    write_checkpoint(tdir, tsd, config)
    log(f"  nvfp4: {len(quantized)} quantized linears; twin at {tdir}")

    twin = load_model(tdir)
    for key in quantized:
        assert torch.equal(hf_tensor(twin, key).detach().float(), tsd[key]), key
    meta = {"model": "qwen3_moe_nvfp4", "config": jsonable(cfg.to_dict()),
            "quantized_tensors": sorted(quantized),
            "weight_scale_2": scale2,
            "scalar_shapes": {"layer 0": {"weight_scale_2": [], "input_scale": [1]},
                              "layer 1": {"weight_scale_2": [1], "input_scale": []}},
            "e2m1_rounding": "round to nearest, ties to even (ModelOpt _cast_fp4): boundaries "
                             "0.25, 1.25, 2.5, 5 round down, 0.75, 1.75, 3.5 round up",
            "e2m1_rounding_table": e2m1_rounding_table(),
            "planted_ties": {"tensor": tie_key, "row": 0, "columns": "0..15",
                             "values_in_scale_units": NVFP4_TIE_VALUES, "codes": want,
                             "weight_scale_times_weight_scale_2": 0.125},
            "twin": "qwen3_moe_nvfp4_dequant (not committed): same tensors, quantized weights "
                    "replaced by their dequantized F32 values, no quantization files",
            "moe_layers": [0, 1], "dense_layers": [], "k": cfg.num_experts_per_tok,
            "num_experts": cfg.num_experts}
    samples = [tie_key, "model.layers.0.self_attn.k_proj.weight",
               "model.layers.1.mlp.experts.2.down_proj.weight"]
    build_references(root, tdir, MoeSpec("softmax", cfg.num_experts_per_tok), cfg.vocab_size,
                     {}, meta, seed0=8100, extra={f"dequant.{k}": tsd[k] for k in samples})
    return {"dir": root}


def nvfp4_calibrate(model, cfg):
    """amax of the input of every to-be-quantized linear (attention projections; per-expert
    gate/up input = routed hidden states, down input = act(gate) * up) on a calibration batch."""
    import torch.nn.functional as F
    amax = {}
    hooks = []

    def note(name, x):
        v = float(x.detach().abs().max()) if x.numel() else 0.0
        amax[name] = max(amax.get(name, 0.0), v)

    for name, mod in model.named_modules():
        if re.match(r"^model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$", name):
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out, name=name: note(name, inp[0])))
        if re.match(r"^model\.layers\.\d+\.mlp\.experts$", name):
            def hook(m, inp, out, name=name):
                x, idx = inp[0], inp[1]
                I = m.down_proj.shape[2]
                for e in range(m.gate_up_proj.shape[0]):
                    rows = (idx == e).any(-1)
                    xe = x[rows]
                    note(f"{name}.{e}.gate_proj", xe)
                    note(f"{name}.{e}.up_proj", xe)
                    gu = F.linear(xe, m.gate_up_proj[e])
                    note(f"{name}.{e}.down_proj", F.silu(gu[:, :I]) * gu[:, I:])
            hooks.append(mod.register_forward_hook(hook))
    forward_logits(model, probe_ids(cfg.vocab_size, 8999))
    for h in hooks:
        h.remove()
    for name in list(amax):
        if amax[name] == 0.0:            # an expert that got no calibration token
            amax[name] = max(amax.values())
    return {k: torch.tensor(v) for k, v in amax.items()}


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return None


def versions():
    import peft
    import safetensors
    import tokenizers
    import torch
    import transformers
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": git_commit(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Stages: " + ", ".join(STAGES))
    ap.add_argument("--out", required=True, help="output root, normally tests/data")
    ap.add_argument("--only", choices=STAGES, action="append",
                    help="run only this stage (repeatable); default: all stages")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--twins-dir", default=None,
                    help="also keep the dequantized-weight twins of the fp8/nvfp4 checkpoints in "
                         "this directory (default: a temporary directory, deleted at exit)")
    args = ap.parse_args()

    # Set iteration order inside PEFT (e.g. target_modules) depends on the string hash seed.
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    if args.twins_dir:
        TWINS_DIR[0] = os.path.abspath(args.twins_dir)
        os.makedirs(TWINS_DIR[0], exist_ok=True)
    import atexit
    atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in TEMP_DIRS])

    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    # PEFT 0.21 warns that rank/alpha_pattern keys for expert parameters "did not match any
    # targeted module" although it applies them to the ParamWrapper (checked via adapted_targets).
    warnings.filterwarnings("ignore", message=".*did not match any targeted module.*")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    import torch
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    stages = args.only or STAGES
    out = os.path.abspath(args.out)
    summary = {}
    for s in stages:
        log(f"=== stage {s}")
        summary[s] = STAGE_FUNCS[s](out)

    vpath = os.path.join(out, "parity", "versions.json")
    old = {}
    if os.path.exists(vpath):
        with open(vpath, encoding="utf-8") as f:
            old = json.load(f)
    v = versions()
    stage_versions = old.get("stages", {})
    for s in stages:
        stage_versions[s] = v
    write_json(vpath, {**v, "command": "python3 scripts/make_reference.py --out tests/data"
                       + "".join(f" --only {s}" for s in (args.only or [])),
                       "stages": stage_versions})
    for d in [os.path.join(out, "tokenizer"), os.path.join(out, "parity")]:
        for dirpath, _dirs, files in os.walk(d):
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o644)
    log(f"done: {json.dumps(summary)}")


STAGE_FUNCS = {
    "tokenizer": stage_tokenizer,
    "qwen3_moe": stage_qwen3_moe,
    "deepseek_v3": stage_deepseek_v3,
    "kimi_like": stage_kimi_like,
    "qwen3_5_moe": stage_qwen3_5_moe,
    "fp8": stage_fp8,
    "nvfp4": stage_nvfp4,
}

if __name__ == "__main__":
    main()
