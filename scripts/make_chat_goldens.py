#!/usr/bin/env python3
"""Renders the chat-template fixtures with Python's jinja2, the way Hugging Face transformers does,
so that tests/unit/chat_template_test.cpp can compare moelora's interpreter (src/chat) with it.

Writes, under tests/data/chat/:
  goldens.json   the real model templates (the <model>/ folders next to it) over a set of
                 conversations: plain turns, multi-turn, tool calls and results, reasoning, list
                 content, add_generation_prompt true / false, enable_thinking / thinking false, and
                 inputs the templates reject (their raise_exception messages are recorded);
  snippets.json  small templates, one engine feature each (whitespace control, filters, tests,
                 methods, macros, namespaces, loops, errors), rendered over a context.

The environment is the one transformers builds in apply_chat_template: an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, the loopcontrols extension and the
{% generation %} tag, transformers' own tojson filter (json.dumps, ensure_ascii=False) and the
raise_exception / strftime_now globals; the render variables are messages, tools, documents,
add_generation_prompt, the special tokens of tokenizer_config.json and the extra kwargs.

Usage: python3 scripts/make_chat_goldens.py   (needs jinja2: pip install jinja2, or
scripts/setup --python). Deterministic: running it twice writes the same files.
"""
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "chat")
MODELS = ["qwen3", "qwen3_5", "deepseek_v3", "kimi_k2_5"]
SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token"]


# ---- the transformers environment ----

