// Checkpoints: the safetensors byte layout, bit-exact round trips, atomic writes, corrupt and truncated files,
// module loading with mismatch reports, training checkpoints.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/random.h"
#include "core/serialize.h"
#include "halfgrad.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "optim/sgd.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::TempDir;
namespace fs = std::filesystem;

namespace {

// Files in `dir` whose name says they are a writer's temporary file.
int temp_files(const TempDir& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) n += e.path().filename().string().find(".tmp-") != std::string::npos;
  return n;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int k = 0; k < 8; ++k) s[size_t(k)] = char((n >> (8 * k)) & 0xff);
  return s;
}

// A safetensors file from a header written by hand (padded to 8 bytes unless told not to) and data bytes.
std::string raw_file(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  return le64(header.size()) + header + data;
}

std::string bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), size_t(c.numel()) * element_size(c.dtype()));
}

std::string load_error(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// The byte layout, pinned without Python: the first two expected files are the test vectors of the reference
// implementation (safetensors' Rust tests of `serialize`, which Python's save_file calls), byte for byte.

TEST_CASE("safetensors layout: one F32 tensor is byte-identical to the reference implementation's") {
  std::vector<uint8_t> expected = {
      64, 0, 0, 0, 0, 0, 0, 0,  // N = 64, little-endian
      // {"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}   (64 bytes: no padding needed)
      123, 34, 97, 116, 116, 110, 46, 48, 34, 58, 123, 34, 100, 116, 121, 112, 101, 34, 58, 34, 70, 51, 50, 34, 44,
      34, 115, 104, 97, 112, 101, 34, 58, 91, 49, 44, 50, 44, 51, 93, 44, 34, 100, 97, 116, 97, 95, 111, 102, 102, 115,
      101, 116, 115, 34, 58, 91, 48, 44, 50, 52, 93, 125, 125,
      // 0.0f 1.0f 2.0f 3.0f 4.0f 5.0f, little-endian
      0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64};
  Tensor attn = tensor(std::vector<float>{0, 1, 2, 3, 4, 5}, Shape{1, 2, 3});
  std::string bytes = serialize_safetensors({{"attn.0", attn}});
  CHECK(bytes == std::string(expected.begin(), expected.end()));

  // The same name one character shorter: the header is padded with spaces so the data starts 8-aligned.
  bytes = serialize_safetensors({{"attn0", attn.view({1, 1, 2, 3})}});
  std::string header = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  CHECK(header.size() == 65);
  CHECK(bytes == le64(72) + header + std::string(7, ' ') + bytes_of(attn));
}

TEST_CASE("safetensors layout: metadata only, as the reference writes {\"framework\": \"pt\"}") {
  std::vector<uint8_t> expected = {40, 0, 0, 0, 0, 0, 0, 0,
                                   // {"__metadata__":{"framework":"pt"}} and 5 spaces
                                   123, 34, 95, 95, 109, 101, 116, 97, 100, 97, 116, 97, 95, 95, 34, 58, 123, 34, 102,
                                   114, 97, 109, 101, 119, 111, 114, 107, 34, 58, 34, 112, 116, 34, 125, 125, 32, 32,
                                   32, 32, 32};
  CHECK(serialize_safetensors({}, {{"framework", "pt"}}) == std::string(expected.begin(), expected.end()));
  // No tensors and no metadata: "{}" padded.
  CHECK(serialize_safetensors({}) == le64(8) + "{}      ");
}

TEST_CASE("safetensors layout: every dtype, ordered widest dtype first then by name, metadata first and sorted") {
  uint8_t mask[2] = {1, 0};
  uint8_t small[2] = {1, 255};
  NamedTensors tensors = {
      {"w", tensor(std::vector<float>{1, 2, 3}).to(kFloat16)},
      {"b", tensor(std::vector<int64_t>{7}, Shape{})},  // 0-d
      {"m", from_buffer(mask, {2}, kBool)},
      {"f", tensor(std::vector<float>{0.5f})},
      {"d", tensor(std::vector<double>{1.0})},
      {"i", tensor(std::vector<int32_t>{-1})},
      {"u", from_buffer(small, {2}, kUInt8)},
      {"h", tensor(std::vector<float>{1.0f}).to(kBFloat16)},
  };
  std::string header =
      R"({"__metadata__":{"a":"x\"y\n","z":"1"},)"
      R"("b":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
      R"("d":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
      R"("f":{"dtype":"F32","shape":[1],"data_offsets":[16,20]},)"
      R"("i":{"dtype":"I32","shape":[1],"data_offsets":[20,24]},)"
      R"("h":{"dtype":"BF16","shape":[1],"data_offsets":[24,26]},)"
      R"("w":{"dtype":"F16","shape":[3],"data_offsets":[26,32]},)"
      R"("u":{"dtype":"U8","shape":[2],"data_offsets":[32,34]},)"
      R"("m":{"dtype":"BOOL","shape":[2],"data_offsets":[34,36]}})";
  std::string data = std::string("\x07\0\0\0\0\0\0\0", 8)     // b: int64 7
                     + std::string("\0\0\0\0\0\0\xf0\x3f", 8)  // d: 1.0
                     + std::string("\0\0\0\x3f", 4)            // f: 0.5f
                     + std::string("\xff\xff\xff\xff", 4)      // i: -1
                     + std::string("\x80\x3f", 2)              // h: bfloat16 1.0 = 0x3f80
                     + std::string("\0\x3c\0\x40\0\x42", 6)    // w: float16 1, 2, 3 = 0x3c00 0x4000 0x4200
                     + std::string("\x01\xff", 2)              // u
                     + std::string("\x01\x00", 2);             // m: true, false
  std::string expected = raw_file(header, data);
  CHECK((expected.size() - 8 - data.size()) % 8 == 0);
  CHECK(serialize_safetensors(tensors, {{"z", "1"}, {"a", "x\"y\n"}}) == expected);
}

