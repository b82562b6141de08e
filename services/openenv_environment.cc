#include "services/openenv_environment.h"

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace grpo::services {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace websocket = boost::beast::websocket;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// How long a session waits for the operations of a socket it closed to hand back their
// completions (they do so at once: the bound keeps a destructor from hanging on a bug).
constexpr std::chrono::milliseconds kDrainTimeout{1000};
// The most of a server's error message kept in a Status (pydantic's validation errors can be long).
constexpr size_t kMaxErrorChars = 2000;
// The fields every OpenEnv Action / Observation model has (openenv.core.env_server.types); never
// the text of a turn. OpenEnv leaves the observation's metadata out of what it sends.
const std::vector<std::string> kActionBaseFields = {"metadata"};
const std::vector<std::string> kObservationBaseFields = {"reward", "done", "metadata"};

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

bool Contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// A JSON schema (pydantic's model_json_schema) that admits strings: "type": "string" (or a list
// holding it), or an anyOf with such a branch (Optional[str]).
bool IsStringSchema(const json& s) {
  if (!s.is_object()) return false;
  if (auto t = s.find("type"); t != s.end()) {
    if (t->is_string() && *t == "string") return true;
    if (t->is_array()) {
      for (const json& x : *t) {
        if (x == "string") return true;
      }
    }
  }
  if (auto any = s.find("anyOf"); any != s.end() && any->is_array()) {
    for (const json& branch : *any) {
      if (IsStringSchema(branch)) return true;
    }
  }
  return false;
}

// The field of `model` (a JSON schema of a pydantic model) named by `option`, or its one string
// field outside `base`. `what`: "action" | "observation"; `key`: the config key that names it.
StatusOr<std::string> PickField(const json& model, const std::vector<std::string>& base,
                                const std::string& option, const char* what, const char* key,
                                const std::string& url) {
  std::vector<std::string> fields, strings;
  if (auto props = model.find("properties"); props != model.end() && props->is_object()) {
    for (const auto& [name, schema] : props->items()) {
      if (Contains(base, name)) continue;
      fields.push_back(name);
      if (IsStringSchema(schema)) strings.push_back(name);
    }
  }
  const std::string title = model.value("title", std::string(what));
  const std::string context = "the " + std::string(what) + " model " + title +
                              " of OpenEnv server " + url + " (fields: " + Join(fields) +
                              "; string fields: " + Join(strings) + ")";
  if (!option.empty()) {
    if (!Contains(fields, option)) {
      return Status::InvalidArgument(std::string(key) + " '" + option + "' names no field of " +
                                     context);
    }
    return option;
  }
  if (strings.size() == 1) return strings[0];
  if (strings.empty()) {
    return Status::InvalidArgument("no string field to carry the text in " + context + ": set " +
                                   key + " to the field to use");
  }
  return Status::InvalidArgument("several string fields in " + context + ": set " + key +
                                 " to the one to use");
}

// An error of asio or Beast as the Status of a session's call.
Status FromError(const beast::error_code& ec, const std::string& context) {
  if (ec == websocket::condition::handshake_failed) {
    return Status::Internal(context + ": the WebSocket upgrade was refused (" + ec.message() +
                            "): is this an OpenEnv server, and the url its base?");
  }
  if (ec == websocket::condition::protocol_violation || ec == websocket::error::buffer_overflow ||
      ec == websocket::error::message_too_big || ec == http::error::body_limit ||
      ec == http::error::header_limit) {
    return Status::Internal(context + ": " + ec.message());
  }
  // Refused, reset, closed, unresolvable, unreachable: the server is not there (any more).
  return Status::Unavailable(context + ": " + ec.message());
}

// Records the completion of one asynchronous operation. Shared with its handler, so that an
// operation abandoned after a failed drain never writes into freed memory.
struct Op {
  bool done = false;
  beast::error_code ec;
};
using OpPtr = std::shared_ptr<Op>;

struct Record {
  OpPtr op;
  template <class... Rest>
  void operator()(const beast::error_code& ec, Rest&&...) const {
    op->ec = ec;
    op->done = true;
  }
};

struct Mapping {
  std::string action_field;
  std::string observation_field;
};

}  // namespace