class GenerationTag(Extension):
    """transformers' AssistantTracker minus the mask bookkeeping: {% generation %} renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_env()


def load_model(folder):
    """(template source, special tokens) of a model folder, found as transformers finds them."""
    config = {}
    config_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    tokens = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            tokens[key] = value
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), tokens
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}["default"]
    return template, tokens


def render(source, tokens, messages, tools, add_generation_prompt, kwargs):
    """{"expected": text} or {"error": message, "error_type": exception class}."""
    try:
        text = ENV.from_string(source).render(messages=messages, tools=tools, documents=None,
                                              add_generation_prompt=add_generation_prompt,
                                              **{**tokens, **kwargs})
        return {"expected": text}
    except Exception as e:  # the fixtures record what Python raised
        return {"error": str(e), "error_type": type(e).__name__}


# ---- conversations ----

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city. Température en °C.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "top_k": {"type": "integer", "default": 5}},
                       "required": ["query"]}}},
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER_CALLS = [
    call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"}),
    call("call_2", "get_weather", {"city": "東京", "days": 3, "flags": [True, None], "extra": {"ratio": 1.5, "note": "a\"b"}}),
]


def tool_conversation(content=None, calls=WEATHER_CALLS, final=True):
    messages = [SYSTEM, {"role": "user", "content": "What's the weather in Paris and Tokyo?"},
                {"role": "assistant", "content": content, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 18, \"sky\": \"clear\"}"},
                {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "{\"temp\": 22}"}]
    if final:
        messages.append({"role": "assistant", "content": "Paris is 18 °C and clear; Tokyo is 22 °C."})
    return messages


CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [SYSTEM, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
    "multi_turn_answered": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}],
    "reasoning": [{"role": "user", "content": "What is 7*6?"},
                  {"role": "assistant", "content": "42", "reasoning_content": "7 times 6 is 42."},
                  {"role": "user", "content": "And 8*9?"},
                  {"role": "assistant", "content": "72", "reasoning_content": "\n8 times 9 is 72.\n"}],
    "inline_think": [{"role": "user", "content": "Greet me."},
                     {"role": "assistant", "content": "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"}],
    "unicode_and_markup": [{"role": "user", "content": "Grüße! 你好 😀 \"quoted\" back\\slash\ttab {{ not_a_tag }} {% raw %}"},
                           {"role": "assistant", "content": "Ça va? 🙂\nline two"},
                           {"role": "user", "content": "  padded  \n"}],
}

TOOL_CONVERSATIONS = {
    "tool_calls_no_content": tool_conversation(None),
    "tool_calls_with_content": tool_conversation("Let me check both cities."),
    "tool_results_pending": tool_conversation("", final=False),
}

# DeepSeek-V3's template concatenates arguments as text: they must be JSON strings there.
DEEPSEEK_CALLS = [call("call_1", "get_weather", "{\"city\": \"Paris\"}"),
                  call("call_2", "get_weather", "{\"city\": \"東京\", \"days\": 3}")]

LIST_CONTENT = [{"role": "user", "content": [{"type": "text", "text": "Describe these."},
                                             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                             {"type": "text", "text": "Be brief."}]}]


def cases_for(model):
    """(name, messages, tools, add_generation_prompt, kwargs) of one model's fixtures."""
    out = []
    for name, messages in CONVERSATIONS.items():
        out.append((name + "_gen", messages, None, True, {}))
        out.append((name + "_nogen", messages, None, False, {}))
    if model == "deepseek_v3":
        base = tool_conversation(None, DEEPSEEK_CALLS)
        out.append(("tool_calls_gen", base, TOOLS, True, {}))
        out.append(("tool_results_pending_gen", base[:-1], TOOLS, True, {}))
        out.append(("one_tool_call_nogen", tool_conversation(None, DEEPSEEK_CALLS[:1]), None, False, {}))
        out.append(("two_system_messages_gen", [SYSTEM, {"role": "system", "content": "Be terse."},
                                                {"role": "user", "content": "Hi"}], None, True, {}))
        out.append(("error_dict_arguments", tool_conversation(None), TOOLS, True, {}))
        out.append(("error_list_content", LIST_CONTENT, None, True, {}))
        return out
    for name, messages in TOOL_CONVERSATIONS.items():
        out.append((name + "_tools_gen", messages, TOOLS, True, {}))
        out.append((name + "_nogen", messages, None, False, {}))
    out.append(("string_arguments_gen", tool_conversation(None, [call("call_9", "search", "{\"query\": \"moe\"}")]),
                TOOLS, True, {}))
    out.append(("list_content_gen", LIST_CONTENT, None, True, {}))
    if model in ("qwen3", "qwen3_5"):
        out.append(("no_thinking_gen", CONVERSATIONS["system_user"], None, True, {"enable_thinking": False}))
        out.append(("no_thinking_tools_gen", TOOL_CONVERSATIONS["tool_results_pending"], TOOLS, True,
                    {"enable_thinking": False}))
        out.append(("thinking_true_gen", CONVERSATIONS["single_user"], None, True, {"enable_thinking": True}))
    if model == "qwen3_5":
        out.append(("vision_ids_gen", [{"role": "user", "content": [
            {"type": "image", "image": "a.png"}, {"type": "video", "video": "b.mp4"},
            {"type": "image_url", "image_url": {"url": "c.png"}}, {"type": "text", "text": "Compare."}]}],
            None, True, {"add_vision_id": True}))
        out.append(("error_no_messages", [], None, True, {}))
        out.append(("error_no_user_query", [SYSTEM], None, True, {}))
        out.append(("error_late_system", [{"role": "user", "content": "Hi"}, SYSTEM], None, True, {}))
        out.append(("error_unknown_role", [{"role": "user", "content": "Hi"}, {"role": "critic", "content": "x"}],
                    None, True, {}))
        out.append(("error_system_image", [{"role": "system", "content": [{"type": "image", "image": "x"}]},
                                           {"role": "user", "content": "Hi"}], None, True, {}))
    if model == "kimi_k2_5":
        out.append(("no_thinking_gen", CONVERSATIONS["reasoning"][:3], None, True, {"thinking": False}))
        out.append(("tools_ts_str_gen", CONVERSATIONS["single_user"], TOOLS, True,
                    {"tools_ts_str": "# Tools\n\n## functions\nnamespace functions {\n// Search the web.\ntype search = (_: {query: string}) => any;\n}"}))
        out.append(("named_speakers_gen", [{"role": "system", "content": "Be nice."},
                                           {"role": "user", "name": "alice", "content": "Hi"},
                                           {"role": "assistant", "name": "kimi", "content": "Hello Alice"},
                                           {"role": "user", "content": "Again"}], None, True, {}))
        out.append(("null_reasoning_gen", [{"role": "user", "content": "Q"},
                                           {"role": "assistant", "content": "A", "reasoning_content": None},
                                           {"role": "user", "content": "Q2"}], None, True, {}))
    return out


