#pragma once
// The key-value store the ranks of a process group meet through: rank 0 serves it on MASTER_ADDR:MASTER_PORT, every
// rank (rank 0 too) is a client over TCP. Gloo's rendezvous and, later, the NCCL unique id go through it, so ranks on
// several machines meet exactly as ranks on one do (torch.distributed's TCPStore plays this part).
//
//   set(key, bytes)     stores a value (a later set replaces it)
//   get(key)            the value, waiting until some rank has set it
//   add(key, delta)     adds to a counter (0 when absent) and returns the new value: barriers, unique numbers
//   wait(keys)          returns once every key is set
// Every wait ends after the store's timeout with a halfgrad::Error that names the key, the rank and the address;
// a server that goes away ends every wait at once with an error that says so.
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace halfgrad::dist {

struct StoreOptions {
  std::string host = "127.0.0.1";  // where rank 0 serves
  int port = 29500;                // torchrun's default MASTER_PORT
  int rank = 0;                    // rank 0 starts the server
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

class TcpStore {
 public:
  explicit TcpStore(const StoreOptions& options);  // rank 0 listens first; every rank connects, retrying until timeout
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  std::vector<char> get(const std::string& key);
  int64_t add(const std::string& key, int64_t delta);
  void wait(const std::vector<std::string>& keys);

  const StoreOptions& options() const { return options_; }

 private:
  class Server;
  std::vector<char> request(char op, const std::string& key, const std::vector<char>& value);

  StoreOptions options_;
  std::unique_ptr<Server> server_;  // rank 0 only
  int fd_ = -1;                     // this rank's connection
  std::mutex mutex_;                // one request on it at a time
};

}  // namespace halfgrad::dist
