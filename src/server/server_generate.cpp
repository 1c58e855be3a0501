// POST /v1/completions and /v1/chat/completions: one HTTP request = n engine requests (one per
// choice) whose token events come back through one queue; text is detokenized incrementally,
// stop strings are cut (serve/stop_matcher.h), and the answer is one JSON body or a stream of
// server-sent events.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "serve/responses.h"
#include "serve/stop_matcher.h"
#include "server/server_impl.h"

namespace moelora::server {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::ordered_json;
constexpr auto kPollInterval = std::chrono::milliseconds(100);

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Events of one HTTP request's engine requests, tagged with their choice index. Filled by the
// engine thread (callbacks), drained by the handler thread.
class EventQueue {
 public:
  void push(int32_t choice, const TokenEvent& event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      events_.push_back({choice, event});
    }
    ready_.notify_one();
  }
  // Moves every queued event into `out`, waiting up to `timeout` for the first.
  void wait(std::vector<std::pair<int32_t, TokenEvent>>& out, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait_for(lock, timeout, [&] { return !events_.empty(); });
    while (!events_.empty()) {
      out.push_back(std::move(events_.front()));
      events_.pop_front();
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::pair<int32_t, TokenEvent>> events_;
};

// Text that became sendable for one choice; `finish` != kNone on its last delta.
struct Delta {
  int32_t choice = 0;
  std::string text;
  serve::ChoiceFinish finish = serve::ChoiceFinish::kNone;
  bool has_token = false;  // a generated token arrived (its text may still be held back)
  std::vector<serve::TokenLogprob> logprobs;  // of the tokens this delta's text came from
  size_t text_offset = 0;                     // bytes of the choice's text before this delta
};

class Generation {
 public:
  struct Choice {
    RequestId id = 0;
    bool submitted = false;
    bool done = false;
    serve::IncrementalDetokenizer detokenizer;
    serve::StopMatcher stops;
    std::string text;                           // everything sent so far (the non-streamed answer)
    std::vector<serve::TokenLogprob> logprobs;  // every token's, for the non-streamed answer
    std::vector<serve::TokenLogprob> pending_logprobs;  // not yet attached to a delta
    serve::ChoiceFinish finish = serve::ChoiceFinish::kNone;
    int64_t tokens = 0;
    Clock::time_point last_token;
    Choice(const io::Tokenizer& tokenizer, const serve::GenerationParams& params)
        : detokenizer(tokenizer, params.skip_special_tokens), stops(params.stop) {}
  };

  Generation(Server::Impl& server, std::string endpoint, std::string adapter, int64_t prompt_tokens,
             Clock::time_point arrival)
      : server_(server),
        queue_(std::make_shared<EventQueue>()),
        endpoint_(std::move(endpoint)),
        adapter_(std::move(adapter)),
        prompt_tokens_(prompt_tokens),
        arrival_(arrival) {}

  ~Generation() { cancel_all(); }

  // Submits one engine request per choice; on a refusal cancels those already submitted.
  std::optional<serve::ApiError> submit(const std::vector<int32_t>& prompt,
                                        const serve::GenerationParams& params,
                                        int64_t max_new_tokens, uint64_t seed) {
    for (int32_t c = 0; c < params.n; ++c) choices_.emplace_back(server_.tokenizer, params);
    for (int32_t c = 0; c < params.n; ++c) {
      Request request;
      request.prompt = prompt;
      request.adapter = adapter_;
      request.sampling = serve::to_engine_sampling(params, max_new_tokens, seed, c);
      if (!params.ignore_eos)
        for (int32_t id : server_.extra_stop_token_ids)
          request.sampling.stop_token_ids.push_back(id);
      std::shared_ptr<EventQueue> queue = queue_;
      Result<RequestId> id = server_.loop->submit(
          std::move(request), [queue, c](const TokenEvent& e) { queue->push(c, e); });
      if (!id.is_ok()) {
        cancel_all();
        return api_error_from_status(id.status());
      }
      choices_[c].id = id.value();
      choices_[c].submitted = true;
      server_.track(id.value());
    }
    return std::nullopt;
  }

  // Waits up to one poll interval and turns the events that arrived into deltas.
  void poll(std::vector<Delta>& out) {
    std::vector<std::pair<int32_t, TokenEvent>> events;
    queue_->wait(events, kPollInterval);
    for (auto& [c, e] : events) handle(c, e, out);
    if (events.empty() && !finished() && !server_.loop->healthy()) {
      serve::ApiError err;
      err.http_status = 500;
      err.type = "internal_server_error";
      err.message = "the engine stopped: " + server_.loop->failure();
      fail(err);
    }
  }

  bool finished() const {
    for (const Choice& c : choices_)
      if (!c.done) return false;
    return true;
  }
  const std::optional<serve::ApiError>& error() const { return error_; }
  const std::vector<Choice>& choices() const { return choices_; }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t completion_tokens() const {
    int64_t n = 0;
    for (const Choice& c : choices_) n += c.tokens;
    return n;
  }

  // The client went away or the server stops: end every choice still running.
  void cancel_all() {
    for (Choice& c : choices_) {
      if (c.submitted && !c.done) {
        (void)server_.loop->cancel(c.id);
        server_.untrack(c.id);
      }
      c.done = true;
    }
  }

  void record(int http_status) {
    if (recorded_) return;
    recorded_ = true;
    serve::MetricsRegistry& m = server_.metrics;
    const std::string adapter = adapter_label(adapter_);
    m.increment(
        "moelora_requests_total",
        {{"endpoint", endpoint_}, {"status", std::to_string(http_status)}, {"adapter", adapter}});
    m.increment("moelora_prompt_tokens_total", {{"adapter", adapter}},
                static_cast<double>(prompt_tokens_));
    m.increment("moelora_generation_tokens_total", {{"adapter", adapter}},
                static_cast<double>(completion_tokens()));
    m.observe("moelora_e2e_request_latency_seconds", {}, seconds_between(arrival_, Clock::now()));
  }

 private:
  void fail(const serve::ApiError& err) {
    if (!error_) error_ = err;
    cancel_all();
  }

  void handle(int32_t index, const TokenEvent& e, std::vector<Delta>& out) {
    Choice& c = choices_[index];
    if (c.done) return;  // events after our own cancel (a stop string ended the choice)
    const Clock::time_point now = Clock::now();
    Delta delta;
    delta.choice = index;
    if (e.token >= 0) {
      ++c.tokens;
      delta.has_token = true;
      if (!first_token_seen_) {
        first_token_seen_ = true;
        server_.metrics.observe("moelora_time_to_first_token_seconds", {},
                                seconds_between(arrival_, now));
      } else if (c.tokens > 1) {
        server_.metrics.observe("moelora_inter_token_latency_seconds", {},
                                seconds_between(c.last_token, now));
      }
      c.last_token = now;
      // The stop token or end-of-sequence token that ended the choice is not part of its text.
      const bool stop_token = e.finished && e.finish_reason == FinishReason::kStop;
      if (!stop_token && e.logprobs)
        c.pending_logprobs.push_back(token_logprob(e.token, *e.logprobs));
      if (!stop_token) {
        serve::StopMatcher::Step step = c.stops.feed(c.detokenizer.add(e.token));
        delta.text += step.text;
        if (step.stopped) {
          (void)server_.loop->cancel(c.id);
          finish_choice(c, serve::ChoiceFinish::kStop, delta, out);
          return;
        }
      }
    }
    if (!e.finished) {
      // One delta per token, as vLLM streams them: a client counts tokens and inter-token
      // latency by chunks even while the text of a token is empty or held back.
      attach_logprobs(c, delta);
      c.text += delta.text;
      out.push_back(std::move(delta));
      return;
    }
    if (e.finish_reason == FinishReason::kStop || e.finish_reason == FinishReason::kLength) {
      serve::StopMatcher::Step step = c.stops.feed(c.detokenizer.finish());
      delta.text += step.text;
      if (!step.stopped) delta.text += c.stops.flush();
      finish_choice(
          c, step.stopped ? serve::ChoiceFinish::kStop : serve::choice_finish(e.finish_reason),
          delta, out);
      return;
    }
    serve::ApiError err;
    err.http_status = 500;
    err.type = "internal_server_error";
    err.message = e.finish_reason == FinishReason::kError
                      ? "generation failed: " + e.error
                      : std::string("generation was cancelled (the server is shutting down)");
    c.done = true;
    server_.untrack(c.id);
    fail(err);
  }

  serve::TokenLogprob token_logprob(int32_t token, const TokenEvent::Logprobs& lp) const {
    serve::TokenLogprob t;
    t.token = server_.tokenizer.decode_token(token);
    t.logprob = lp.logprob;
    for (const auto& [id, value] : lp.top)
      t.top.push_back({server_.tokenizer.decode_token(id), value});
    return t;
  }

  static void attach_logprobs(Choice& c, Delta& delta) {
    delta.text_offset = c.text.size();
    delta.logprobs = std::move(c.pending_logprobs);
    c.pending_logprobs.clear();
    c.logprobs.insert(c.logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
  }

  void finish_choice(Choice& c, serve::ChoiceFinish finish, Delta& delta, std::vector<Delta>& out) {
    attach_logprobs(c, delta);
    c.done = true;
    c.finish = finish;
    c.text += delta.text;
    delta.finish = finish;
    server_.untrack(c.id);
    out.push_back(std::move(delta));
  }

  Server::Impl& server_;
  std::shared_ptr<EventQueue> queue_;
  std::vector<Choice> choices_;
  std::string endpoint_;
  std::string adapter_;
  int64_t prompt_tokens_ = 0;
  Clock::time_point arrival_;
  bool first_token_seen_ = false;
  bool recorded_ = false;
  std::optional<serve::ApiError> error_;
};

// What a parsed request of either endpoint contributes to one generation.
struct Prepared {
  serve::ModelSelection model;
  serve::GenerationParams params;
  std::vector<int32_t> prompt;
  std::string prompt_param;  // field named in prompt-length errors
};

std::optional<serve::ApiError> prepare(Server::Impl& s, const ordered_json& body, bool chat,
                                       Prepared& p) {
  EngineModelRegistry registry(s);
  Status encoded;
  if (chat) {
    auto parsed = serve::parse_chat_completion_request(body, registry, s.limits);
    if (!parsed.is_ok()) return parsed.error();
    serve::ChatCompletionRequest& r = parsed.value();
    p.model = r.model;
    p.params = r.params;
    p.prompt_param = "messages";
    if (!s.chat_template) {
      serve::ApiError e;
      e.message =
          "the model has no chat template (chat_template.jinja or tokenizer_config.json "
          "'chat_template'); start the server with --chat-template FILE or use "
          "/v1/completions";
      e.param = "messages";
      return e;
    }
    std::string text;
    Status rendered = capture([&] {
      text = s.chat_template->render(r.messages, r.add_generation_prompt, r.tools,
                                     r.chat_template_kwargs);
    });
    if (!rendered.is_ok()) return api_error_from_status(rendered, "messages");
    encoded = capture([&] { p.prompt = s.tokenizer.encode(text, false); });
  } else {
    auto parsed = serve::parse_completion_request(body, registry, s.limits);
    if (!parsed.is_ok()) return parsed.error();
    serve::CompletionRequest& r = parsed.value();
    p.model = r.model;
    p.params = r.params;
    p.prompt_param = "prompt";
    if (r.prompt_is_tokens)
      p.prompt = std::move(r.prompt_tokens);
    else
      encoded = capture([&] { p.prompt = s.tokenizer.encode(r.prompt_text, true); });
  }
  if (!encoded.is_ok()) return api_error_from_status(encoded, p.prompt_param);
  serve::ApiError e;
  e.param = p.prompt_param;
  if (p.prompt.empty()) {
    e.message = "the prompt is empty after tokenization; send at least one token";
    return e;
  }
  const int64_t prompt_len = static_cast<int64_t>(p.prompt.size());
  if (s.max_model_len > 0 && prompt_len >= s.max_model_len) {
    e.message = "this model's maximum context length is " + std::to_string(s.max_model_len) +
                " tokens; the prompt has " + std::to_string(prompt_len) +
                " tokens, which leaves no room to generate";
    e.code = "context_length_exceeded";
    return e;
  }
  if (p.params.max_tokens && s.max_model_len > 0 &&
      prompt_len + *p.params.max_tokens > s.max_model_len) {
    e.message = "this model's maximum context length is " + std::to_string(s.max_model_len) +
                " tokens; the request asks for " + std::to_string(prompt_len) +
                " prompt tokens + " + std::to_string(*p.params.max_tokens) +
                " max_tokens = " + std::to_string(prompt_len + *p.params.max_tokens) +
                "; lower max_tokens";
    e.param = "max_tokens";
    e.code = "context_length_exceeded";
    return e;
  }
  if (p.params.max_tokens && *p.params.max_tokens <= 0) {
    e.message = "'max_tokens' must be at least 1; got " + std::to_string(*p.params.max_tokens);
    e.param = "max_tokens";
    return e;
  }
  return std::nullopt;
}

int64_t default_max_tokens(const Server::Impl& s, int64_t prompt_len) {
  const int64_t left = s.max_model_len > 0 ? s.max_model_len - prompt_len : int64_t{1} << 30;
  return s.options.default_max_tokens > 0 ? std::min(s.options.default_max_tokens, left) : left;
}

uint64_t fresh_seed(uint64_t sequence) {
  static std::random_device device;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  return (static_cast<uint64_t>(device()) << 32 | device()) ^ (sequence * 0x9E3779B97F4A7C15ull);
}

}  // namespace

void Server::Impl::handle_completion(const httplib::Request& req, httplib::Response& res,
                                     bool chat) {
  const Clock::time_point arrival = Clock::now();
  const std::string endpoint = chat ? "chat_completions" : "completions";
  auto refuse = [&](const serve::ApiError& e, const std::string& adapter) {
    metrics.increment(
        "moelora_requests_total",
        {{"endpoint", endpoint}, {"status", std::to_string(e.http_status)}, {"adapter", adapter}});
    send_error(res, e);
  };
  auto body = serve::parse_json_body(req.body, limits);
  if (!body.is_ok()) return refuse(body.error(), "");
  Prepared p;
  if (auto e = prepare(*this, body.value(), chat, p)) return refuse(*e, "");

  if (engine->stats().waiting + p.params.n > options.max_queued_requests) {
    serve::ApiError e;
    e.http_status = 503;
    e.type = "service_unavailable";
    e.code = "queue_full";
    e.message = "the server's queue is full (" + std::to_string(options.max_queued_requests) +
                " requests waiting); retry later";
    res.set_header("Retry-After", "1");
    return refuse(e, adapter_label(p.model.adapter));
  }
  const uint64_t sequence = ++response_sequence;
  const int64_t max_new = p.params.max_tokens.value_or(default_max_tokens(*this, p.prompt.size()));
  const uint64_t seed = p.params.seed.value_or(fresh_seed(sequence));
  auto gen = std::make_shared<Generation>(*this, endpoint, p.model.adapter,
                                          static_cast<int64_t>(p.prompt.size()), arrival);
  if (auto e = gen->submit(p.prompt, p.params, max_new, seed)) {
    return refuse(*e, p.model.adapter.empty() ? "base" : p.model.adapter);
  }

  serve::ResponseMeta meta;
  meta.id = serve::make_response_id(chat ? "chatcmpl" : "cmpl", sequence);
  meta.created = std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  meta.model = p.model.requested;

  if (!p.params.stream) {
    std::vector<Delta> deltas;
    while (!gen->finished()) {
      deltas.clear();
      gen->poll(deltas);
    }
    if (gen->error()) {
      gen->record(gen->error()->http_status);
      return send_error(res, *gen->error());
    }
    const serve::Usage usage{gen->prompt_tokens(), gen->completion_tokens()};
    const bool want_logprobs = p.params.logprobs.has_value();
    auto logprobs_of = [&](const Generation::Choice& c) {
      return want_logprobs ? std::optional<std::vector<serve::TokenLogprob>>(c.logprobs)
                           : std::nullopt;
    };
    ordered_json out;
    if (chat) {
      std::vector<serve::ChatChoice> choices;
      for (size_t i = 0; i < gen->choices().size(); ++i)
        choices.push_back({static_cast<int32_t>(i), gen->choices()[i].text, std::nullopt,
                           gen->choices()[i].finish, logprobs_of(gen->choices()[i])});
      out = serve::chat_completion_response(meta, choices, usage);
    } else {
      std::vector<serve::CompletionChoice> choices;
      for (size_t i = 0; i < gen->choices().size(); ++i)
        choices.push_back({static_cast<int32_t>(i), gen->choices()[i].text,
                           gen->choices()[i].finish, logprobs_of(gen->choices()[i])});
      out = serve::completion_response(meta, choices, usage);
    }
    gen->record(200);
    return send_json(res, 200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }

  // Streamed: the provider runs on this worker after the handler returns, once per call until it
  // calls done(); each call waits up to one poll interval for tokens.
  const bool include_usage = p.params.include_usage;
  const bool want_logprobs = p.params.logprobs.has_value();
  auto started = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [gen, meta, chat, include_usage, want_logprobs, started](size_t, httplib::DataSink& sink) {
        auto send = [&](const std::string& event) {
          return sink.write(event.data(), event.size());
        };
        if (!*started) {
          *started = true;
          if (chat)
            for (size_t i = 0; i < gen->choices().size(); ++i)
              if (!send(serve::sse_event(
                      serve::chat_role_chunk(meta, static_cast<int32_t>(i), include_usage))))
                return false;
        }
        std::vector<Delta> deltas;
        gen->poll(deltas);
        for (const Delta& d : deltas) {
          if (d.has_token || !d.text.empty()) {
            const std::vector<serve::TokenLogprob>* lp = want_logprobs ? &d.logprobs : nullptr;
            const ordered_json chunk =
                chat ? serve::chat_content_chunk(meta, d.choice, d.text, include_usage, lp)
                     : serve::completion_chunk(meta, d.choice, d.text, serve::ChoiceFinish::kNone,
                                               include_usage, lp, d.text_offset);
            if (!send(serve::sse_event(chunk))) return false;
          }
          if (d.finish != serve::ChoiceFinish::kNone) {
            const ordered_json chunk =
                chat ? serve::chat_finish_chunk(meta, d.choice, d.finish, include_usage)
                     : serve::completion_chunk(meta, d.choice, "", d.finish, include_usage);
            if (!send(serve::sse_event(chunk))) return false;
          }
        }
        if (gen->error()) {
          send(serve::sse_error(*gen->error()));
          send(serve::sse_done());
          gen->record(gen->error()->http_status);
          sink.done();
          return true;
        }
        if (!gen->finished()) return true;
        if (include_usage && !send(serve::sse_event(serve::usage_chunk(
                                 meta, chat, {gen->prompt_tokens(), gen->completion_tokens()}))))
          return false;
        if (!send(serve::sse_done())) return false;
        gen->record(200);
        sink.done();
        return true;
      },
      [gen](bool success) {
        // The client closed the connection (or a write failed) before the end: stop generating
        // for it. 499 is the de-facto code for "client closed request".
        if (!success) {
          gen->cancel_all();
          gen->record(499);
        }
      });
}

}  // namespace moelora::server
