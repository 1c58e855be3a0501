#include "server/engine_loop.h"

#include <chrono>
#include <utility>

namespace moelora::server {

EngineLoop::EngineLoop(Engine& engine, std::function<void()> after_step,
                       std::function<void(const std::string&)> on_failure)
    : engine_(engine), after_step_(std::move(after_step)), on_failure_(std::move(on_failure)) {}

EngineLoop::~EngineLoop() {
  stop();
}

void EngineLoop::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (started_) return;
  started_ = true;
  thread_ = std::thread([this] { run(); });
}

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Result<RequestId> EngineLoop::submit(Request request, TokenCallback callback) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty())
      return Status(ErrorCode::kInternal, "the engine stopped after an error: " + failure_);
    if (stopping_) return Status(ErrorCode::kInternal, "the server is shutting down");
  }
  Result<RequestId> id = engine_.submit(std::move(request), std::move(callback));
  if (id.is_ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    work_pending_ = true;
  }
  wake_.notify_one();
  return id;
}

Status EngineLoop::cancel(RequestId id) {
  Status s = engine_.cancel(id);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work_pending_ = true;
  }
  wake_.notify_one();  // the final kCancelled event is delivered by the next step
  return s;
}

Result<bool> EngineLoop::unload_adapter_when_idle(const std::string& name) {
  Status s = engine_.unregister_adapter(name);
  if (s.is_ok()) return true;
  if (s.code() == ErrorCode::kNotFound) return s;
  // kInvalidArgument: a waiting or running request names it. Retry after the steps that end them.
  std::lock_guard<std::mutex> lock(mutex_);
  pending_unloads_.insert(name);
  work_pending_ = true;
  wake_.notify_one();
  return false;
}

std::set<std::string> EngineLoop::pending_unloads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_unloads_;
}

bool EngineLoop::healthy() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_.empty();
}

std::string EngineLoop::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void EngineLoop::retry_pending_unloads() {
  std::set<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_unloads_.empty()) return;
    names = pending_unloads_;
  }
  for (const std::string& name : names) {
    Status s = engine_.unregister_adapter(name);
    // kNotFound: someone else removed it meanwhile; either way it is no longer pending.
    if (s.is_ok() || s.code() == ErrorCode::kNotFound) {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_unloads_.erase(name);
    }
  }
}

void EngineLoop::run() {
  auto stop_with = [&](const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = s.message();
    }
    if (on_failure_) on_failure_(s.message());
  };
  for (;;) {
    bool idle = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Sleep while there is nothing to run; a submit always notifies. The timeout wakes an idle
      // loop to ask the backend whether it can still run. engine.idle() takes the engine's own
      // lock, never ours, so no lock order issue.
      if (!stopping_ && !work_pending_ && engine_.idle())
        wake_.wait_for(lock, std::chrono::milliseconds(200));
      if (stopping_) return;
      idle = !work_pending_ && engine_.idle();
      if (!idle) work_pending_ = false;
    }
    if (idle) {
      const Status health = engine_.check_backend();
      if (!health.is_ok()) return stop_with(health);
      continue;
    }
    if (!engine_.idle()) {
      const Status s = engine_.step();
      if (!s.is_ok()) return stop_with(s);
    }
    retry_pending_unloads();
    if (after_step_) after_step_();
  }
}

}  // namespace moelora::server
