// Server internals shared by its translation units: server.cpp (lifecycle, routing, auth,
// models / tokenize / health / metrics), server_generate.cpp (completions and chat completions)
// and server_adapters.cpp (runtime adapter loading). Not part of any other layer's API.
#pragma once

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "serve/metrics.h"
#include "serve/protocol.h"
#include "server/engine_loop.h"
#include "server/server.h"

namespace moelora::server {

// The models a request may name: the base and every registered adapter that is not being
// unloaded (serve::ModelRegistry over the live engine).
class EngineModelRegistry final : public serve::ModelRegistry {
 public:
  EngineModelRegistry(const Server::Impl& server);
  std::string base_model() const override;
  bool has_adapter(std::string_view name) const override;
  std::vector<std::string> adapter_names() const override;

 private:
  std::string base_;
  std::vector<std::string> names_;  // sorted, snapshot taken at construction
};

struct Server::Impl {
  ServerOptions options;
  std::unique_ptr<Engine> engine;
  io::Tokenizer tokenizer;
  std::optional<chat::ChatTemplate> chat_template;
  std::string base_name;
  int64_t max_model_len = 0;  // prompt + generated tokens one request may reach
  // The tokenizer's end-of-sequence token when config.json does not list it (chat models end a
  // turn with it: Qwen's <|im_end|>); the engine stops on config.json's ids by itself.
  std::vector<int32_t> extra_stop_token_ids;
  serve::ProtocolLimits limits;
  serve::MetricsRegistry metrics;
  std::unique_ptr<EngineLoop> loop;
  httplib::Server http;
  std::thread http_thread;
  int bound_port = 0;
  int listen_fd = -1;  // the listening socket (set_socket_options), to raise its backlog
  int64_t created_unix = 0;
  std::atomic<bool> stopping{false};
  std::mutex lifecycle_mutex;
  bool started = false;
  bool stopped = false;
  bool http_ended = false;  // the listener returned (after stop(), or on its own)
  std::condition_variable http_ended_cv;

  // Engine requests in flight (shutdown cancels them).
  std::mutex live_mutex;
  std::set<RequestId> live_requests;
  std::atomic<uint64_t> response_sequence{0};
  std::atomic<int64_t> http_in_flight{0};

  std::mutex adapter_update_mutex;  // one load / unload at a time
  EngineStats last_stats;           // engine counters already turned into metric increments
  std::mutex stats_mutex;

  Impl(ServerOptions options, std::unique_ptr<Engine> engine, io::Tokenizer tokenizer,
       std::optional<chat::ChatTemplate> chat_template);

  void declare_metrics();
  void sample_engine_metrics();  // engine stats -> gauges and counter increments
  void install_routes();
  bool authorized(const httplib::Request& req, httplib::Response& res);

  // Generation endpoints (server_generate.cpp).
  void handle_completion(const httplib::Request& req, httplib::Response& res, bool chat);
  // Adapter endpoints (server_adapters.cpp).
  void handle_load_adapter(const httplib::Request& req, httplib::Response& res);
  void handle_unload_adapter(const httplib::Request& req, httplib::Response& res);

  void track(RequestId id);
  void untrack(RequestId id);
};

// JSON answers.
void send_json(httplib::Response& res, int status, const std::string& body);
void send_error(httplib::Response& res, const serve::ApiError& error);
// An engine / library Status as an API error (invalid argument / out of range -> 400, not found
// -> 404, anything else -> 500).
serve::ApiError api_error_from_status(const Status& status, const std::string& param = {});
// The adapter label of metrics: the adapter's name, or "base".
std::string adapter_label(const std::string& adapter);

}  // namespace moelora::server
