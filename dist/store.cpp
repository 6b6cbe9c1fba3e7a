// TcpStore (dist/store.h): a request and its answer per call, over one TCP connection per rank.
//
//   request   op (1 byte: Set, Get, Add, Wait), key length (u32), key, value length (u64), value
//   answer    status (1 byte: Ok, TimedOut), value length (u64), value
// Get and Wait block in the server until the key is set or the timeout passes, so no rank polls. The server is a
// thread that accepts connections and a thread per connection; the values live in one map under one mutex.
#include "dist/store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"

namespace halfgrad::dist {
namespace {

enum Op : char { kSet = 'S', kGet = 'G', kAdd = 'A', kWait = 'W' };
enum Status : char { kOk = 0, kTimedOut = 1 };

std::string errno_text() { return std::strerror(errno); }

// Whole buffers over a socket; false when the peer has gone (or a receive timeout passed).
bool send_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t sent = ::send(fd, p, size, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    p += sent;
    size -= size_t(sent);
  }
  return true;
}
bool recv_all(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::recv(fd, p, size, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    size -= size_t(got);
  }
  return true;
}

// A message body: a length, then that many bytes. Keys and values are small (ids, counters, addresses).
constexpr uint64_t kMaxMessage = uint64_t(1) << 30;
bool send_bytes(int fd, const void* data, uint64_t size) {
  return send_all(fd, &size, sizeof size) && (size == 0 || send_all(fd, data, size_t(size)));
}
template <typename Length> bool recv_bytes(int fd, std::vector<char>& out) {
  Length size = 0;
  if (!recv_all(fd, &size, sizeof size) || uint64_t(size) > kMaxMessage) return false;
  out.resize(size_t(size));
  return size == 0 || recv_all(fd, out.data(), size_t(size));
}

// A connect() to a local port nothing listens on yet can be given that very port as its own source by the kernel and
// so succeed, connected to itself (TCP's simultaneous open): its requests would come back as their own answers.
bool connected_to_itself(int fd) {
  sockaddr_storage mine{}, peer{};
  socklen_t mine_size = sizeof mine, peer_size = sizeof peer;
  return ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &mine_size) == 0 &&
         ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) == 0 && mine_size == peer_size &&
         std::memcmp(&mine, &peer, mine_size) == 0;
}

void set_no_delay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

class TcpStore::Server {
 public:
  Server(int port, std::chrono::milliseconds timeout) : timeout_(timeout) {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    HG_CHECK(listen_fd_ >= 0, "TcpStore: cannot create the server's socket: {}", errno_text());
    const int one = 1, zero = 0;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int bound;
    if (v6) {  // both IPv4 and IPv6 clients
      ::setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 addr{};
      addr.sin6_family = AF_INET6;
      addr.sin6_addr = in6addr_any;
      addr.sin6_port = htons(uint16_t(port));
      bound = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    } else {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
      addr.sin_port = htons(uint16_t(port));
      bound = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    }
    if (bound != 0 || ::listen(listen_fd_, 128) != 0) {
      const std::string why = errno_text();
      ::close(listen_fd_);
      HG_FAIL("TcpStore: rank 0 cannot serve on port {}: {} (is MASTER_PORT taken by another run?)", port, why);
    }
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~Server() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      for (int fd : clients_) ::shutdown(fd, SHUT_RDWR);
    }
    ::shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    ::close(listen_fd_);
    changed_.notify_all();
    for (std::thread& t : handlers_) t.join();
  }

 private:
  void accept_loop() {
    while (true) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // shut down
      }
      std::lock_guard lock(mutex_);
      if (stopping_) {
        ::close(fd);
        return;
      }
      set_no_delay(fd);
      clients_.push_back(fd);
      handlers_.emplace_back([this, fd] { serve(fd); });
    }
  }

  // One client's requests, in order, until it disconnects.
  void serve(int fd) {
    while (true) {
      char op = 0;
      std::vector<char> key, value;
      if (!recv_all(fd, &op, 1) || !recv_bytes<uint32_t>(fd, key) || !recv_bytes<uint64_t>(fd, value)) break;
      const std::string k(key.begin(), key.end());
      Status status = kOk;
      std::vector<char> answer;
      std::unique_lock lock(mutex_);
      switch (op) {
        case kSet:
          values_[k] = std::move(value);
          changed_.notify_all();
          break;
        case kAdd: {
          int64_t delta = 0, now = 0;
          if (value.size() == sizeof delta) std::memcpy(&delta, value.data(), sizeof delta);
          std::vector<char>& slot = values_[k];
          if (slot.size() == sizeof now) std::memcpy(&now, slot.data(), sizeof now);
          now += delta;
          slot.assign(reinterpret_cast<const char*>(&now), reinterpret_cast<const char*>(&now) + sizeof now);
          answer = slot;
          changed_.notify_all();
          break;
        }
        case kGet:
        case kWait:
          if (!changed_.wait_for(lock, timeout_, [&] { return stopping_ || values_.count(k) > 0; }) || stopping_) {
            status = kTimedOut;
          } else if (op == kGet) {
            answer = values_[k];
          }
          break;
        default: status = kTimedOut;  // not a request of ours: the client is told no
      }
      lock.unlock();
      if (!send_all(fd, &status, 1) || !send_bytes(fd, answer.data(), answer.size())) break;
    }
    std::lock_guard lock(mutex_);
    ::close(fd);
    std::erase(clients_, fd);
  }

  std::chrono::milliseconds timeout_;
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<char>> values_;
  std::vector<int> clients_;
  std::vector<std::thread> handlers_;
  bool stopping_ = false;
};

