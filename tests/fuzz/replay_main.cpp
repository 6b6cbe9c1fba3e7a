// A main for the fuzz targets without libFuzzer, with any compiler: what CI runs, in its sanitizer build, in the time it
// has. Each seed file of the folder given, then `--mutations N` inputs made from the seeds by a deterministic blind
// mutator (bits flipped, bytes and 8-byte fields overwritten with edge values, the input cut short or lengthened, a
// chunk copied within it; half of the changes in the first 512 bytes, where the formats keep their headers), each
// through the target's LLVMFuzzerTestOneInput. Not coverage-guided as `make fuzz` is: it finds what random damage to
// valid files finds.
//
//   fuzz_text_replay tests/fuzz/corpus/text --mutations 20000
//
// The rule is the targets' (tests/fuzz/README.md): a halfgrad::Error is the answer to bad input; a crash, a sanitizer
// report or another exception is a finding: the run stops, naming the input after the sanitizer's report or with the
// exception's message (its seed and mutation number: the same command reproduces it).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// Provided by the sanitizers' runtime when there is one (gcc and clang): called before a report ends the process.
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace {

char g_current[512] = "no input yet";  // what is running, for the death callback and the terminate handler

extern "C" void say_current() { std::fprintf(stderr, "\nfuzz replay: the finding is %s\n", g_current); }

// xorshift64*: the same inputs on every machine and run.
struct Random {
  uint64_t state;
  uint64_t next() {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545F4914F6CDD1DULL;
  }
  size_t below(size_t n) { return n == 0 ? 0 : size_t(next() % n); }
};

// An offset in [0, size): half the time within the first 512 bytes.
size_t offset(Random& r, size_t size) { return r.below(2) ? r.below(std::min<size_t>(size, 512)) : r.below(size); }

std::vector<uint8_t> mutate(std::vector<uint8_t> in, Random& r) {
  static const uint64_t edges[] = {0, 1, 0x7f, 0x80, 0xff, 0x7fffffffULL, 0x80000000ULL, 0xffffffffULL,
                                   0x7fffffffffffffffULL, 0x8000000000000000ULL, ~0ULL};
  const int changes = 1 + int(r.below(4));
  for (int c = 0; c < changes; ++c) {
    switch (r.below(6)) {
      case 0:  // a bit
        if (!in.empty()) in[offset(r, in.size())] ^= uint8_t(1u << r.below(8));
        break;
      case 1:  // a byte: an edge value, an ASCII digit or anything
        if (!in.empty()) {
          const size_t at = offset(r, in.size());
          const size_t pick = r.below(3);
          in[at] = pick == 0 ? uint8_t(edges[r.below(std::size(edges))]) : pick == 1 ? uint8_t('0' + r.below(10))
                                                                                      : uint8_t(r.next());
        }
        break;
      case 2:  // an 8-byte little-endian field (lengths, offsets)
        if (in.size() >= 8) {
          const uint64_t v = edges[r.below(std::size(edges))];
          std::memcpy(&in[offset(r, in.size() - 7)], &v, 8);
        }
        break;
      case 3:  // cut short
        in.resize(r.below(in.size() + 1));
        break;
      case 4: {  // lengthened with random bytes
        const size_t n = 1 + r.below(64), at = r.below(in.size() + 1);
        std::vector<uint8_t> extra(n);
        for (uint8_t& b : extra) b = uint8_t(r.next());
        in.insert(in.begin() + std::ptrdiff_t(at), extra.begin(), extra.end());
        break;
      }
      default:  // a chunk copied elsewhere
        if (in.size() >= 2) {
          const size_t from = r.below(in.size()), to = r.below(in.size());
          const size_t n = 1 + r.below(std::min<size_t>(64, in.size() - std::max(from, to)));
          std::memmove(&in[to], &in[from], n);
        }
    }
  }
  return in;
}

void run(const std::vector<uint8_t>& input) { LLVMFuzzerTestOneInput(input.data(), input.size()); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && !(argc == 4 && std::strcmp(argv[2], "--mutations") == 0)) {
    std::fprintf(stderr, "usage: %s SEED_FOLDER [--mutations N]\n", argv[0]);
    return 2;
  }
  const long mutations = argc == 4 ? std::strtol(argv[3], nullptr, 10) : 0;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> seeds;
  for (const auto& entry : std::filesystem::directory_iterator(argv[1])) {
    std::ifstream in(entry.path(), std::ios::binary);
    seeds.emplace_back(entry.path().filename().string(),
                       std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  }
  std::sort(seeds.begin(), seeds.end());
  if (seeds.empty()) {
    std::fprintf(stderr, "fuzz replay: no seed file in %s\n", argv[1]);
    return 2;
  }
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(say_current);
  std::set_terminate([] {  // an exception other than halfgrad::Error left the target
    say_current();
    if (const std::exception_ptr e = std::current_exception()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        std::fprintf(stderr, "fuzz replay: it threw %s\n", x.what());
      } catch (...) {
        std::fprintf(stderr, "fuzz replay: it threw something that is not a std::exception\n");
      }
    }
    std::abort();
  });
  for (const auto& [name, bytes] : seeds) {
    std::snprintf(g_current, sizeof g_current, "the seed %s", name.c_str());
    run(bytes);
  }
  Random random{0x9E3779B97F4A7C15ULL};
  for (long k = 0; k < mutations; ++k) {
    const auto& [name, bytes] = seeds[size_t(k) % seeds.size()];
    std::snprintf(g_current, sizeof g_current, "mutation %ld (of the seed %s)", k, name.c_str());
    run(mutate(bytes, random));
  }
  std::printf("fuzz replay: %zu seeds and %ld mutations of them, no finding\n", seeds.size(), mutations);
  return 0;
}
