// Is memory mapped through the VMM API as fast as cudaMalloc memory?
//
// For cudaMalloc memory and for VMM memory mapped from physical handles of several sizes, this
// measures a device copy kernel, cudaMemcpy device-to-device (one large copy, and many copies
// of 64 MiB), and pinned host-to-device / device-to-host copies. Each figure is the median of
// the repetitions, in GB/s counting bytes read plus bytes written for device-to-device work and
// bytes moved for host transfers, and as a ratio to cudaMalloc memory in the same run.
//
//   bench_bandwidth [--size-mib N] [--reps N] [--json FILE]

#include <streamalloc/vmm.hpp>

#include "bench_common.hpp"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

/// One device buffer: cudaMalloc, or a reservation mapped from handles of `handle_bytes`.
class buffer {
 public:
  virtual ~buffer() = default;
  virtual void* data() const = 0;
};

class malloc_buffer final : public buffer {
 public:
  explicit malloc_buffer(std::size_t bytes) { BENCH_CHECK(cudaMalloc(&p_, bytes)); }
  ~malloc_buffer() override { cudaFree(p_); }
  void* data() const override { return p_; }

 private:
  void* p_ = nullptr;
};

class vmm_buffer final : public buffer {
 public:
  vmm_buffer(std::size_t bytes, std::size_t handle_bytes, std::size_t alignment)
      : va_(bytes, alignment) {
    using namespace streamalloc;
    const auto gpu = memory_location::device(0);
    for (std::size_t off = 0; off < bytes; off += handle_bytes) {
      physical_allocation mem(std::min(handle_bytes, bytes - off), gpu);
      maps_.emplace_back(va_, off, mem);
    }
    set_access(va_.address(), bytes, {{gpu, access_flags::read_write}});
  }
  void* data() const override { return va_.data(); }

 private:
  streamalloc::address_reservation va_;
  std::vector<streamalloc::mapping> maps_;
};

struct layout {
  std::string name;
  std::size_t handle_bytes;  // 0: cudaMalloc; SIZE_MAX: one handle for the whole buffer
  std::size_t alignment;     // of the reservation; 0: the driver's default
};