// What an environment's sessions share: where the server is, the options, and the schema's
// mapping once known. Thread-safe.
class OpenEnvEnvironment::Shared {
 public:
  Shared(std::string url, Endpoint endpoint, OpenEnvOptions options)
      : url(std::move(url)), endpoint(std::move(endpoint)), options(std::move(options)) {}

  // The cached mapping: nullopt before a schema was read; InvalidArgument when it cannot be
  // mapped.
  std::optional<StatusOr<Mapping>> Cached() const {
    common::MutexLock lock(&mu_);
    return mapping_;
  }

  // Maps the body of GET /schema and caches the result (the first one stored wins).
  StatusOr<Mapping> Store(const json& schema) {
    StatusOr<Mapping> mapping = Map(schema);
    common::MutexLock lock(&mu_);
    if (!mapping_.has_value()) mapping_ = std::move(mapping);
    return *mapping_;
  }

  const std::string url;
  const Endpoint endpoint;
  const OpenEnvOptions options;

 private:
  StatusOr<Mapping> Map(const json& schema) const {
    if (!schema.is_object() || !schema.contains("action") || !schema.contains("observation")) {
      return Status::InvalidArgument("OpenEnv server " + url +
                                     " answered /schema without action and observation schemas");
    }
    const json& action = schema["action"];
    Mapping m;
    ASSIGN_OR_RETURN(m.action_field, PickField(action, kActionBaseFields, options.action_field,
                                               "action", "env_action_field", url));
    ASSIGN_OR_RETURN(m.observation_field, PickField(schema["observation"], kObservationBaseFields,
                                                    options.observation_field, "observation",
                                                    "env_observation_field", url));
    // Only the text is sent: any other field the action requires would fail every step.
    if (auto req = action.find("required"); req != action.end() && req->is_array()) {
      for (const json& r : *req) {
        if (r.is_string() && r != m.action_field) {
          return Status::InvalidArgument("the action model of OpenEnv server " + url +
                                         " requires field '" + r.get<std::string>() +
                                         "' besides the text field '" + m.action_field +
                                         "': grpo sends the text alone");
        }
      }
    }
    return m;
  }

  mutable common::Mutex mu_;
  std::optional<StatusOr<Mapping>> mapping_ GRPO_GUARDED_BY(mu_);
};

namespace {

using Shared = OpenEnvEnvironment::Shared;

// One episode: one WebSocket at BASE/ws, driven on the calling thread by an io_context of its
// own, run until each operation completes or the call's deadline passes (then the socket is
// closed). Not thread-safe (EnvSession).
class OpenEnvSession final : public rollout::EnvSession {
 public:
  explicit OpenEnvSession(std::shared_ptr<Shared> shared)
      : shared_(std::move(shared)), resolver_(ioc_), ws_(ioc_) {}
  ~OpenEnvSession() override { Close(); }

  StatusOr<rollout::EnvObservation> Reset(const nlohmann::json& row, uint64_t seed,
                                          Clock::time_point deadline) override {
    if (reset_done_) return Status::FailedPrecondition("Reset called twice on one session");
    reset_done_ = true;
    failed_ = true;  // until the reset succeeded
    std::optional<StatusOr<Mapping>> cached = shared_->Cached();
    if (!cached.has_value()) {
      StatusOr<json> schema = FetchSchema(deadline);
      if (!schema.ok()) return schema.status();
      cached = shared_->Store(*schema);
    }
    if (!cached->ok()) return cached->status();
    mapping_ = **cached;
    RETURN_IF_ERROR(Connect(deadline));
    json data = row.is_object() ? row : json::object();
    data["seed"] = seed;
    ASSIGN_OR_RETURN(json answer,
                     Exchange({{"type", "reset"}, {"data", std::move(data)}}, "reset", deadline));
    ASSIGN_OR_RETURN(rollout::EnvObservation obs, ToObservation(answer, "reset", true));
    failed_ = false;
    return obs;
  }

