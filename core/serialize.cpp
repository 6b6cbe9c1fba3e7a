// The safetensors format: writer, validating reader, the small JSON reader and writer they need, and
// atomic file replacement. The format and its guarantees are described in core/serialize.h.
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

// ---- UTF-8: the header must be valid UTF-8 (the reference rejects it otherwise). Returns the offset of the
// first invalid byte, or nullopt.
std::optional<size_t> invalid_utf8_at(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    auto c = uint8_t(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    int extra;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) extra = 1, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) extra = 2, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) extra = 3, cp = c & 0x07;
    else return i;
    if (i + size_t(extra) >= s.size()) return i;
    for (int k = 1; k <= extra; ++k) {
      auto cc = uint8_t(s[i + size_t(k)]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong encodings, surrogates and code points past U+10FFFF are invalid too.
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return i;
    i += size_t(extra) + 1;
  }
  return std::nullopt;
}

// ---- JSON writer: serde_json's compact output, which is what the reference writes.

void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char ch : s) {
    auto c = uint8_t(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

// ---- JSON reader: a strict RFC 8259 parser that remembers where each value starts, so that an error about
// a tensor's entry can point at its byte in the file.

struct JsonMember;
struct Json {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  size_t pos = 0;        // offset of the value's first byte in the header
  bool boolean = false;
  std::string text;      // String: the decoded text; Number: the literal as written
  std::vector<Json> items;             // Array
  std::vector<JsonMember> members;     // Object, in the order written
};
struct JsonMember {
  std::string key;
  size_t key_pos = 0;
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

class JsonParser {
 public:
  explicit JsonParser(std::string_view text) : s_(text) {}

  Json parse_document() {
    skip_space();
    Json v = value(0);
    skip_space();
    if (i_ != s_.size()) fail(i_, fmt::format("unexpected {} after the JSON value", describe(i_)));
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;  // a safetensors header nests 3 deep; garbage "[[[[..." must not recurse

  [[noreturn]] void fail(size_t pos, std::string what) const { throw HeaderError{pos, std::move(what)}; }

  std::string describe(size_t pos) const {
    if (pos >= s_.size()) return "end of header";
    auto c = uint8_t(s_[pos]);
    if (c >= 0x20 && c < 0x7f) return fmt::format("character '{}'", char(c));
    return fmt::format("byte 0x{:02x}", c);
  }

  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }

  void expect(char c) {
    if (i_ >= s_.size() || s_[i_] != c) fail(i_, fmt::format("expected '{}', found {}", c, describe(i_)));
    ++i_;
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail(i_, fmt::format("JSON nested more than {} deep", kMaxDepth));
    if (i_ >= s_.size()) fail(i_, "unexpected end of header, expected a JSON value");
    Json v;
    v.pos = i_;
    char c = s_[i_];
    if (c == '{') {
      v.kind = Json::Kind::Object;
      std::unordered_set<std::string> keys;
      ++i_;
      skip_space();
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        return v;
      }
      while (true) {
        skip_space();
        JsonMember m;
        m.key_pos = i_;
        if (i_ >= s_.size() || s_[i_] != '"') fail(i_, fmt::format("expected a string key, found {}", describe(i_)));
        m.key = string();
        if (!keys.insert(m.key).second) fail(m.key_pos, fmt::format("duplicate key \"{}\"", m.key));
        skip_space();
        expect(':');
        skip_space();
        m.value = value(depth + 1);
        v.members.push_back(std::move(m));
        skip_space();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == '}') {
          ++i_;
          return v;
        }
        fail(i_, fmt::format("expected ',' or '}}' in an object, found {}", describe(i_)));
      }
    }
    if (c == '[') {
      v.kind = Json::Kind::Array;
      ++i_;
      skip_space();
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        return v;
      }
      while (true) {
        skip_space();
        v.items.push_back(value(depth + 1));
        skip_space();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == ']') {
          ++i_;
          return v;
        }
        fail(i_, fmt::format("expected ',' or ']' in an array, found {}", describe(i_)));
      }
    }
    if (c == '"') {
      v.kind = Json::Kind::String;
      v.text = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::Kind::Number;
      v.text = number();
      return v;
    }
    for (auto [word, kind, b] : {std::tuple{"true", Json::Kind::Bool, true}, std::tuple{"false", Json::Kind::Bool, false},
                                 std::tuple{"null", Json::Kind::Null, false}}) {
      std::string_view w(word);
      if (s_.substr(i_, w.size()) == w) {
        i_ += w.size();
        v.kind = kind;
        v.boolean = b;
        return v;
      }
    }
    fail(i_, fmt::format("expected a JSON value, found {}", describe(i_)));
  }

  std::string number() {
    size_t start = i_;
    if (s_[i_] == '-') ++i_;
    auto digits = [&] {
      size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == from) fail(i_, fmt::format("expected a digit, found {}", describe(i_)));
    };
    if (i_ < s_.size() && s_[i_] == '0') {
      ++i_;
      if (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') fail(start, "a JSON number cannot have a leading zero");
    } else {
      digits();
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      digits();
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return std::string(s_.substr(start, i_ - start));
  }

  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail(i_, "truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
      else fail(i_ - 1, fmt::format("invalid hex digit {} in a \\u escape", describe(i_ - 1)));
    }
    return v;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    size_t start = i_;
    ++i_;  // the opening quote
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail(start, "unterminated string");
      char c = s_[i_];
      if (c == '"') {
        ++i_;
        return out;
      }
      if (uint8_t(c) < 0x20) fail(i_, fmt::format("unescaped control {} in a string", describe(i_)));
      if (c != '\\') {
        out += c;
        ++i_;
        continue;
      }
      size_t escape = i_;
      ++i_;
      if (i_ >= s_.size()) fail(start, "unterminated string");
      switch (s_[i_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair: the low half must follow
            if (s_.substr(i_, 2) != "\\u") fail(escape, "unpaired surrogate in a \\u escape");
            i_ += 2;
            uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail(escape, "invalid surrogate pair in a \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail(escape, "unpaired surrogate in a \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(escape, fmt::format("invalid escape \\{}", s_[i_ - 1]));
      }
    }
  }

  std::string_view s_;
  size_t i_ = 0;
};

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
    HG_CHECK(!invalid_utf8_at(name), "{}: tensor name is not valid UTF-8: '{}'", op, name);
    HG_CHECK(t.defined(), "{}: tensor '{}' is undefined", op, name);
    info_of(t.dtype());
    p.order.emplace_back(&name, &t);
  }
  for (const auto& [key, value] : metadata)
    HG_CHECK(!invalid_utf8_at(key) && !invalid_utf8_at(value), "{}: metadata \"{}\" is not valid UTF-8", op, key);
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
      append_json_string(h, it->first);
      h += ':';
      append_json_string(h, it->second);
    }
    h += '}';
    first = false;
  }
  uint64_t offset = 0;
  for (auto [name, t] : p.order) {
    if (!first) h += ',';
    first = false;
    append_json_string(h, *name);
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

// "<path>.tmp-<pid>-<n>" files of writers that are gone (a process killed mid-write): removed after a successful
// write of the same path. A live process's temporaries (this one's included) are left alone.
void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const std::string prefix = target.filename().string() + ".tmp-";
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());  // "<pid>-<n>"
    const size_t dash = rest.find('-');
    if (dash == 0 || dash == std::string::npos || dash > 9 ||
        rest.find_first_not_of("0123456789-") != std::string::npos)
      continue;
    const long pid = std::stol(rest.substr(0, dash));
    if (pid != long(::getpid()) && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) fs::remove(e.path(), ec);
  }
}

}  // namespace

