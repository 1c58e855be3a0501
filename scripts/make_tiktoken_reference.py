#!/usr/bin/env python3
"""Generate the tiktoken-format tokenizer fixture under tests/data/tokenizer_tiktoken.

Why this exists: Kimi-K2 / K2.5 ship `tiktoken.model` (one "base64(token bytes) rank" line per
token) plus remote code (`tokenization_kimi.py`) holding the pre-tokenization regex and the special
tokens, instead of a tokenizer.json. The real rank file is not available offline, so this script
builds a small but real one and records what Python `tiktoken` makes of many strings:

  1. the byte-level BPE vocabulary of tests/data/tokenizer/tokenizer.json (GPT-2 byte alphabet) is
     converted the standard way: every non-added token is mapped back to its raw bytes and gets a
     rank in increasing id order (ranks 0..n-1, contiguous);
  2. tiktoken.model and a Kimi-style tokenizer_config.json are written: the special tokens follow
     the layout of tokenization_kimi.py, i.e. ids n .. n+257 (num_reserved_special_tokens = 256,
     plus 2), named from added_tokens_decoder or "<|reserved_token_{id}|>";
  3. goldens.json: ids of a few thousand strings, encoded like TikTokenTokenizer.encode does
     (texts cut into runs of at most 25,000 whitespace / non-whitespace characters, then
     tiktoken's encode with allowed_special="all"), plus, for the character classes of the pattern
     that use class intersection (`&&`, not available in PCRE2), the code points that tiktoken's
     regex engine puts in each class (as ranges), so the C++ translation can be checked on every
     code point.

Usage:
    python3 -m venv /tmp/tkenv && /tmp/tkenv/bin/pip install tiktoken
    /tmp/tkenv/bin/python scripts/make_tiktoken_reference.py --out tests/data/tokenizer_tiktoken
"""

import argparse
import base64
import json
import os
import random
import sys

import tiktoken

# tokenization_kimi.py, TikTokenTokenizer.pat_str (Kimi-K2, K2.5, Kimi-Linear share it).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000  # TikTokenTokenizer.encode: TIKTOKEN_MAX_ENCODE_CHARS
MAX_RUN_CHARS = 25_000  # TikTokenTokenizer.encode: MAX_NO_WHITESPACES_CHARS

# Classes of the pattern with intersections, checked code point by code point.
CLASSES = {
    "upper_no_han": r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]",
    "lower_no_han": r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]",
    "han": r"[\p{Han}]",
}

# Offsets from the first special id, laid out like Kimi-K2's tokenizer_config.json.
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}


def bytes_to_unicode():
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def convert_vocab(tokenizer_json):
  """HF byte-level BPE vocab -> {token bytes: rank}, ranks in id order, added tokens left out."""
  data = json.load(open(tokenizer_json, encoding="utf-8"))
  added = {t["id"] for t in data.get("added_tokens", [])}
  decoder = {c: b for b, c in bytes_to_unicode().items()}
  ranks = {}
  for token, token_id in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
    if token_id in added:
      continue
    raw = bytes(decoder[c] for c in token)
    assert raw not in ranks, token
    ranks[raw] = len(ranks)
  assert all(bytes([b]) in ranks for b in range(256)), "every byte needs a rank"
  return ranks


def is_py_space(ch):
  return ch.isspace()


def split_runs(s, limit):
  """TikTokenTokenizer._split_whitespaces_or_nonwhitespaces."""
  run_len = 0
  run_space = s[0].isspace() if s else False
  start = 0
  for i, ch in enumerate(s):
    now_space = ch.isspace()
    if run_space ^ now_space:
      run_len = 1
      run_space = now_space
    else:
      run_len += 1
      if run_len > limit:
        yield s[start:i]
        start = i
        run_len = 1
  yield s[start:]