  StatusOr<rollout::EnvObservation> Step(const std::string& action_text,
                                         Clock::time_point deadline) override {
    if (!reset_done_) return Status::FailedPrecondition("Step called before Reset");
    if (failed_) {
      return Status::FailedPrecondition("environment session failed earlier: open a new one");
    }
    failed_ = true;  // until the step succeeded
    json action = {{mapping_.action_field, action_text}};
    ASSIGN_OR_RETURN(json answer,
                     Exchange({{"type", "step"}, {"data", std::move(action)}}, "step", deadline));
    ASSIGN_OR_RETURN(rollout::EnvObservation obs, ToObservation(answer, "step", false));
    failed_ = false;
    return obs;
  }

 private:
  enum class Wait { kDone, kTimedOut };

  std::string Context(const std::string& what) const {
    return "OpenEnv server " + shared_->url + ", " + what;
  }

  // Runs the io_context until `op` completes or `deadline` passes.
  Wait Run(const OpPtr& op, Clock::time_point deadline) {
    if (abandoned_) {
      op->ec = asio::error::operation_aborted;
      return Wait::kDone;
    }
    ioc_.restart();
    while (!op->done) {
      if (ioc_.run_one_until(deadline) > 0) continue;
      if (Clock::now() >= deadline) return Wait::kTimedOut;
      if (ioc_.stopped()) {  // no work left, yet no completion: cannot happen; fail, don't spin
        op->ec = asio::error::operation_aborted;
        op->done = true;
      }
    }
    return Wait::kDone;
  }

  // Closes every socket of the session and runs the completions of their aborted operations
  // (at most kDrainTimeout; operations still pending then are abandoned, never run again).
  void Abort(beast::tcp_stream* http_stream = nullptr) {
    broken_ = true;
    resolver_.cancel();
    beast::error_code ignored;
    beast::get_lowest_layer(ws_).socket().close(ignored);
    if (http_stream != nullptr) http_stream->socket().close(ignored);
    if (abandoned_) return;
    ioc_.restart();
    ioc_.run_for(kDrainTimeout);
    if (!ioc_.stopped()) {
      abandoned_ = true;
      GRPO_LOG_ERROR("{}: operations still pending {} ms after their sockets closed; abandoned",
                     Context("closing"), kDrainTimeout.count());
    }
  }

  // Starts an operation with `initiate(Record)` and waits for it until `deadline`; the error of
  // the call `what` when it fails or times out (then the sockets are closed).
  template <class Initiate>
  Status Await(const std::string& what, Clock::time_point deadline, Initiate&& initiate,
               beast::tcp_stream* http_stream = nullptr) {
    auto op = std::make_shared<Op>();
    initiate(Record{op});
    if (Run(op, deadline) == Wait::kTimedOut) {
      Abort(http_stream);
      return Status::DeadlineExceeded(Context(what) +
                                      ": no answer by the deadline (connection "
                                      "closed)");
    }
    if (op->ec) {
      broken_ = true;
      return FromError(op->ec, Context(what));
    }
    return Status::OK();
  }

  // The server's addresses: an IP address as is (no lookup), a name through the resolver. A
  // name's lookup is cancelled at the deadline, but asio's resolver thread finishes the blocking
  // getaddrinfo before the session's destructor returns (a DNS server that does not answer
  // delays it by the resolver's own timeout, resolv.conf's).
  StatusOr<std::vector<tcp::endpoint>> Resolve(Clock::time_point deadline) {
    const auto& ep = shared_->endpoint;
    const auto port = static_cast<uint16_t>(std::stoi(ep.port));
    beast::error_code not_ip;
    const asio::ip::address ip = asio::ip::make_address(ep.host, not_ip);
    if (!not_ip) return std::vector<tcp::endpoint>{tcp::endpoint(ip, port)};
    auto results = std::make_shared<std::vector<tcp::endpoint>>();
    RETURN_IF_ERROR(Await("resolving " + ep.host, deadline, [&](Record done) {
      resolver_.async_resolve(
          ep.host, ep.port,
          [done, results](const beast::error_code& ec, const tcp::resolver::results_type& r) {
            for (const auto& entry : r) results->push_back(entry.endpoint());
            done(ec);
          });
    }));
    return *results;
  }

