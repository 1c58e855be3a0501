// Tests of the chat-template module (chat/chat_template.h) and its Jinja2 interpreter.
//
// Three kinds of checks:
//  - parity with Python's jinja2 rendering the way transformers does: tests/data/chat/goldens.json
//    holds the real Qwen3, Qwen3.5, DeepSeek-V3 and Kimi-K2.5 templates (the <model>/ folders)
//    rendered over conversations with tools, reasoning and thinking switches, and
//    snippets.json one small template per engine feature (scripts/make_chat_goldens.py writes
//    both); inputs Python rejects must be rejected here too;
//  - engine features one by one, with expectations written out here;
//  - loading rules, error codes and line/column in messages, and the limits that keep bad
//    templates from crashing or exhausting the process.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/error.h"
#include "support/test_support.h"

namespace moelora::chat {
namespace {

using nlohmann::ordered_json;
using test::TempDir;

std::filesystem::path chat_data() {
  return test::data_dir() / "chat";
}

ordered_json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "missing fixture " << path
                         << " (scripts/make_chat_goldens.py writes it)";
  return in.good() ? ordered_json::parse(in) : ordered_json::array();
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// Renders `source` with `kwargs` as the template variables and no messages.
std::string render(const std::string& source, const ordered_json& kwargs = ordered_json::object()) {
  return ChatTemplate::from_source(source).render(ordered_json::array(), false, std::nullopt,
                                                  kwargs);
}

// The moelora::Error of rendering `source` (empty message when nothing was thrown).
Error render_error(const std::string& source, const ordered_json& kwargs = ordered_json::object(),
                   const RenderLimits* limits = nullptr) {
  try {
    ChatTemplate t = ChatTemplate::from_source(source, ordered_json::object(), "test.jinja");
    if (limits) t.set_limits(*limits);
    t.render(ordered_json::array(), false, std::nullopt, kwargs);
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorCode::kInternal, "");
}

// First difference of two texts, for readable failures on long prompts.
::testing::AssertionResult same_text(const std::string& actual, const std::string& expected) {
  if (actual == expected) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (i < actual.size() && i < expected.size() && actual[i] == expected[i]) ++i;
  const size_t from = i < 40 ? 0 : i - 40;
  return ::testing::AssertionFailure()
         << "texts differ at byte " << i << " (sizes " << actual.size() << " vs " << expected.size()
         << ")\n  actual:   ..." << ordered_json(actual.substr(from, 120)).dump()
         << "\n  expected: ..." << ordered_json(expected.substr(from, 120)).dump();
}

std::string test_name(std::string name) {
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

// ---------------------------------------------------------------------------------------------
// Parity with jinja2: the real templates

struct GoldenCase {
  ordered_json json;
};
std::vector<GoldenCase> golden_cases() {
  std::vector<GoldenCase> cases;
  for (const auto& c : read_json(chat_data() / "goldens.json")) cases.push_back({c});
  return cases;
}

void PrintTo(const GoldenCase& c, std::ostream* os) {
  *os << c.json["model"] << "/" << c.json["name"];
}

class ChatModelTemplate : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(ChatModelTemplate, MatchesJinja2) {
  const ordered_json& c = GetParam().json;
  const ChatTemplate t = ChatTemplate::load(chat_data() / c["model"].get<std::string>());
  const std::optional<ordered_json> tools =
      c.contains("tools") ? std::optional<ordered_json>(c["tools"]) : std::nullopt;
  const ordered_json kwargs = c.value("kwargs", ordered_json::object());
  const bool gen = c["add_generation_prompt"].get<bool>();
  if (c.contains("expected")) {
    EXPECT_TRUE(
        same_text(t.render(c["messages"], gen, tools, kwargs), c["expected"].get<std::string>()));
    return;
  }
  // Python raised: so must we, with raise_exception's own message when the template raised it.
  try {
    t.render(c["messages"], gen, tools, kwargs);
    ADD_FAILURE() << "rendered, but jinja2 raised " << c["error_type"] << ": " << c["error"];
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    if (c["error_type"] == "TemplateError") {
      EXPECT_NE(std::string(e.what()).find(c["error"].get<std::string>()), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(" line "), std::string::npos) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Goldens, ChatModelTemplate, ::testing::ValuesIn(golden_cases()),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) {
                           return test_name(info.param.json["model"].get<std::string>() + "_" +
                                            info.param.json["name"].get<std::string>());
                         });

// tests/data/tokenizer carries texts rendered by transformers' apply_chat_template itself
// (scripts/make_reference.py).
TEST(ChatTemplateGoldens, TransformersApplyChatTemplate) {
  const ChatTemplate t = ChatTemplate::load(test::data_dir() / "tokenizer");
  const ordered_json chats = read_json(test::data_dir() / "tokenizer" / "chat_cases.json");
  ASSERT_GE(chats.size(), 4u);
  for (const auto& c : chats) {
    EXPECT_TRUE(same_text(t.render(c["messages"], c["add_generation_prompt"].get<bool>()),
                          c["text"].get<std::string>()));
  }
}

TEST(ChatTemplateGoldens, CoverEveryModelAndRejection) {
  std::map<std::string, int> per_model;
  int errors = 0;
  for (const GoldenCase& c : golden_cases()) {
    ++per_model[c.json["model"].get<std::string>()];
    errors += c.json.contains("error") ? 1 : 0;
  }
  for (const char* model : {"qwen3", "qwen3_5", "deepseek_v3", "kimi_k2_5"})
    EXPECT_GE(per_model[model], 20) << model;
  EXPECT_GE(errors, 5);
}

// ---------------------------------------------------------------------------------------------
// Parity with jinja2: one feature per snippet

struct SnippetCase {
  ordered_json json;
  ordered_json context;
};
std::vector<SnippetCase> snippet_cases() {
  const ordered_json all = read_json(chat_data() / "snippets.json");
  std::vector<SnippetCase> cases;
  if (!all.is_object()) return cases;
  for (const auto& c : all["cases"]) cases.push_back({c, all["context"]});
  return cases;
}

void PrintTo(const SnippetCase& c, std::ostream* os) {
  *os << c.json["source"];
}

class ChatSnippet : public ::testing::TestWithParam<SnippetCase> {};

TEST_P(ChatSnippet, MatchesJinja2) {
  const ordered_json& c = GetParam().json;
  const std::string source = c["source"].get<std::string>();
  if (c.contains("expected")) {
    EXPECT_TRUE(same_text(render(source, GetParam().context), c["expected"].get<std::string>()))
        << source;
    return;
  }
  const Error e = render_error(source, GetParam().context);
  EXPECT_NE(std::string(e.what()), "")
      << "no error for " << source << "; jinja2 raised " << c["error"];
  EXPECT_NE(e.code(), ErrorCode::kInternal) << e.what();
  EXPECT_NE(std::string(e.what()).find("test.jinja line 1 column "), std::string::npos) << e.what();
}

INSTANTIATE_TEST_SUITE_P(Snippets, ChatSnippet, ::testing::ValuesIn(snippet_cases()),
                         [](const ::testing::TestParamInfo<SnippetCase>& info) {
                           return test_name(info.param.json["name"].get<std::string>());
                         });

// ---------------------------------------------------------------------------------------------
// Engine features

TEST(ChatJinja, WhitespaceControl) {
  EXPECT_EQ(render("a  {{- 'b' -}}  \n c"), "abc");
  EXPECT_EQ(render("a\n{%- if true -%}\n  b  \n{%- endif -%}\nc"), "abc");
  // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it.
  EXPECT_EQ(render("<\n  {% if true %}\n  x\n  {% endif %}\n>"), "<\n  x\n>");
  EXPECT_EQ(render("{{ 'v' }}\nnext"), "v\nnext");  // not after {{ }}
  EXPECT_EQ(render("a\n  {%+ if true %}b{% endif %}"), "a\n  b");
  EXPECT_EQ(render("{% if true +%}\nb{% endif %}"), "\nb");
  EXPECT_EQ(render("x {# comment #} y\n  {# own line #}\nz"), "x  y\nz");
  EXPECT_EQ(render("end\n"), "end");  // keep_trailing_newline=False
  EXPECT_EQ(render("a\r\nb"), "a\nb");
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
}

TEST(ChatJinja, ExpressionsAndOperators) {
  EXPECT_EQ(
      render("{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 7 / 2 }}|{{ 2 ** 8 }}"),
      "7|3|-4|2|3.5|256");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }}|{{ 'a' + 'b' }}|{{ [1] + [2] }}|{{ 'ab' * 2 }}"),
            "a1None|ab|[1, 2]|abab");
  EXPECT_EQ(render("{{ 1 < 2 <= 2 }}|{{ 1 == 1.0 }}|{{ 'b' in 'abc' }}|{{ 3 not in [1, 2] }}"),
            "True|True|True|True");
  EXPECT_EQ(render("{{ 0 or 'x' }}|{{ 'y' if false else 'z' }}|{{ not none }}"), "x|z|True");
  EXPECT_EQ(render("{{ 0.1 + 0.2 }}|{{ 1e16 }}|{{ 1e-5 }}|{{ 100.0 }}|{{ 1 / 3 }}"),
            "0.30000000000000004|1e+16|1e-05|100.0|0.3333333333333333");
}

TEST(ChatJinja, SubscriptsSlicesAndUnicode) {
  const ordered_json ctx = {{"xs", {1, 2, 3, 4}}, {"s", "héllo"}, {"d", {{"k", "v"}}}};
  EXPECT_EQ(render("{{ xs[::-1] }}|{{ xs[1:] }}|{{ xs[-1] }}|{{ xs[1:3] }}|{{ xs[::2] }}", ctx),
            "[4, 3, 2, 1]|[2, 3, 4]|4|[2, 3]|[1, 3]");
  EXPECT_EQ(
      render("{{ s[1] }}|{{ s[::-1] }}|{{ s|length }}|{{ s[1:3] }}|{{ d.k }}{{ d['k'] }}", ctx),
      "é|olléh|5|él|vv");
  EXPECT_EQ(render("[{{ xs[9] }}][{{ d.nope }}][{{ nope }}]", ctx), "[][][]");
}

TEST(ChatJinja, Filters) {
  const ordered_json ctx = {{"d", {{"b", 1}, {"a", {1.5, nullptr, true}}}},
                            {"u", {{{"n", "x"}, {"on", true}}, {{"n", "y"}, {"on", false}}}}};
  // tojson keeps key order, writes non-ASCII as is (ensure_ascii=False) and takes indent.
  EXPECT_EQ(render("{{ d|tojson }}|{{ 'é\"'|tojson }}", ctx),
            "{\"b\": 1, \"a\": [1.5, null, true]}|\"é\\\"\"");
  EXPECT_EQ(render("{{ {'k': [1]}|tojson(indent=2) }}"), "{\n  \"k\": [\n    1\n  ]\n}");
  EXPECT_EQ(render("{{ [1, 'a']|tojson(separators=(',', ':')) }}"), "[1,\"a\"]");
  EXPECT_EQ(
      render("[{{ '  x \n'|trim }}]|{{ [3, 4]|first }}{{ [3, 4]|last }}|{{ [1, 2]|join('-') }}"),
      "[x]|34|1-2");
  EXPECT_EQ(render("{{ nope|default('D') }}|{{ ''|default('E', true) }}|{{ d|items|list }}", ctx),
            "D|E|[('b', 1), ('a', [1.5, None, True])]");
  EXPECT_EQ(render("{{ 'ab'|list }}|{{ 5|string }}|{{ 'Ab'|upper }}{{ 'Ab'|lower }}|{{ "
                   "'aXa'|replace('a', 'b') }}"),
            "['a', 'b']|5|ABab|bXb");
  EXPECT_EQ(render("{{ '<x>'|safe }}|{{ '12'|int + 1 }}|{{ 'z'|int }}|{{ 2.9|int }}"),
            "<x>|13|0|2");
  EXPECT_EQ(render("{{ u|selectattr('on')|map(attribute='n')|join }}|{{ "
                   "u|rejectattr('on')|map(attribute='n')|list }}",
                   ctx),
            "x|['y']");
  EXPECT_EQ(render("{{ d|length }}{{ 'héé'|length }}{{ nope|length }}", ctx), "230");
}

TEST(ChatJinja, Tests) {
  const ordered_json ctx = {{"s", "x"},
                            {"n", 3},
                            {"d", ordered_json::object()},
                            {"l", ordered_json::array()},
                            {"z", nullptr}};
  EXPECT_EQ(render("{{ s is defined }}{{ nope is defined }}{{ nope is undefined }}{{ z is none "
                   "}}{{ s is string }}",
                   ctx),
            "TrueFalseTrueTrueTrue");
  EXPECT_EQ(render("{{ d is mapping }}{{ l is mapping }}{{ l is iterable }}{{ s is iterable }}{{ n "
                   "is iterable }}",
                   ctx),
            "TrueFalseTrueTrueFalse");
  EXPECT_EQ(render("{{ l is sequence }}{{ n is number }}{{ s is number }}{{ n is not string }}{{ n "
                   "is odd }}",
                   ctx),
            "TrueTrueFalseTrueTrue");
}

TEST(ChatJinja, StringDictAndListMethods) {
  const ordered_json ctx = {{"s", "  a<think>b</think>c  "}, {"d", {{"k", 1}}}};
  EXPECT_EQ(render("{{ s.strip().split('</think>')[-1] }}|{{ s.strip().startswith('a') }}|{{ "
                   "'x.y'.endswith('.y') }}",
                   ctx),
            "c|True|True");
  EXPECT_EQ(render("[{{ s.lstrip() }}][{{ s.rstrip() }}][{{ '\\nx\\n'.strip('\\n') }}]", ctx),
            "[a<think>b</think>c  ][  a<think>b</think>c][x]");
  EXPECT_EQ(render("{{ 'a b  c'.split() }}|{{ 'hello world'.title() }}|{{ 'AbC'.lower() }}{{ "
                   "'abc'.upper() }}|{{ 'aa'.replace('a', 'b') }}"),
            "['a', 'b', 'c']|Hello World|abcABC|bb");
  EXPECT_EQ(render("{{ d.get('k') }}{{ d.get('x', 0) }}{{ d.get('x') }}|{{ d.items()|list }}|{{ "
                   "d.keys()|list }}",
                   ctx),
            "10None|[('k', 1)]|['k']");
  EXPECT_EQ(render_error("{{ [].append(1) }}").code(),
            ErrorCode::kInvalidArgument);  // immutable sandbox
}

TEST(ChatJinja, LoopsAndScopes) {
  EXPECT_EQ(render("{% for x in [5, 6, 7] %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ "
                   "loop.length }};{% endfor %}"),
            "0TrueFalse3;1FalseFalse3;2FalseTrue3;");
  EXPECT_EQ(render("{% for x in [1, 2, 3]|reverse %}{{ x }}{% else %}none{% endfor %}{% for x in "
                   "[] %}{% else %}none{% endfor %}"),
            "321none");
  EXPECT_EQ(render("{% for x in range(6) %}{% if x == 1 %}{% continue %}{% elif x == 4 %}{% break "
                   "%}{% endif %}{{ x }}{% endfor %}"),
            "023");
  // A set inside a loop does not leak; a namespace carries the value out.
  EXPECT_EQ(
      render("{% set n = 0 %}{% set ns = namespace(n=0) %}{% for x in [1, 2] %}{% set n = n + x %}"
             "{% set ns.n = ns.n + x %}{% endfor %}{{ n }}{{ ns.n }}"),
      "03");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}|items %}{{ k }}{{ v }}{% endfor %}"), "a1b2");
}

