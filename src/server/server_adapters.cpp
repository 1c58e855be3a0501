// Runtime adapter loading: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM) and the
// same bodies on /load_lora_adapter and /unload_lora_adapter (SGLang): {"lora_name", "lora_path"}.
//
// Only with --enable-lora-updates, and only from under --lora-root: lora_path is taken relative to
// the root (an absolute path must lie inside it), resolved with symlinks followed, and refused
// when the result leaves the root, so a client cannot make the server read arbitrary files.
#include <filesystem>
#include <string>

#include "server/server_impl.h"

namespace moelora::server {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

constexpr size_t kMaxAdapterNameBytes = 256;

serve::ApiError bad_request(const std::string& message, const std::string& param,
                            const std::string& code = "invalid_value") {
  serve::ApiError e;
  e.message = message;
  e.param = param;
  e.code = code;
  return e;
}

// A name clients can put in `model`: printable ASCII without ':' (which separates BASE:ADAPTER)
// and without whitespace, so that it reads the same in every client and log line.
std::optional<serve::ApiError> check_adapter_name(const std::string& name,
                                                  const std::string& base) {
  if (name.empty() || name.size() > kMaxAdapterNameBytes)
    return bad_request("'lora_name' must be 1 to " + std::to_string(kMaxAdapterNameBytes) +
                           " characters; got " + std::to_string(name.size()),
                       "lora_name");
  for (unsigned char ch : name)
    if (ch <= 0x20 || ch >= 0x7f || ch == ':' || ch == '"' || ch == '\\')
      return bad_request(
          "'lora_name' may hold printable ASCII other than spaces, ':', '\"' and "
          "'\\'; got '" +
              io::sanitize_utf8(name) + "'",
          "lora_name");
  if (name == base)
    return bad_request("'lora_name' '" + name + "' is the base model's name", "lora_name");
  return std::nullopt;
}

// lora_path inside the root, or an error naming why not.
std::optional<serve::ApiError> resolve_under_root(const fs::path& root, const std::string& raw,
                                                  fs::path& out) {
  if (raw.empty() || raw.find('\0') != std::string::npos)
    return bad_request("'lora_path' must be a non-empty path", "lora_path");
  const fs::path requested(raw);
  const fs::path joined = requested.is_absolute() ? requested : root / requested;
  std::error_code ec;
  const fs::path resolved = fs::weakly_canonical(joined, ec);
  if (ec)
    return bad_request("'lora_path' '" + raw + "' cannot be resolved: " + ec.message(),
                       "lora_path");
  // The resolved path must be the root or below it, component by component (not a string prefix:
  // /srv/lora-evil is not under /srv/lora).
  auto r = root.begin();
  auto p = resolved.begin();
  for (; r != root.end(); ++r, ++p) {
    if (p == resolved.end() || *p != *r) {
      serve::ApiError e = bad_request("'lora_path' '" + raw + "' resolves to " + resolved.string() +
                                          ", outside the server's --lora-root " + root.string(),
                                      "lora_path", "path_outside_lora_root");
      e.http_status = 403;
      e.type = "permission_error";
      return e;
    }
  }
  if (!fs::is_directory(resolved, ec))
    return bad_request("'lora_path' " + resolved.string() +
                           " is not a directory (an adapter is a folder with "
                           "adapter_config.json and adapter_model.safetensors)",
                       "lora_path", "not_found");
  out = resolved;
  return std::nullopt;
}

std::optional<serve::ApiError> updates_enabled(const ServerOptions& options) {
  if (options.enable_lora_updates) return std::nullopt;
  serve::ApiError e;
  e.http_status = 403;
  e.type = "permission_error";
  e.code = "lora_updates_disabled";
  e.message =
      "runtime adapter loading is off; start the server with --enable-lora-updates "
      "--lora-root DIR";
  return e;
}

void answer(httplib::Response& res, const std::string& message) {
  ordered_json out;
  out["success"] = true;
  out["message"] = message;
  send_json(res, 200, out.dump());
}

}  // namespace

