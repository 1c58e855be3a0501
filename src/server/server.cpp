#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"
#include "serve/responses.h"
#include "server/server_impl.h"

namespace moelora::server {

using nlohmann::ordered_json;

// ---- small helpers shared by the server's files ----

void send_json(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, "application/json");
}

void send_error(httplib::Response& res, const serve::ApiError& error) {
  send_json(res, error.http_status,
            error.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

serve::ApiError api_error_from_status(const Status& status, const std::string& param) {
  serve::ApiError e;
  e.message = status.message();
  e.param = param;
  switch (status.code()) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:
    case ErrorCode::kInvalidFile:
    case ErrorCode::kUnsupported:
      e.http_status = 400;
      e.code = "invalid_value";
      break;
    case ErrorCode::kNotFound:
      e.http_status = 404;
      e.code = "not_found";
      break;
    default:
      e.http_status = 500;
      e.type = "internal_server_error";
      break;
  }
  return e;
}

std::string adapter_label(const std::string& adapter) {
  return adapter.empty() ? "base" : adapter;
}

// ---- the model registry over the live engine ----

EngineModelRegistry::EngineModelRegistry(const Server::Impl& server) : base_(server.base_name) {
  const std::set<std::string> retiring = server.loop->pending_unloads();
  for (const AdapterInfo& a : server.engine->adapters())
    if (!retiring.count(a.name)) names_.push_back(a.name);
  std::sort(names_.begin(), names_.end());
}
std::string EngineModelRegistry::base_model() const {
  return base_;
}
bool EngineModelRegistry::has_adapter(std::string_view name) const {
  return std::binary_search(names_.begin(), names_.end(), name);
}
std::vector<std::string> EngineModelRegistry::adapter_names() const {
  return names_;
}

// ---- construction ----

Server::Impl::Impl(ServerOptions opts, std::unique_ptr<Engine> eng, io::Tokenizer tok,
                   std::optional<chat::ChatTemplate> tmpl)
    : options(std::move(opts)),
      engine(std::move(eng)),
      tokenizer(std::move(tok)),
      chat_template(std::move(tmpl)) {
  const ModelInfo& info = engine->model_info();
  max_model_len = info.max_position_embeddings;
  if (info.max_sequence_length > 0)
    max_model_len = max_model_len > 0 ? std::min(max_model_len, info.max_sequence_length)
                                      : info.max_sequence_length;
  base_name = options.served_model_name.empty() ? engine->options().model_dir.filename().string()
                                                : options.served_model_name;
  if (base_name.empty()) base_name = engine->options().model_dir.parent_path().filename().string();
  if (std::optional<int32_t> eos = tokenizer.eos_token_id()) {
    const auto& ids = info.eos_token_ids;
    if (std::find(ids.begin(), ids.end(), static_cast<int32_t>(*eos)) == ids.end())
      extra_stop_token_ids.push_back(static_cast<int32_t>(*eos));
  }
  limits = options.limits;
  limits.vocab_size = info.vocab_size;
  limits.logprobs_supported = true;
  limits.max_logprobs = kMaxTopLogprobs;
  created_unix = std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  declare_metrics();
  loop = std::make_unique<EngineLoop>(
      *engine, [this] { sample_engine_metrics(); }, options.on_engine_failure);
}

void Server::Impl::declare_metrics() {
  const std::vector<double> latency = serve::latency_buckets_seconds();
  metrics.add_counter("moelora_requests_total",
                      "HTTP generation requests answered, by endpoint, HTTP status and adapter.");
  metrics.add_counter("moelora_prompt_tokens_total", "Prompt tokens of answered requests.");
  metrics.add_counter("moelora_generation_tokens_total", "Tokens generated for answered requests.");
  metrics.add_histogram("moelora_time_to_first_token_seconds",
                        "From request arrival to the first generated token.", latency);
  metrics.add_histogram("moelora_inter_token_latency_seconds",
                        "Between consecutive generated tokens of one choice.", latency);
  metrics.add_histogram("moelora_e2e_request_latency_seconds",
                        "From request arrival to its last token.", latency);
  metrics.add_gauge("moelora_requests_running", "Requests in the engine's running batch.");
  metrics.add_gauge("moelora_requests_waiting", "Requests queued for admission.");
  metrics.add_gauge("moelora_http_requests_in_flight", "HTTP requests being handled.");
  metrics.add_gauge("moelora_kv_cache_usage_ratio",
                    "KV cache pages reserved by running requests / pages in the pool "
                    "(0 on a backend without a page pool).");
  metrics.add_gauge("moelora_kv_cache_bytes", "KV cache bytes held by running requests.");
  metrics.add_gauge("moelora_state_cache_bytes",
                    "Linear-attention (Gated DeltaNet) state bytes held by running requests "
                    "(0 for models without such layers).");
  metrics.add_gauge("moelora_state_slots_in_use",
                    "Running requests holding a linear-attention state.");
  metrics.add_gauge("moelora_state_slots_total",
                    "Linear-attention state slots of the backend's fixed pool (0: none, or "
                    "states allocated per request as on the CPU backend).");
  metrics.add_gauge("moelora_lora_slots_in_use", "Adapter slots held by running requests.");
  metrics.add_gauge("moelora_lora_slots_total", "Adapter slots of the backend's pool.");
  metrics.add_gauge("moelora_lora_adapters_registered", "Adapters registered with the engine.");
  metrics.add_counter("moelora_lora_loads_total",
                      "Adapter loads into a pool slot (a request needed a non-resident adapter).");
  metrics.add_counter("moelora_lora_evictions_total",
                      "Pool slots taken from an idle adapter for another one.");
  metrics.add_counter("moelora_lora_updates_total",
                      "Runtime adapter loads and unloads through the API, by action and result.");
  metrics.add_counter("moelora_engine_steps_total", "Engine forwards.");
  metrics.add_counter("moelora_graph_replays_total", "Decode steps replayed from a CUDA graph.");
  metrics.add_counter("moelora_graph_captures_total",
                      "CUDA graphs captured (one per decode batch bucket and LoRA flag, at first "
                      "use).");
  metrics.add_counter("moelora_engine_prefill_steps_total", "Engine steps with prompt tokens.");
  metrics.add_counter("moelora_kv_blocked_steps_total",
                      "Steps whose admission stopped at a request that did not fit the "
                      "unreserved KV pages.");
  metrics.add_gauge("moelora_requests_running_peak", "Most requests that ran in one step.");
}

void Server::Impl::sample_engine_metrics() {
  const EngineStats s = engine->stats();
  std::lock_guard<std::mutex> lock(stats_mutex);
  metrics.set("moelora_requests_running", {}, s.running);
  metrics.set("moelora_requests_waiting", {}, s.waiting);
  const ModelInfo& info = engine->model_info();
  metrics.set("moelora_kv_cache_usage_ratio", {},
              info.kv_cache_pages > 0 ? static_cast<double>(s.kv_pages_reserved) /
                                            static_cast<double>(info.kv_cache_pages)
                                      : 0.0);
  metrics.set("moelora_kv_cache_bytes", {}, static_cast<double>(s.kv_cache_bytes));
  metrics.set("moelora_state_cache_bytes", {}, static_cast<double>(s.state_cache_bytes));
  metrics.set("moelora_state_slots_in_use", {}, static_cast<double>(s.state_sequences));
  metrics.set("moelora_state_slots_total", {}, static_cast<double>(info.state_slots));
  auto bump = [&](const char* name, int64_t now, int64_t before) {
    if (now > before) metrics.increment(name, {}, static_cast<double>(now - before));
  };
  bump("moelora_lora_loads_total", s.pool_misses, last_stats.pool_misses);
  bump("moelora_lora_evictions_total", s.pool_evictions, last_stats.pool_evictions);
  bump("moelora_engine_steps_total", s.steps, last_stats.steps);
  bump("moelora_graph_replays_total", s.graph_replays, last_stats.graph_replays);
  bump("moelora_graph_captures_total", s.graph_captures, last_stats.graph_captures);
  bump("moelora_engine_prefill_steps_total", s.prefill_steps, last_stats.prefill_steps);
  bump("moelora_kv_blocked_steps_total", s.kv_blocked_steps, last_stats.kv_blocked_steps);
  metrics.set("moelora_requests_running_peak", {}, s.peak_running);
  last_stats = s;
}

void Server::Impl::track(RequestId id) {
  std::lock_guard<std::mutex> lock(live_mutex);
  live_requests.insert(id);
}
void Server::Impl::untrack(RequestId id) {
  std::lock_guard<std::mutex> lock(live_mutex);
  live_requests.erase(id);
}

bool Server::Impl::authorized(const httplib::Request& req, httplib::Response& res) {
  if (options.api_key.empty()) return true;
  const std::string expected = "Bearer " + options.api_key;
  const std::string got = req.get_header_value("Authorization");
  // Compare in constant time over the expected length: the key must not leak through timing.
  bool same = got.size() == expected.size();
  unsigned char diff = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i] ^ (i < got.size() ? got[i] : 0));
  if (same && diff == 0) return true;
  serve::ApiError e;
  e.http_status = 401;
  e.type = "authentication_error";
  e.code = "invalid_api_key";
  e.message = got.empty() ? "missing API key: send the header 'Authorization: Bearer <key>'"
                          : "invalid API key in the Authorization header";
  send_error(res, e);
  return false;
}

