// `moelora serve`: the OpenAI-compatible HTTP server (src/server/server.h) on one engine.
//
//   moelora serve --model DIR [--adapter NAME=DIR ...] [--host 127.0.0.1] [--port 8000]
//                 [--device cuda|cpu] [--max-loras-per-batch N] [--max-lora-rank R]
//                 [--max-cpu-loras N] [--api-key KEY] [--served-model-name NAME]
//                 [--chat-template FILE] [--enable-lora-updates --lora-root DIR] ...
//
// Prints "moelora serve: listening on http://HOST:PORT" (flushed) once the socket listens, so a
// script that started it with --port 0 can read the port; stops cleanly on SIGINT / SIGTERM.
#include <signal.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "core/error.h"
#include "device_run.h"
#include "io/hf_config.h"
#include "model/model_setup.h"
#include "moelora/engine.h"
#include "serve_parallel.h"
#include "synth.h"

#if MOELORA_WITH_HTTP
#include <thread>

#include "server/server.h"
#endif

namespace {

using moelora::ErrorCode;

struct ServeArgs {
  std::string model_dir;
  std::vector<std::string> adapters;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string device;
  int32_t max_loras_per_batch = 8;
  int32_t adapter_slots = 0;
  int64_t max_lora_rank = 0;  // 0: inferred from the adapters given at start
  int32_t max_cpu_loras = 32;
  std::string api_key;
  std::string served_model_name;
  std::string chat_template;
  bool enable_lora_updates = false;
  std::string lora_root;
  int32_t max_running = 64;
  int64_t max_batch_tokens = 2048;
  int64_t max_seq_len = 0;
  int64_t default_max_tokens = 0;
  int32_t max_n = 8;
  int64_t max_queued_requests = 1024;
  int http_threads = 128;
  double gpu_memory_fraction = 0.9;
  bool no_cuda_graphs = false;
  bool log_requests = false;
  // Benchmarks of models nobody has on disk (GPU): the preset's config.json only, weights and
  // adapters drawn on the device, the tokenizer copied from --tokenizer.
  std::string preset;
  bool random_weights = false;
  int32_t random_adapters = 0;
  int64_t random_adapter_rank = 16;
  int64_t layers = 0;
  std::string tokenizer_dir;
  moelora::tools::ParallelArgs parallel;
};

#if MOELORA_WITH_HTTP
// Signal handling without work in the handler: a thread waits for SIGINT / SIGTERM with
// sigwait and shuts the server down from normal code.
sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// The engine's options from the command line (every rank computes the same).
moelora::EngineOptions engine_options_of(const ServeArgs& a,
                                         const std::vector<moelora::model::AdapterSpec>& specs) {
  moelora::EngineOptions options;
  options.model_dir = a.model_dir;
  options.device = a.device.empty() ? moelora::default_device() : a.device;
  options.max_running = a.max_running;
  options.max_batch_tokens = a.max_batch_tokens;
  options.max_loras_per_batch = a.max_loras_per_batch;
  options.adapter_slots = a.adapter_slots > 0 ? a.adapter_slots : a.max_loras_per_batch;
  // The slot pool is sized for max_lora_rank on every expert of every layer (with 128 experts
  // and 48 layers, 8 slots of rank 64 are ~300 GB): take the adapters' own rank unless told.
  int64_t rank = a.max_lora_rank;
  if (rank <= 0) {
    rank = std::max<int64_t>(16, moelora::tools::adapter_rank_bound(specs));
    if (a.random_adapters > 0) rank = std::max(rank, a.random_adapter_rank);
  }
  options.max_lora_rank = rank;
  options.host_adapter_cache = a.max_cpu_loras;
  options.max_seq_len = a.max_seq_len;
  options.gpu_memory_fraction = a.gpu_memory_fraction;
  options.cuda_graphs = !a.no_cuda_graphs;
  options.show_progress = true;
  options.random_weights = a.random_weights;
  options.max_layers = a.layers;
  return options;
}

int run_serve(const ServeArgs& args) {
  namespace fs = std::filesystem;
  ServeArgs a = args;
  std::unique_ptr<moelora::cli::ScratchDir> scratch;
  MOELORA_CHECK(a.model_dir.empty() != a.preset.empty(), ErrorCode::kInvalidArgument,
                "moelora serve: give exactly one of --model DIR and --preset NAME");
  MOELORA_CHECK(a.preset.empty() || (a.random_weights && !a.tokenizer_dir.empty()),
                ErrorCode::kInvalidArgument,
                "moelora serve: --preset needs --random-weights (the GPU draws the weights) and "
                "--tokenizer DIR (a folder with tokenizer.json)");
  MOELORA_CHECK(a.random_adapters == 0 || a.random_weights, ErrorCode::kInvalidArgument,
                "moelora serve: --random-adapters needs --random-weights");
  if (!a.preset.empty()) {
    scratch = std::make_unique<moelora::cli::ScratchDir>("serve");
    const fs::path dir = scratch->path() / a.preset;
    fs::create_directories(dir);
    const moelora::io::ModelConfig config = moelora::cli::preset_config(a.preset, a.layers, "fp8");
    std::ofstream out(dir / "config.json");
    out << moelora::io::model_config_to_json(config).dump(2) << "\n";
    out.close();
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
      std::error_code ec;
      if (fs::exists(fs::path(a.tokenizer_dir) / name, ec))
        fs::copy_file(fs::path(a.tokenizer_dir) / name, dir / name,
                      fs::copy_options::overwrite_existing, ec);
    }
    a.model_dir = dir.string();
    if (a.served_model_name.empty()) a.served_model_name = a.preset;
  }
  {
    const std::string device = a.device.empty() ? moelora::default_device() : a.device;
    moelora::tools::check_parallel_args(a.parallel, device);
    MOELORA_CHECK(
        a.parallel.tp == 1 || !a.random_weights || device == "cuda", ErrorCode::kUnsupported,
        "moelora serve: --random-weights draws weights on the "
        "GPU; --tp ",
        a.parallel.tp, " --device cpu runs a checkpoint folder (--model) on the CPU backend");
  }
  if (a.parallel.launcher()) return moelora::tools::launch_serve_ranks(a.parallel);
  std::vector<moelora::model::AdapterSpec> specs;
  for (const std::string& spec_text : a.adapters)
    specs.push_back(moelora::model::parse_adapter_spec(spec_text));
  moelora::EngineOptions options = engine_options_of(a, specs);
  if (a.parallel.worker()) return moelora::tools::run_worker_rank(a.parallel, options);

