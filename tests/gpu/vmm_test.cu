// The VMM layer on a real GPU: memory that kernels write and the host reads back, growth in
// place, memory returned to the device, export to a second process, errors with the driver's
// codes.

#include <streamalloc/vmm.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

extern char** environ;

using namespace streamalloc;
using namespace streamalloc_test;

namespace {
const auto gpu0 = memory_location::device(0);

std::size_t granularity() { return allocation_granularity(gpu0); }

void grant(const mapping& m) { set_access(m.address(), m.size(), {{gpu0, access_flags::read_write}}); }
}  // namespace

TEST_CASE("granularities are powers of two, the recommended a multiple of the minimum") {
  const std::size_t min = allocation_granularity(gpu0, granularity_kind::minimum);
  const std::size_t rec = allocation_granularity(gpu0, granularity_kind::recommended);
  MESSAGE("granularity: minimum " << min << ", recommended " << rec);
  CHECK(min > 0);
  CHECK((min & (min - 1)) == 0);
  CHECK(rec % min == 0);
}

TEST_CASE("reserve, create, map, grant: a kernel writes and the host reads it back") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t size = 32 * granularity();
  address_reservation va(size);
  physical_allocation mem(size, gpu0);
  mapping m(va, 0, mem);
  grant(m);
  CHECK(get_access(gpu0, m.address()) == access_flags::read_write);

  fill(m.data(), size, 11);
  SA_CUDA_REQUIRE(cudaGetLastError());
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());

  std::vector<std::uint32_t> host(size / 4);
  SA_CUDA_REQUIRE(cudaMemcpy(host.data(), m.data(), size, cudaMemcpyDeviceToHost));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < host.size(); ++i) bad += host[i] != pattern(i, 11);
  CHECK(bad == 0);
  CHECK(mismatches(m.data(), size, 11) == 0);
}

TEST_CASE("a mapped range grows in place: same pointer, old data intact") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t chunk = 8 * granularity();
  address_reservation va(4 * chunk);

  physical_allocation first(chunk, gpu0);
  mapping m1(va, 0, first);
  grant(m1);
  void* const base = m1.data();
  fill(base, chunk, 21);
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());

  // Grow: more physical memory right behind, access granted for the new part only.
  physical_allocation second(2 * chunk, gpu0);
  mapping m2(va, chunk, second);
  grant(m2);
  CHECK(m1.data() == base);
  CHECK(m2.address() == va.address() + chunk);

  // The old contents survived the growth...
  CHECK(mismatches(base, chunk, 21) == 0);
  // ...and one kernel now works across the whole grown range.
  fill(base, 3 * chunk, 22);
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(mismatches(base, 3 * chunk, 22) == 0);
  // Access over both mappings in one call works once they are contiguous.
  CHECK_NOTHROW(set_access(va.address(), 3 * chunk, {{gpu0, access_flags::read_write}}));
}

TEST_CASE("unmapping and releasing give the memory back to the device") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t size = 1024 * MiB;
  const std::size_t slack = 64 * MiB;  // other allocations of the driver move a little
  const std::size_t before = device_memory(0).free;
  {
    address_reservation va(size);
    mapping m;
    {
      physical_allocation mem(size, gpu0);
      CHECK(device_memory(0).free + size <= before + slack);
      m = mapping(va, 0, mem);
      grant(m);
      fill(m.data(), size, 31);
      SA_CUDA_REQUIRE(cudaDeviceSynchronize());
    }
    // The handle is released, but the mapping still holds the memory.
    CHECK(device_memory(0).free + size <= before + slack);
    CHECK(mismatches(m.data(), size, 31) == 0);
    m.unmap();
    const std::size_t after = device_memory(0).free;
    MESSAGE("free before " << before / MiB << " MiB, after unmap " << after / MiB << " MiB");
    CHECK(after + slack >= before);
  }
}

