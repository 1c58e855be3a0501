// The engine's own thread for `moelora serve`.
//
// Engine::step() must be driven by one thread while HTTP handler threads submit and cancel
// requests (include/moelora/engine.h, "Threads"). EngineLoop is that thread: it steps while any
// request waits or runs and sleeps on a condition variable otherwise, so a new request starts
// within one wake-up, not a polling period; an idle loop wakes every 200 ms only to ask the
// backend whether it can still run (Engine::check_backend: a multi-process backend notices a lost
// rank between requests), which stops the loop as a failed step does.
//
// Adapter unloads that running requests still use are deferred here: the name is taken out of
// service at once (the server stops routing new requests to it) and Engine::unregister_adapter
// is retried after every step until the last request that holds it has finished.
//
// A step that fails (Engine::step() returned an error: the backend itself broke, not one request)
// stops the loop; healthy() turns false and /health reports the message, so an orchestrator can
// restart the process. Requests still queued then end with an error event from the engine or are
// cancelled by shutdown.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "moelora/engine.h"

namespace moelora::server {

class EngineLoop {
 public:
  // `after_step` (may be empty) runs on the loop thread after every step, outside the loop's lock
  // (metrics sampling); `on_failure` (may be empty) once, on the loop thread, with the message of
  // the step error that stopped the loop.
  explicit EngineLoop(Engine& engine, std::function<void()> after_step = {},
                      std::function<void(const std::string&)> on_failure = {});
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  void start();
  // Cancels every request still queued or running, delivers their final events and joins the
  // thread. Idempotent.
  void stop();

  // Engine::submit, then wakes the loop.
  Result<RequestId> submit(Request request, TokenCallback callback);
  Status cancel(RequestId id);

  // Unregisters `name` now if no request uses it, else once the last one has finished. Returns
  // true when it was unregistered at once.
  Result<bool> unload_adapter_when_idle(const std::string& name);
  // Names whose unload is still waiting for running requests.
  std::set<std::string> pending_unloads() const;

  bool healthy() const;
  std::string failure() const;  // the step error that stopped the loop ("" while healthy)

 private:
  void run();
  void retry_pending_unloads();

  Engine& engine_;
  std::function<void()> after_step_;
  std::function<void(const std::string&)> on_failure_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool started_ = false;
  bool work_pending_ = false;  // a submit or cancel since the loop last looked
  std::string failure_;
  std::set<std::string> pending_unloads_;
  std::thread thread_;
};

}  // namespace moelora::server