// ---------------------------------------------------------------------------------------------------------
// Round trips

TEST_CASE("safetensors round trip is bit-exact for every dtype, including NaN payloads, -0 and subnormals") {
  TempDir dir;
  std::mt19937_64 rng(1234);
  NamedTensors saved;
  for (DType dtype : {kBool, kUInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64}) {
    // Random bit patterns: every float class shows up (NaNs with payloads, infinities, subnormals, -0).
    std::vector<uint8_t> raw(37 * element_size(dtype));
    for (uint8_t& b : raw) b = dtype == kBool ? uint8_t(rng() & 1) : uint8_t(rng());
    saved.emplace_back(std::string("t_") + dtype_name(dtype), from_buffer(raw.data(), {37}, dtype));
    saved.emplace_back(std::string("scalar_") + dtype_name(dtype), from_buffer(raw.data(), {}, dtype));
    saved.emplace_back(std::string("empty_") + dtype_name(dtype), empty({0, 3}, {.dtype = dtype}));
  }
  // Views are written as their (contiguous) values.
  Tensor base = arange(0, 12, 1, {.dtype = kFloat32}).view({3, 4});
  saved.emplace_back("transposed", base.t());
  Metadata metadata = {{"epoch", "3"}, {"note", "unicode \u00e9\u4e2d\U0001F600, tab\t, quote\", backslash\\"}};

  std::string path = dir.file("all.safetensors");
  save_safetensors(path, saved, metadata);
  SafetensorsContents loaded = load_safetensors(path);
  CHECK(loaded.metadata == metadata);
  REQUIRE(loaded.tensors.size() == saved.size());
  for (const auto& [name, t] : saved) {
    CAPTURE(name);
    Tensor back = loaded.find(name);
    REQUIRE(back.defined());
    CHECK(back.dtype() == t.dtype());
    CHECK(back.shape() == t.shape());
    CHECK(bytes_of(back) == bytes_of(t));
  }
  CHECK(to_vector<float>(loaded.find("transposed")) == to_vector<float>(base.t()));
}

TEST_CASE("safetensors reads what other writers may produce: any key order, whitespace, no padding, escapes") {
  TempDir dir;
  std::string path = dir.file("foreign.safetensors");
  // Tensors listed out of data order, metadata last, pretty-printed, \u escapes, header not padded.
  std::string header = "{\n  \"b\": {\"shape\": [2], \"dtype\": \"F32\", \"data_offsets\": [8, 16], \"extra\": null},\n"
                       "  \"a\\u00e9\": {\"dtype\": \"I64\", \"shape\": [], \"data_offsets\": [0, 8]},\n"
                       "  \"__metadata__\": {\"k\": \"\\ud83d\\ude00\"}\n}";
  float b[2] = {1.5f, -2.0f};
  int64_t a = -3;
  std::string data = std::string(reinterpret_cast<const char*>(&a), 8) + std::string(reinterpret_cast<const char*>(b), 8);
  write_bytes(path, raw_file(header, data, /*pad=*/false));
  SafetensorsContents c = load_safetensors(path);
  CHECK(c.metadata.at("k") == "\U0001F600");
  REQUIRE(c.tensors.size() == 2);
  CHECK(c.tensors[0].first == "a\u00e9");  // data order
  CHECK(c.find("a\u00e9").item<int64_t>() == -3);
  CHECK(to_vector<float>(c.find("b")) == std::vector<float>{1.5f, -2.0f});
}

TEST_CASE("save_safetensors refuses bad names before touching the file") {
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  Tensor t = zeros({2});
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"a", t}, {"a", t}}), doctest::Contains("two tensors are named 'a'"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"__metadata__", t}}), doctest::Contains("reserved"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"", t}}), doctest::Contains("empty"), Error);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"u", Tensor()}}), doctest::Contains("'u' is undefined"), Error);
  CHECK_FALSE(fs::exists(path));
  CHECK(temp_files(dir) == 0);
}

// ---------------------------------------------------------------------------------------------------------
// Atomic writes

