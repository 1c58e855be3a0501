#include "support/serve_client.h"

#include <chrono>

namespace moelora::test {

namespace {
HttpAnswer to_answer(const httplib::Result& r) {
  HttpAnswer a;
  if (!r) {
    a.error = httplib::to_string(r.error());
    return a;
  }
  a.status = r->status;
  a.raw = r->body;
  a.content_type = r->get_header_value("Content-Type");
  a.body = nlohmann::json::parse(r->body, nullptr, false);
  return a;
}
}  // namespace

HttpAnswer http_post(int port, const std::string& path, const std::string& body,
                     const httplib::Headers& headers) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(120));
  return to_answer(cli.Post(path.c_str(), headers, body, "application/json"));
}

HttpAnswer http_get(int port, const std::string& path, const httplib::Headers& headers) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(120));
  return to_answer(cli.Get(path.c_str(), headers));
}

SseAnswer http_post_stream(int port, const std::string& path, const std::string& body) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(120));
  std::string text;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    text.append(data, n);
    return true;
  };
  SseAnswer s;
  auto r = cli.send(req);
  if (!r) {
    s.error = httplib::to_string(r.error());
    return s;
  }
  s.status = r->status;
  size_t pos = 0;
  while ((pos = text.find("data: ", pos)) != std::string::npos) {
    const size_t end = text.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string payload = text.substr(pos + 6, end - pos - 6);
    pos = end + 2;
    if (payload == "[DONE]") {
      s.done = true;
      continue;
    }
    s.events.push_back(nlohmann::json::parse(payload, nullptr, false));
  }
  return s;
}

std::string streamed_completion_text(const SseAnswer& answer) {
  std::string text;
  bool ok = answer.status == 200 && answer.done;
  for (const nlohmann::json& e : answer.events) {
    if (!e.is_object() || !e.contains("choices") || !e["choices"].is_array()) {
      ok = false;
      continue;
    }
    if (e["choices"].empty()) continue;  // the include_usage chunk
    const nlohmann::json& c = e["choices"][0];
    if (!c.is_object() || !c.contains("text") || !c["text"].is_string()) {
      ok = false;
      continue;
    }
    text += c["text"].get<std::string>();
  }
  if (ok) return text;
  std::string report = "status " + std::to_string(answer.status) + " " + answer.error + ":";
  for (const nlohmann::json& e : answer.events) report += " " + e.dump();
  return report;
}

}  // namespace moelora::test