void Server::Impl::install_routes() {
  http.new_task_queue = [n = std::max(4, options.http_threads)] {
    return new httplib::ThreadPool(static_cast<size_t>(n));
  };
  // cpp-httplib listens with a backlog of 5: a burst of clients connecting at once (a load test, a
  // batch job) overflows it and the kernel drops their handshakes, which clients see as reset
  // connections. Keep the listening socket so start() can raise the backlog after the bind.
  http.set_socket_options([this](int fd) {
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = fd;
  });
  http.set_payload_max_length(limits.max_body_bytes);
  // Every refused or failed request gets a log line (what a user debugging a client needs);
  // successful ones only with --log-requests.
  const bool log_all = options.log_requests || std::getenv("MOELORA_SERVE_LOG") != nullptr;
  http.set_logger([log_all](const httplib::Request& req, const httplib::Response& res) {
    if (res.status < 400 && !log_all) return;
    std::string detail;
    if (res.status >= 400) {
      const nlohmann::json body = nlohmann::json::parse(res.body, nullptr, false);
      if (body.is_object() && body.contains("error") && body["error"].is_object() &&
          body["error"].contains("message") && body["error"]["message"].is_string())
        detail = ": " + body["error"]["message"].get<std::string>().substr(0, 300);
    }
    std::fprintf(stderr, "moelora serve: %s %s %s %d%s\n", req.remote_addr.c_str(),
                 req.method.c_str(), req.path.c_str(), res.status, detail.c_str());
  });
  http.set_read_timeout(std::chrono::seconds(30));
  http.set_write_timeout(std::chrono::seconds(30));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        serve::ApiError e;
        e.http_status = 500;
        e.type = "internal_server_error";
        try {
          if (ep) std::rethrow_exception(ep);
          e.message = "unknown error";
        } catch (const std::exception& ex) {
          e.message = ex.what();
        } catch (...) {
          e.message = "unknown error";
        }
        send_error(res, e);
      });
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler already wrote its own error
    serve::ApiError e;
    e.http_status = res.status;
    if (res.status == 404) {
      e.message = "no route " + req.method + " " + req.path +
                  " (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, ...)";
      e.code = "not_found";
    } else if (res.status == 413) {
      e.message = "request body larger than the server's limit";
      e.code = "payload_too_large";
    } else {
      e.message = "HTTP error " + std::to_string(res.status);
    }
    send_error(res, e);
  });

  auto guarded = [this](bool needs_key, auto handler) {
    return [this, needs_key, handler](const httplib::Request& req, httplib::Response& res) {
      ++http_in_flight;
      struct Done {
        std::atomic<int64_t>& n;
        ~Done() { --n; }
      } done{http_in_flight};
      if (stopping.load()) {
        serve::ApiError e;
        e.http_status = 503;
        e.type = "service_unavailable";
        e.message = "the server is shutting down";
        send_error(res, e);
        return;
      }
      if (needs_key && !authorized(req, res)) return;
      handler(req, res);
    };
  };

  http.Post("/v1/completions",
            guarded(true, [this](const httplib::Request& q, httplib::Response& r) {
              handle_completion(q, r, false);
            }));
  http.Post("/v1/chat/completions",
            guarded(true, [this](const httplib::Request& q, httplib::Response& r) {
              handle_completion(q, r, true);
            }));
  http.Get("/v1/models", guarded(true, [this](const httplib::Request&, httplib::Response& r) {
             EngineModelRegistry registry(*this);
             send_json(r, 200,
                       serve::models_response(registry, created_unix, max_model_len).dump());
           }));
  for (const char* path : {"/v1/load_lora_adapter", "/load_lora_adapter"})
    http.Post(path, guarded(true, [this](const httplib::Request& q, httplib::Response& r) {
                handle_load_adapter(q, r);
              }));
  for (const char* path : {"/v1/unload_lora_adapter", "/unload_lora_adapter"})
    http.Post(path, guarded(true, [this](const httplib::Request& q, httplib::Response& r) {
                handle_unload_adapter(q, r);
              }));

  auto tokenize = [this](const httplib::Request& req, httplib::Response& res) {
    auto body = serve::parse_json_body(req.body, limits);
    if (!body.is_ok()) return send_error(res, body.error());
    const ordered_json& b = body.value();
    if (!b.is_object()) {
      serve::ApiError e;
      e.message = "the body must be a JSON object with 'prompt' or 'messages'";
      return send_error(res, e);
    }
    std::string text;
    bool add_special = true;
    if (b.contains("messages")) {
      // Reuse the chat parser so that tokenize counts exactly what a chat request would run.
      ordered_json chat_body = b;
      chat_body.erase("max_tokens");
      EngineModelRegistry registry(*this);
      auto parsed = serve::parse_chat_completion_request(chat_body, registry, limits);
      if (!parsed.is_ok()) return send_error(res, parsed.error());
      if (!chat_template) {
        serve::ApiError e;
        e.message = "the model has no chat template: tokenize a 'prompt' instead";
        e.param = "messages";
        return send_error(res, e);
      }
      Status s = capture([&] {
        text = chat_template->render(parsed.value().messages, parsed.value().add_generation_prompt,
                                     parsed.value().tools, parsed.value().chat_template_kwargs);
      });
      if (!s.is_ok()) return send_error(res, api_error_from_status(s, "messages"));
      add_special = false;
    } else if (b.contains("prompt") && b["prompt"].is_string()) {
      text = b["prompt"].get<std::string>();
    } else {
      serve::ApiError e;
      e.message = "'prompt' must be a string (or send 'messages')";
      e.param = "prompt";
      e.code = "missing_required_parameter";
      return send_error(res, e);
    }
    if (b.contains("add_special_tokens") && b["add_special_tokens"].is_boolean())
      add_special = b["add_special_tokens"].get<bool>();
    std::vector<int32_t> ids;
    Status s = capture([&] { ids = tokenizer.encode(text, add_special); });
    if (!s.is_ok()) return send_error(res, api_error_from_status(s, "prompt"));
    ordered_json out;
    out["count"] = ids.size();
    out["max_model_len"] = max_model_len;
    out["tokens"] = ids;
    send_json(res, 200, out.dump());
  };
  auto detokenize = [this](const httplib::Request& req, httplib::Response& res) {
    auto body = serve::parse_json_body(req.body, limits);
    if (!body.is_ok()) return send_error(res, body.error());
    const ordered_json& b = body.value();
    serve::ApiError e;
    e.param = "tokens";
    if (!b.is_object() || !b.contains("tokens") || !b["tokens"].is_array()) {
      e.message = "'tokens' must be an array of token ids";
      return send_error(res, e);
    }
    if (b["tokens"].size() > limits.max_prompt_tokens) {
      e.message = "'tokens' holds more than " + std::to_string(limits.max_prompt_tokens) + " ids";
      return send_error(res, e);
    }
    std::vector<int32_t> ids;
    for (size_t i = 0; i < b["tokens"].size(); ++i) {
      const ordered_json& v = b["tokens"][i];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= limits.vocab_size) {
        e.message = "'tokens[" + std::to_string(i) + "]' must be a token id in [0, " +
                    std::to_string(limits.vocab_size) + "); got " + v.dump();
        return send_error(res, e);
      }
      ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
    ordered_json out;
    out["prompt"] = io::sanitize_utf8(tokenizer.decode(ids));
    send_json(res, 200, out.dump());
  };
  for (const char* path : {"/v1/tokenize", "/tokenize"}) http.Post(path, guarded(true, tokenize));
  for (const char* path : {"/v1/detokenize", "/detokenize"})
    http.Post(path, guarded(true, detokenize));

  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (loop->healthy() && !stopping.load()) {
      send_json(res, 200, R"({"status":"ok"})");
    } else {
      ordered_json out;
      out["status"] = stopping.load() ? "shutting_down" : "engine_failed";
      out["error"] = loop->failure();
      send_json(res, 503, out.dump());
    }
  });
  http.Get("/metrics", guarded(true, [this](const httplib::Request&, httplib::Response& res) {
             sample_engine_metrics();
             {
               std::lock_guard<std::mutex> lock(stats_mutex);
               int32_t in_use = 0;
               const std::vector<AdapterInfo> adapters = engine->adapters();
               for (const AdapterInfo& a : adapters)
                 if (a.slot >= 0 && a.running_requests > 0) ++in_use;
               metrics.set("moelora_lora_slots_in_use", {}, in_use);
               metrics.set("moelora_lora_slots_total", {}, engine->options().adapter_slots);
               metrics.set("moelora_lora_adapters_registered", {},
                           static_cast<double>(adapters.size()));
               metrics.set("moelora_http_requests_in_flight", {},
                           static_cast<double>(http_in_flight.load()));
             }
             res.status = 200;
             res.set_content(metrics.render(), serve::MetricsRegistry::content_type());
           }));
}