TEST_CASE("a write that fails half-way leaves the existing checkpoint untouched and no temporary file") {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"old", tensor(std::vector<float>{1, 2, 3})}});
  std::string before = read_bytes(path);

  // A real I/O failure in the middle of the data: the file-size limit makes write() fail with EFBIG after
  // 4 KiB (SIGXFSZ ignored, so the error comes back as errno instead of killing the process).
  struct rlimit old_limit;
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old_limit;
  limit.rlim_cur = 4096;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  std::string message;
  try {
    save_safetensors(path, {{"new", zeros({1 << 16})}});  // 256 KiB
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);

  CHECK(contains(message, path));
  CHECK(contains(message, "unchanged"));
  CHECK(read_bytes(path) == before);
  CHECK(temp_files(dir) == 0);
  CHECK(load_safetensors(path).find("old").defined());
}

TEST_CASE("a successful write removes the temporary files that killed writers of the same path left") {
  TempDir dir;
  const std::string path = dir.file("run.safetensors");
  // pid 999999999 is above any pid_max: no such process. Ours is alive, and another file's are not ours to judge.
  // check_writable's probe is a temporary too; a name of another shape is not ours to remove.
  const std::string stale = path + ".tmp-999999999-3", live = path + fmt::format(".tmp-{}-77", ::getpid()),
                    other = dir.file("other.safetensors.tmp-999999999-1"), probe = path + ".tmp-999999999-probe",
                    unknown = path + ".tmp-999999999-3x";
  for (const std::string& f : {stale, live, other, probe, unknown}) std::ofstream(f) << "partial";
  save_safetensors(path, {{"w", ones({2})}});
  CHECK_FALSE(fs::exists(stale));
  CHECK_FALSE(fs::exists(probe));
  CHECK(fs::exists(live));
  CHECK(fs::exists(other));
  CHECK(fs::exists(unknown));
  CHECK(load_safetensors(path).tensors.size() == 1);
}

TEST_CASE("an exception while producing the contents leaves the existing file untouched") {
  TempDir dir;
  std::string path = dir.file("state.bin");
  write_bytes(path, "precious");
  CHECK_THROWS_WITH_AS(write_file_atomic(path,
                                         [](const WriteBytes& write) {
                                           write("partial", 7);
                                           throw Error("simulated crash while writing");
                                         }),
                       doctest::Contains("simulated crash"), Error);
  CHECK(read_bytes(path) == "precious");
  CHECK(temp_files(dir) == 0);
}

TEST_CASE("a successful write replaces the file whole and keeps its permissions") {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"a", zeros({100})}});
  ::chmod(path.c_str(), 0640);
  save_safetensors(path, {{"b", ones({2})}});
  struct stat st;
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0640);
  SafetensorsContents c = load_safetensors(path);
  REQUIRE(c.tensors.size() == 1);
  CHECK(c.tensors[0].first == "b");
  CHECK(temp_files(dir) == 0);
}

TEST_CASE("writing where no file can be created is an error that names the path") {
  TempDir dir;
  std::string missing_dir = dir.file("no/such/dir/model.safetensors");
  CHECK_THROWS_WITH_AS(save_safetensors(missing_dir, {{"a", zeros({1})}}), doctest::Contains(missing_dir.c_str()), Error);

  if (::geteuid() == 0) {
    MESSAGE("running as root: a read-only directory does not stop root, skipped that part");
    return;
  }
  std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"a", zeros({1})}});
  std::string before = read_bytes(path);
  fs::permissions(dir.path, fs::perms::owner_read | fs::perms::owner_exec);
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"b", zeros({1})}}), doctest::Contains(path.c_str()), Error);
  fs::permissions(dir.path, fs::perms::owner_all);
  CHECK(read_bytes(path) == before);
}

TEST_CASE("a save writes through a symbolic link: the file it leads to is replaced, the link kept") {
  TempDir dir;
  const std::string target = dir.file("target.safetensors"), link = dir.file("link.safetensors");
  save_safetensors(target, {{"a", zeros({1})}});
  fs::create_symlink("target.safetensors", link);  // relative to the link's folder
  const std::string chain = dir.file("chain.safetensors");
  fs::create_symlink(link, chain);                 // a link to the link, absolute
  save_safetensors(chain, {{"b", ones({2})}});
  CHECK(fs::is_symlink(fs::symlink_status(link)));
  CHECK(fs::is_symlink(fs::symlink_status(chain)));
  CHECK(load_safetensors(target).tensors[0].first == "b");
  check_writable(chain, "--save");
  CHECK(temp_files(dir) == 0);
}

