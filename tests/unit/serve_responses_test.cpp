// Tests of the OpenAI-compatible response side of `moelora serve`: response and stream-chunk JSON
// (serve/responses.h, compared as parsed JSON; SSE framing as exact strings), GET /v1/models,
// the streaming stop-string matcher and the UTF-8-safe incremental detokenizer
// (serve/stop_matcher.h), including every split point of a stream and a seeded random sweep.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/tokenizer.h"
#include "serve/protocol.h"
#include "serve/responses.h"
#include "serve/stop_matcher.h"
#include "support/test_support.h"

namespace moelora::serve {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

// Compares as unordered JSON values (key order is not part of the contract).
json plain(const ojson& j) {
  return json::parse(j.dump());
}

const ResponseMeta kMeta{"cmpl-1", 1700000000, "qwen3-moe:math"};

TEST(ServeResponses, CompletionResponse) {
  std::vector<CompletionChoice> choices(2);
  choices[0].text = "Hello";
  choices[0].finish = ChoiceFinish::kStop;
  choices[1].index = 1;
  choices[1].text = "Hi";
  choices[1].finish = ChoiceFinish::kLength;
  choices[1].logprobs =
      std::vector<TokenLogprob>{{"H", -0.5, {{"H", -0.5}, {"Y", -1.5}}}, {"i", -0.25, {}}};
  const ojson r = completion_response(kMeta, choices, Usage{5, 7});
  EXPECT_EQ(plain(r), json::parse(R"({
    "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "qwen3-moe:math",
    "choices": [
      {"index": 0, "text": "Hello", "logprobs": null, "finish_reason": "stop"},
      {"index": 1, "text": "Hi", "finish_reason": "length",
       "logprobs": {"tokens": ["H", "i"], "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"H": -0.5, "Y": -1.5}, {}], "text_offset": [0, 1]}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})"));
  // OpenAI's key order: id, object, created, model, choices, usage.
  std::vector<std::string> keys;
  for (auto it = r.begin(); it != r.end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(keys,
            (std::vector<std::string>{"id", "object", "created", "model", "choices", "usage"}));
}

TEST(ServeResponses, ChatCompletionResponse) {
  std::vector<ChatChoice> choices(1);
  choices[0].content = "4";
  choices[0].reasoning_content = "2+2";
  choices[0].finish = ChoiceFinish::kStop;
  choices[0].logprobs = std::vector<TokenLogprob>{{"4", -0.1, {{"4", -0.1}, {"\xC3\xA9", -3.0}}}};
  const ResponseMeta meta{"chatcmpl-9", 1, "math"};
  EXPECT_EQ(plain(chat_completion_response(meta, choices, Usage{3, 1})), json::parse(R"({
    "id": "chatcmpl-9", "object": "chat.completion", "created": 1, "model": "math",
    "choices": [{"index": 0,
      "message": {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
      "logprobs": {"content": [{"token": "4", "logprob": -0.1, "bytes": [52],
        "top_logprobs": [{"token": "4", "logprob": -0.1, "bytes": [52]},
                         {"token": "é", "logprob": -3.0, "bytes": [195, 169]}]}]},
      "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})"));
  choices[0].reasoning_content.reset();
  choices[0].logprobs.reset();
  const json plain_choice = plain(chat_completion_response(meta, choices, Usage{}))["choices"][0];
  EXPECT_EQ(plain_choice,
            json::parse(R"({"index": 0, "message": {"role": "assistant", "content": "4"},
    "logprobs": null, "finish_reason": "stop"})"));
}

TEST(ServeResponses, InvalidUtf8IsReplacedNotThrown) {
  // A token that ends inside a character: its bytes are kept in "bytes", the text gets U+FFFD.
  std::vector<ChatChoice> choices(1);
  choices[0].content = std::string("a\xC3", 2);
  choices[0].logprobs = std::vector<TokenLogprob>{{std::string("\xC3", 1), -1.0, {}}};
  const ojson r = chat_completion_response(kMeta, choices, Usage{});
  std::string dumped;
  ASSERT_NO_THROW(dumped = r.dump());
  EXPECT_EQ(r["choices"][0]["message"]["content"], "a\xEF\xBF\xBD");
  EXPECT_EQ(plain(r["choices"][0]["logprobs"]["content"][0]["bytes"]), json::array({195}));
  ASSERT_NO_THROW(completion_chunk(kMeta, 0, std::string("\xFF", 1), ChoiceFinish::kNone).dump());
  ResponseMeta bad = kMeta;
  bad.model = "\xFF";
  ASSERT_NO_THROW(sse_event(usage_chunk(bad, true, Usage{})));
}

TEST(ServeResponses, SseFraming) {
  EXPECT_EQ(sse_event(ojson{{"a", 1}, {"b", "x\ny"}}), "data: {\"a\":1,\"b\":\"x\\ny\"}\n\n");
  EXPECT_EQ(sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  ApiError e;
  e.message = "boom";
  e.http_status = 500;
  e.type = "internal_error";
  EXPECT_EQ(sse_error(e),
            "data: {\"error\":{\"code\":null,\"message\":\"boom\",\"param\":null,\"type\":"
            "\"internal_error\"}}\n\n");
}

TEST(ServeResponses, ChatStreamChunks) {
  EXPECT_EQ(plain(chat_role_chunk(kMeta, 0)), json::parse(R"({"id": "cmpl-1",
    "object": "chat.completion.chunk", "created": 1700000000, "model": "qwen3-moe:math",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                 "finish_reason": null}]})"));
  const json content = plain(chat_content_chunk(kMeta, 1, "Hel"));
  EXPECT_EQ(content["choices"], json::parse(R"([{"index": 1, "delta": {"content": "Hel"},
    "logprobs": null, "finish_reason": null}])"));
  EXPECT_FALSE(content.contains("usage"));
  const std::vector<TokenLogprob> lp = {{"Hel", -0.5, {}}};
  EXPECT_EQ(plain(chat_content_chunk(kMeta, 0, "Hel", false, &lp))["choices"][0]["logprobs"],
            json::parse(R"({"content": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
                             "top_logprobs": []}]})"));
  EXPECT_EQ(plain(chat_finish_chunk(kMeta, 0, ChoiceFinish::kLength, true)), json::parse(R"({
    "id": "cmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
    "model": "qwen3-moe:math", "usage": null,
    "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}]})"));
  EXPECT_EQ(plain(usage_chunk(kMeta, true, Usage{4, 6})), json::parse(R"({"id": "cmpl-1",
    "object": "chat.completion.chunk", "created": 1700000000, "model": "qwen3-moe:math",
    "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}})"));
}

TEST(ServeResponses, CompletionStreamChunks) {
  EXPECT_EQ(plain(completion_chunk(kMeta, 0, "lo", ChoiceFinish::kNone)), json::parse(R"({
    "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "qwen3-moe:math",
    "choices": [{"index": 0, "text": "lo", "logprobs": null, "finish_reason": null}]})"));
  const json last = plain(completion_chunk(kMeta, 0, "", ChoiceFinish::kStop, true));
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(last["usage"].is_null());
  const std::vector<TokenLogprob> lp = {{"lo", -0.5, {{"lo", -0.5}}}};
  EXPECT_EQ(plain(completion_chunk(kMeta, 0, "lo", ChoiceFinish::kNone, false, &lp,
                                   3))["choices"][0]["logprobs"],
            json::parse(R"({"tokens": ["lo"], "token_logprobs": [-0.5],
                            "top_logprobs": [{"lo": -0.5}], "text_offset": [3]})"));
  EXPECT_EQ(plain(usage_chunk(kMeta, false, Usage{1, 2}))["object"], "text_completion");
}

TEST(ServeResponses, ModelsList) {
  StaticModelRegistry registry("qwen3-moe", {"sql", "math"});
  EXPECT_EQ(plain(models_response(registry, 42, 4096)), json::parse(R"({"object": "list", "data": [
    {"id": "qwen3-moe", "object": "model", "created": 42, "owned_by": "moelora",
     "root": "qwen3-moe", "parent": null, "max_model_len": 4096},
    {"id": "math", "object": "model", "created": 42, "owned_by": "moelora", "root": "math",
     "parent": "qwen3-moe"},
    {"id": "sql", "object": "model", "created": 42, "owned_by": "moelora", "root": "sql",
     "parent": "qwen3-moe"}]})"));
  StaticModelRegistry bare("m", {});
  const json j = plain(models_response(bare, 0));
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_FALSE(j["data"][0].contains("max_model_len"));
}

TEST(ServeResponses, FinishReasonAndIds) {
  EXPECT_EQ(choice_finish(FinishReason::kStop), ChoiceFinish::kStop);
  EXPECT_EQ(choice_finish(FinishReason::kLength), ChoiceFinish::kLength);
  EXPECT_EQ(choice_finish(FinishReason::kCancelled), ChoiceFinish::kNone);
  EXPECT_EQ(choice_finish(FinishReason::kError), ChoiceFinish::kNone);
  EXPECT_EQ(choice_finish(FinishReason::kNone), ChoiceFinish::kNone);
  const std::string a = make_response_id("chatcmpl", 1), b = make_response_id("chatcmpl", 2);
  EXPECT_EQ(a.rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(a.size(), std::string("chatcmpl-").size() + 24);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, make_response_id("chatcmpl", 1));
}

// ---- stop strings ----

// Feeds `pieces` and returns (text, stopped, matched) with the final flush appended; every
// returned piece must be valid UTF-8.
struct Streamed {
  std::string text;
  bool stopped = false;
  std::string matched;
};
Streamed stream(StopMatcher& m, const std::vector<std::string>& pieces) {
  Streamed out;
  for (const auto& p : pieces) {
    auto step = m.feed(p);
    EXPECT_FALSE(io::find_invalid_utf8(step.text)) << "piece split a character: " << step.text;
    out.text += step.text;
    if (step.stopped) {
      out.stopped = true;
      out.matched = step.matched;
    }
  }
  const std::string rest = m.flush();
  EXPECT_FALSE(io::find_invalid_utf8(rest));
  out.text += rest;
  return out;
}

// What the whole stream must produce, computed on the whole text: the text cut before the stop
// string occurrence that ends first (the longest among those ending at the same byte).
Streamed reference(const std::string& text, const std::vector<std::string>& stops) {
  Streamed out{text, false, ""};
  size_t best_end = std::string::npos;
  for (size_t end = 1; end <= text.size() && best_end == std::string::npos; ++end) {
    for (const auto& s : stops) {
      if (s.empty() || s.size() > end || text.compare(end - s.size(), s.size(), s) != 0) continue;
      if (best_end == std::string::npos || s.size() > out.matched.size()) {
        best_end = end;
        out.matched = s;
      }
    }
  }
  if (best_end != std::string::npos) {
    out.text = text.substr(0, best_end - out.matched.size());
    out.stopped = true;
  }
  return out;
}

TEST(ServeStopMatcher, Basics) {
  StopMatcher m({"</s>"});
  auto s1 = m.feed("Hello </");
  EXPECT_EQ(s1.text, "Hello ");  // "</" may begin the stop string
  EXPECT_FALSE(s1.stopped);
  EXPECT_EQ(m.held_bytes(), 2u);
  auto s2 = m.feed("s> tail");
  EXPECT_EQ(s2.text, "");
  EXPECT_TRUE(s2.stopped);
  EXPECT_EQ(s2.matched, "</s>");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.feed("more").text, "");  // nothing after a stop
  EXPECT_EQ(m.flush(), "");

  StopMatcher released({"</s>"});
  EXPECT_EQ(released.feed("a</").text, "a");
  EXPECT_EQ(released.feed("b").text, "</b");  // the prefix did not complete: released
  EXPECT_EQ(released.feed("<").text, "");
  EXPECT_EQ(released.flush(), "<");  // end of generation without a stop
}

TEST(ServeStopMatcher, FirstCompletedAndLongestAndEmpty) {
  StopMatcher m({"abcd", "", "bc"});
  auto r = stream(m, {"xab", "cde"});
  EXPECT_EQ(r.text, "xa");  // "bc" is whole before "abcd" could be
  EXPECT_EQ(r.matched, "bc");
  StopMatcher one_byte({"abcd", "b"});
  r = stream(one_byte, {"xa", "bcd"});
  EXPECT_EQ(r.matched, "b");
  EXPECT_EQ(r.text, "xa");
  StopMatcher same_end({"c", "abc"});
  r = stream(same_end, {"zabc"});
  EXPECT_EQ(r.matched, "abc");  // longest among those ending at the same byte
  EXPECT_EQ(r.text, "z");
  StopMatcher none({""});
  EXPECT_EQ(stream(none, {"pass", " through"}).text, "pass through");
  StopMatcher at_start({"Hi"});
  r = stream(at_start, {"Hi there"});
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
}

TEST(ServeStopMatcher, EverySplitPoint) {
  const std::string text = "The answer: 42\n\nUser: é€𝄞 done";
  const std::vector<std::vector<std::string>> stop_sets = {
      {"\n\n"}, {"User:"}, {"€𝄞"}, {"𝄞"}, {"é€"}, {"nope"}, {"42\n", "answer"}, {"done!"}};
  for (const auto& stops : stop_sets) {
    const Streamed want = reference(text, stops);
    // Every way of cutting the text into three byte pieces, including cuts inside characters.
    for (size_t i = 0; i <= text.size(); ++i) {
      for (size_t j = i; j <= text.size(); j += 3) {
        StopMatcher m(stops);
        const Streamed got = stream(m, {text.substr(0, i), text.substr(i, j - i), text.substr(j)});
        ASSERT_EQ(got.text, want.text) << "stops[0]=" << stops[0] << " cuts " << i << "," << j;
        ASSERT_EQ(got.stopped, want.stopped);
        ASSERT_EQ(got.matched, want.matched);
      }
    }
  }
}

TEST(ServeStopMatcher, MultiByteHeldWhole) {
  StopMatcher m;
  EXPECT_EQ(m.feed("a\xC3").text, "a");  // half of 'é' waits
  EXPECT_EQ(m.feed("\xA9"
                   "b")
                .text,
            "\xC3\xA9"
            "b");
  EXPECT_EQ(m.feed("\xF0\x9D").text, "");
  EXPECT_EQ(m.feed("\x84").text, "");
  EXPECT_EQ(m.feed("\x9E").text, "\xF0\x9D\x84\x9E");
  EXPECT_EQ(m.feed("\xE2\x82").text, "");
  EXPECT_EQ(m.flush(), "\xEF\xBF\xBD");  // an unfinished character at the end
  // A stop string that shares a lead byte with the text.
  StopMatcher shared({"é!"});
  EXPECT_EQ(shared.feed("\xC3").text, "");
  EXPECT_EQ(shared.feed("\xA8").text, "\xC3\xA8");  // 'è', not 'é'
  auto r = shared.feed("\xC3\xA9!x");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
}

TEST(ServeStopMatcher, RandomStreamsMatchReference) {
  std::mt19937_64 rng(test::test_seed(7));
  const std::vector<std::string> alphabet = {"a", "b", "\n", "é", "€", "𝄞", "<", "/", ">"};
  auto random_text = [&](size_t max_chars) {
    std::string s;
    const size_t n = rng() % (max_chars + 1);
    for (size_t i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
    return s;
  };
  for (int iter = 0; iter < 3000; ++iter) {
    const std::string text = random_text(30);
    std::vector<std::string> stops;
    const size_t num_stops = rng() % 4;
    for (size_t i = 0; i < num_stops; ++i) stops.push_back(random_text(3));
    // Random byte pieces (cuts may fall inside characters).
    std::vector<std::string> pieces;
    for (size_t pos = 0; pos < text.size();) {
      const size_t len = std::min(text.size() - pos, 1 + static_cast<size_t>(rng() % 6));
      pieces.push_back(text.substr(pos, len));
      pos += len;
    }
    StopMatcher m(stops);
    const Streamed got = stream(m, pieces);
    const Streamed want = reference(text, stops);
    ASSERT_EQ(got.text, want.text) << "iteration " << iter;
    ASSERT_EQ(got.stopped, want.stopped) << "iteration " << iter;
    ASSERT_EQ(got.matched, want.matched) << "iteration " << iter;
  }
}

// ---- UTF-8 joining and incremental detokenization ----

TEST(ServeDetokenize, JoinerByteByByte) {
  const std::string text = "héllo €𝄞!";
  Utf8StreamJoiner j;
  std::string out;
  for (char c : text) {
    const std::string piece = j.push(std::string(1, c));
    EXPECT_FALSE(io::find_invalid_utf8(piece));
    out += piece;
  }
  out += j.finish();
  EXPECT_EQ(out, text);
  EXPECT_EQ(j.pending_bytes(), 0u);
  Utf8StreamJoiner bad;
  EXPECT_EQ(bad.push("a\xFF"
                     "b"),
            "a\xEF\xBF\xBD"
            "b");  // invalid at once, not held
  EXPECT_EQ(bad.push("\xE2\x82"), "");
  EXPECT_EQ(bad.pending_bytes(), 2u);
  EXPECT_EQ(bad.finish(), "\xEF\xBF\xBD");
}

// A byte-level tokenizer whose ids 0..255 are the single bytes, plus a special <|end|> at 256.
io::Tokenizer byte_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b)
    vocab[io::byte_level_encode(std::string(1, static_cast<char>(b)))] = b;
  const json tok = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({{{"id", 256},
                                     {"content", "<|end|>"},
                                     {"single_word", false},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", false},
                                     {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", false},
        {"use_regex", false}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array()}}}};
  return io::Tokenizer::from_json(tok.dump());
}

TEST(ServeDetokenize, IncrementalMatchesWholeDecode) {
  const io::Tokenizer tok = byte_tokenizer();
  const std::string text = "né €𝄞 ok";
  std::vector<int32_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());  // one token per byte: characters span several tokens
  ids.push_back(256);
  IncrementalDetokenizer skip(tok, /*skip_special_tokens=*/true);
  IncrementalDetokenizer keep(tok, /*skip_special_tokens=*/false);
  std::string a, b;
  for (int32_t id : ids) {
    const std::string pa = skip.add(id), pb = keep.add(id);
    EXPECT_FALSE(io::find_invalid_utf8(pa));
    a += pa;
    b += pb;
  }
  a += skip.finish();
  b += keep.finish();
  EXPECT_EQ(a, tok.decode(ids, true));
  EXPECT_EQ(a, text);
  EXPECT_EQ(b, text + "<|end|>");
  // A sequence that ends inside a character ends with U+FFFD, as `tokenizers` decodes it.
  IncrementalDetokenizer cut(tok);
  EXPECT_EQ(cut.add(0xE2), "");
  EXPECT_EQ(cut.add(0x82), "");
  EXPECT_EQ(cut.finish(), "\xEF\xBF\xBD");
}

TEST(ServeDetokenize, DetokenizerFeedsStopMatcher) {
  // The pipeline the server runs: token -> text increment -> stop matcher -> client.
  const io::Tokenizer tok = byte_tokenizer();
  const std::string text = "A: 𝄞€ STOP€ after";
  IncrementalDetokenizer detok(tok);
  StopMatcher stop({"STOP€"});
  std::string sent;
  bool stopped = false;
  for (int32_t id : tok.encode(text)) {
    auto step = stop.feed(detok.add(id));
    sent += step.text;
    if (step.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(sent, "A: 𝄞€ ");
}

}  // namespace
}  // namespace moelora::serve