TEST_CASE("an access_grant gives access for its lifetime") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t size = granularity();
  address_reservation va(size);
  physical_allocation mem(size, gpu0);
  mapping m(va, 0, mem);
  {
    access_grant g(m.address(), size, {{gpu0, access_flags::read_write}});
    CHECK(get_access(gpu0, m.address()) == access_flags::read_write);
    fill(m.data(), size, 41);
    SA_CUDA_REQUIRE(cudaDeviceSynchronize());
    CHECK(mismatches(m.data(), size, 41) == 0);
  }
  CHECK(get_access(gpu0, m.address()) == access_flags::none);
}

// --- export to a second process ---------------------------------------------------------------

namespace {
// The child: imports the descriptor it inherited, checks what the parent wrote, writes its own.
int import_child(int argc, char** argv) {
  if (argc != 3) return 10;
  const int fd = std::atoi(argv[0]);
  const std::size_t size = std::strtoull(argv[1], nullptr, 10);
  const auto seed = static_cast<std::uint32_t>(std::strtoul(argv[2], nullptr, 10));
  try {
    if (cudaSetDevice(0) != cudaSuccess) return 11;
    physical_allocation mem = physical_allocation::import_from_fd(fd, size);
    ::close(fd);
    if (mem.location() != gpu0) return 12;
    address_reservation va(size);
    mapping m(va, 0, mem);
    grant(m);
    if (mismatches(m.data(), size, seed) != 0) return 13;
    fill(m.data(), size, seed + 1);
    if (cudaDeviceSynchronize() != cudaSuccess) return 14;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: %s\n", e.what());
    return 15;
  }
}
register_child import_child_registration("vmm_import", import_child);
}  // namespace

TEST_CASE("physical memory exported as a file descriptor is shared with a second process") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  REQUIRE(query_capabilities(0).posix_fd_handles);
  const std::size_t size = 4 * granularity();
  physical_allocation mem(size, gpu0, {.handle_types = shareable_handle_type::posix_fd});
  address_reservation va(size);
  mapping m(va, 0, mem);
  grant(m);
  fill(m.data(), size, 51);
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());

  unique_fd fd = mem.export_to_fd();
  REQUIRE(fd);
  // The child inherits the descriptor across exec (SCM_RIGHTS over a socket works the same).
  const int flags = ::fcntl(fd.get(), F_GETFD);
  REQUIRE(::fcntl(fd.get(), F_SETFD, flags & ~FD_CLOEXEC) == 0);

  std::string fd_arg = std::to_string(fd.get()), size_arg = std::to_string(size), seed_arg = "51";
  std::string child_flag = "--child", child_name = "vmm_import";
  std::vector<char*> args{const_cast<char*>(self_path), child_flag.data(), child_name.data(),
                          fd_arg.data(), size_arg.data(), seed_arg.data(), nullptr};
  pid_t pid = 0;
  REQUIRE(::posix_spawn(&pid, self_path, nullptr, nullptr, args.data(), environ) == 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // 13: the child did not see the parent's data
  // What the child wrote is in the parent's memory.
  CHECK(mismatches(m.data(), size, 52) == 0);
}

// --- errors ---------------------------------------------------------------------------------

TEST_CASE("mapping past the end of a reservation is std::invalid_argument, before the driver") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t g = granularity();
  address_reservation va(4 * g);
  physical_allocation mem(2 * g, gpu0);
  CHECK_THROWS_WITH_AS(mapping(va, 3 * g, mem), doctest::Contains("leaves the reservation"), std::invalid_argument);
  CHECK_THROWS_AS(mapping(va, std::size_t{1} << 62, mem), std::invalid_argument);  // offset overflow
  // Nothing was mapped: the whole reservation is still free to map.
  mapping ok(va, 2 * g, mem);
  CHECK(ok.address() == va.address() + 2 * g);
  physical_allocation rest(2 * g, gpu0);
  mapping also_ok(va, 0, rest);
}