TEST(ChatJinja, MacrosAndCall) {
  EXPECT_EQ(render("{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ "
                   "m(b=3, a=4) }}"),
            "[1B][12][43]");
  EXPECT_EQ(render("{% macro m() %}<{{ caller() }}>{% endmacro %}{% call m() %}inner{% endcall %}"),
            "<inner>");
  EXPECT_EQ(render("{% macro m(x) %}{{ x }}{% endmacro %}{{ m(1)|trim ~ m(2) }}"), "12");
  EXPECT_EQ(render_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}").code(),
            ErrorCode::kInvalidArgument);
}

TEST(ChatJinja, RenderVariables) {
  ChatTemplate t = ChatTemplate::from_source(
      "{{ bos_token }}|{{ messages|length }}|{{ tools }}|{{ add_generation_prompt }}|{{ documents "
      "}}|{{ enable_thinking }}",
      {{"bos_token", "<s>"}});
  EXPECT_EQ(t.render(ordered_json::array({{{"role", "user"}}}), true), "<s>|1|None|True|None|");
  EXPECT_EQ(t.render(ordered_json::array(), false, ordered_json::array({1}),
                     {{"enable_thinking", false}}),
            "<s>|0|[1]|False|None|False");
  EXPECT_THROW(t.render(ordered_json::array(), false, std::nullopt, {{"messages", 1}}), Error);
  EXPECT_THROW(t.render(ordered_json::object(), false), Error);
}

