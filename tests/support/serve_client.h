// HTTP client helpers for the `moelora serve` tests (CPU and GPU): one request per call over
// cpp-httplib's client, the answer parsed as JSON, streamed answers split into their SSE events.
#pragma once

#include <httplib.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moelora::test {

struct HttpAnswer {
  int status = 0;  // 0: no answer (the client's error is in `error`)
  std::string error;
  nlohmann::json body;  // discarded (is_discarded()) when the body is not JSON
  std::string raw;
  std::string content_type;
};

HttpAnswer http_post(int port, const std::string& path, const std::string& body,
                     const httplib::Headers& headers = {});
HttpAnswer http_get(int port, const std::string& path, const httplib::Headers& headers = {});

// The events of one server-sent-events answer: the JSON payloads in order, and whether the
// stream ended with "data: [DONE]".
struct SseAnswer {
  int status = 0;
  std::string error;
  std::vector<nlohmann::json> events;
  bool done = false;
};
SseAnswer http_post_stream(int port, const std::string& path, const std::string& body);

// The text a completions stream carried (its choice-0 "text" pieces joined), or "status N ERROR:
// <events>" when it did not end well, so that a comparison shows what went wrong.
std::string streamed_completion_text(const SseAnswer& answer);

}  // namespace moelora::test
