// `moelora serve`: an OpenAI-compatible HTTP server over one Engine.
//
// Threads: cpp-httplib's worker pool runs the handlers (one per connection at a time; a streamed
// answer keeps its worker until [DONE]); EngineLoop (engine_loop.h) is the one thread that steps
// the engine. A handler validates the body (serve/protocol.h), renders the chat template,
// tokenizes, submits one engine request per choice and then waits on its own event queue, which
// the engine thread fills from the requests' callbacks. Requests never share state beyond the
// engine, so one bad request cannot disturb another.
//
// Endpoints (bodies and errors in OpenAI's shapes, serve/responses.h):
//   POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
//   GET  /v1/models                               base model and adapters (adapters with parent)
//   POST /v1/load_lora_adapter, /v1/unload_lora_adapter   {"lora_name", "lora_path"} (vLLM)
//   POST /load_lora_adapter, /unload_lora_adapter          the same bodies (SGLang)
//   POST /v1/tokenize, /tokenize                   {"prompt" | "messages", ...} -> token ids
//   POST /v1/detokenize, /detokenize               {"tokens": [...]} -> text
//   GET  /health                                   200 while the engine runs, else 503
//   GET  /metrics                                  Prometheus text format
// With --api-key every route but /health needs "Authorization: Bearer KEY". More than
// max_queued_requests waiting for admission: 503 with Retry-After.
//
// Adapters: --adapter NAME=DIR at start; at run time only with enable_lora_updates and only from
// under lora_root (the resolved path, symlinks followed, must stay inside it). Unloading an adapter
// that running requests use takes its name out of service at once and unregisters it from the
// engine when they have finished.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "chat/chat_template.h"
#include "io/tokenizer.h"
#include "moelora/engine.h"
#include "serve/protocol.h"

namespace moelora::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (port() tells which)
  // The name clients use for the base model; empty: the model directory's name.
  std::string served_model_name;
  std::string api_key;  // non-empty: required as a bearer token
  bool enable_lora_updates = false;
  std::filesystem::path lora_root;  // runtime loads only from under here (required with updates)
  // max_tokens when a request gives none: 0 = the context left after the prompt (as vLLM does).
  int64_t default_max_tokens = 0;
  int http_threads = 128;     // cpp-httplib workers: the most requests served at once
  bool log_requests = false;  // a line per answered request on stderr (errors always get one)
  // Requests waiting for admission beyond which new ones get 503 with Retry-After (the client
  // backs off instead of piling up behind a queue it cannot see).
  int64_t max_queued_requests = 1024;
  serve::ProtocolLimits limits;  // vocab_size and logprobs_supported are set by the server
  // Called once, on the engine's thread, when a failed step stops the engine (/health turns
  // 503); must not call shutdown() itself (it joins that thread). Rank 0 of a multi-process job
  // ends the process with it, so the launcher ends the job.
  std::function<void(const std::string&)> on_engine_failure;
};

class Server {
 public:
  // Takes over the engine. `chat_template` nullopt: chat requests get a 400 naming the missing
  // template. Fails (kInvalidArgument) on inconsistent options.
  static Result<std::unique_ptr<Server>> create(std::unique_ptr<Engine> engine,
                                                io::Tokenizer tokenizer,
                                                std::optional<chat::ChatTemplate> chat_template,
                                                ServerOptions options);
  ~Server();  // shutdown()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port and starts the engine thread and the HTTP workers; returns once the socket
  // listens (kInvalidArgument naming the address when it cannot bind).
  Status start();
  // Blocks until shutdown() (from another thread or a signal handler's helper thread).
  void wait();
  // Stops accepting, cancels every request in flight (their clients get an error or the end of
  // their stream), joins all threads. Idempotent.
  void shutdown();

  int port() const;
  std::string base_model_name() const;
  Engine& engine();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelora::server