# ---- engine snippets ----

SNIPPET_CONTEXT = {
    "s": "Hello World", "n": 7, "f": 2.5, "items": [3, 1, 2], "words": ["b", "A", "c", "a"],
    "d": {"b": 1, "a": [1, 2], "c": {"x": None}}, "t": True, "none": None, "empty": "",
    "users": [{"name": "ann", "age": 31, "admin": True}, {"name": "bob", "age": 25, "admin": False},
              {"name": "cy", "age": 40}],
    "uni": "héllo wörld ✓", "text": "  a\n\tb  ", "nested": [[1, 2], [3, 4]],
}

SNIPPETS = [
    # whitespace control, trim_blocks, lstrip_blocks
    ("ws_dash_both", "a  {{- 'b' -}}  c"),
    ("ws_dash_block", "x\n  {%- if t %}\n  y\n  {%- endif %}\nz"),
    ("ws_lstrip_trim", "<ul>\n  {% for i in items %}\n  <li>{{ i }}</li>\n  {% endfor %}\n</ul>"),
    ("ws_plus_disables_lstrip", "a\n  {%+ if t %}b{% endif %}\nc"),
    ("ws_plus_disables_trim", "{% if t +%}\nb{% endif %}"),
    ("ws_comment", "a\n  {# note #}\nb {#- tight -#} c"),
    ("ws_var_not_trimmed", "{{ 'x' }}\ny"),
    ("ws_trailing_newline", "line\n"),
    ("ws_crlf", "a\r\n{% if t %}\r\nb\r\n{% endif %}\r\nc"),
    ("ws_raw", "{% raw %}{{ not evaluated }}{% endraw %}|{%- raw -%}  {% x %}  {%- endraw %}|"),
    ("ws_inline_if", "{% for i in items %}{{ i }}{% if not loop.last %}, {% endif %}{% endfor %}"),
    # literals, operators, precedence
    ("literals", "{{ 1 }} {{ 1.0 }} {{ 1e16 }} {{ 0.1 + 0.2 }} {{ -0.0 }} {{ 'a' 'b' }} {{ true }} {{ none }} {{ [1, 'x', none] }} {{ {'k': 'v'} }}"),
    ("string_escapes", "{{ 'tab\\tnl\\nq\\'\\\"\\u00e9\\x41' }}|{{ \"it's\" }}"),
    ("arith", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 1 + 2.5 }} {{ true + 1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }}"),
    ("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ not t and false }} {{ 2 ** 3 ** 2 }} {{ 1 + items|length }} {{ -n|abs }}"),
    ("concat", "{{ 'a' ~ 1 ~ none ~ undefined_var ~ [1] }}"),
    ("compare", "{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ [1, 2] == [1, 2] }} {{ 'b' >= 'a' }} {{ d == {'a': [1, 2], 'b': 1, 'c': {'x': none}} }}"),
    ("in_not_in", "{{ 'ell' in s }} {{ 2 in items }} {{ 'a' in d }} {{ 'z' not in d }} {{ 5 not in items }} {{ 'x' in undefined_var }}"),
    ("and_or_values", "{{ 0 or 'x' }}|{{ '' and 'y' }}|{{ 'p' and 'q' }}|{{ none or none }}"),
    ("cond_expr", "{{ 'yes' if t else 'no' }}|{{ 'yes' if none }}|{{ 'a' if false else 'b' if t else 'c' }}"),
    # subscripts, slices, attributes, undefined
    ("subscripts", "{{ items[0] }} {{ items[-1] }} {{ s[1] }} {{ d['b'] }} {{ d.c.x }} {{ nested[1][0] }} {{ nested.0.1 }} {{ uni[1] }}"),
    ("slices", "{{ items[::-1] }} {{ items[1:] }} {{ s[:5] }} {{ s[::2] }} {{ s[-5:] }} {{ uni[::-1] }} {{ items[5:] }} {{ s[2:-2:3] }} {{ items[-100:100] }}"),
    ("undefined", "[{{ missing }}][{{ d.missing }}][{{ items[10] }}][{{ missing is defined }}][{{ d.missing is undefined }}][{{ missing|length }}][{{ none.x }}]"),
    ("undefined_loop", "{% for x in missing %}{{ x }}{% else %}empty{% endfor %}"),
    # statements
    ("if_elif_else", "{% for v in [0, 1, 2] %}{% if v == 0 %}zero{% elif v == 1 %}one{% else %}many{% endif %};{% endfor %}"),
    ("for_loop_vars", "{% for x in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}[{{ loop.previtem }}|{{ loop.nextitem }}] {% endfor %}"),
    ("for_reverse_filter", "{% for x in items|reverse %}{{ x }}{% endfor %}|{% for x in items[::-1] %}{{ x }}{% endfor %}"),
    ("for_unpack_items", "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}|{% for k, v in d.items() %}{{ k }};{% endfor %}"),
    ("for_dict_keys", "{% for k in d %}{{ k }}{% endfor %}|{% for c in 'héllo' %}{{ c }}.{% endfor %}"),
    ("for_else", "{% for x in [] %}x{% else %}none{% endfor %}"),
    ("for_inline_filter", "{% for x in items if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %}"),
    ("for_nested_loop", "{% for row in nested %}{% for x in row %}{{ loop.index }}{% endfor %}-{{ loop.index }} {% endfor %}"),
    ("for_break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
    ("for_cycle", "{% for x in items %}{{ loop.cycle('a', 'b') }}{% endfor %}"),
    ("set_scoping", "{% set x = 1 %}{% for i in items %}{% set x = i %}{{ x }}{% endfor %}|{{ x }}"),
    ("set_in_if", "{% if t %}{% set y = 'in-if' %}{% endif %}{{ y }}"),
    ("set_block", "{% set block %}  Hi {{ s }}  {% endset %}[{{ block }}]{% set b2 | upper | trim %} up {% endset %}[{{ b2 }}]"),
    ("set_tuple", "{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set c = 1, 2 %}{{ c }}"),
    ("namespace", "{% set ns = namespace(count=0, names=[]) %}{% for u in users %}{% set ns.count = ns.count + u.age %}{% endfor %}{{ ns.count }} {{ ns.names }}"),
    ("namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns.c }}"),
    ("loop_control_in_blocks", "{% for i in range(4) %}{% set x %}a{{ i }}{% if i == 1 %}{% break %}{% endif %}{% endset %}[{{ x }}]{% endfor %}|{% for i in range(4) %}{% filter upper %}a{{ i }}{% if i == 1 %}{% break %}{% endif %}{% endfilter %}{% endfor %}|{% for i in range(3) %}{% with %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endwith %}{% endfor %}"),
    ("tuples", "{{ (1, 2) * 2 }} {{ (1,) + (2,) }} {{ (1, 2)[::-1] }} {{ (1, 2) == [1, 2] }} {{ ('a',) }} {{ ('x', 'y')|list }}"),
    ("with_block", "{% with a = 1, b = 'two' %}{{ a }}{{ b }}{% endwith %}[{{ a }}]"),
    ("filter_block", "{% filter upper %}hello {{ s }}{% endfilter %}"),
    ("generation_tag", "a{% generation %}b{{ s }}{% endgeneration %}c"),
    # macros and call
    ("macro_args", "{% macro m(a, b=2, c=a) %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, 3) }} {{ m(1, c=9) }} {{ m() }}"),
    ("macro_scope", "{% set outer = 'O' %}{% macro m() %}{{ outer }}{% set outer = 'inner' %}{{ outer }}{% endmacro %}{{ m() }}{{ outer }}"),
    ("macro_recursive", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% endmacro %}{{ fact(5) }}"),
    ("macro_whitespace", "{%- macro item(x) %}\n  <{{ x }}>\n{%- endmacro %}\n[{{ item(1) }}][{{ item(2)|trim }}]"),
    ("macro_varargs_kwargs", "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k='v') }}|{{ m(0) }}"),
    ("call_block", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ s }}{% endcall %}"),
    ("call_block_args", "{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(v) each(items) %}[{{ v }}]{% endcall %}"),
    # filters
    ("f_tojson", "{{ d|tojson }}|{{ uni|tojson }}|{{ 'a\"b\\\\c\\n'|tojson }}|{{ [1.5, none, true, 1e20]|tojson }}|{{ {}|tojson }}"),
    ("f_tojson_options", "{{ d|tojson(indent=2) }}|{{ d|tojson(separators=(',', ':')) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|{{ uni|tojson(ensure_ascii=true) }}|{{ '😀'|tojson(ensure_ascii=true) }}"),
    ("f_trim", "[{{ text|trim }}][{{ '--x--'|trim('-') }}][{{ none|trim }}]"),
    ("f_length", "{{ items|length }} {{ uni|length }} {{ d|count }} {{ ''|length }}"),
    ("f_first_last", "{{ items|first }} {{ items|last }} {{ s|first }} {{ d|first }} [{{ []|first }}]"),
    ("f_join", "{{ items|join(', ') }} {{ words|join }} {{ users|join('/', attribute='name') }}"),
    ("f_default", "{{ missing|default('dflt') }} {{ none|default('dflt') }} {{ empty|default('dflt', true) }} {{ s|d('x') }} [{{ missing|default }}]"),
    ("f_items_list", "{{ d|items|list }} {{ s|list }} {{ d|list }} {{ missing|items|list }}"),
    ("f_string_int_float", "{{ 3|string }}{{ none|string }}{{ [1, 'a']|string }} {{ '42'|int + 1 }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(5) }} {{ 3.9|int }} {{ true|int }} {{ '2.5'|float }} {{ 'x'|float }}"),
    ("f_case", "{{ s|upper }} {{ s|lower }} {{ 'hello world'|title }} {{ \"they're-fine(ok)\"|title }} {{ 'hELLO'|capitalize }} {{ uni|upper }}"),
    ("f_replace", "{{ s|replace('o', '0') }} {{ s|replace('l', 'L', 2) }} {{ 'ab'|replace('', '-') }}"),
    ("f_safe_escape", "{{ '<b>'|safe }} {{ '<a href=\"x\">&\\''|e }}"),
    ("f_selectattr", "{{ users|selectattr('admin')|map(attribute='name')|list }} {{ users|rejectattr('admin')|map(attribute='name')|join(',') }} {{ users|selectattr('age', 'gt', 30)|map(attribute='name')|list }} {{ users|selectattr('admin', 'defined')|list|length }}"),
    ("f_map_select", "{{ words|map('upper')|list }} {{ items|select('odd')|list }} {{ items|reject('odd')|list }} {{ users|map(attribute='missing', default='-')|list }}"),
    ("f_sort_unique", "{{ words|sort }} {{ words|sort(case_sensitive=true) }} {{ items|sort(reverse=true) }} {{ users|sort(attribute='age')|map(attribute='name')|list }} {{ ['a', 'A', 'b']|unique|list }} {{ d|dictsort }}"),
    ("f_min_max_sum", "{{ items|min }} {{ items|max }} {{ words|min }} {{ items|sum }} {{ users|sum(attribute='age') }} {{ users|max(attribute='age')|attr('name') }}"),
    ("f_misc", "{{ -3|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ 3|round }} {{ 'a\\nb'|indent(2) }} {{ 'a\\nb'|indent(2, true) }} {{ items|reverse|list }} {{ s|reverse }}"),
    # tests
    ("tests_types", "{{ s is string }}{{ n is number }}{{ t is number }}{{ n is integer }}{{ f is float }}{{ t is boolean }}{{ d is mapping }}{{ items is sequence }}{{ s is iterable }}{{ n is iterable }}{{ none is none }}{{ missing is iterable }}{{ d is not mapping }}"),
    ("tests_float_numbers", "{{ 2.5 is odd }}{{ 3.0 is odd }}{{ 4.0 is even }}{{ 7.5 is divisibleby 2.5 }}{{ -3 is odd }}"),
    ("tests_values", "{{ n is odd }}{{ n is even }}{{ 9 is divisibleby 3 }}{{ t is true }}{{ false is false }}{{ 1 is true }}{{ 2 is in items }}{{ 'a' is eq 'a' }}{{ 3 is gt 2 }}{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ none is sameas none }}{{ s is callable }}"),
    # methods
    ("m_string", "{{ s.startswith('He') }}{{ s.endswith(('x', 'ld')) }} [{{ text.strip() }}][{{ text.lstrip() }}][{{ text.rstrip() }}][{{ '--x--'.strip('-') }}] {{ s.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }}"),
    ("m_string_more", "{{ s.replace('l', '_') }} {{ s.upper() }} {{ s.lower() }} {{ \"they're bob's\".title() }} {{ 'x'.join(['1', '2']) }} {{ s.find('o') }} {{ uni.find('w') }} {{ s.count('l') }} {{ 'a\\nb\\r\\nc'.splitlines() }} {{ s.capitalize() }}"),
    ("m_split_maxsplit", "{{ '  a  b  c '.split(None, 1) }}{{ '  a  b  c '.rsplit(None, 1) }}{{ ' x '.split(None, 0) }}{{ 'a,b,c'.rsplit(',', 5) }}"),
    ("m_dict", "{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.items()|list }}"),
    ("m_list", "{{ items.index(2) }} {{ items.count(3) }}"),
    ("globals", "{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ dict(a=1, b='x') }}"),
    # errors (the C++ test only checks that they fail)
    ("err_raise", "{{ raise_exception('Custom failure: ' ~ n) }}"),
    ("err_undefined_attr_chain", "{{ missing.attr }}"),
    ("err_undefined_call", "{{ missing() }}"),
    ("err_type_add", "{{ 1 + 'a' }}"),
    ("err_none_iter", "{% for x in none %}{% endfor %}"),
    ("err_items_not_mapping", "{{ items|items|list }}"),
    ("err_unsafe_append", "{{ items.append(4) }}"),
    ("err_syntax_unclosed", "{% if t %}never closed"),
    ("err_syntax_bad_tag", "{% frobnicate %}"),
    ("err_syntax_expr", "{{ 1 + }}"),
    ("err_unknown_filter", "{{ s|no_such_filter }}"),
    ("err_unknown_test", "{{ s is no_such_test }}"),
    ("err_division_by_zero", "{{ 1 / 0 }}"),
    ("err_namespace_assign", "{% set x = 1 %}{% set x.y = 2 %}"),
    ("err_unpack", "{% for a, b in items %}{% endfor %}"),
]


def main():
    goldens = []
    for model in MODELS:
        folder = os.path.join(DATA, model)
        source, tokens = load_model(folder)
        for name, messages, tools, gen, kwargs in cases_for(model):
            case = {"model": model, "name": name, "messages": messages,
                    "add_generation_prompt": gen}
            if tools is not None:
                case["tools"] = tools
            if kwargs:
                case["kwargs"] = kwargs
            case.update(render(source, tokens, messages, tools, gen, kwargs))
            goldens.append(case)
    snippets = []
    for name, source in SNIPPETS:
        case = {"name": name, "source": source}
        case.update(render(source, {}, [], None, False, SNIPPET_CONTEXT))
        snippets.append(case)
    outputs = {"goldens.json": goldens, "snippets.json": {"context": SNIPPET_CONTEXT, "cases": snippets}}
    for name, payload in outputs.items():
        with open(os.path.join(DATA, name), "w", encoding="utf-8") as f:
            json.dump(payload, f, ensure_ascii=False, indent=1)
            f.write("\n")
    errors = sum(1 for c in goldens if "error" in c)
    print(f"jinja2 {jinja2.__version__}: {len(goldens)} template renders ({errors} expected errors), "
          f"{len(snippets)} snippets -> {os.path.relpath(DATA, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