TcpStore::TcpStore(const StoreOptions& options) : options_(options) {
  HG_CHECK(options.port > 0 && options.port < 65536, "TcpStore: port {} is not a TCP port (1..65535)", options.port);
  HG_CHECK(options.rank >= 0, "TcpStore: rank must be >= 0, got {}", options.rank);
  HG_CHECK(options.timeout.count() > 0, "TcpStore: the timeout must be positive, got {} ms", options.timeout.count());
  if (options.rank == 0) server_ = std::make_unique<Server>(options.port, options.timeout);

  // Connect, retrying while rank 0 is not listening yet.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  std::string last_error = "no address";
  while (fd_ < 0) {
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(options.host.c_str(), std::to_string(options.port).c_str(), &hints, &found);
    if (rc != 0) {
      last_error = ::gai_strerror(rc);
    } else {
      for (addrinfo* a = found; a && fd_ < 0; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
          last_error = errno_text();
          ::close(fd);
        } else if (connected_to_itself(fd)) {
          last_error = "nothing listens there yet (a connection to itself)";
          ::close(fd);
        } else {
          fd_ = fd;
        }
      }
      ::freeaddrinfo(found);
    }
    if (fd_ >= 0) break;
    HG_CHECK(std::chrono::steady_clock::now() < deadline, "TcpStore: rank {} could not reach rank 0's store at {}:{} "
             "within {} ms: {}", options.rank, options.host, options.port, options.timeout.count(), last_error);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  set_no_delay(fd_);
  // A server that stops answering (its machine gone) ends a call after the timeout, plus a margin for the server's
  // own timeout answer to arrive first.
  timeval tv{};
  const auto limit = options.timeout + std::chrono::seconds(5);
  tv.tv_sec = time_t(std::chrono::duration_cast<std::chrono::seconds>(limit).count());
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<char> TcpStore::request(char op, const std::string& key, const std::vector<char>& value) {
  const char* what = op == kSet ? "set" : op == kGet ? "get" : op == kAdd ? "add" : "wait";
  const std::string where = fmt::format("rank {}, store {}:{}", options_.rank, options_.host, options_.port);
  HG_CHECK(key.size() <= UINT32_MAX && value.size() <= kMaxMessage, "TcpStore::{}: key or value too large ({})", what,
           where);
  const uint32_t key_size = uint32_t(key.size());
  std::lock_guard lock(mutex_);
  const bool sent = send_all(fd_, &op, 1) && send_all(fd_, &key_size, sizeof key_size) &&
                    send_all(fd_, key.data(), key.size()) && send_bytes(fd_, value.data(), value.size());
  char status = kOk;
  std::vector<char> answer;
  const bool answered = sent && recv_all(fd_, &status, 1) && recv_bytes<uint64_t>(fd_, answer);
  HG_CHECK(answered, "TcpStore::{}(\"{}\"): rank 0's store stopped answering ({}): it has exited, or its machine "
           "is unreachable", what, key, where);
  HG_CHECK(status == kOk, "TcpStore::{}(\"{}\"): no rank set the key within {} ms ({}): a rank has not started, or "
           "has stopped", what, key, options_.timeout.count(), where);
  return answer;
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) { request(kSet, key, value); }

std::vector<char> TcpStore::get(const std::string& key) { return request(kGet, key, {}); }

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::vector<char> bytes(sizeof delta);
  std::memcpy(bytes.data(), &delta, sizeof delta);
  const std::vector<char> answer = request(kAdd, key, bytes);
  int64_t now = 0;
  HG_CHECK(answer.size() == sizeof now, "TcpStore::add(\"{}\"): the store answered {} bytes, not a counter", key,
           answer.size());
  std::memcpy(&now, answer.data(), sizeof now);
  return now;
}

void TcpStore::wait(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) request(kWait, key, {});
}

}  // namespace halfgrad::dist