  // GET BASE/schema over a connection of its own.
  StatusOr<json> FetchSchema(Clock::time_point deadline) {
    const auto& ep = shared_->endpoint;
    ASSIGN_OR_RETURN(std::vector<tcp::endpoint> addrs, Resolve(deadline));
    beast::tcp_stream stream(ioc_);
    RETURN_IF_ERROR(Await(
        "connecting for /schema", deadline, [&](Record done) { stream.async_connect(addrs, done); },
        &stream));
    http::request<http::empty_body> req{http::verb::get, ep.base + "/schema", 11};
    req.set(http::field::host, HostHeader());
    req.set(http::field::user_agent, "grpo-serve");
    req.set(http::field::accept, "application/json");
    RETURN_IF_ERROR(Await(
        "sending GET /schema", deadline, [&](Record done) { http::async_write(stream, req, done); },
        &stream));
    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(kMaxOpenEnvMessageBytes);
    RETURN_IF_ERROR(Await(
        "reading /schema", deadline,
        [&](Record done) { http::async_read(stream, buffer, parser, done); }, &stream));
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.socket().close(ignored);
    broken_ = false;  // the schema's connection is not the episode's
    const auto& res = parser.get();
    if (res.result() != http::status::ok) {
      const std::string context =
          Context("GET " + ep.base + "/schema answered HTTP " + std::to_string(res.result_int()) +
                  " " + res.body().substr(0, 200));
      if (res.result() == http::status::service_unavailable) return Status::Unavailable(context);
      return Status::Internal(context + " (is this an OpenEnv server, and the url its base?)");
    }
    json schema = json::parse(res.body(), nullptr, /*allow_exceptions=*/false);
    if (schema.is_discarded()) {
      return Status::Internal(Context("/schema is not JSON"));
    }
    return schema;
  }

  std::string HostHeader() const {
    const auto& ep = shared_->endpoint;
    const bool v6 = ep.host.find(':') != std::string::npos;
    return (v6 ? "[" + ep.host + "]" : ep.host) + ":" + ep.port;
  }

  // Resolves, connects and upgrades to the WebSocket at BASE/ws.
  Status Connect(Clock::time_point deadline) {
    ASSIGN_OR_RETURN(std::vector<tcp::endpoint> addrs, Resolve(deadline));
    RETURN_IF_ERROR(Await("connecting", deadline, [&](Record done) {
      beast::get_lowest_layer(ws_).async_connect(addrs, done);
    }));
    connected_ = true;
    ws_.read_message_max(kMaxOpenEnvMessageBytes);
    ws_.set_option(websocket::stream_base::decorator(
        [](websocket::request_type& req) { req.set(http::field::user_agent, "grpo-serve"); }));
    const std::string target = shared_->endpoint.base + "/ws";
    const std::string host = HostHeader();
    RETURN_IF_ERROR(Await("opening the WebSocket " + target, deadline,
                          [&](Record done) { ws_.async_handshake(host, target, done); }));
    ws_.text(true);
    open_ = true;
    return Status::OK();
  }

