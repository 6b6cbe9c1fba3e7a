// The safetensors format: writer, validating reader (the header's JSON through nlohmann-json) and atomic file
// replacement. The format and its guarantees are described in core/serialize.h.
#include "core/serialize.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/autograd.h"

namespace halfgrad {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; halfgrad copies tensor bytes as they are in memory");

namespace {

// The reference implementation refuses larger headers too: a garbage length must not make us allocate
// gigabytes before we find out the file is not a safetensors file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// ---- dtypes

struct DTypeInfo {
  DType dtype;
  const char* name;
  // Position in safetensors' Dtype enum (BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32,
  // F64, I64, U64): the writer orders tensors by it, descending, then by name, as the reference does.
  int reference_order;
};
constexpr DTypeInfo kDTypes[] = {
    {kBool, "BOOL", 0},    {kUInt8, "U8", 1},      {kFloat16, "F16", 7}, {kBFloat16, "BF16", 8},
    {kInt32, "I32", 9},    {kFloat32, "F32", 11},  {kFloat64, "F64", 12}, {kInt64, "I64", 13},
};

const DTypeInfo& info_of(DType dtype) {
  for (const DTypeInfo& d : kDTypes)
    if (d.dtype == dtype) return d;
  HG_FAIL("safetensors: dtype {} has no safetensors name", dtype_name(dtype));
}

const DTypeInfo* info_of(std::string_view name) {
  for (const DTypeInfo& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

// ---- JSON: nlohmann-json's SAX parser (strict RFC 8259, UTF-8 checked inside strings, where alone other bytes
// may be) builds a small tree that remembers where each value starts, so that an error about a tensor's entry can
// point at its byte in the file.

struct JsonMember;
struct Json {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  size_t pos = 0;        // offset of the value's first byte in the header
  std::string text;      // String: the decoded text; Number: the literal (an integer's digits as written)
  std::vector<Json> items;             // Array
  std::vector<JsonMember> members;     // Object, in the order written
};
struct JsonMember {
  std::string key;
  Json value;
};

const char* kind_name(Json::Kind k) {
  switch (k) {
    case Json::Kind::Null: return "null";
    case Json::Kind::Bool: return "a boolean";
    case Json::Kind::Number: return "a number";
    case Json::Kind::String: return "a string";
    case Json::Kind::Array: return "an array";
    case Json::Kind::Object: return "an object";
  }
  return "?";
}

// A problem at a byte of the header; the loader adds the file name and turns the offset into a file offset.
struct HeaderError {
  size_t pos;
  std::string what;
};

// The header's characters as nlohmann's lexer takes them, one at a time, counted: the parser reports a value right
// after reading its last character (a number's, after the one character that ends it), so the count at the report
// says where the value is.
class CountingIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;
  CountingIterator(const char* p, size_t* taken) : p_(p), taken_(taken) {}
  reference operator*() const { return *p_; }
  CountingIterator& operator++() {
    ++p_;
    ++*taken_;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const CountingIterator& o) const { return p_ == o.p_; }
  bool operator!=(const CountingIterator& o) const { return p_ != o.p_; }

 private:
  const char* p_;
  size_t* taken_;
};

// Builds the Json tree from nlohmann's SAX events; refuses duplicate keys (the parser keeps the last), nesting
// deeper than a header needs ("[[[[...": the tree's destructor recurses), more values than a checkpoint has (a node
// takes ~100 bytes, so a 100 MB header of "1,1,1,..." would have built a 5 GB tree) and NUL bytes (where nlohmann's
// lexer stops reading, and JSON has none).
class TreeBuilder : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit TreeBuilder(std::string_view text) : s_(text) {}

  Json parse() {
    if (const size_t nul = s_.find('\0'); nul != std::string_view::npos)
      throw HeaderError{nul, "a NUL byte: JSON has none (outside strings they are not whitespace, inside they must be "
                             "escaped as \\u0000)"};
    if (!nlohmann::json::sax_parse(CountingIterator(s_.data(), &taken_), CountingIterator(s_.data() + s_.size(), &taken_),
                                   this))
      throw error_.value_or(HeaderError{taken_, "the JSON parser stopped"});
    return std::move(root_);
  }

  bool null() override { return value(Json::Kind::Null, taken_ - 4); }
  bool boolean(bool b) override { return value(Json::Kind::Bool, taken_ - (b ? 4 : 5)); }
  bool number_integer(number_integer_t v) override { return number(std::to_string(v)); }
  bool number_unsigned(number_unsigned_t v) override { return number(std::to_string(v)); }
  bool number_float(number_float_t, const string_t& literal) override { return number(literal); }
  bool string(string_t& v) override { return value(Json::Kind::String, string_start(), std::move(v)); }
  bool binary(binary_t&) override { return fail(taken_, "binary values are not JSON"); }
  bool start_object(std::size_t) override { return open(Json::Kind::Object); }
  bool start_array(std::size_t) override { return open(Json::Kind::Array); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    const size_t at = string_start();
    if (!keys_.back().insert(k).second) return fail(at, fmt::format("duplicate key \"{}\"", k));
    open_.back()->members.push_back({std::move(k), {}});
    return true;
  }
  bool parse_error(std::size_t read, const std::string&, const nlohmann::detail::exception& e) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 57: syntax error ...": the part after the
    // position, which the loader gives as a byte of the file.
    std::string what = e.what();
    if (const size_t colon = what.find(": "); colon != std::string::npos) what.erase(0, colon + 2);
    return fail(read > 0 ? read - 1 : 0, std::move(what));
  }