TEST_CASE("a save refuses, before writing a byte, an empty path, a folder, a FIFO and a file it may not write") {
  using halfgrad::testing::contains;
  TempDir dir;
  const NamedTensors one{{"a", zeros({1})}};
  CHECK(contains(testing::error_of([&] { save_safetensors("", one); }), "save: the path is empty"));
  const std::string folder = dir.file("folder");
  CHECK(contains(testing::error_of([&] { save_safetensors(folder + "/", one); }),
                 "save: '" + folder + "/' ends with '/', which names a folder, not a file"));
  fs::create_directory(folder);
  CHECK(contains(testing::error_of([&] { save_safetensors(folder, one); }), "'" + folder + "' is a folder, not a file"));
  // A rename over a FIFO or a device would replace it with a plain file (a save to /dev/null as root: no more
  // /dev/null).
  const std::string fifo = testing::make_fifo(dir, "fifo.safetensors");
  const std::string refused = "save: cannot write '" + fifo + "': it is not a regular file";
  CHECK(contains(testing::error_of_without_waiting(fifo, [&] { save_safetensors(fifo, one); }), refused));
  CHECK(contains(testing::error_of_without_waiting(fifo, [&] { check_writable(fifo, "save"); }), refused));
  CHECK(fs::is_fifo(fifo));
  const std::string link = dir.file("link");
  fs::create_symlink(fifo, link);
  CHECK(contains(testing::error_of_without_waiting(fifo, [&] { save_safetensors(link, one); }),
                 "save: cannot write '" + link + "' (a link to '" + fifo + "'): it is not a regular file"));
  CHECK(temp_files(dir) == 0);
  // /proc's links to a pipe (/dev/stdout in a pipeline) read as "pipe:[n]", no path: what the kernel finds is refused.
  int ends[2];
  REQUIRE(::pipe(ends) == 0);
  const std::string piped = "/proc/self/fd/" + std::to_string(ends[1]);
  CHECK(contains(testing::error_of([&] { save_safetensors(piped, one); }),
                 "save: cannot write '" + piped + "' (a link to '/proc/self/fd/pipe:["));
  CHECK(contains(testing::error_of([&] { save_safetensors(piped, one); }), "it is not a regular file"));
  ::close(ends[0]);
  ::close(ends[1]);
  if (::geteuid() == 0) {
    MESSAGE("running as root: a read-only file does not stop root, skipped that part");
    return;
  }
  const std::string read_only = dir.file("read_only.safetensors");
  save_safetensors(read_only, one);
  const std::string before = read_bytes(read_only);
  ::chmod(read_only.c_str(), 0444);
  CHECK(contains(testing::error_of([&] { save_safetensors(read_only, {{"b", ones({2})}}); }),
                 "save: cannot write '" + read_only + "': Permission denied"));
  CHECK(read_bytes(read_only) == before);
  CHECK(temp_files(dir) == 0);
}

TEST_CASE("loading a folder or a FIFO is an error that names it, at once: a FIFO is not waited on for a writer") {
  using halfgrad::testing::contains;
  TempDir dir;
  fs::create_directory(dir.file("folder.safetensors"));
  CHECK(contains(testing::error_of([&] { load_safetensors(dir.file("folder.safetensors")); }),
                 "'" + dir.file("folder.safetensors") + "' is not a regular file"));
  const std::string fifo = testing::make_fifo(dir, "fifo.safetensors");
  CHECK(contains(testing::error_of_without_waiting(fifo, [&] { load_safetensors(fifo); }),
                 "'" + fifo + "' is not a regular file"));
}

// ---------------------------------------------------------------------------------------------------------
// Corrupt and truncated files: always a halfgrad::Error naming the file and where, never a crash.

TEST_CASE("a file truncated at any byte is an error that names the file") {
  TempDir dir(/*in_memory=*/true);
  std::string good = dir.file("good.safetensors");
  save_safetensors(good, {{"weight", randn({3, 4})}, {"steps", tensor(std::vector<int64_t>{5})}}, {{"k", "v"}});
  std::string bytes = read_bytes(good);
  std::string path = dir.file("cut.safetensors");
  for (size_t keep = 0; keep < bytes.size(); ++keep) {
    CAPTURE(keep);
    write_bytes(path, bytes.substr(0, keep));
    std::string message = load_error(path);
    CHECK(contains(message, path));
    CHECK(contains(message, "truncated"));
  }
  // Where the cut is inside the data, the message says which tensor and which bytes it needed.
  write_bytes(path, bytes.substr(0, bytes.size() - 1));
  std::string message = load_error(path);
  CHECK(contains(message, "tensor '"));
  CHECK(contains(message, fmt::format("ends at byte {}", bytes.size() - 1)));
}

