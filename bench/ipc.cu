// Importing another process's allocations: streamalloc's imported_pool::import_pointer against
// the driver's cudaMemPoolImportPointer, in the same two processes, for blocks of 64 KiB and
// 16 MiB. The exporter (this process) allocates and exports N blocks from each pool; the
// importer (this binary again, `--importer ...`) imports them all, timing each call, then ends
// them (streamalloc: ipc_handle::release on a stream; driver: cudaFreeAsync).
//
//   bench_ipc [--json FILE]

#include <streamalloc/ipc.hpp>
#include <streamalloc/streamalloc.hpp>

#include "bench_common.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

extern char** environ;

namespace {

constexpr int blocks = 256;
constexpr std::size_t sizes[] = {std::size_t{64} << 10, std::size_t{16} << 20};

/// What the exporter writes for the importer, per size: streamalloc's descriptors, the driver's.
struct exported_set {
  streamalloc::ipc_descriptor ours[blocks];
  cudaMemPoolPtrExportData theirs[blocks];
};

double ns_per(bench::clk::time_point t, int n) { return bench::seconds_since(t) * 1e9 / n; }

int importer(const char* socket, const char* file, int driver_pool_fd, const char* json) {
  std::vector<exported_set> sets(std::size(sizes));
  {
    std::ifstream in(file, std::ios::binary);
    in.read(reinterpret_cast<char*>(sets.data()), static_cast<std::streamsize>(sets.size() * sizeof(exported_set)));
    if (!in) return 3;
  }
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  cudaMemPool_t theirs = nullptr;
  BENCH_CHECK(cudaMemPoolImportFromShareableHandle(&theirs, reinterpret_cast<void*>(static_cast<std::intptr_t>(driver_pool_fd)),
                                                   cudaMemHandleTypePosixFileDescriptor, 0));
  streamalloc::imported_pool ours(socket);
  streamalloc::stream s(0);
  bench::json_rows rows;
  std::printf("%-10s %22s %22s %8s %22s %22s\n", "block", "streamalloc import ns", "driver import ns", "ratio",
              "streamalloc release ns", "driver free ns");
  for (std::size_t k = 0; k < std::size(sizes); ++k) {
    std::vector<streamalloc::ipc_handle> handles(blocks);
    auto t = bench::clk::now();
    for (int i = 0; i < blocks; ++i) handles[i] = ours.import_pointer(sets[k].ours[i]);
    const double our_import = ns_per(t, blocks);
    t = bench::clk::now();
    for (auto& h : handles) h.release(s);
    const double our_release = ns_per(t, blocks);

    std::vector<void*> ptrs(blocks);
    t = bench::clk::now();
    for (int i = 0; i < blocks; ++i) BENCH_CHECK(cudaMemPoolImportPointer(&ptrs[i], theirs, &sets[k].theirs[i]));
    const double their_import = ns_per(t, blocks);
    t = bench::clk::now();
    for (void* p : ptrs) BENCH_CHECK(cudaFreeAsync(p, s.get()));
    const double their_free = ns_per(t, blocks);
    s.synchronize();

    std::printf("%-10zu %22.0f %22.0f %8.2f %22.0f %22.0f\n", sizes[k], our_import, their_import,
                our_import / their_import, our_release, their_free);
    rows.add("import_" + std::to_string(sizes[k]),
             "\"blocks\": " + std::to_string(blocks) + ", \"streamalloc_import_ns\": " + std::to_string(our_import) +
                 ", \"driver_import_ns\": " + std::to_string(their_import) +
                 ", \"streamalloc_release_ns\": " + std::to_string(our_release) +
                 ", \"driver_free_ns\": " + std::to_string(their_free));
  }
  if (json[0] != '\0') {
    const bench::gpu_info gpu = bench::describe_gpu();
    std::ofstream out(json);
    out << "{\n  \"bench\": \"ipc\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"rows\": [\n" << rows.str() << "\n  ]\n}\n";
    std::printf("wrote %s\n", json);
  }
  return 0;
}

int exporter(const char* self, const std::string& json) {
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  streamalloc::pool_properties props = bench::kept();
  props.handle_types = streamalloc::shareable_handle_type::posix_fd;
  streamalloc::pool ours(props);
  const std::string socket = "@streamalloc-bench-ipc-" + std::to_string(::getpid());
  streamalloc::export_pool(ours, socket);

  cudaMemPoolProps dp{};
  dp.allocType = cudaMemAllocationTypePinned;
  dp.location = {cudaMemLocationTypeDevice, 0};
  dp.handleTypes = cudaMemHandleTypePosixFileDescriptor;
  cudaMemPool_t theirs;
  BENCH_CHECK(cudaMemPoolCreate(&theirs, &dp));
  int fd = -1;
  BENCH_CHECK(cudaMemPoolExportToShareableHandle(&fd, theirs, cudaMemHandleTypePosixFileDescriptor, 0));
  ::fcntl(fd, F_SETFD, 0);  // inherited by the importer, at the same number

  streamalloc::stream s(0);
  std::vector<exported_set> sets(std::size(sizes));
  std::vector<void*> mine, driver;
  for (std::size_t k = 0; k < std::size(sizes); ++k) {
    for (int i = 0; i < blocks; ++i) {
      mine.push_back(ours.allocate(sizes[k], s));
      sets[k].ours[i] = streamalloc::export_pointer(ours, mine.back());
      void* p = nullptr;
      BENCH_CHECK(cudaMallocFromPoolAsync(&p, sizes[k], theirs, s.get()));
      driver.push_back(p);
      BENCH_CHECK(cudaMemPoolExportPointer(&sets[k].theirs[i], p));
    }
  }
  s.synchronize();
  char file[] = "/tmp/streamalloc-bench-ipc-XXXXXX";
  const int f = ::mkstemp(file);
  if (f < 0 || ::write(f, sets.data(), sets.size() * sizeof(exported_set)) !=
                   static_cast<ssize_t>(sets.size() * sizeof(exported_set))) {
    std::perror("bench_ipc: writing the descriptors");
    return 1;
  }
  ::close(f);

  std::string fd_arg = std::to_string(fd), json_arg = json, flag = "--importer", sock = socket, file_arg = file;
  std::vector<char*> args{const_cast<char*>(self), flag.data(), sock.data(), file_arg.data(), fd_arg.data(),
                          json_arg.data(), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, self, nullptr, nullptr, args.data(), environ) != 0) {
    std::perror("bench_ipc: posix_spawn");
    return 1;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::unlink(file);
  for (void* p : mine) ours.deallocate(p, s);
  for (void* p : driver) BENCH_CHECK(cudaFreeAsync(p, s.get()));
  s.synchronize();
  BENCH_CHECK(cudaMemPoolDestroy(theirs));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::strcmp(argv[1], "--importer") == 0) return importer(argv[2], argv[3], std::atoi(argv[4]), argv[5]);
  bench::require_gpu("bench_ipc");
  std::string json;
  if (argc == 3 && std::strcmp(argv[1], "--json") == 0) {
    json = argv[2];
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: bench_ipc [--json FILE]\n");
    return 2;
  }
  std::printf("importing %d blocks exported by another process (ns per call; ratio: streamalloc / driver)\n", blocks);
  return exporter(argv[0], json);
}