  // Sends one message and reads its one answer: the "data" of an "observation" answer.
  StatusOr<json> Exchange(const json& message, const std::string& what,
                          Clock::time_point deadline) {
    write_buffer_ = Dump(message);
    RETURN_IF_ERROR(Await("sending the " + what, deadline, [&](Record done) {
      ws_.async_write(asio::buffer(write_buffer_), done);
    }));
    read_buffer_.clear();
    RETURN_IF_ERROR(Await("waiting for the " + what + "'s answer", deadline,
                          [&](Record done) { ws_.async_read(read_buffer_, done); }));
    const json answer = json::parse(beast::buffers_to_string(read_buffer_.data()), nullptr,
                                    /*allow_exceptions=*/false);
    read_buffer_.clear();
    if (!answer.is_object() || !answer.contains("type")) {
      return Status::Internal(Context(what) + ": the answer is not a JSON object with a type");
    }
    const json data = answer.value("data", json::object());
    if (answer["type"] == "observation" && data.is_object()) return data;
    if (answer["type"] == "error" && data.is_object()) {
      const std::string code = data.value("code", std::string("UNKNOWN"));
      std::string message;
      if (auto m = data.find("message"); m != data.end()) {
        message = m->is_string() ? m->get<std::string>() : Dump(*m);
      }
      if (auto errors = data.find("errors"); errors != data.end()) message += " " + Dump(*errors);
      if (message.size() > kMaxErrorChars) message = message.substr(0, kMaxErrorChars) + "...";
      if (code == "CAPACITY_REACHED") {
        return Status::ResourceExhausted(
            Context(what) + ": " + message +
            " (the server's max_concurrent_envs must cover every worker's env_max_concurrency)");
      }
      return Status::Internal(Context(what) + " failed on the server (" + code + "): " + message);
    }
    return Status::Internal(Context(what) + ": unexpected answer " + Dump(answer).substr(0, 200));
  }

  // OpenEnv's StepResult ({"observation": {...}, "reward", "done"}) as an EnvObservation.
  StatusOr<rollout::EnvObservation> ToObservation(const json& data, const std::string& what,
                                                  bool reset) const {
    const auto nonsense = [&](const std::string& why) {
      return Status::Internal(Context(what) + ": the answer " + why);
    };
    if (!data.contains("observation") || !data["observation"].is_object()) {
      return nonsense("has no observation object");
    }
    rollout::EnvObservation obs;
    const json& reward = data.value("reward", json());
    if (reward.is_boolean()) {
      obs.reward = reward.get<bool>() ? 1.0 : 0.0;
    } else if (reward.is_number()) {
      obs.reward = reward.get<double>();
    } else if (!reward.is_null()) {
      return nonsense("has a reward that is not a number: " + Dump(reward));
    }
    const json& done = data.value("done", json(false));
    if (!done.is_boolean()) return nonsense("has a done that is not a boolean");
    obs.done = done.get<bool>();
    json fields = data["observation"];
    std::string text;
    if (auto it = fields.find(mapping_.observation_field); it != fields.end()) {
      text = it->is_string() ? it->get<std::string>() : it->is_null() ? "" : Dump(*it);
      fields.erase(it);
    }
    obs.metadata = std::move(fields);
    if (reset) {
      // Shown to the model before its first turn (rollout/env/episode.h), and kept in the
      // metadata reward functions see.
      obs.metadata["reset_observation"] = text;
      if (!text.empty()) obs.messages.push_back({shared_->options.role, std::move(text)});
    } else if (!(obs.done && text.empty())) {
      obs.messages.push_back({shared_->options.role, std::move(text)});
    }
    return obs;
  }

  // Ends the episode: the protocol's "close" message and the close handshake within
  // close_timeout while the WebSocket is healthy; then the socket is closed and drained.
  void Close() {
    if (open_ && !broken_) {
      const auto deadline = Clock::now() + shared_->options.close_timeout;
      bool polite = Await("closing", deadline, [&](Record done) {
                      write_buffer_ = R"({"type":"close"})";
                      ws_.async_write(asio::buffer(write_buffer_), done);
                    }).ok();
      if (polite) {
        (void)Await("closing", deadline,
                    [&](Record done) { ws_.async_close(websocket::close_code::normal, done); });
      }
    }
    Abort();
  }