TEST_CASE("garbage, bad JSON and impossible headers are errors with the file and the byte offset") {
  TempDir dir;
  std::string path = dir.file("bad.safetensors");
  auto error_for = [&](const std::string& file_bytes) {
    write_bytes(path, file_bytes);
    return load_error(path);
  };

  SUBCASE("random garbage") {
    std::mt19937 rng(7);
    std::string garbage(1000, '\0');
    for (char& c : garbage) c = char(rng());
    std::string m = error_for(garbage);
    CHECK(contains(m, path));
    CHECK(contains(m, "byte 0"));
  }
  SUBCASE("a header length larger than the limit") {
    CHECK(contains(error_for(le64(uint64_t(1) << 40) + "{}"), "limit"));
  }
  SUBCASE("bad JSON: the offset points at the offending byte") {
    std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})";
    size_t bad = header.rfind('}');  // after the trailing comma a key was expected
    std::string m = error_for(raw_file(header, std::string(4, '\0')));
    CHECK(contains(m, path));
    CHECK(contains(m, fmt::format("byte {}", 8 + bad)));
    CHECK(contains(m, "while parsing object key"));
  }
  SUBCASE("an entry's bad value: the offset points at the value's first byte, whatever its kind") {
    // Each header has one bad value, the `needle`; strings, numbers, arrays and objects are located differently.
    const std::pair<std::string, std::string> cases[] = {
        {R"({"x":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", R"("F8_E4M3")"},
        {R"({"x":{"dtype":"F\"32","shape":[1],"data_offsets":[0,1]}})", R"("F\"32")"},
        {R"({"x":{"dtype":"F32","shape":[2, -1],"data_offsets":[0,4]}})", "-1"},
        {R"({"x":{"dtype":"F32","shape":[1.5e0],"data_offsets":[0,4]}})", "1.5e0"},
        {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0, 99999999999999999999]}})", "99999999999999999999"},
        {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":  [4,0] }})", "[4,0]"},
        {R"({"x":{"dtype":"F32","shape":true,"data_offsets":[0,4]}})", "true"},
        {R"({"x":  {"dtype":"F32","shape":[1]}})", R"({"dtype")"},
        {R"({"__metadata__":{"k":null}})", "null"},
    };
    for (const auto& [header, needle] : cases) {
      CAPTURE(header);
      std::string m = error_for(raw_file(header, std::string(4, '\0')));
      CAPTURE(m);
      CHECK(contains(m, fmt::format("corrupt header at byte {}:", 8 + header.find(needle))));
    }
  }
  SUBCASE("JSON that is not an object, or not closed") {
    CHECK(contains(error_for(raw_file("[1, 2]", "")), "must be a JSON object"));
    CHECK(contains(error_for(raw_file(R"({"a": {"dtype": "F32")", "")), "byte"));
    CHECK(contains(error_for(raw_file(std::string(10000, '[') , "")), "nested"));
    CHECK(contains(error_for(raw_file("{\"a\xff\": 1}", "")), "UTF-8"));
  }
  SUBCASE("a NUL byte in the header, where nlohmann's lexer would stop reading and take what came before") {
    const std::string valid = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
    const std::string m = error_for(raw_file(valid + std::string("\0 garbage {[", 12), "\x01"));
    CHECK(contains(m, fmt::format("corrupt header at byte {}: a NUL byte", 8 + valid.size())));
    const std::string inside = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"k":"v)";
    CHECK(contains(error_for(raw_file(inside + std::string("\0\"}}", 4), "\x01")),
                   fmt::format("at byte {}: a NUL byte", 8 + inside.size())));
  }
  SUBCASE("more JSON values than a checkpoint holds: refused before the tree grows past ~100 MB") {
    // 2^20 + 1 dims of 1 in a 2 MB header; the tree of every value would take ~100 bytes a value.
    std::string shape;
    for (int k = 0; k <= (1 << 20); ++k) shape += k == 0 ? "1" : ",1";
    const std::string m = error_for(raw_file(R"({"a":{"dtype":"U8","shape":[)" + shape + R"(],"data_offsets":[0,1]}})",
                                             "\x01"));
    CHECK(contains(m, path));
    CHECK(contains(m, "more than 1048576 JSON values"));
  }
  SUBCASE("duplicate names") {
    std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
    CHECK(contains(error_for(raw_file(header, std::string(8, '\0'))), "duplicate key \"a\""));
  }
  SUBCASE("an unknown dtype names the tensor") {
    std::string m = error_for(raw_file(R"({"x":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "\0"));
    CHECK(contains(m, "tensor 'x'"));
    CHECK(contains(m, "F8_E4M3"));
  }
  SUBCASE("shape x dtype size must equal the data_offsets span") {
    std::string m = error_for(raw_file(R"({"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", std::string(20, '\0')));
    CHECK(contains(m, "tensor 'x'"));
    CHECK(contains(m, "needs 24 bytes"));
    CHECK(contains(error_for(raw_file(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0'))),
                   "non-negative"));
    CHECK(contains(error_for(raw_file(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4]}})",
                                      std::string(4, '\0'))), "too large"));
    CHECK(contains(error_for(raw_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", std::string(4, '\0'))),
                   "end before they begin"));
    CHECK(contains(error_for(raw_file(R"({"x":{"dtype":"F32","shape":[1]}})", "")), "no \"data_offsets\""));
  }
  SUBCASE("overlapping offsets name both tensors") {
    std::string m = error_for(raw_file(
        R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
        std::string(6, '\0')));
    CHECK(contains(m, "tensor 'b'"));
    CHECK(contains(m, "overlap tensor 'a'"));
  }
  SUBCASE("a hole in the data buffer") {
    std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
    std::string m = error_for(raw_file(header, std::string(8, '\0')));
    CHECK(contains(m, "belong to no tensor"));
  }
  SUBCASE("trailing garbage after the last tensor") {
    std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
    std::string file = raw_file(header, std::string(4, '\0') + "junk");
    std::string m = error_for(file);
    CHECK(contains(m, "4 bytes of trailing garbage"));
    CHECK(contains(m, fmt::format("from byte {}", file.size() - 4)));
  }
  SUBCASE("a BOOL byte that is neither 0 nor 1") {
    std::string m = error_for(raw_file(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x02"));
    CHECK(contains(m, "tensor 'm'"));
  }
  SUBCASE("metadata values must be strings") {
    CHECK(contains(error_for(raw_file(R"({"__metadata__":{"epoch":3}})", "")), "must be a string"));
  }
  SUBCASE("a missing file") {
    CHECK(contains(load_error(dir.file("nope.safetensors")), "cannot open"));
  }
}

TEST_CASE("random byte corruption of a checkpoint never crashes the reader") {
  TempDir dir(/*in_memory=*/true);
  std::string good = dir.file("good.safetensors");
  save_safetensors(good, {{"w", randn({2, 3})}, {"n", tensor(std::vector<int64_t>{1, 2})}, {"h", ones({3}).to(kFloat16)}},
                   {{"epoch", "1"}});
  std::string bytes = read_bytes(good);
  std::string path = dir.file("fuzz.safetensors");
  std::mt19937 rng(42);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string corrupt = bytes;
    int flips = 1 + int(rng() % 3);
    for (int k = 0; k < flips; ++k) corrupt[rng() % corrupt.size()] = char(rng());
    write_bytes(path, corrupt);
    try {
      load_safetensors(path);  // some corruptions (inside float data) are still valid files
    } catch (const Error& e) {
      ++rejected;
      CHECK(contains(e.what(), path));
    }
  }
  CHECK(rejected > 0);
}

// ---------------------------------------------------------------------------------------------------------
// Modules

namespace {
// A small module without layers: parameters, a buffer, a submodule.
struct Net : nn::Module {
  struct Head : nn::Module {
    Tensor& weight = register_parameter("weight", randn({2, 3}));
    std::string type_name() const override { return "Head"; }
  };
  Tensor& w = register_parameter("w", randn({3, 4}));
  Tensor& b = register_parameter("b", randn({4}));
  Tensor& count = register_buffer("count", zeros({}, {.dtype = kInt64}));
  std::shared_ptr<Head> head = register_module("head", std::make_shared<Head>());
  std::string type_name() const override { return "Net"; }
};
}  // namespace

TEST_CASE("nn::save and nn::load round-trip a module's parameters and buffers bit-exactly, in place") {
  TempDir dir;
  std::string path = dir.file("net.safetensors");
  Net a, b;
  {
    NoGradGuard no_grad;
    a.count.fill_(17);
  }
  nn::save(a, path, {{"epoch", "2"}});
  Tensor w_before = b.w;  // the same tensor object must be filled, not replaced
  nn::load(b, path);
  CHECK(b.w.same(w_before));
  CHECK(b.w.requires_grad());
  for (const auto& [name, t] : a.state_dict()) CHECK(bytes_of(b.tensor_at(name)) == bytes_of(t));
  CHECK(b.count.item<int64_t>() == 17);
  SafetensorsContents c = load_safetensors(path);
  CHECK(c.metadata.at("format") == "pt");
  CHECK(c.metadata.at("epoch") == "2");
}

TEST_CASE("nn::load reports every mismatch at once, names the file, and loads nothing") {
  TempDir dir;
  std::string path = dir.file("other.safetensors");
  save_safetensors(path, {
                             {"w", zeros({4, 3})},                  // wrong shape
                             {"b", zeros({4}, {.dtype = kFloat64})},  // wrong dtype
                             {"extra.thing", zeros({1})},           // unexpected
                             // "count" and "head.weight" missing
                         });
  Net net;
  std::string before = bytes_of(net.w);
  std::string message;
  try {
    nn::load(net, path);
  } catch (const Error& e) {
    message = e.what();
  }
  CAPTURE(message);
  CHECK(contains(message, path));
  CHECK(contains(message, "4 problems"));
  CHECK(contains(message, "shape mismatch for 'w': the state has [4, 3], the model [3, 4]"));
  CHECK(contains(message, "dtype mismatch for 'b': the state has float64, the model float32"));
  CHECK(contains(message, "missing from the state (2): count, head.weight"));
  CHECK(contains(message, "unexpected in the state (1): extra.thing"));
  CHECK(bytes_of(net.w) == before);

  // Non-strict: names may differ, the rest still must match; what was skipped is returned.
  save_safetensors(path, {{"w", ones({3, 4})}, {"extra", zeros({1})}});
  nn::LoadResult r = nn::load(net, path, {.strict = false});
  CHECK(r.unexpected_keys == std::vector<std::string>{"extra"});
  CHECK(r.missing_keys == std::vector<std::string>{"b", "count", "head.weight"});
  CHECK(to_vector<float>(net.w) == std::vector<float>(12, 1.0f));

  // convert_dtypes: a float64 checkpoint loads into a float32 model.
  save_safetensors(path, {{"w", full({3, 4}, 2.0, {.dtype = kFloat64})}});
  nn::load(net, path, {.strict = false, .convert_dtypes = true});
  CHECK(net.w.dtype() == kFloat32);
  CHECK(to_vector<float>(net.w) == std::vector<float>(12, 2.0f));
}

// ---------------------------------------------------------------------------------------------------------
// Training checkpoints

TEST_CASE("a training checkpoint round-trips model, optimizer and scaler tensors, epoch, step and RNG state") {
  TempDir dir;
  std::string path = dir.file("train.safetensors");
  Net net;
  manual_seed(99);
  randn({10});  // advance the generator
  nn::TrainingCheckpoint ck{
      .model = net.state_dict(),
      .optimizer = {{"state.0.0.momentum_buffer", randn({3, 4})}, {"param_groups.0.lr", scalar_tensor(0.1, {.dtype = kFloat64})}},
      .extra = {{"scaler.scale", scalar_tensor(65536.0)}, {"scaler.growth_tracker", scalar_tensor(int64_t(17), {.dtype = kInt64})}},
      .epoch = 3,
      .step = 1234,
      .rng = generator_state(),
      .metadata = {{"run", "resnet18-cifar"}},
  };
  std::vector<float> next_draw = to_vector<float>(randn({5}));  // what follows the saved RNG state
  nn::save_training_checkpoint(path, ck);

  nn::TrainingCheckpoint back = nn::load_training_checkpoint(path);
  CHECK(back.epoch == 3);
  CHECK(back.step == 1234);
  CHECK(back.rng.seed == ck.rng.seed);
  CHECK(back.rng.offset == ck.rng.offset);
  CHECK(back.metadata == Metadata{{"run", "resnet18-cifar"}});
  auto same = [](const NamedTensors& a, NamedTensors b) {
    std::sort(b.begin(), b.end(), [](auto& x, auto& y) { return x.first < y.first; });
    NamedTensors sorted_a = a;
    std::sort(sorted_a.begin(), sorted_a.end(), [](auto& x, auto& y) { return x.first < y.first; });
    REQUIRE(sorted_a.size() == b.size());
    for (size_t k = 0; k < b.size(); ++k) {
      CHECK(sorted_a[k].first == b[k].first);
      CHECK(sorted_a[k].second.dtype() == b[k].second.dtype());
      CHECK(bytes_of(sorted_a[k].second) == bytes_of(b[k].second));
    }
  };
  same(ck.model, back.model);
  same(ck.optimizer, back.optimizer);
  same(ck.extra, back.extra);

  // Restoring the generator makes the next random numbers those that followed the save.
  randn({100});
  set_generator_state(back.rng);
  CHECK(to_vector<float>(randn({5})) == next_draw);

  // The model part loads straight into a module.
  Net other;
  other.load_state_dict(back.model);
  CHECK(bytes_of(other.w) == bytes_of(net.w));
}

TEST_CASE("resuming from a training checkpoint continues exactly like the uninterrupted run") {
  TempDir dir;
  std::string path = dir.file("resume.safetensors");
  auto make_model = [](uint64_t seed) {
    manual_seed(seed);
    return nn::sequential({std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(),
                           std::make_shared<nn::Dropout>(0.25), std::make_shared<nn::Linear>(8, 2)});
  };
  manual_seed(5);
  Tensor x = randn({16, 4}), y = randn({16, 2});
  auto train = [&](nn::Module& model, optim::Optimizer& opt, int steps) {
    for (int k = 0; k < steps; ++k) {
      opt.zero_grad();
      mse_loss(model.forward(x), y).backward();  // dropout draws from the generator each step
      opt.step();
    }
  };

  // The uninterrupted run: 3 steps, a checkpoint, 3 more.
  auto a = make_model(11);
  optim::SGD opt_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  train(*a, opt_a, 3);
  nn::save_training_checkpoint(path, {.model = a->state_dict(), .optimizer = opt_a.state_tensors(), .epoch = 0,
                                      .step = 3, .rng = generator_state()});
  train(*a, opt_a, 3);

  // A new process, in effect: another initialisation, a fresh optimizer, a disturbed generator; then resume.
  auto b = make_model(12345);
  optim::SGD opt_b(b->parameters(), {.lr = 0.1, .momentum = 0.9});
  randn({7});
  nn::TrainingCheckpoint ck = nn::load_training_checkpoint(path);
  b->load_state_dict(ck.model);
  opt_b.load_state_tensors(ck.optimizer);
  set_generator_state(ck.rng);
  CHECK(ck.step == 3);
  train(*b, opt_b, 3);

  NamedTensors pa = a->named_parameters(), pb = b->named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t k = 0; k < pa.size(); ++k) {
    CAPTURE(pa[k].first);
    CHECK(bytes_of(pa[k].second) == bytes_of(pb[k].second));  // bit-identical, not merely close
  }
}

TEST_CASE("load_training_checkpoint refuses a model checkpoint and reserved names are refused on save") {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  Net net;
  nn::save(net, path);
  CHECK_THROWS_WITH_AS(nn::load_training_checkpoint(path), doctest::Contains("not a halfgrad training checkpoint"), Error);
  CHECK_THROWS_WITH_AS(nn::save_training_checkpoint(path, {.extra = {{"model.w", zeros({1})}}}),
                       doctest::Contains("reserved"), Error);
  CHECK_THROWS_WITH_AS(nn::save_training_checkpoint(path, {.metadata = {{"halfgrad.epoch", "1"}}}),
                       doctest::Contains("reserved"), Error);
}

TEST_CASE("a training checkpoint's epoch that is not a number, or more than a uint64 holds, is named as such") {
  TempDir dir;
  const std::string path = dir.file("run.safetensors");
  nn::save_training_checkpoint(path, {.model = {{"w", ones({2})}}, .epoch = 3});
  const SafetensorsContents saved = load_safetensors(path);
  for (const auto& [epoch, error] : {std::pair<std::string, std::string>{"-1", "is \"-1\", not a non-negative integer"},
                                     {"18446744073709551616", "more than a uint64 holds"},
                                     {"3x", "not a non-negative integer"}}) {
    CAPTURE(epoch);
    Metadata metadata = saved.metadata;
    metadata["halfgrad.epoch"] = epoch;
    save_safetensors(path, saved.tensors, metadata);
    CHECK_THROWS_WITH_AS(nn::load_training_checkpoint(path), doctest::Contains(error.c_str()), Error);
  }
}

// ---------------------------------------------------------------------------------------------------------
// For tools/check_safetensors.py, which checks with Python's safetensors (and PyTorch, where installed) that
// Python reads these files, and writes one with Python for halfgrad to read. Skipped unless it runs them.

namespace {
// Values every dtype holds exactly: floats arange(6) / 4 - 0.5, integers arange(6) - 2; 2 x 3 each.
NamedTensors sample_tensors() {
  NamedTensors tensors;
  Tensor values = arange(0, 6, 1, {.dtype = kFloat64}).view({2, 3}) / 4.0 - 0.5;
  for (DType d : {kFloat64, kFloat32, kFloat16, kBFloat16}) tensors.emplace_back(safetensors_dtype_name(d), values.to(d));
  Tensor ints = arange(0, 6, 1, {.dtype = kInt64}).view({2, 3}) - int64_t(2);
  tensors.emplace_back("I64", ints);
  tensors.emplace_back("I32", ints.to(kInt32));
  uint8_t u8[6] = {0, 1, 2, 3, 254, 255};
  tensors.emplace_back("U8", from_buffer(u8, {2, 3}, kUInt8));
  uint8_t mask[6] = {1, 0, 1, 0, 0, 1};
  tensors.emplace_back("BOOL", from_buffer(mask, {2, 3}, kBool));
  tensors.emplace_back("scalar", scalar_tensor(3.25));
  return tensors;
}
}  // namespace

TEST_CASE("a sample checkpoint for Python is written where HALFGRAD_SAFETENSORS_SAMPLE points") {
  const char* where = std::getenv("HALFGRAD_SAFETENSORS_SAMPLE");
  if (!where) {
    MESSAGE("HALFGRAD_SAFETENSORS_SAMPLE not set: skipped (tools/check_safetensors.py sets it)");
    return;
  }
  save_safetensors(where, sample_tensors(), {{"written_by", "halfgrad"}});
  MESSAGE("wrote " << where);
}

TEST_CASE("a file written by Python's safetensors, named by HALFGRAD_SAFETENSORS_FROM_PYTHON, reads bit-exactly") {
  const char* where = std::getenv("HALFGRAD_SAFETENSORS_FROM_PYTHON");
  if (!where) {
    MESSAGE("HALFGRAD_SAFETENSORS_FROM_PYTHON not set: skipped (tools/check_safetensors.py sets it)");
    return;
  }
  SafetensorsContents c = load_safetensors(where);
  CHECK(c.metadata.at("written_by") == "python");
  int compared = 0;
  for (const auto& [name, expected] : sample_tensors()) {
    Tensor t = c.find(name);
    if (!t.defined()) continue;  // numpy has no bfloat16: Python without torch leaves BF16 out
    CAPTURE(name);
    CHECK(t.dtype() == expected.dtype());
    CHECK(t.shape() == expected.shape());
    CHECK(bytes_of(t) == bytes_of(expected));
    ++compared;
  }
  CHECK(compared >= 8);
  // The reference writer's layout, byte for byte: halfgrad writing the same tensors gives the same file.
  CHECK(serialize_safetensors(c.tensors, c.metadata) == read_bytes(where));
  MESSAGE("compared " << compared << " tensors written by Python, and halfgrad's serialisation of them");
}