  // Block the stop signals in every thread this process starts from here on.
  sigset_t signals = stop_signals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::optional<moelora::io::Tokenizer> tokenizer = moelora::model::find_tokenizer(a.model_dir);
  MOELORA_CHECK(tokenizer.has_value(), ErrorCode::kNotFound, "moelora serve: ", a.model_dir,
                " has no tokenizer.json (or tiktoken.model); the server needs the model's "
                "tokenizer: copy its tokenizer files into the folder");
  std::optional<moelora::chat::ChatTemplate> chat_template;
  if (!a.chat_template.empty()) {
    std::ifstream in(a.chat_template, std::ios::binary);
    MOELORA_CHECK(in.good(), ErrorCode::kNotFound, "--chat-template ", a.chat_template,
                  ": cannot read the file");
    std::stringstream text;
    text << in.rdbuf();
    // The special tokens come from the model folder's config even with an override template.
    nlohmann::ordered_json specials = nlohmann::ordered_json::object();
    moelora::Status s = moelora::capture(
        [&] { specials = moelora::chat::ChatTemplate::load(a.model_dir).special_tokens(); });
    (void)s;  // a folder without a template of its own still has its tokens read below
    chat_template = moelora::chat::ChatTemplate::from_source(text.str(), specials, a.chat_template);
  } else {
    moelora::Status s =
        moelora::capture([&] { chat_template = moelora::chat::ChatTemplate::load(a.model_dir); });
    if (!s.is_ok()) {
      if (s.code() != ErrorCode::kNotFound) throw moelora::Error(s.code(), s.message());
      std::fprintf(stderr,
                   "moelora serve: %s has no chat template; /v1/chat/completions answers 400 "
                   "(pass --chat-template FILE)\n",
                   a.model_dir.c_str());
    }
  }

  auto engine = a.parallel.rank0()
                    ? moelora::Engine::create(
                          moelora::tools::make_rank0_executor(a.parallel, options), options)
                    : moelora::Engine::create(options);
  if (!engine.is_ok()) throw moelora::Error(engine.status().code(), engine.status().message());
  for (const moelora::model::AdapterSpec& spec : specs) {
    moelora::Status s = engine.value()->register_adapter(spec.name, spec.dir);
    if (!s.is_ok())
      throw moelora::Error(s.code(),
                           "--adapter " + spec.name + "=" + spec.dir.string() + ": " + s.message());
  }