  const std::shared_ptr<Shared> shared_;
  asio::io_context ioc_;  // declared before the objects that use it: destroyed after them
  tcp::resolver resolver_;
  websocket::stream<beast::tcp_stream> ws_;
  beast::flat_buffer read_buffer_;
  std::string write_buffer_;  // the message being sent (alive until its write completes)
  Mapping mapping_;
  bool reset_done_ = false;
  bool failed_ = false;     // a call failed: the session is spent
  bool broken_ = false;     // a socket failed or was closed: no close handshake
  bool connected_ = false;  // the episode's TCP connection was made
  bool open_ = false;       // the WebSocket handshake completed
  bool abandoned_ = false;  // operations outlived their drain: the io_context never runs again
};

StatusOr<OpenEnvEnvironment::Endpoint> ParseUrl(const std::string& url) {
  const auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("OpenEnv url '" + url + "' " + why +
                                   " (want http://HOST[:PORT][/BASE])");
  };
  constexpr std::string_view kScheme = "http://";
  if (url.rfind(kScheme, 0) != 0) {
    return bad(url.rfind("https://", 0) == 0 || url.rfind("wss://", 0) == 0
                   ? "needs TLS, which grpo does not speak to OpenEnv servers: put a proxy in "
                     "front"
                   : "is not http://");
  }
  const std::string rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  std::string base = slash == std::string::npos ? "" : rest.substr(slash);
  while (!base.empty() && base.back() == '/') base.pop_back();
  if (base.find_first_of("?#") != std::string::npos) return bad("has a query or fragment");
  OpenEnvEnvironment::Endpoint ep;
  ep.base = base;
  std::string port_part;
  if (!authority.empty() && authority[0] == '[') {
    const size_t close = authority.find(']');
    if (close == std::string::npos) return bad("has an unclosed '['");
    ep.host = authority.substr(1, close - 1);
    port_part = authority.substr(close + 1);
    if (!port_part.empty() && port_part[0] != ':') return bad("has text after ']'");
  } else {
    const size_t colon = authority.find(':');
    ep.host = authority.substr(0, colon);
    port_part = colon == std::string::npos ? "" : authority.substr(colon);
  }
  if (ep.host.empty()) return bad("has no host");
  if (ep.host.find('@') != std::string::npos) return bad("has user information");
  ep.port = port_part.empty() ? "80" : port_part.substr(1);
  if (ep.port.empty() || ep.port.size() > 5 ||
      ep.port.find_first_not_of("0123456789") != std::string::npos || std::stoi(ep.port) == 0 ||
      std::stoi(ep.port) > 65535) {
    return bad("has no valid port");
  }
  return ep;
}

}  // namespace

OpenEnvEnvironment::OpenEnvEnvironment(std::string url, Endpoint endpoint, OpenEnvOptions options)
    : url_(url),
      name_(options.name.empty() ? "openenv:" + url : options.name),
      shared_(std::make_shared<Shared>(std::move(url), std::move(endpoint), std::move(options))) {}

OpenEnvEnvironment::~OpenEnvEnvironment() = default;

StatusOr<std::unique_ptr<rollout::EnvSession>> OpenEnvEnvironment::Open() {
  return std::unique_ptr<rollout::EnvSession>(std::make_unique<OpenEnvSession>(shared_));
}

StatusOr<std::unique_ptr<rollout::Environment>> MakeOpenEnvEnvironment(std::string url,
                                                                       OpenEnvOptions options) {
  ASSIGN_OR_RETURN(OpenEnvEnvironment::Endpoint endpoint, ParseUrl(url));
  if (options.role != "user" && options.role != "tool") {
    return Status::InvalidArgument("OpenEnv observation role must be user or tool, got '" +
                                   options.role + "'");
  }
  if (options.close_timeout.count() <= 0) {
    return Status::InvalidArgument("OpenEnv close_timeout must be positive");
  }
  return std::unique_ptr<rollout::Environment>(std::make_unique<OpenEnvEnvironment>(
      std::move(url), std::move(endpoint), std::move(options)));
}

}  // namespace grpo::services