// ---------------------------------------------------------------------------------------------
// Errors: codes, line and column

TEST(ChatJinjaErrors, SyntaxErrorsNameLineAndColumn) {
  try {
    ChatTemplate::from_source("line one\n{{ ok }}\n   {{ 1 + }}\n", ordered_json::object(),
                              "t.jinja");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidFile);
    EXPECT_NE(std::string(e.what()).find("t.jinja line 3 column 11"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(render_error("{% if x %}\nno end").code(), ErrorCode::kInvalidFile);
  EXPECT_EQ(render_error("{{ 'unterminated }}").code(), ErrorCode::kInvalidFile);
  EXPECT_EQ(render_error("{% for %}{% endfor %}").code(), ErrorCode::kInvalidFile);
  EXPECT_EQ(render_error("{% break %}").code(), ErrorCode::kInvalidFile);
  EXPECT_EQ(render_error("{{ (1 }}").code(), ErrorCode::kInvalidFile);
  EXPECT_EQ(render_error("{% include 'x' %}").code(), ErrorCode::kUnsupported);
}

TEST(ChatJinjaErrors, UnknownFilterAndTestFailAtLoad) {
  try {
    ChatTemplate::from_source("ok\n  {{ x | frobnicate }}", ordered_json::object(), "t.jinja");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("t.jinja line 2 column 10: no filter named 'frobnicate'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(render_error("{{ x is frobnicated }}").code(), ErrorCode::kUnsupported);
}

TEST(ChatJinjaErrors, RaiseExceptionKeepsMessageAndLocation) {
  const Error e =
      render_error("{% if true %}\n  {{- raise_exception('Bad request: ' ~ 42) }}\n{% endif %}");
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(std::string(e.what()), "test.jinja line 2 column 7: Bad request: 42");
}

TEST(ChatJinjaErrors, UndefinedOnlyFailsWhereJinja2Does) {
  EXPECT_EQ(render("{{ a }}{{ a.b is defined }}", {{"a", ordered_json::object()}}), "{}False");
  const Error e = render_error("{{ missing.attr }}");
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("'missing' is undefined"), std::string::npos) << e.what();
  EXPECT_EQ(render_error("{{ {}.a.b }}").code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(render_error("{{ missing + 1 }}").code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(render_error("{{ 'a' + {} }}").code(), ErrorCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Limits: bad templates fail with an error, never a crash

TEST(ChatJinjaLimits, RecursionDepth) {
  const Error e = render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(std::string(e.what()).find("nested deeper than 100"), std::string::npos) << e.what();
  // Deeply nested source is refused by the parser, not by the stack.
  EXPECT_EQ(
      render_error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}").code(),
      ErrorCode::kOutOfRange);
  std::string ifs;
  for (int i = 0; i < 1000; ++i) ifs += "{% if true %}";
  EXPECT_EQ(render_error(ifs).code(), ErrorCode::kOutOfRange);
}

TEST(ChatJinjaLimits, NestingOfValuesAndEvaluation) {
  // A list nested in a loop, a deeply nested request, a macro called from deep inside an
  // expression: each stops with an error before the stack is at risk.
  EXPECT_EQ(render_error("{% set ns = namespace(x=1) %}{% for i in range(100000) %}"
                         "{% set ns.x = [ns.x] %}{% endfor %}")
                .code(),
            ErrorCode::kOutOfRange);
  ordered_json deep = 1;
  for (int i = 0; i < 2000; ++i) deep = ordered_json::array({deep});
  EXPECT_EQ(render_error("{{ x|length }}", {{"x", deep}}).code(), ErrorCode::kOutOfRange);
  std::string open_lists(90, '['), close_lists(90, ']');
  const Error e = render_error("{% macro f(n) %}{{ " + open_lists + "f(n + 1) if n < 50 else 0" +
                               close_lists + " }}{% endmacro %}{{ f(0) }}");
  EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(std::string(e.what()).find("evaluation nested deeper"), std::string::npos) << e.what();
  // A namespace holding itself renders (and is freed after the render).
  EXPECT_EQ(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns.me is defined }}"), "True");
}

TEST(ChatJinjaLimits, OutputSizeAndSteps) {
  RenderLimits small;
  small.max_output_bytes = 1 << 20;
  small.max_steps = 200000;
  EXPECT_EQ(render_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = "
                         "ns.s ~ ns.s %}{% endfor %}",
                         ordered_json::object(), &small)
                .code(),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(render_error("{{ 'x' * 100000000000 }}", ordered_json::object(), &small).code(),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(render_error(
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                ordered_json::object(), &small)
                .code(),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(render_error("{{ range(1000000)|length }}").code(),
            ErrorCode::kOutOfRange);  // sandbox MAX_RANGE
}

TEST(ChatJinjaLimits, TruncatedTemplatesNeverCrash) {
  // Every prefix of the real templates (many cut inside a tag or a string) either renders or
  // fails with moelora::Error.
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  int failures = 0;
  for (const char* model : {"qwen3_5", "kimi_k2_5"}) {
    const std::string source = ChatTemplate::load(chat_data() / model).source();
    for (size_t n = 0; n < source.size(); n += 7) {
      try {
        ChatTemplate::from_source(source.substr(0, n)).render(messages, true);
      } catch (const Error& e) {
        EXPECT_NE(e.code(), ErrorCode::kInternal) << e.what();
        ++failures;
      }
    }
  }
  EXPECT_GT(failures, 100);
}

// ---------------------------------------------------------------------------------------------
// Loading from a model folder

TEST(ChatTemplateLoad, JinjaFileWinsOverConfig) {
  TempDir dir;
  write_file(dir / "tokenizer_config.json",
             R"({"chat_template": "from config", "eos_token": null,)"
             R"( "bos_token": {"__type": "AddedToken", "content": "<s>"}})");
  EXPECT_EQ(ChatTemplate::load(dir.path()).render(ordered_json::array(), false), "from config");
  write_file(dir / "chat_template.jinja", "from file {{ bos_token }}[{{ eos_token }}]");
  const ChatTemplate t = ChatTemplate::load(dir.path());
  EXPECT_EQ(t.render(ordered_json::array(), false), "from file <s>[]");
  EXPECT_EQ(t.special_tokens(), ordered_json::parse(R"({"bos_token": "<s>"})"));
}

TEST(ChatTemplateLoad, NamedTemplates) {
  TempDir dir;
  write_file(dir / "tokenizer_config.json",
             R"({"chat_template": [{"name": "default", "template": "D"},)"
             R"( {"name": "tool_use", "template": "T"}]})");
  write_file(dir / "additional_chat_templates" / "rag.jinja", "R");
  EXPECT_EQ(ChatTemplate::load(dir.path()).render(ordered_json::array(), false), "D");
  EXPECT_EQ(ChatTemplate::load(dir.path(), "tool_use").render(ordered_json::array(), false), "T");
  EXPECT_EQ(ChatTemplate::load(dir.path(), "rag").render(ordered_json::array(), false), "R");
  EXPECT_EQ(ChatTemplate::load(dir.path()).other_template_names(),
            (std::vector<std::string>{"rag", "tool_use"}));
  try {
    ChatTemplate::load(dir.path(), "nope");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("rag, tool_use"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplateLoad, ProcessorTemplateAndMissingOrBadFiles) {
  TempDir dir;
  EXPECT_THROW(ChatTemplate::load(dir / "absent"), Error);
  try {
    ChatTemplate::load(dir.path());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  }
  write_file(dir / "chat_template.json", R"({"chat_template": "P"})");
  EXPECT_EQ(ChatTemplate::load(dir.path()).render(ordered_json::array(), false), "P");
  write_file(dir / "tokenizer_config.json", "{not json");
  try {
    ChatTemplate::load(dir.path());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidFile);
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
  }
  write_file(dir / "tokenizer_config.json", R"({"chat_template": 5})");
  EXPECT_THROW(ChatTemplate::load(dir.path()), Error);
}

TEST(ChatTemplateLoad, ConcurrentRendersAgree) {
  const ChatTemplate t = ChatTemplate::load(chat_data() / "qwen3_5");
  const ordered_json messages = ordered_json::parse(
      R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])");
  const std::string expected = t.render(messages, true);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 50; ++i) mismatches[k] += t.render(messages, true) != expected;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, (std::vector<int>{0, 0, 0, 0}));
}

}  // namespace
}  // namespace moelora::chat