 private:
  static constexpr size_t kMaxDepth = 64;  // a safetensors header nests 3 deep
  // A tensor's entry is 6 values (its object, dtype, shape, offsets and their 2) and its shape's dims: 2^20 values are
  // ~100,000 tensors of 4 dims, a tree of ~100 MB.
  static constexpr size_t kMaxValues = size_t(1) << 20;

  bool fail(size_t pos, std::string what) {
    error_ = HeaderError{pos, std::move(what)};
    return false;
  }

  // The slot the next value goes in: the root, the next item of an array, or the value of the last key.
  Json& next_slot() {
    if (open_.empty()) return root_;
    Json& parent = *open_.back();
    if (parent.kind == Json::Kind::Array) return parent.items.emplace_back();
    return parent.members.back().value;
  }
  bool value(Json::Kind kind, size_t pos, std::string text = {}) {
    if (++values_ > kMaxValues) return too_many_values(pos);
    add(kind, pos, std::move(text));
    return true;
  }
  bool too_many_values(size_t pos) {
    return fail(pos, fmt::format("more than {} JSON values, more than a header of ~100,000 tensors holds (halfgrad "
                                 "reads no more)", kMaxValues));
  }
  // Pointers into the tree stay valid while they are on open_: only the last value of a container is ever open, and
  // a container grows only while it is the innermost.
  Json& add(Json::Kind kind, size_t pos, std::string text = {}) {
    Json& v = next_slot();
    v.kind = kind;
    v.pos = pos;
    v.text = std::move(text);
    return v;
  }
  bool open(Json::Kind kind) {
    if (open_.size() >= kMaxDepth) return fail(taken_ - 1, fmt::format("JSON nested more than {} deep", kMaxDepth));
    if (++values_ > kMaxValues) return too_many_values(taken_ - 1);
    open_.push_back(&add(kind, taken_ - 1));
    keys_.emplace_back();
    return true;
  }
  bool close() {
    open_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool number(std::string literal) {
    // The lexer has read the character after the number too, unless the number ends the header.
    size_t end = taken_;
    if (end > 0 && end <= s_.size() && !is_number_char(s_[end - 1])) --end;
    const size_t start = end - std::min(end, literal.size());
    return value(Json::Kind::Number, start, std::move(literal));
  }
  static bool is_number_char(char c) { return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'; }
  // The opening quote of the string whose closing quote was the last character read: the nearest quote before it
  // that no backslash escapes (inside a string every quote is escaped).
  size_t string_start() const {
    for (size_t i = taken_ - 1; i-- > 0;) {
      if (s_[i] != '"') continue;
      size_t slashes = 0;
      while (slashes < i && s_[i - 1 - slashes] == '\\') ++slashes;
      if (slashes % 2 == 0) return i;
    }
    return 0;
  }

  std::string_view s_;
  size_t taken_ = 0;
  size_t values_ = 0;  // values built so far, containers included
  Json root_;
  std::vector<Json*> open_;  // the containers being filled, innermost last
  std::vector<std::unordered_set<std::string>> keys_;
  std::optional<HeaderError> error_;
};

// A JSON string as serde_json writes it in compact form (what the reference writes): nlohmann's escaping is the same.
// nlohmann refuses text that is not UTF-8; `what` names the string in the error.
std::string json_string(const std::string& s, const std::string& what) {
  try {
    return nlohmann::json(s).dump();
  } catch (const nlohmann::json::type_error&) {
    HG_FAIL("{} is not valid UTF-8", what);
  }
}

// A non-negative integer that fits in uint64 (shape entries, data offsets).
uint64_t as_uint(const Json& v, const std::string& what) {
  if (v.kind != Json::Kind::Number) throw HeaderError{v.pos, fmt::format("{} must be an integer, got {}", what, kind_name(v.kind))};
  if (v.text.find_first_not_of("0123456789") != std::string::npos)
    throw HeaderError{v.pos, fmt::format("{} must be a non-negative integer, got {}", what, v.text)};
  uint64_t r = 0;
  for (char c : v.text) {
    if (r > (std::numeric_limits<uint64_t>::max() - uint64_t(c - '0')) / 10)
      throw HeaderError{v.pos, fmt::format("{} {} does not fit in 64 bits", what, v.text)};
    r = r * 10 + uint64_t(c - '0');
  }
  return r;
}

// ---- the header

struct TensorEntry {
  std::string name;
  size_t pos = 0;  // of the entry's value in the header
  const DTypeInfo* dtype = nullptr;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<TensorEntry> tensors;  // in header order
  Metadata metadata;
};

Header interpret_header(const Json& root) {
  if (root.kind != Json::Kind::Object)
    throw HeaderError{root.pos, fmt::format("the header must be a JSON object, got {}", kind_name(root.kind))};
  Header h;
  for (const JsonMember& m : root.members) {
    const Json& v = m.value;
    if (m.key == "__metadata__") {
      if (v.kind != Json::Kind::Object)
        throw HeaderError{v.pos, fmt::format("\"__metadata__\" must be an object of strings, got {}", kind_name(v.kind))};
      for (const JsonMember& kv : v.members) {
        if (kv.value.kind != Json::Kind::String)
          throw HeaderError{kv.value.pos, fmt::format("metadata \"{}\" must be a string, got {}", kv.key,
                                                       kind_name(kv.value.kind))};
        h.metadata[kv.key] = kv.value.text;
      }
      continue;
    }
    TensorEntry e;
    e.name = m.key;
    e.pos = v.pos;
    std::string who = fmt::format("tensor '{}'", m.key);
    if (v.kind != Json::Kind::Object)
      throw HeaderError{v.pos, fmt::format("{}: entry must be an object, got {}", who, kind_name(v.kind))};
    const Json *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
    for (const JsonMember& f : v.members) {
      if (f.key == "dtype") dtype = &f.value;
      else if (f.key == "shape") shape = &f.value;
      else if (f.key == "data_offsets") offsets = &f.value;
      // Other fields are ignored, as the reference does.
    }
    for (auto [field, name] : {std::pair{dtype, "dtype"}, std::pair{shape, "shape"}, std::pair{offsets, "data_offsets"}})
      if (!field) throw HeaderError{v.pos, fmt::format("{}: entry has no \"{}\"", who, name)};

    if (dtype->kind != Json::Kind::String)
      throw HeaderError{dtype->pos, fmt::format("{}: dtype must be a string, got {}", who, kind_name(dtype->kind))};
    e.dtype = info_of(dtype->text);
    if (!e.dtype)
      throw HeaderError{dtype->pos, fmt::format("{}: unknown or unsupported dtype \"{}\" (halfgrad reads I64, F64, "
                                                "F32, I32, BF16, F16, U8, BOOL)", who, dtype->text)};

    if (shape->kind != Json::Kind::Array)
      throw HeaderError{shape->pos, fmt::format("{}: shape must be an array, got {}", who, kind_name(shape->kind))};
    for (const Json& d : shape->items) {
      uint64_t size = as_uint(d, who + ": a shape entry");
      if (size > uint64_t(std::numeric_limits<int64_t>::max()))
        throw HeaderError{d.pos, fmt::format("{}: shape entry {} is too large", who, size)};
      e.shape.push_back(int64_t(size));
    }

    if (offsets->kind != Json::Kind::Array || offsets->items.size() != 2)
      throw HeaderError{offsets->pos, fmt::format("{}: data_offsets must be an array [begin, end]", who)};
    e.begin = as_uint(offsets->items[0], who + ": data_offsets begin");
    e.end = as_uint(offsets->items[1], who + ": data_offsets end");
    if (e.end < e.begin)
      throw HeaderError{offsets->pos, fmt::format("{}: data_offsets [{}, {}] end before they begin", who, e.begin, e.end)};

    // The element count must fit in int64 (ignoring zero dims, so the product never overflows on the way to
    // a zero), and shape x dtype size must be exactly the span the offsets give.
    uint64_t count = 1, nonzero = 1;
    bool overflow = false;
    for (int64_t s : e.shape) {
      if (s == 0) count = 0;
      else overflow |= __builtin_mul_overflow(nonzero, uint64_t(s), &nonzero);
    }
    overflow |= nonzero > uint64_t(std::numeric_limits<int64_t>::max());
    uint64_t bytes = 0;
    if (count != 0) overflow |= __builtin_mul_overflow(nonzero, uint64_t(element_size(e.dtype->dtype)), &bytes);
    if (overflow) throw HeaderError{shape->pos, fmt::format("{}: shape {} is too large", who, shape_str(e.shape))};
    if (e.end - e.begin != bytes)
      throw HeaderError{offsets->pos, fmt::format("{}: shape {} of {} needs {} bytes, but data_offsets [{}, {}] span {}",
                                                  who, shape_str(e.shape), e.dtype->name, bytes, e.begin, e.end,
                                                  e.end - e.begin)};
    h.tensors.push_back(std::move(e));
  }
  return h;
}

// ---- the writer

struct Prepared {
  std::string header;  // padded JSON
  std::vector<std::pair<const std::string*, const Tensor*>> order;  // data order
};

Prepared prepare(const NamedTensors& tensors, const Metadata& metadata, const char* op) {
  Prepared p;
  for (const auto& [name, t] : tensors) {
    HG_CHECK(!name.empty(), "{}: a tensor name is empty", op);
    HG_CHECK(name != "__metadata__", "{}: \"__metadata__\" is reserved and cannot name a tensor", op);
    HG_CHECK(t.defined(), "{}: tensor '{}' is undefined", op, name);
    info_of(t.dtype());
    p.order.emplace_back(&name, &t);
  }
  std::stable_sort(p.order.begin(), p.order.end(), [](const auto& a, const auto& b) {
    int ra = info_of(a.second->dtype()).reference_order, rb = info_of(b.second->dtype()).reference_order;
    return ra != rb ? ra > rb : *a.first < *b.first;
  });
  {
    std::vector<const std::string*> names;
    for (auto& e : p.order) names.push_back(e.first);
    std::sort(names.begin(), names.end(), [](auto* a, auto* b) { return *a < *b; });
    for (size_t k = 1; k < names.size(); ++k)
      HG_CHECK(*names[k] != *names[k - 1], "{}: two tensors are named '{}'", op, *names[k]);
  }

  std::string& h = p.header;
  h += '{';
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      if (it != metadata.begin()) h += ',';
      h += json_string(it->first, fmt::format("{}: a metadata key", op));
      h += ':';
      h += json_string(it->second, fmt::format("{}: metadata \"{}\"", op, it->first));
    }
    h += '}';
    first = false;
  }
  uint64_t offset = 0;
  for (auto [name, t] : p.order) {
    if (!first) h += ',';
    first = false;
    h += json_string(*name, fmt::format("{}: tensor name '{}'", op, *name));
    h += ":{\"dtype\":\"";
    h += info_of(t->dtype()).name;
    h += "\",\"shape\":[";
    for (int64_t d = 0; d < t->dim(); ++d) {
      if (d) h += ',';
      h += std::to_string(t->size(d));
    }
    uint64_t bytes = uint64_t(t->numel()) * element_size(t->dtype());
    h += fmt::format("],\"data_offsets\":[{},{}]}}", offset, offset + bytes);
    offset += bytes;
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');  // the data buffer starts 8-byte aligned
  return p;
}

void write_prepared(const Prepared& p, const WriteBytes& write) {
  uint64_t n = p.header.size();
  write(&n, sizeof n);  // little-endian (static_assert above)
  write(p.header.data(), p.header.size());
  NoGradGuard no_grad;
  for (auto [name, t] : p.order) {
    Tensor host = t->detach().to(Device::cpu()).contiguous();  // zero-copy for contiguous CPU tensors
    if (host.numel() > 0) write(host.data_ptr(), size_t(host.numel()) * element_size(host.dtype()));
  }
}

// ---- files

std::string errno_text(int err) { return std::strerror(err); }

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Reads exactly `size` bytes at `offset`; false if the file ended first.
bool read_exact(int fd, void* dst, size_t size, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  while (size > 0) {
    ssize_t got = ::pread(fd, p, std::min<size_t>(size, size_t(1) << 30), off_t(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      HG_FAIL("load_safetensors: reading '{}' at byte {} failed: {}", path, offset, errno_text(errno));
    }
    if (got == 0) return false;
    p += got;
    size -= size_t(got);
    offset += uint64_t(got);
  }
  return true;
}

std::atomic<uint64_t> temp_counter{0};

}  // namespace

// ---- public API

Tensor SafetensorsContents::find(std::string_view name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  return Tensor();
}

const char* safetensors_dtype_name(DType dtype) { return info_of(dtype).name; }

std::string serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata) {
  Prepared p = prepare(tensors, metadata, "serialize_safetensors");
  std::string out;
  write_prepared(p, [&](const void* data, size_t size) { out.append(static_cast<const char*>(data), size); });
  return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata) {
  Prepared p = prepare(tensors, metadata, "save_safetensors");  // all checks before the file is touched
  write_file_atomic(path, [&](const WriteBytes& write) { write_prepared(p, write); });
}

namespace {

// The folder a file is in: its path's parent, "." for a bare name.
std::filesystem::path folder_of(const std::filesystem::path& file) {
  return file.parent_path().empty() ? std::filesystem::path(".") : file.parent_path();
}

// "<path>.tmp-<pid>-<n>" files (and check_writable's "<path>.tmp-<pid>-probe") of writers that are gone (a process
// killed mid-write): removed after a successful write of the same path. A live process's temporaries (this one's
// included) are left alone. Best effort: the save has succeeded, so nothing here may throw (the range-for form of a
// directory_iterator throws where its increment fails).
void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const std::string prefix = target.filename().string() + ".tmp-";
  const fs::path dir = folder_of(target);
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());  // "<pid>-<n>" or "<pid>-probe"
    const size_t dash = rest.find('-');
    if (dash == 0 || dash == std::string::npos || dash > 9 ||
        rest.find_first_not_of("0123456789") != dash ||
        (rest.substr(dash + 1) != "probe" && rest.find_first_not_of("0123456789", dash + 1) != std::string::npos))
      continue;
    const long pid = std::stol(rest.substr(0, dash));
    std::error_code removed;
    if (pid != long(::getpid()) && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) fs::remove(it->path(), removed);
  }
}