def kimi_encode(enc, text):
  ids = []
  for i in range(0, len(text), MAX_ENCODE_CHARS):
    for sub in split_runs(text[i:i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
      ids.extend(enc.encode(sub, allowed_special="all"))
  return ids


def test_strings(specials, seed):
  fixed = [
      "", "Hello world", "Hello world ", " Hello world", "hello   world", "  leading", "trailing  ",
      "I'm here, you're there; they'll come. We'd've", "DON'T SHOUT, I'M HERE", "It'S OdD'Ll",
      "don't", "DoN'T", "'s alone", "x's 'S", "CamelCaseWordsHERE", "HTTPServerError", "iPhone",
      "ABC", "abc", "aBC", "Abc", "ǅungla ǈubav", "ʰʲʷ modifier ˢ", "A\u0301bc e\u0301",
      "123", "1234567", "3.14159", "1,000,000", "٣٤٥ ١٢", "12abc34", "v1.2.3-rc4",
      "\n", "\n\n", "\r\n", " \n ", "a\n\nb", "a \n b", "tab\tsep\t\tx", "   \n\n   x", "x   ",
      "\u00a0nbsp\u3000ideographic space", "\u2028line sep\u2029para", "\x1c\x1d\x1e\x1f units",
      "中文分词测试", "你好，世界！", "汉字abc汉字", "A中B", "中a", "日本語のテキスト、カタカナ。",
      "ひらがなとカタカナ", "ｶﾀｶﾅ半角", "한국어 텍스트", "Привет, мир!", "Ελληνικά", "עברית שלום",
      "مرحبا بالعالم", "हिन्दी भाषा", "ไทย ภาษา", "〆切〃々〇", "「引用」『二重』【括弧】",
      "ー長音ー", "㐀㐁 𠀀𠀁 𪜀", "⺀⺁ ⼀⼁", "漢字ｶﾅ", "Ⅻ roman Ⅷ", "①②③", "²³ superscripts",
      "😀 emoji 👍🏽 family 👨‍👩‍👧", "🇩🇪🇯🇵 flags", "✓ ✗ → ← ∀x∈ℝ", "e = mc²",
      "def foo(x):\n    return x + 1\n", "int main() { return 0; }", "for (i=0;i<n;++i) a[i]=b[i];",
      "<html><body class=\"x\">hi</body></html>", "SELECT * FROM t WHERE id = 42;",
      "path/to/file.txt", "https://example.com/a?b=c&d=e", "user@example.com", "#!/bin/bash",
      "    indented", "\t\tdouble tab", "a  b   c    d", "!!!???", "...", "---", "___init___",
      "$$$ 100%", "(parenthesis)", "[brackets]", "{braces}", "\"quotes\" 'single'",
      "`backticks`", "~tilde^caret", "emoji🙂text", "mixed中文English日本語한국어",
      "Ωmega ωmega", "straße STRASSE", "ﬁ ligature", "İstanbul ı", "ǈ titlecase",
  ]
  for s in specials:
    fixed += [s, "a" + s + "b", " " + s + " ", s + s, "x " + s + "\n", s[:-1], s[1:] + s]
  fixed += [
      "[BOS]Hello[EOS]", "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>",
      "<|im_end|<|im_end|>", "<|reserved_token_300|>", "[BOS[BOS]]", "<|im_system|>system",
  ]
  fragments = [
      "the", " the", "The", " THE", "a", " ", "  ", "\n", "\r\n", "\t", "'s", "'T", "'re", "'Ll", "'d",
      "中", "文", "字", "你好", "世界", "の", "カ", "ー", "。", "、", "「", "」", "ｶ", "한", "글",
      "é", "e\u0301", "ß", "Ω", "ǅ", "ʰ", "1", "23", "4567", "٣", "Ⅻ", "²", "😀", "👍🏽", "‍", "🇯🇵",
      ".", ",", "!", "?", "(", ")", "{", "}", "=", "==", "->", "::", "/", "\\", "#", "@", "$", "%",
      "\u00a0", "\u3000", "\u2028", "\x1c", "def", " return", "x", "Y", "zz", "HTTP", "Server",
      "iPhone", "don't", "I'M", "abc123", "0x1F", "\u0300", "\u093f", "क", "ि", "𠀀", "㐀", "⺀",
  ]
  rng = random.Random(seed)
  generated = []
  for _ in range(2400):
    parts = [rng.choice(fragments) for _ in range(rng.randint(1, 12))]
    if rng.random() < 0.15:
      parts.insert(rng.randint(0, len(parts)), rng.choice(specials))
    generated.append("".join(parts))
  for _ in range(300):  # random code points from many blocks
    chars = []
    for _ in range(rng.randint(1, 16)):
      cp = rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff), rng.randint(0x3000, 0x9fff),
                       rng.randint(0xac00, 0xd7a3), rng.randint(0xf900, 0xfffd),
                       rng.randint(0x1f300, 0x1faff), rng.randint(0x20000, 0x2a6df)])
      if 0xd800 <= cp <= 0xdfff:
        continue
      chars.append(chr(cp))
    generated.append("".join(chars))
  # Runs longer than MAX_RUN_CHARS, where the cutting of TikTokenTokenizer.encode changes the ids.
  long_runs = ["e" + "er" * 12500, " " * 25003 + "x"]
  return fixed + generated + long_runs


