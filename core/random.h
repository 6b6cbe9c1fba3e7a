#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a counter-based generator.
// Each number is a pure function of (seed, counter), so the same seed gives the same stream on any
// device and any number of threads; a GPU kernel can compute element i's numbers without a shared state.
#include <cstdint>

#include "core/half.h"  // HG_HOST_DEVICE

namespace halfgrad {

struct Philox {
  struct U4 {
    uint32_t x[4];
  };

  static HG_HOST_DEVICE U4 generate(uint64_t seed, uint64_t counter) {
    U4 c{{uint32_t(counter), uint32_t(counter >> 32), 0u, 0u}};
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      uint64_t p0 = uint64_t(0xD2511F53u) * c.x[0];
      uint64_t p1 = uint64_t(0xCD9E8D57u) * c.x[2];
      c = U4{{uint32_t(p1 >> 32) ^ c.x[1] ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ c.x[3] ^ k1, uint32_t(p0)}};
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return c;
  }
  // Uniform in [0, 1) from 24 random bits (exact in float32).
  static HG_HOST_DEVICE float uniform(uint32_t bits) { return float(bits >> 8) * (1.0f / 16777216.0f); }
};

// The global generator: a seed and how many counters have been consumed.
struct GeneratorState {
  uint64_t seed;
  uint64_t offset;
  // Set while a CUDA graph is captured (core/cuda_graph.h): device memory holding {seed, offset} of the generator at
  // the time of each replay. A kernel then draws with seed graph_state[0] from counter graph_state[1] + offset (see
  // seed_and_offset below), so every replay continues the generator's stream as an eager step would.
  const uint64_t* graph_state = nullptr;
};
// Where a kernel's counters start, in device code: {seed, first counter}.
struct SeedAndOffset {
  uint64_t seed, offset;
};
inline HG_HOST_DEVICE SeedAndOffset seed_and_offset(const GeneratorState& s) {
  if (s.graph_state != nullptr) return {s.graph_state[0], s.graph_state[1] + s.offset};
  return {s.seed, s.offset};
}
// Reserves `count` counters and returns (seed, first counter).
GeneratorState next_random_counters(uint64_t count);
// While a CUDA graph is captured on this host thread, next_random_counters reserves counters of the graph's: relative
// offsets from `used` on, with graph_state set. cuda::Graph installs it; nullptr ends it.
struct GraphGenerator {
  const uint64_t* device_state;
  uint64_t used = 0;
};
void set_graph_generator(GraphGenerator* generator);
// The generator's state now, and setting it back (training checkpoints): after
// set_generator_state(s) the random numbers continue exactly as they did after generator_state() gave s.
GeneratorState generator_state();
void set_generator_state(GeneratorState state);

}  // namespace halfgrad