// The file a save of `path` replaces: `path`, or the file its symbolic links lead to (a save writes through a link, as
// open() would, and keeps the link). Checked before anything is written, as the write itself would find out only
// after producing every byte, or not at all (a rename replaces what open() refuses): the path is not empty and names
// no folder, its folder exists, and an existing file is a regular one (a FIFO or a device would be replaced by a
// plain file) that this process may write (a read-only file is refused).
std::filesystem::path save_target(const std::string& path, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  HG_CHECK(!path.empty(), "{}: the path is empty", what);
  HG_CHECK(!path.ends_with('/'), "{}: '{}' ends with '/', which names a folder, not a file", what, path);
  HG_CHECK(!fs::is_directory(path, ec), "{}: '{}' is a folder, not a file", what, path);
  fs::path target(path);
  for (int links = 0; fs::is_symlink(fs::symlink_status(target, ec)); ++links) {
    HG_CHECK(links < 40, "{}: cannot write '{}': too many levels of symbolic links", what, path);
    const fs::path next = fs::read_symlink(target, ec);
    HG_CHECK(!ec, "{}: cannot write '{}': reading the link '{}' failed: {}", what, path, target.string(),
             ec.message());
    target = next.is_absolute() ? next : target.parent_path() / next;
  }
  const std::string shown = target == fs::path(path) ? fmt::format("'{}'", path)
                                                     : fmt::format("'{}' (a link to '{}')", path, target.string());
  // What is there, as the kernel follows the links: /proc's links to pipes (/dev/stdout) name no path to follow.
  const fs::file_status status = fs::status(path, ec);
  if (fs::exists(status)) {
    HG_CHECK(fs::is_regular_file(status), "{}: cannot write {}: it is not a regular file (a folder, FIFO, socket or "
             "device), and a save would replace it", what, shown);
    HG_CHECK(::access(path.c_str(), W_OK) == 0, "{}: cannot write {}: {} (the file is left as it is)", what, shown,
             errno_text(errno));
  }
  const fs::path dir = folder_of(target);
  HG_CHECK(fs::is_directory(dir, ec), "{}: cannot write {}: the folder '{}' does not exist", what, shown,
           dir.string());
  return target;
}

}  // namespace