TEST_CASE("mapping over an existing mapping is CUDA_ERROR_INVALID_VALUE") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t g = granularity();
  address_reservation va(2 * g);
  physical_allocation a(g, gpu0), b(g, gpu0);
  mapping first(va, 0, a);
  try {
    mapping second(va, 0, b);
    FAIL("a second mapping at the same address should have thrown");
  } catch (const cuda_error& e) {
    CHECK(e.code() == CUDA_ERROR_INVALID_VALUE);
    CHECK(e.call() == "cuMemMap");
  }
}

TEST_CASE("invalid handles: a bad descriptor is the driver's error; an empty owner is ours") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t g = granularity();
  // A descriptor that is open but not an exported allocation: the driver's error.
  unique_fd not_cuda(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  REQUIRE(not_cuda);
  try {
    (void)physical_allocation::import_from_fd(not_cuda.get(), g);
    FAIL("importing /dev/null should have thrown");
  } catch (const cuda_error& e) {
    MESSAGE("import of /dev/null: " << std::string(e.what()));
    CHECK(e.call() == "cuMemImportFromShareableHandle");
    CHECK(e.code() == CUDA_ERROR_UNKNOWN);  // what driver 580 answers; the message explains
  }
  // One that is not open at all is stopped before the driver.
  CHECK_THROWS_AS((void)physical_allocation::import_from_fd(1000, g), std::invalid_argument);
  // A moved-from allocation has no handle; the driver would crash on a stale one, so the
  // mapping refuses it before calling the driver.
  address_reservation va(g);
  physical_allocation mem(g, gpu0);
  physical_allocation taken = std::move(mem);
  CHECK_THROWS_AS(mapping(va, 0, mem), std::invalid_argument);
  CHECK_THROWS_AS(mapping(va.address(), mem), std::invalid_argument);
  mapping ok(va, 0, taken);
  CHECK(ok.size() == g);
}

TEST_CASE("zero and absurd sizes fail with clear errors and leak nothing") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t before = device_memory(0).free;
  CHECK_THROWS_AS(physical_allocation(0, gpu0), std::invalid_argument);
  CHECK_THROWS_AS(address_reservation(0), std::invalid_argument);
  CHECK_THROWS_AS(physical_allocation(granularity() + 1, gpu0), std::invalid_argument);
  const std::size_t absurd = std::size_t{1} << 50;  // 1 PiB, a multiple of any granularity
  try {
    physical_allocation huge(absurd, gpu0);
    FAIL("1 PiB of device memory should not exist");
  } catch (const cuda_error& e) {
    MESSAGE("1 PiB: " << std::string(e.what()));
    CHECK(e.code() == CUDA_ERROR_OUT_OF_MEMORY);
  }
  CHECK_THROWS_AS(address_reservation(std::size_t{1} << 62), cuda_error);
  CHECK(device_memory(0).free + 64 * MiB >= before);
}

TEST_CASE("host NUMA memory: the host writes, a kernel reads and updates, the host sees it") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const auto caps = query_capabilities(0);
  const auto node = memory_location::host_numa(caps.host_numa_id < 0 ? 0 : caps.host_numa_id);
  if (!caps.host_numa_memory) {
    // Not on this machine: the failure must say so, as not_supported.
    CHECK_THROWS_AS(physical_allocation(granularity(), node), not_supported);
    MESSAGE("host NUMA VMM not supported here; checked the not_supported error instead");
    return;
  }
  const std::size_t g = allocation_granularity(node);
  address_reservation va(g);
  physical_allocation mem(g, node);
  CHECK(mem.location() == node);
  mapping m(va, 0, mem);
  set_access(m.address(), g, {{gpu0, access_flags::read_write}, {node, access_flags::read_write}});
  auto* words = static_cast<std::uint32_t*>(m.data());
  const std::size_t n = g / 4;
  for (std::size_t i = 0; i < n; ++i) words[i] = pattern(i, 61);
  CHECK(mismatches(words, g, 61) == 0);  // the GPU reads what the host wrote
  increment_kernel<<<256, 256>>>(words, n);
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += words[i] != pattern(i, 61) + 1;
  CHECK(bad == 0);  // the host reads what the GPU wrote
}