struct result {
  std::string layout;
  double kernel, memcpy_whole, memcpy_64m, h2d, d2h;  // GB/s
};

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_bandwidth");
  std::size_t size = 1024 * MiB;
  int reps = 30;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--size-mib") && i + 1 < argc) size = std::strtoull(argv[++i], nullptr, 10) * MiB;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  }
  BENCH_CHECK(cudaSetDevice(0));
  const bench::gpu_info gpu = bench::describe_gpu();
  const std::size_t g = streamalloc::allocation_granularity(streamalloc::memory_location::device(0));
  std::printf("buffers of %zu MiB, %d repetitions, median; granularity %zu KiB\n\n", size / MiB,
              reps, g / 1024);

  const std::vector<layout> layouts = {
      {"cudaMalloc", 0, 0},
      {"vmm 2 MiB handles", 2 * MiB, 0},
      {"vmm 8 MiB handles", 8 * MiB, 0},
      {"vmm 16 MiB handles", 16 * MiB, 0},
      {"vmm 32 MiB handles", 32 * MiB, 0},
      {"vmm 64 MiB handles", 64 * MiB, 0},
      {"vmm 128 MiB handles", 128 * MiB, 0},
      {"vmm 256 MiB handles", 256 * MiB, 0},
      {"vmm 512 MiB handles", 512 * MiB, 0},
      {"vmm one handle", SIZE_MAX, 0},
      {"vmm 2 MiB, VA 1 GiB-aligned", 2 * MiB, 1024 * MiB},
      {"vmm 64 MiB, VA 1 GiB-aligned", 64 * MiB, 1024 * MiB},
  };

  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* host = nullptr;
  BENCH_CHECK(cudaMallocHost(&host, size));

  // All layouts live at once and are measured in interleaved rounds, so drift in clocks or
  // temperature during the run spreads over every layout instead of favouring the first.
  struct buffers {
    std::unique_ptr<buffer> src, dst;
  };
  std::vector<buffers> bufs;
  for (const layout& l : layouts) {
    auto make = [&]() -> std::unique_ptr<buffer> {
      if (l.handle_bytes == 0) return std::make_unique<malloc_buffer>(size);
      return std::make_unique<vmm_buffer>(size, std::min(l.handle_bytes, size), l.alignment);
    };
    bufs.push_back({make(), make()});
  }

  enum op { kernel, memcpy_whole, memcpy_64m, h2d, d2h, op_count };
  const double bytes_moved[op_count] = {2.0 * size, 2.0 * size, 2.0 * size, 1.0 * size, 1.0 * size};
  auto run = [&](op o, const buffers& b) {
    switch (o) {
      case kernel:
        copy_kernel<<<gpu.sms * 8, 512, 0, stream>>>(static_cast<const uint4*>(b.src->data()),
                                                     static_cast<uint4*>(b.dst->data()), size / 16);
        break;
      case memcpy_whole:
        BENCH_CHECK(cudaMemcpyAsync(b.dst->data(), b.src->data(), size, cudaMemcpyDeviceToDevice, stream));
        break;
      case memcpy_64m:
        for (std::size_t off = 0; off < size; off += 64 * MiB) {
          BENCH_CHECK(cudaMemcpyAsync(static_cast<char*>(b.dst->data()) + off,
                                      static_cast<const char*>(b.src->data()) + off,
                                      std::min(64 * MiB, size - off), cudaMemcpyDeviceToDevice, stream));
        }
        break;
      case h2d:
        BENCH_CHECK(cudaMemcpyAsync(b.dst->data(), host, size, cudaMemcpyHostToDevice, stream));
        break;
      case d2h:
        BENCH_CHECK(cudaMemcpyAsync(host, b.src->data(), size, cudaMemcpyDeviceToHost, stream));
        break;
      case op_count: break;
    }
  };

  std::vector<std::vector<std::vector<double>>> ms(layouts.size(),
                                                   std::vector<std::vector<double>>(op_count));
  for (int round = -1; round < reps; ++round) {  // round -1 warms up every path
    for (std::size_t li = 0; li < layouts.size(); ++li) {
      for (int o = 0; o < op_count; ++o) {
        auto t = bench::time_ms(stream, 1, [&] { run(static_cast<op>(o), bufs[li]); });
        if (round >= 0) ms[li][o].push_back(t[0]);
      }
    }
  }

  // The copies must have copied. Each layout: src filled with a byte, copied to dst on the
  // device and to the host, both read back.
  for (std::size_t li = 0; li < layouts.size(); ++li) {
    const auto value = static_cast<unsigned char>(li + 1);
    BENCH_CHECK(cudaMemsetAsync(bufs[li].src->data(), value, size, stream));
    run(memcpy_whole, bufs[li]);
    run(d2h, bufs[li]);
    unsigned char last = 0;
    BENCH_CHECK(cudaMemcpyAsync(&last, static_cast<char*>(bufs[li].dst->data()) + size - 1, 1,
                                cudaMemcpyDeviceToHost, stream));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    if (last != value || static_cast<unsigned char*>(host)[size / 2] != value) {
      std::fprintf(stderr, "%s: copies did not land\n", layouts[li].name.c_str());
      return 1;
    }
  }

  std::vector<result> results;
  for (std::size_t li = 0; li < layouts.size(); ++li) {
    auto gbps = [&](op o) { return bytes_moved[o] / (bench::median(ms[li][o]) * 1e6); };
    results.push_back({layouts[li].name, gbps(kernel), gbps(memcpy_whole), gbps(memcpy_64m),
                       gbps(h2d), gbps(d2h)});
  }

  // Where a gap comes from. For one large copy: how long the host takes to enqueue it (a copy
  // the driver splits per physical allocation costs host time per piece), its speed repeated
  // back to back ("warm"), and its speed right after a sweep over 4 GiB of other memory has
  // evicted the GPU's address translations and L2 ("cold").
  struct anatomy {
    std::string layout;
    double enqueue_us, warm, cold;
  };
  std::vector<anatomy> anatomies;
  void* scratch = nullptr;
  const std::size_t scratch_bytes = 4096 * MiB;
  BENCH_CHECK(cudaMalloc(&scratch, scratch_bytes));
  for (std::size_t li = 0; li < layouts.size(); ++li) {
    std::vector<double> enqueue, warm, cold;
    for (int i = 0; i < reps; ++i) {
      BENCH_CHECK(cudaMemsetAsync(scratch, i, scratch_bytes, stream));
      BENCH_CHECK(cudaStreamSynchronize(stream));
      cold.push_back(bench::time_ms(stream, 1, [&] { run(memcpy_whole, bufs[li]); })[0]);
      warm.push_back(bench::time_ms(stream, 1, [&] { run(memcpy_whole, bufs[li]); })[0]);
      BENCH_CHECK(cudaStreamSynchronize(stream));
      const auto a = std::chrono::steady_clock::now();
      run(memcpy_whole, bufs[li]);
      const auto b = std::chrono::steady_clock::now();
      BENCH_CHECK(cudaStreamSynchronize(stream));
      enqueue.push_back(std::chrono::duration<double, std::micro>(b - a).count());
    }
    anatomies.push_back({layouts[li].name, bench::median(enqueue),
                         bytes_moved[memcpy_whole] / (bench::median(warm) * 1e6),
                         bytes_moved[memcpy_whole] / (bench::median(cold) * 1e6)});
  }
  cudaFree(scratch);
  bufs.clear();

  const result& base = results.front();
  std::printf("%-30s %17s %17s %17s %17s %17s\n", "layout", "copy kernel", "memcpy D2D", "memcpy D2D 64MiB",
              "H2D pinned", "D2H pinned");
  std::printf("%-30s %17s %17s %17s %17s %17s\n", "", "GB/s  ratio", "GB/s  ratio", "GB/s  ratio",
              "GB/s  ratio", "GB/s  ratio");
  for (const result& r : results) {
    std::printf("%-30s %10.0f %6.3f %10.0f %6.3f %10.0f %6.3f %10.1f %6.3f %10.1f %6.3f\n", r.layout.c_str(),
                r.kernel, r.kernel / base.kernel, r.memcpy_whole, r.memcpy_whole / base.memcpy_whole,
                r.memcpy_64m, r.memcpy_64m / base.memcpy_64m, r.h2d, r.h2d / base.h2d, r.d2h,
                r.d2h / base.d2h);
  }

  std::printf("\nOne %zu MiB cudaMemcpy device-to-device, in detail:\n", size / MiB);
  std::printf("%-30s %14s %17s %17s\n", "layout", "enqueue (us)", "warm GB/s ratio", "cold GB/s ratio");
  for (const anatomy& a : anatomies) {
    std::printf("%-30s %14.1f %10.0f %6.3f %10.0f %6.3f\n", a.layout.c_str(), a.enqueue_us, a.warm,
                a.warm / anatomies.front().warm, a.cold, a.cold / anatomies.front().cold);
  }

  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"bandwidth\",\n  \"gpu\": \"" << bench::json_escape(gpu.name)
        << "\",\n  \"driver\": " << gpu.driver << ",\n  \"runtime\": " << gpu.runtime
        << ",\n  \"buffer_bytes\": " << size << ",\n  \"repetitions\": " << reps
        << ",\n  \"unit\": \"GB/s, median\",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < results.size(); ++i) {
      const result& r = results[i];
      out << "    {\"layout\": \"" << r.layout << "\", \"copy_kernel\": " << r.kernel
          << ", \"memcpy_d2d\": " << r.memcpy_whole << ", \"memcpy_d2d_64mib\": " << r.memcpy_64m
          << ", \"h2d_pinned\": " << r.h2d << ", \"d2h_pinned\": " << r.d2h << "}"
          << (i + 1 < results.size() ? ",\n" : "\n");
    }
    out << "  ],\n  \"memcpy_d2d_detail\": [\n";
    for (std::size_t i = 0; i < anatomies.size(); ++i) {
      const anatomy& a = anatomies[i];
      out << "    {\"layout\": \"" << a.layout << "\", \"enqueue_us\": " << a.enqueue_us
          << ", \"warm\": " << a.warm << ", \"cold\": " << a.cold << "}"
          << (i + 1 < anatomies.size() ? ",\n" : "\n");
    }
    out << "  ]\n}\n";
    std::printf("\nwrote %s\n", json.c_str());
  }
  cudaFreeHost(host);
  cudaStreamDestroy(stream);
  return 0;
}
