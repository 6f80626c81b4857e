// The pool core (detail/core/pool_core.hpp) under arbitrary operation sequences, on the simulated
// device of tests/support/sim_backend.hpp. Each input decodes into a pool configuration and a
// sequence of operations: allocations of any size (0, huge), frees on the allocating stream or on
// another one ordered after it, frees of foreign, interior and freed pointers, grow and shrink in
// place, handing a block to another stream, event records and waits, host synchronizations of a
// stream, an event or the device, the device running streams partly or wholly, trim, release
// thresholds, reuse policies, and streams made and destroyed: streamalloc-owned ones (retired),
// raw ones, raw ones reusing a destroyed stream's handle value, per-thread default streams that
// share one value. After every step an independent model of stream order (the one of the
// randomized test in tests/cpu/detail/pool_core_randomized_test.cpp, made exact: waits carry what they wait
// for, the device runs a stream only past what it waits on) checks that
//   - no two live blocks overlap, each is mapped, and each call returns the sizes it promises;
//   - a block, or the bytes grow_in_place adds, goes to stream T only where each earlier free of
//     that memory on stream S is on T itself, ordered before T, or executed on the device;
//   - memory is unmapped (released or remapped) only when no live block and no unexecuted free
//     touches it;
//   - the pool uses a stream's handle only while it is valid: a stream whose record says the
//     handle is stable and that has not retired, or the stream of the call in progress;
//   - bad pointers throw std::invalid_argument and change nothing;
//   - the statistics equal the model's sums, and shutdown gives everything back.
// A violation prints what was wrong and traps.
//
// Built with clang's -fsanitize=fuzzer as `pool_core_fuzz` (STREAMALLOC_BUILD_FUZZ=ON, the `fuzz`
// preset), and with any compiler as the replay program `cpu_fuzz_replay`
// (STREAMALLOC_FUZZ_REPLAY), which runs each file of tests/fuzz/corpus/ through the same entry
// point. STREAMALLOC_FUZZ_TRACE=1 prints each operation, to follow an input that fails.
//
// The harness is split by theme into the headers beside this file, all included here (one
// translation unit, so the targets build from this file alone): harness.hpp declares it and lists
// the parts, fuzz_support.hpp holds what they all use. This file holds the entry points and the
// reset each input starts from.

#include "fuzz_support.hpp"
#include "harness.hpp"
#include "stream_model.hpp"
#include "fuzz_backend.hpp"
#include "operations.hpp"
#include "block_operations.hpp"
#include "model_checks.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(STREAMALLOC_FUZZ_REPLAY)
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#endif

namespace pool_core_fuzz {

/// Gives the process a fresh ordering registry. Records of streams never retired (raw ones, the
/// legacy default stream) stay for the process's life, so a fuzzer running millions of inputs
/// would grow without bound; and fresh ids per input keep a replayed input's behaviour the same
/// as when found.
/// Nothing refers to the old records here: the input's pool is gone, and the core's per-thread
/// cache of states is keyed by the pool's serial, never reused.
void reset_ordering() {
  ordering_registry& r = ordering();
  r.~ordering_registry();
  ::new (static_cast<void*>(&r)) ordering_registry;
}

}  // namespace pool_core_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool init = [] {
    const char* t = std::getenv("STREAMALLOC_FUZZ_TRACE");
    pool_core_fuzz::trace_on = t != nullptr && *t != '\0' && *t != '0';
    return true;
  }();
  (void)init;
  pool_core_fuzz::reset_ordering();
  pool_core_fuzz::step_now = 0;
  pool_core_fuzz::reader in(data, size);
  pool_core_fuzz::harness h(in);
  h.run();
  return 0;
}

#if defined(STREAMALLOC_FUZZ_REPLAY)
// Runs each file named, or each file in each directory named, through the entry point.
int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg(argv[i]);
    if (fs::is_directory(arg)) {
      for (const auto& e : fs::directory_iterator(arg)) {
        if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
      }
    } else {
      files.push_back(arg);
    }
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string name = f.string();
    pool_core_fuzz::input_name = name.c_str();
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  }
  pool_core_fuzz::input_name = nullptr;
  std::printf("pool_core_fuzz: replayed %zu inputs\n", files.size());
  // An empty corpus (a wrong path, a lost directory) would pass without checking anything.
  return files.empty() ? 1 : 0;
}
#endif