void check_writable(const std::string& path, const char* what) {
  const std::filesystem::path target = save_target(path, what);
  const std::filesystem::path dir = folder_of(target);
  const std::string probe = fmt::format("{}.tmp-{}-probe", target.string(), ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  HG_CHECK(fd >= 0 || errno == EEXIST, "{}: cannot write '{}' in '{}': {}", what, path, dir.string(), errno_text(errno));
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  }
}

void write_file_atomic(const std::string& path, const std::function<void(const WriteBytes& write)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target = save_target(path, "save");
  const std::string file = target.string();  // where the bytes go: path, or the file its links lead to
  const fs::path dir = folder_of(target);

  // A fresh name next to the target. O_EXCL: never reuse (and truncate) a file someone else is writing.
  std::string temp;
  int raw_fd = -1;
  for (int attempt = 0; raw_fd < 0; ++attempt) {
    temp = fmt::format("{}.tmp-{}-{}", file, ::getpid(), temp_counter.fetch_add(1));
    raw_fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (raw_fd < 0 && (errno != EEXIST || attempt > 100))
      HG_FAIL("save: cannot write '{}': creating the temporary file '{}' failed: {}", path, temp, errno_text(errno));
  }
  Fd fd(raw_fd);

  bool renamed = false;
  struct RemoveTemp {  // on any failure before the rename: the target is untouched, the temp file goes
    const std::string& temp;
    const bool& renamed;
    ~RemoveTemp() {
      if (!renamed) ::unlink(temp.c_str());
    }
  } remove_temp{temp, renamed};

  auto fail = [&](const char* step) {
    HG_FAIL("save: cannot write '{}': {} '{}' failed: {} (the existing file, if any, is unchanged)", path, step,
            temp, errno_text(errno));
  };

  struct stat existing;
  if (::stat(file.c_str(), &existing) == 0 && S_ISREG(existing.st_mode)) {
    if (::fchmod(fd.get(), existing.st_mode & 07777) != 0) fail("setting the permissions of");
  }

  uint64_t written = 0;
  produce([&](const void* data, size_t size) {
    auto* p = static_cast<const char*>(data);
    while (size > 0) {
      ssize_t n = ::write(fd.get(), p, std::min<size_t>(size, size_t(1) << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        HG_FAIL("save: cannot write '{}': writing byte {} of the temporary file '{}' failed: {} (the existing file, "
                "if any, is unchanged)", path, written, temp, errno_text(errno));
      }
      p += n;
      size -= size_t(n);
      written += uint64_t(n);
    }
  });
  if (::fsync(fd.get()) != 0) fail("flushing (fsync)");
  if (::close(fd.release()) != 0) fail("closing");
  if (::rename(temp.c_str(), file.c_str()) != 0) fail("renaming over it");
  renamed = true;

  // The rename is durable once the directory entry is on disk.
  Fd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || (::fsync(dir_fd.get()) != 0 && errno != EINVAL && errno != EROFS))
    HG_FAIL("save: '{}' was written, but syncing its directory '{}' failed: {} (a power cut now could lose the "
            "rename)", path, dir.string(), errno_text(errno));
  remove_stale_temporaries(file);
}