// ---- Server ----

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() {
  shutdown();
}

Result<std::unique_ptr<Server>> Server::create(std::unique_ptr<Engine> engine,
                                               io::Tokenizer tokenizer,
                                               std::optional<chat::ChatTemplate> chat_template,
                                               ServerOptions options) {
  if (!engine) return Status(ErrorCode::kInvalidArgument, "serve: no engine");
  if (options.port < 0 || options.port > 65535)
    return Status(ErrorCode::kInvalidArgument,
                  "serve: --port must be in [0, 65535]; got " + std::to_string(options.port));
  if (options.default_max_tokens < 0)
    return Status(ErrorCode::kInvalidArgument, "serve: --default-max-tokens must be >= 0; got " +
                                                   std::to_string(options.default_max_tokens));
  if (options.enable_lora_updates) {
    std::error_code ec;
    if (options.lora_root.empty() || !std::filesystem::is_directory(options.lora_root, ec))
      return Status(ErrorCode::kInvalidArgument,
                    "serve: --enable-lora-updates needs --lora-root DIR, an existing directory "
                    "that runtime loads are confined to; got '" +
                        options.lora_root.string() + "'");
    options.lora_root = std::filesystem::canonical(options.lora_root, ec);
  }
  if (tokenizer.vocab_size() > engine->model_info().vocab_size)
    return Status(ErrorCode::kInvalidArgument, "serve: the tokenizer addresses " +
                                                   std::to_string(tokenizer.vocab_size()) +
                                                   " token ids but the model's vocabulary has " +
                                                   std::to_string(engine->model_info().vocab_size));
  auto impl = std::make_unique<Impl>(std::move(options), std::move(engine), std::move(tokenizer),
                                     std::move(chat_template));
  impl->install_routes();
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Status Server::start() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.lifecycle_mutex);
  if (s.started) return Status(ErrorCode::kInvalidArgument, "serve: already started");
  int port = s.options.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.options.host);
    if (port <= 0)
      return Status(ErrorCode::kInvalidArgument,
                    "serve: cannot bind " + s.options.host + " on any port");
  } else if (!s.http.bind_to_port(s.options.host, port)) {
    return Status(ErrorCode::kInvalidArgument,
                  "serve: cannot listen on " + s.options.host + ":" + std::to_string(port) +
                      " (in use, or not an address of this machine); pick another with --port "
                      "or --host");
  }
  s.bound_port = port;
  if (s.listen_fd >= 0) ::listen(s.listen_fd, SOMAXCONN);
  s.loop->start();
  s.http_thread = std::thread([&s] {
    s.http.listen_after_bind();
    std::lock_guard<std::mutex> lock(s.lifecycle_mutex);
    s.http_ended = true;
    s.http_ended_cv.notify_all();
  });
  s.started = true;
  return Status::ok();
}

void Server::wait() {
  // Only shutdown() joins the listener thread; waiting here is on its end, so wait() and a
  // shutdown() from another thread (a signal watcher) never both join it.
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lock(s.lifecycle_mutex);
  s.http_ended_cv.wait(lock, [&] { return !s.started || s.http_ended; });
}

void Server::shutdown() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.lifecycle_mutex);
    if (s.stopped) return;
    s.stopped = true;
  }
  s.stopping = true;
  // Cancel what runs, let the engine deliver the final events (handlers waiting on them return),
  // then stop accepting and join the HTTP workers, then the engine thread.
  std::vector<RequestId> live;
  {
    std::lock_guard<std::mutex> lock(s.live_mutex);
    live.assign(s.live_requests.begin(), s.live_requests.end());
  }
  for (RequestId id : live) (void)s.loop->cancel(id);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (s.started && !s.engine->idle() && s.loop->healthy() &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (s.started) s.http.stop();
  if (s.http_thread.joinable()) s.http_thread.join();
  s.loop->stop();
}

int Server::port() const {
  return impl_->bound_port;
}
std::string Server::base_model_name() const {
  return impl_->base_name;
}
Engine& Server::engine() {
  return *impl_->engine;
}

}  // namespace moelora::server
