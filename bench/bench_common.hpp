#pragma once

// Shared by the benches: checked CUDA calls, event timing, medians, the GPU and driver banner,
// and a small JSON writer.

#include <streamalloc/driver.hpp>
#include <streamalloc/pool.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define BENCH_CHECK(call) ::bench::check((call), #call)

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

/// Times `reps` runs of `op` on `stream` with events; returns each run's milliseconds.
template <class Op>
std::vector<double> time_ms(cudaStream_t stream, int reps, Op op) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  std::vector<double> out;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(start, stream));
    op();
    BENCH_CHECK(cudaEventRecord(stop, stream));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
    out.push_back(ms);
  }
  BENCH_CHECK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return out;
}

struct gpu_info {
  std::string name;
  int driver = 0;
  int runtime = 0;
  int sms = 0;
};

inline gpu_info describe_gpu() {
  gpu_info g;
  cudaDeviceProp p{};
  BENCH_CHECK(cudaGetDeviceProperties(&p, 0));
  g.name = p.name;
  g.sms = p.multiProcessorCount;
  BENCH_CHECK(cudaDriverGetVersion(&g.driver));
  BENCH_CHECK(cudaRuntimeGetVersion(&g.runtime));
  std::printf("GPU: %s (%d SMs), driver API %d, runtime %d\n", g.name.c_str(), g.sms, g.driver,
              g.runtime);
  return g;
}

/// Exits 77 (skipped) when there is no usable GPU, saying why.
inline void require_gpu(const char* bench_name) {
  if (!streamalloc::driver_available()) {
    std::printf("%s: no usable GPU (%s); skipped\n", bench_name,
                streamalloc::driver_problem().c_str());
    std::exit(77);
  }
}

/// The driver's pool, made like streamalloc's for a fair comparison: memory kept between uses
/// (release threshold `threshold`).
inline cudaMemPool_t make_driver_pool(std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max()) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location = {cudaMemLocationTypeDevice, 0};
  cudaMemPool_t p;
  BENCH_CHECK(cudaMemPoolCreate(&p, &props));
  BENCH_CHECK(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &threshold));
  return p;
}

/// A streamalloc pool that keeps its memory between uses, as the driver's pool above does.
inline streamalloc::pool_properties kept() {
  streamalloc::pool_properties p;
  p.release_threshold = std::numeric_limits<std::size_t>::max();
  return p;
}

using clk = std::chrono::steady_clock;
inline double seconds_since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

/// The rows of a bench's results JSON, one object per measure: {"measure": name, fields}.
class json_rows {
 public:
  void add(const std::string& name, const std::string& fields) {
    out_ << (count_++ ? ",\n" : "") << "    {\"measure\": \"" << name << "\", " << fields << "}";
  }
  [[nodiscard]] std::string str() const { return out_.str(); }

 private:
  std::ostringstream out_;
  int count_ = 0;
};

inline std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

}  // namespace bench