SafetensorsContents load_safetensors(const std::string& path) {
  // O_NONBLOCK: opening a FIFO would wait for a writer; this way it opens at once and is refused below, as anything
  // that is not a regular file is. (Reads of a regular file do not heed the flag.)
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  HG_CHECK(fd.get() >= 0, "load_safetensors: cannot open '{}': {}", path, errno_text(errno));
  struct stat st;
  HG_CHECK(::fstat(fd.get(), &st) == 0, "load_safetensors: cannot stat '{}': {}", path, errno_text(errno));
  HG_CHECK(S_ISREG(st.st_mode), "load_safetensors: '{}' is not a regular file", path);
  const uint64_t file_size = uint64_t(st.st_size);

  HG_CHECK(file_size >= 8, "load_safetensors: '{}' is truncated: it has {} bytes, fewer than the 8-byte header "
           "length at byte 0", path, file_size);
  uint64_t n = 0;
  HG_CHECK(read_exact(fd.get(), &n, 8, 0, path), "load_safetensors: '{}' is truncated at byte 0", path);
  HG_CHECK(n <= kMaxHeaderBytes, "load_safetensors: '{}': the header length at byte 0 says {} bytes, more than the "
           "{}-byte limit: this is not a safetensors file, or it is corrupt", path, n, kMaxHeaderBytes);
  HG_CHECK(8 + n <= file_size, "load_safetensors: '{}' is truncated: the header length at byte 0 says the JSON header "
           "ends at byte {}, but the file has {} bytes", path, 8 + n, file_size);
  std::string text(size_t(n), '\0');
  HG_CHECK(read_exact(fd.get(), text.data(), size_t(n), 8, path), "load_safetensors: '{}' is truncated in the header",
           path);

  Header header;
  try {
    header = interpret_header(TreeBuilder(text).parse());
  } catch (const HeaderError& e) {
    HG_FAIL("load_safetensors: '{}': corrupt header at byte {}: {}", path, 8 + e.pos, e.what);
  }

  // The data buffer must be covered exactly: sorted by offset, each tensor starts where the previous one
  // ended, and the last one ends at the end of the file.
  const uint64_t data_start = 8 + n, data_size = file_size - data_start;
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& e : header.tensors) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  uint64_t expected = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* e : by_offset) {
    if (e->begin < expected)
      HG_FAIL("load_safetensors: '{}': tensor '{}' (header byte {}) data_offsets [{}, {}] overlap tensor '{}' [{}, {}]",
              path, e->name, 8 + e->pos, e->begin, e->end, previous->name, previous->begin, previous->end);
    if (e->begin > expected)
      HG_FAIL("load_safetensors: '{}': bytes {} to {} of the file belong to no tensor (a hole before tensor '{}', "
              "data_offsets [{}, {}])", path, data_start + expected, data_start + e->begin, e->name, e->begin, e->end);
    if (e->end > data_size)
      HG_FAIL("load_safetensors: '{}' is truncated: tensor '{}' needs file bytes {} to {}, but the file ends at byte {}",
              path, e->name, data_start + e->begin, data_start + e->end, file_size);
    expected = e->end;
    previous = e;
  }
  HG_CHECK(expected == data_size, "load_safetensors: '{}': {} bytes of trailing garbage after the last tensor, from "
           "byte {} to the end of the file (byte {})", path, data_size - expected, data_start + expected, file_size);

  SafetensorsContents out;
  out.metadata = std::move(header.metadata);
  for (const TensorEntry* e : by_offset) {
    Tensor t = empty(e->shape, {.dtype = e->dtype->dtype});
    size_t bytes = size_t(e->end - e->begin);
    if (bytes > 0 && !read_exact(fd.get(), t.data_ptr(), bytes, data_start + e->begin, path))
      HG_FAIL("load_safetensors: '{}' is truncated: it ended while reading tensor '{}' at byte {}", path, e->name,
              data_start + e->begin);
    if (e->dtype->dtype == kBool) {
      // Any byte but 0 and 1 would be an invalid C++ bool (undefined behaviour downstream).
      const auto* b = static_cast<const uint8_t*>(t.data_ptr());
      for (size_t k = 0; k < bytes; ++k)
        HG_CHECK(b[k] <= 1, "load_safetensors: '{}': tensor '{}' (BOOL) has the value {} at byte {}, not 0 or 1", path,
                 e->name, b[k], data_start + e->begin + k);
    }
    out.tensors.emplace_back(e->name, std::move(t));
  }
  return out;
}

}  // namespace halfgrad