void check_writable(const std::string& path, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  HG_CHECK(!path.empty(), "{}: the path is empty", what);
  HG_CHECK(!fs::is_directory(path, ec), "{}: '{}' is a folder, not a file", what, path);
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  HG_CHECK(fs::is_directory(dir, ec), "{}: cannot write '{}': the folder '{}' does not exist", what, path,
           dir.string());
  const std::string probe = fmt::format("{}.tmp-{}-probe", path, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  HG_CHECK(fd >= 0 || errno == EEXIST, "{}: cannot write '{}' in '{}': {}", what, path, dir.string(), errno_text(errno));
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  }
}

void write_file_atomic(const std::string& path, const std::function<void(const WriteBytes& write)>& produce) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";

  // A fresh name next to the target. O_EXCL: never reuse (and truncate) a file someone else is writing.
  std::string temp;
  int raw_fd = -1;
  for (int attempt = 0; raw_fd < 0; ++attempt) {
    temp = fmt::format("{}.tmp-{}-{}", path, ::getpid(), temp_counter.fetch_add(1));
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
  if (::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode)) {
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
  if (::rename(temp.c_str(), path.c_str()) != 0) fail("renaming over it");
  renamed = true;

  // The rename is durable once the directory entry is on disk.
  Fd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || (::fsync(dir_fd.get()) != 0 && errno != EINVAL && errno != EROFS))
    HG_FAIL("save: '{}' was written, but syncing its directory '{}' failed: {} (a power cut now could lose the "
            "rename)", path, dir.string(), errno_text(errno));
  remove_stale_temporaries(path);
}

SafetensorsContents load_safetensors(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
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
    if (auto bad = invalid_utf8_at(text)) throw HeaderError{*bad, "the header is not valid UTF-8"};
    header = interpret_header(JsonParser(text).parse_document());
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