void Server::Impl::handle_load_adapter(const httplib::Request& req, httplib::Response& res) {
  auto refuse = [&](const serve::ApiError& e) {
    metrics.increment("moelora_lora_updates_total", {{"action", "load"}, {"result", "error"}});
    send_error(res, e);
  };
  if (auto e = updates_enabled(options)) return refuse(*e);
  auto body = serve::parse_json_body(req.body, limits);
  if (!body.is_ok()) return refuse(body.error());
  const ordered_json& b = body.value();
  if (!b.is_object() || !b.contains("lora_name") || !b["lora_name"].is_string())
    return refuse(
        bad_request("'lora_name' must be a string", "lora_name", "missing_required_parameter"));
  if (!b.contains("lora_path") || !b["lora_path"].is_string())
    return refuse(
        bad_request("'lora_path' must be a string (a folder under the server's "
                    "--lora-root)",
                    "lora_path", "missing_required_parameter"));
  const std::string name = b["lora_name"].get<std::string>();
  if (auto e = check_adapter_name(name, base_name)) return refuse(*e);
  fs::path dir;
  if (auto e = resolve_under_root(options.lora_root, b["lora_path"].get<std::string>(), dir))
    return refuse(*e);

  std::lock_guard<std::mutex> lock(adapter_update_mutex);
  if (loop->pending_unloads().count(name))
    return refuse(bad_request("adapter '" + name +
                                  "' is still being unloaded (requests that use it are "
                                  "running); load it again when they have finished",
                              "lora_name", "adapter_busy"));
  for (const AdapterInfo& a : engine->adapters())
    if (a.name == name)
      return refuse(bad_request(
          "an adapter named '" + name + "' is already loaded; unload it first or pick another name",
          "lora_name", "adapter_exists"));
  // Reading and checking the files happens here, on this worker: a broken adapter is a 400 that
  // names the file, and running requests never see it.
  Status s = engine->register_adapter(name, dir);
  if (!s.is_ok()) return refuse(api_error_from_status(s, "lora_path"));
  metrics.increment("moelora_lora_updates_total", {{"action", "load"}, {"result", "ok"}});
  answer(res, "adapter '" + name + "' loaded from " + dir.string());
}

void Server::Impl::handle_unload_adapter(const httplib::Request& req, httplib::Response& res) {
  auto refuse = [&](const serve::ApiError& e) {
    metrics.increment("moelora_lora_updates_total", {{"action", "unload"}, {"result", "error"}});
    send_error(res, e);
  };
  if (auto e = updates_enabled(options)) return refuse(*e);
  auto body = serve::parse_json_body(req.body, limits);
  if (!body.is_ok()) return refuse(body.error());
  const ordered_json& b = body.value();
  if (!b.is_object() || !b.contains("lora_name") || !b["lora_name"].is_string())
    return refuse(
        bad_request("'lora_name' must be a string", "lora_name", "missing_required_parameter"));
  const std::string name = b["lora_name"].get<std::string>();
  std::lock_guard<std::mutex> lock(adapter_update_mutex);
  if (loop->pending_unloads().count(name)) {
    serve::ApiError e = bad_request("adapter '" + name + "' is already being unloaded", "lora_name",
                                    "model_not_found");
    e.http_status = 404;
    return refuse(e);
  }
  Result<bool> done = loop->unload_adapter_when_idle(name);
  if (!done.is_ok()) {
    serve::ApiError e = api_error_from_status(done.status(), "lora_name");
    if (done.status().code() == ErrorCode::kNotFound) {
      e.message = "no adapter named '" + io::sanitize_utf8(name) + "' is loaded";
      e.code = "model_not_found";
    }
    return refuse(e);
  }
  metrics.increment("moelora_lora_updates_total", {{"action", "unload"}, {"result", "ok"}});
  answer(res, done.value() ? "adapter '" + name + "' unloaded"
                           : "adapter '" + name +
                                 "' no longer takes new requests; it is unloaded when the "
                                 "requests that use it have finished");
}

}  // namespace moelora::server