  for (int32_t i = 0; i < a.random_adapters; ++i) {
    moelora::Status s = engine.value()->register_random_adapter(
        "lora" + std::to_string(i), a.random_adapter_rank, /*shared_outer=*/false,
        1000 + static_cast<uint64_t>(i));
    if (!s.is_ok()) throw moelora::Error(s.code(), "--random-adapters: " + s.message());
  }

  moelora::server::ServerOptions so;
  so.log_requests = a.log_requests;
  so.host = a.host;
  so.port = a.port;
  so.served_model_name = a.served_model_name.empty()
                             ? fs::path(a.model_dir).lexically_normal().filename().string()
                             : a.served_model_name;
  if (so.served_model_name.empty())
    so.served_model_name =
        fs::path(a.model_dir).lexically_normal().parent_path().filename().string();
  so.api_key = a.api_key;
  so.enable_lora_updates = a.enable_lora_updates;
  so.lora_root = a.lora_root;
  so.default_max_tokens = a.default_max_tokens;
  so.http_threads = a.http_threads;
  so.limits.max_n = a.max_n;
  so.max_queued_requests = a.max_queued_requests;
  // Rank 0 of a multi-process job ends when its engine stops (a lost rank breaks the group), so
  // the launcher ends the job instead of a server that answers 503 forever.
  std::atomic<bool> engine_failed{false};
  // Set by the signal watcher first thing: a worker that the same SIGTERM stopped is then the
  // job ending, not a failure to report.
  std::atomic<bool> stop_requested{false};
  if (a.parallel.rank0()) {
    so.on_engine_failure = [&engine_failed, &stop_requested](const std::string& message) {
      if (stop_requested) return;
      std::fprintf(stderr, "moelora serve: the engine stopped: %s\n", message.c_str());
      engine_failed = true;
      kill(getpid(), SIGTERM);  // taken by the watcher below, which shuts the server down
    };
  }
  auto created = moelora::server::Server::create(std::move(engine.value()), std::move(*tokenizer),
                                                 std::move(chat_template), so);
  if (!created.is_ok()) throw moelora::Error(created.status().code(), created.status().message());
  moelora::server::Server& server = *created.value();
  moelora::Status started = server.start();
  if (!started.is_ok()) throw moelora::Error(started.code(), started.message());

  const moelora::ModelInfo& info = server.engine().model_info();
  std::printf("moelora serve: model '%s' (%s, %lld layers) on %s; adapters:",
              server.base_model_name().c_str(), info.model_type.c_str(),
              static_cast<long long>(info.num_layers), options.device.c_str());
  for (const moelora::AdapterInfo& ad : server.engine().adapters())
    std::printf(" %s", ad.name.c_str());
  std::printf("%s\n", server.engine().adapters().empty() ? " none" : "");
  std::printf("moelora serve: listening on http://%s:%d\n", a.host.c_str(), server.port());
  std::fflush(stdout);

  std::thread watcher([&server, &stop_requested, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    stop_requested = true;
    std::fprintf(stderr, "moelora serve: signal %d, shutting down\n", sig);
    server.shutdown();
  });
  server.wait();
  // wait() returns after shutdown() (from the watcher) stopped the listener; if the listener
  // ended on its own, wake the watcher so it can be joined.
  pthread_kill(watcher.native_handle(), SIGTERM);
  watcher.join();
  server.shutdown();
  return engine_failed ? 1 : 0;
}
#endif