def class_ranges(pattern, ranks):
  """Code points that tiktoken's regex engine puts in `pattern` (a one-character class)."""
  enc = tiktoken.Encoding(name="class", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
  ranges = []
  for cp in range(0x110000):
    if 0xd800 <= cp <= 0xdfff:
      continue
    if enc.encode_ordinary(chr(cp)):
      if ranges and ranges[-1][1] == cp - 1:
        ranges[-1][1] = cp
      elif ranges and ranges[-1][1] == 0xd7ff and cp == 0xe000:
        ranges[-1][1] = cp
      else:
        ranges.append([cp, cp])
  return ranges


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="tests/data/tokenizer_tiktoken")
  parser.add_argument("--vocab", default="tests/data/tokenizer/tokenizer.json")
  parser.add_argument("--seed", type=int, default=1234)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)

  ranks = convert_vocab(args.vocab)
  with open(os.path.join(args.out, "tiktoken.model"), "w", encoding="ascii", newline="\n") as f:
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
      f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")

  base = len(ranks)
  added = {str(base + off): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True} for off, c in KIMI_SPECIALS.items()}
  config = {
      "added_tokens_decoder": added,
      "additional_special_tokens": [c for off, c in sorted(KIMI_SPECIALS.items()) if 2 <= off < 254],
      "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
      "bos_token": "[BOS]",
      "clean_up_tokenization_spaces": False,
      "eos_token": "<|im_end|>",
      "model_max_length": 1000000000000000019884624838656,
      "pad_token": "[PAD]",
      "tokenizer_class": "TikTokenTokenizer",
      "unk_token": "[UNK]",
  }
  with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
    f.write("\n")

  # TikTokenTokenizer.__init__: special ids base .. base+257, named from added_tokens_decoder.
  special_tokens = {KIMI_SPECIALS.get(i - base, f"<|reserved_token_{i}|>"): i
                    for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS + 2)}
  enc = tiktoken.Encoding(name="tiktoken.model", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                          special_tokens=special_tokens)
  cases = []
  for text in test_strings(list(KIMI_SPECIALS.values()) + [f"<|reserved_token_{base + 5}|>"], args.seed):
    ids = kimi_encode(enc, text)
    assert enc.decode_bytes(ids) == text.encode("utf-8"), text
    cases.append({"text": text, "ids": ids})
  goldens = {
      "tiktoken_version": tiktoken.__version__,
      "python": sys.version.split()[0],
      "pat_str": KIMI_PAT_STR,
      "num_base_tokens": base,
      "num_special_tokens": NUM_RESERVED_SPECIAL_TOKENS + 2,
      "classes": {name: {"pattern": p, "ranges": class_ranges(p, ranks)} for name, p in CLASSES.items()},
      "cases": cases,
  }
  with open(os.path.join(args.out, "goldens.json"), "w", encoding="utf-8") as f:
    json.dump(goldens, f, ensure_ascii=False, separators=(",", ":"))
    f.write("\n")
  print(f"{len(ranks)} ranks, {len(special_tokens)} special tokens, {len(cases)} cases -> {args.out}")


if __name__ == "__main__":
  main()