MOELORA_SUBCOMMAND(
    "serve",
    "Serve the model over HTTP with the OpenAI API (completions, chat, streaming, adapters)", 35,
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<ServeArgs>();
      app.footer(
          "Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true for "
          "server-sent\n"
          "events), GET /v1/models, POST /v1/tokenize, POST /v1/detokenize, GET /health, GET "
          "/metrics\n"
          "(Prometheus), POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with\n"
          "--enable-lora-updates). An adapter is chosen per request by `model`: the adapter's "
          "name\n"
          "(vLLM), BASE:ADAPTER (SGLang), or by \"lora_path\": NAME in the body. Example:\n"
          "  moelora serve --model ./Qwen3-30B-A3B --adapter sql=./lora-sql --port 8000\n"
          "  curl localhost:8000/v1/completions -d '{\"model\": \"sql\", \"prompt\": \"SELECT\", "
          "\"max_tokens\": 16}'");
      app.add_option("--model", a->model_dir,
                     "Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)");
      app.add_option("--adapter", a->adapters, "PEFT adapter to serve, NAME=DIR (repeatable)");
      app.add_option("--host", a->host, "address to listen on")->capture_default_str();
      app.add_option("--port", a->port, "TCP port (0 = any free port, printed at start)")
          ->capture_default_str();
      app.add_option("--device", a->device, "cuda or cpu (default: cuda when a GPU is visible)")
          ->check(CLI::IsMember({"cpu", "cuda"}));
      app.add_option("--max-loras-per-batch", a->max_loras_per_batch,
                     "distinct adapters in one batch (base-only requests do not count)")
          ->capture_default_str();
      app.add_option("--adapter-slots", a->adapter_slots,
                     "adapters resident in the backend's pool (default: --max-loras-per-batch)");
      app.add_option("--max-lora-rank", a->max_lora_rank,
                     "larger adapters are refused; the GPU's slot pool is sized for it (default: "
                     "twice the largest r of the --adapter folders, at least 16)");
      app.add_option("--max-cpu-loras", a->max_cpu_loras,
                     "adapters kept in host memory (least recently used dropped)")
          ->capture_default_str();
      app.add_option("--api-key", a->api_key,
                     "require 'Authorization: Bearer KEY' on the API routes");
      app.add_option("--served-model-name", a->served_model_name,
                     "the base model's name in requests and /v1/models (default: the folder name)");
      app.add_option("--chat-template", a->chat_template,
                     "Jinja chat template file to use instead of the model's");
      app.add_flag("--enable-lora-updates", a->enable_lora_updates,
                   "allow /v1/load_lora_adapter and /v1/unload_lora_adapter");
      app.add_option("--lora-root", a->lora_root,
                     "runtime adapter loads only from folders under this directory");
      app.add_option("--max-running", a->max_running, "requests in the running batch at once")
          ->capture_default_str();
      app.add_option("--max-batch-tokens", a->max_batch_tokens,
                     "tokens per engine step (decode tokens + prefill chunks)")
          ->capture_default_str();
      app.add_option("--max-seq-len", a->max_seq_len,
                     "GPU: longest prompt + output (0 = the model's, at most 8192)");
      app.add_option("--default-max-tokens", a->default_max_tokens,
                     "max_tokens of requests that give none (0 = the context left)")
          ->capture_default_str();
      app.add_option("--max-n", a->max_n, "most choices (n) one request may ask for")
          ->capture_default_str();
      app.add_option("--max-queued-requests", a->max_queued_requests,
                     "requests waiting for admission beyond which new ones get 503 + Retry-After")
          ->capture_default_str();
      app.add_option("--http-threads", a->http_threads,
                     "HTTP worker threads: requests handled at once (a stream holds one)")
          ->capture_default_str();
      app.add_option("--gpu-memory-fraction", a->gpu_memory_fraction,
                     "GPU: share of free device memory for weights + KV cache")
          ->capture_default_str();
      app.add_flag("--no-cuda-graphs", a->no_cuda_graphs, "GPU: run decode steps eagerly");
      app.add_flag("--log-requests", a->log_requests,
                   "one line per answered request on stderr (method, path, status)");
      app.add_option("--preset", a->preset,
                     "benchmarks: serve a `moelora synth` preset's shapes (with --random-weights, "
                     "--tokenizer) instead of --model");
      app.add_flag("--random-weights", a->random_weights,
                   "benchmarks (GPU): draw FP8 weights on the device from the config alone");
      app.add_option("--random-adapters", a->random_adapters,
                     "benchmarks (GPU): register N random adapters lora0..loraN-1 on every target");
      app.add_option("--random-adapter-rank", a->random_adapter_rank, "their rank")
          ->capture_default_str();
      app.add_option("--layers", a->layers, "benchmarks: run only the first N decoder layers");
      app.add_option("--tokenizer", a->tokenizer_dir,
                     "with --preset: the folder whose tokenizer files to serve with");
      moelora::tools::add_parallel_options(app, a->parallel);
      return [a]() -> int {
#if MOELORA_WITH_HTTP
        return run_serve(*a);
#else
        MOELORA_THROW(ErrorCode::kUnsupported,
                      "moelora serve: this build has no HTTP library; install libcpp-httplib-dev "
                      "(scripts/setup) and rebuild");
#endif
      };
    });

}  // namespace
