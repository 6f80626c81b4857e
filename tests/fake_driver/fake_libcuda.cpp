// A fake CUDA driver for streamalloc's CPU tests: a shared library that exports
// cuGetProcAddress_v2 and models the driver calls streamalloc makes, with the bookkeeping the
// real driver keeps (reservations, physical handles, mappings, access), so tests on machines
// without a GPU can check what streamalloc asks of the driver: that each object is released
// exactly once, that moved-from objects release nothing, that lookups happen once.
//
// It is a model, not the driver: the GPU tests check the real one. Environment knobs:
//   FAKE_CUDA_DRIVER_VERSION  reported version (default 13000)
//   FAKE_CUDA_INIT_RESULT     what cuInit returns (default 0)
//   FAKE_CUDA_DEVICES         device count (default 1)
//   FAKE_CUDA_NO_VMM          1: devices report no VMM support, cuMemCreate fails
//   FAKE_CUDA_NO_POSIX_FD     1: devices cannot export POSIX file descriptors
//   FAKE_CUDA_MISSING         a symbol cuGetProcAddress reports as not found
//   FAKE_CUDA_DEVICE_MEMORY   bytes of memory per device (default 8 GiB)
//   FAKE_CUDA_ADDRESS_SPACE   bytes of virtual addresses the process may reserve (default 64 TiB)

#include <cuda.h>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr std::size_t granularity = 2u << 20;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

struct physical {
  std::size_t size = 0;
  CUmemLocation location{};
  unsigned handle_types = 0;
  int handles = 0;   // open handles (create/import/retain) not yet released
  int mappings = 0;  // mapped ranges using it
};

struct mapped {
  std::size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  unsigned long long access_flags[8] = {};  // per device
  unsigned long long host_access = 0;
};

struct state {
  std::mutex m;
  std::map<CUdeviceptr, std::size_t> reservations;
  std::map<CUmemGenericAllocationHandle, std::uint64_t> handles;  // handle -> physical id
  std::map<std::uint64_t, physical> physicals;
  std::map<CUdeviceptr, mapped> mappings;
  std::map<int, std::uint64_t> exported_fds;
  std::map<std::string, int> lookups;
  CUdeviceptr next_address = 0x7f0000000000ULL;
  CUmemGenericAllocationHandle next_handle = 0x1000;
  std::uint64_t next_physical = 1;
  std::size_t used[8] = {};
  bool initialized = false;
};

state& S() {
  static state s;
  return s;
}

// The library is dlopened; its thread-locals use the static TLS block (initial-exec) rather than
// __tls_get_addr, whose dynamic blocks GCC 12's LeakSanitizer misreads at exit on glibc 2.36
// ("Tracer caught signal 11" after every test passed).
[[gnu::tls_model("initial-exec")]] thread_local CUcontext current_context = nullptr;
CUcontext primary_contexts[8] = {};

int devices() { return env_int("FAKE_CUDA_DEVICES", 1); }
std::size_t device_memory() {
  const char* v = std::getenv("FAKE_CUDA_DEVICE_MEMORY");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : (8ULL << 30);
}

CUresult need_init() { return S().initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

// --- device and context -------------------------------------------------------------------

CUresult fake_cuInit(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = static_cast<CUresult>(env_int("FAKE_CUDA_INIT_RESULT", 0));
  if (r == CUDA_SUCCESS) S().initialized = true;
  return r;
}
CUresult fake_cuDriverGetVersion(int* v) {
  if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *v = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetCount(int* n) {
  if (CUresult r = need_init()) return r;
  *n = devices();
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGet(CUdevice* d, int ordinal) {
  if (CUresult r = need_init()) return r;
  if (ordinal < 0 || ordinal >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetName(char* name, int len, CUdevice d) {
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, static_cast<std::size_t>(len), "Fake GPU %d", d);
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  if (CUresult r = need_init()) return r;
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = env_int("FAKE_CUDA_NO_VMM", 0) ? 0 : 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *v = env_int("FAKE_CUDA_NO_POSIX_FD", 0) ? 0 : 1; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = 1; break;
    default: *v = 0; break;
  }
  return CUDA_SUCCESS;
}
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  if (CUresult r = need_init()) return r;
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *c = reinterpret_cast<CUcontext>(&primary_contexts[d]);
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxGetCurrent(CUcontext* c) {
  if (CUresult r = need_init()) return r;
  *c = current_context;
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxSetCurrent(CUcontext c) {
  if (CUresult r = need_init()) return r;
  current_context = c;
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxGetDevice(CUdevice* d) {
  if (current_context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *d = static_cast<CUdevice>(reinterpret_cast<CUcontext*>(current_context) - primary_contexts);
  return CUDA_SUCCESS;
}
CUresult need_context() {
  if (CUresult r = need_init()) return r;
  return current_context != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult fake_cuGetErrorName(CUresult r, const char** s) {
  switch (r) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    default: *s = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
}
CUresult fake_cuGetErrorString(CUresult r, const char** s) {
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; return CUDA_SUCCESS;
    default: *s = "fake driver error"; return CUDA_SUCCESS;
  }
}

// --- memory -------------------------------------------------------------------------------

std::size_t& used_on(const CUmemLocation& l) {
  return S().used[l.type == CU_MEM_LOCATION_TYPE_DEVICE ? l.id : 7];
}

CUresult fake_cuMemGetInfo(std::size_t* free, std::size_t* total) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  CUdevice d = 0;
  fake_cuCtxGetDevice(&d);
  *total = device_memory();
  *free = *total - S().used[d];
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetAllocationGranularity(std::size_t* g, const CUmemAllocationProp* p,
                                            CUmemAllocationGranularity_flags) {
  if (CUresult r = need_context()) return r;
  if (p == nullptr || g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && (p->location.id < 0 || p->location.id >= devices()))
    return CUDA_ERROR_INVALID_DEVICE;
  *g = granularity;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr* p, std::size_t size, std::size_t alignment,
                                  CUdeviceptr hint, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  if (size == 0 || size % 4096 != 0 || flags != 0 || (alignment & (alignment - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  const char* space = std::getenv("FAKE_CUDA_ADDRESS_SPACE");
  const std::size_t limit = space != nullptr && *space != '\0' ? std::strtoull(space, nullptr, 10) : (1ULL << 46);
  std::lock_guard lock(S().m);
  std::size_t reserved = 0;
  for (const auto& [at, bytes] : S().reservations) reserved += bytes;
  if (size > limit - std::min(limit, reserved)) return CUDA_ERROR_OUT_OF_MEMORY;
  std::size_t align = alignment > granularity ? alignment : granularity;
  // The hint is honoured when the range there is free, as the driver usually does.
  if (hint != 0 && hint % align == 0) {
    auto next = S().reservations.lower_bound(hint);
    const bool free_after = next == S().reservations.end() || next->first >= hint + size;
    const bool free_before = next == S().reservations.begin() || std::prev(next)->first + std::prev(next)->second <= hint;
    if (free_after && free_before) {
      S().reservations[hint] = size;
      if (hint + size + granularity > S().next_address) S().next_address = hint + size + granularity;
      *p = hint;
      return CUDA_SUCCESS;
    }
  }
  CUdeviceptr a = (S().next_address + align - 1) / align * align;
  S().next_address = a + size + granularity;  // a guard gap, so ranges never touch
  S().reservations[a] = size;
  *p = a;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressFree(CUdeviceptr p, std::size_t size) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  auto it = S().reservations.find(p);
  if (it == S().reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = S().mappings.lower_bound(p);
  if (m != S().mappings.end() && m->first < p + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  S().reservations.erase(it);
  return CUDA_SUCCESS;
}

void maybe_free(std::uint64_t id) {
  auto it = S().physicals.find(id);
  if (it != S().physicals.end() && it->second.handles == 0 && it->second.mappings == 0) {
    used_on(it->second.location) -= it->second.size;
    S().physicals.erase(it);
  }
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* h, std::size_t size,
                          const CUmemAllocationProp* p, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  if (p == nullptr || flags != 0 || size == 0 || size % granularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (env_int("FAKE_CUDA_NO_VMM", 0)) return CUDA_ERROR_NOT_SUPPORTED;
  if (p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && (p->location.id < 0 || p->location.id >= devices()))
    return CUDA_ERROR_INVALID_DEVICE;
  if ((p->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) && env_int("FAKE_CUDA_NO_POSIX_FD", 0))
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  if (used_on(p->location) + size > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
  used_on(p->location) += size;
  std::uint64_t id = S().next_physical++;
  S().physicals[id] = physical{size, p->location, static_cast<unsigned>(p->requestedHandleTypes), 1, 0};
  *h = S().next_handle++;
  S().handles[*h] = id;
  return CUDA_SUCCESS;
}

// Unmapping and releasing need no current context: the real driver (580, H100) accepts both
// from a thread that never made one, and the pool gives memory back from any thread.
CUresult fake_cuMemRelease(CUmemGenericAllocationHandle h) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t id = it->second;
  S().handles.erase(it);
  S().physicals[id].handles--;
  maybe_free(id);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemMap(CUdeviceptr p, std::size_t size, std::size_t offset,
                       CUmemGenericAllocationHandle h, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  if (flags != 0 || size == 0 || p % granularity != 0 || size % granularity != 0 || offset % granularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  auto hit = S().handles.find(h);
  if (hit == S().handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  physical& ph = S().physicals[hit->second];
  if (offset > ph.size || size > ph.size - offset) return CUDA_ERROR_INVALID_VALUE;
  auto r = S().reservations.upper_bound(p);
  if (r == S().reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
  --r;
  if (p < r->first || p + size > r->first + r->second) return CUDA_ERROR_INVALID_VALUE;
  auto next = S().mappings.lower_bound(p);
  if (next != S().mappings.end() && next->first < p + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != S().mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > p) return CUDA_ERROR_INVALID_VALUE;
  }
  S().mappings[p] = mapped{size, h};
  ph.mappings++;
  // the mapping refers to the physical memory, not the handle value
  S().mappings[p].handle = static_cast<CUmemGenericAllocationHandle>(hit->second);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemUnmap(CUdeviceptr p, std::size_t size) {  // no context needed (see cuMemRelease)
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().mappings.find(p);
  if (it == S().mappings.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t id = it->second.handle;
  S().mappings.erase(it);
  S().physicals[id].mappings--;
  maybe_free(id);
  return CUDA_SUCCESS;
}

// Every mapping inside [p, p + size), which must be covered without gaps; null if not.
template <class F>
CUresult for_each_mapping(CUdeviceptr p, std::size_t size, F f) {
  CUdeviceptr at = p;
  auto it = S().mappings.upper_bound(p);
  if (it == S().mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (it->first + it->second.size <= p) return CUDA_ERROR_INVALID_VALUE;
  while (at < p + size) {
    if (it == S().mappings.end() || it->first > at) return CUDA_ERROR_INVALID_VALUE;
    f(it->second);
    at = it->first + it->second.size;
    ++it;
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemSetAccess(CUdeviceptr p, std::size_t size, const CUmemAccessDesc* d, std::size_t n) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  for (std::size_t i = 0; i < n; ++i) {
    if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && (d[i].location.id < 0 || d[i].location.id >= devices()))
      return CUDA_ERROR_INVALID_DEVICE;
  }
  CUresult covered = for_each_mapping(p, size, [](mapped&) {});
  if (covered != CUDA_SUCCESS) return covered;
  return for_each_mapping(p, size, [&](mapped& m) {
    for (std::size_t i = 0; i < n; ++i) {
      if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        m.access_flags[d[i].location.id] = d[i].flags;
      else
        m.host_access = d[i].flags;
    }
  });
}

CUresult fake_cuMemGetAccess(unsigned long long* flags, const CUmemLocation* l, CUdeviceptr p) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  return for_each_mapping(p, 1, [&](mapped& m) {
    *flags = l->type == CU_MEM_LOCATION_TYPE_DEVICE ? m.access_flags[l->id] : m.host_access;
  });
}

CUresult fake_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* p, CUmemGenericAllocationHandle h) {
  std::lock_guard lock(S().m);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  const physical& ph = S().physicals[it->second];
  *p = CUmemAllocationProp{};
  p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->location = ph.location;
  p->requestedHandleTypes = static_cast<CUmemAllocationHandleType>(ph.handle_types);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                           CUmemAllocationHandleType type, unsigned long long) {
  std::lock_guard lock(S().m);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      !(S().physicals[it->second].handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return CUDA_ERROR_INVALID_VALUE;
  int fd = ::eventfd(0, EFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  S().exported_fds[fd] = it->second;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle,
                                             CUmemAllocationHandleType type) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle));
  auto it = S().exported_fds.find(fd);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || it == S().exported_fds.end() ||
      S().physicals.count(it->second) == 0)
    return CUDA_ERROR_INVALID_VALUE;
  S().physicals[it->second].handles++;
  *h = S().next_handle++;
  S().handles[*h] = it->second;
  return CUDA_SUCCESS;
}

// --- streams, events, context stack: the device runs everything at once -------------------

[[gnu::tls_model("initial-exec")]] thread_local std::vector<CUcontext> context_stack;

CUresult fake_cuCtxPushCurrent(CUcontext c) {
  if (CUresult r = need_init()) return r;
  context_stack.push_back(current_context);
  current_context = c;
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxPopCurrent(CUcontext* c) {
  if (CUresult r = need_init()) return r;
  if (c != nullptr) *c = current_context;
  if (context_stack.empty()) {
    current_context = nullptr;
  } else {
    current_context = context_stack.back();
    context_stack.pop_back();
  }
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxSynchronize() { return need_context(); }

struct fake_stream {
  unsigned long long id;
  CUcontext ctx;
};
std::atomic<unsigned long long> next_stream_id{100};
std::atomic<int> live_streams{0};
std::atomic<int> live_events{0};

CUresult fake_cuStreamCreateWithPriority(CUstream* s, unsigned, int) {
  if (CUresult r = need_context()) return r;
  *s = reinterpret_cast<CUstream>(new fake_stream{next_stream_id++, current_context});
  ++live_streams;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamDestroy(CUstream s) {
  if (s == nullptr || reinterpret_cast<std::uintptr_t>(s) <= 2) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<fake_stream*>(s);
  --live_streams;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamGetId(CUstream s, unsigned long long* id) {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (v <= 2) {  // the default streams of the current context
    if (CUresult r = need_context()) return r;
    *id = 1 + v;
    return CUDA_SUCCESS;
  }
  *id = reinterpret_cast<fake_stream*>(s)->id;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamGetCtx(CUstream s, CUcontext* c) {
  if (reinterpret_cast<std::uintptr_t>(s) <= 2) {
    if (CUresult r = need_context()) return r;
    *c = current_context;
    return CUDA_SUCCESS;
  }
  *c = reinterpret_cast<fake_stream*>(s)->ctx;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamSynchronize(CUstream) { return need_init(); }
CUresult fake_cuStreamQuery(CUstream) { return need_init(); }
CUresult fake_cuStreamWaitEvent(CUstream, CUevent e, unsigned) { return e == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS; }
CUresult fake_cuEventCreate(CUevent* e, unsigned) {
  if (CUresult r = need_context()) return r;
  *e = reinterpret_cast<CUevent>(new int(0));
  ++live_events;
  return CUDA_SUCCESS;
}
CUresult fake_cuEventDestroy(CUevent e) {
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<int*>(e);
  --live_events;
  return CUDA_SUCCESS;
}
CUresult fake_cuEventRecord(CUevent e, CUstream) { return e == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS; }
CUresult fake_cuEventQuery(CUevent e) { return e == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS; }
CUresult fake_cuEventSynchronize(CUevent e) { return e == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS; }

// The real driver hands out a newer ABI under the same name when asked for a new enough
// version (cuStreamGetCtx_v2 from 12.5, cuCtxGetDevice_v2 and cuCtxSynchronize_v2 from 13.0).
// These stand-ins for the newer ABIs fail loudly, so a loader asking for the wrong version is
// caught on machines without a GPU.
CUresult fake_newer_abi() { return CUDA_ERROR_NOT_SUPPORTED; }
struct versioned {
  const char* name;
  int since;
};
constexpr versioned newer_abis[] = {{"cuStreamGetCtx", 12050}, {"cuCtxGetDevice", 13000}, {"cuCtxSynchronize", 13000}};

struct symbol {
  const char* name;
  void* fn;
};

#define FAKE(name) symbol{#name, reinterpret_cast<void*>(&fake_##name)}
const symbol symbols[] = {
    FAKE(cuInit), FAKE(cuDriverGetVersion), FAKE(cuDeviceGetCount), FAKE(cuDeviceGet),
    FAKE(cuDeviceGetName), FAKE(cuDeviceGetAttribute), FAKE(cuDevicePrimaryCtxRetain),
    FAKE(cuCtxGetCurrent), FAKE(cuCtxSetCurrent), FAKE(cuCtxGetDevice), FAKE(cuGetErrorName),
    FAKE(cuGetErrorString), FAKE(cuMemGetInfo), FAKE(cuMemGetAllocationGranularity),
    FAKE(cuMemAddressReserve), FAKE(cuMemAddressFree), FAKE(cuMemCreate), FAKE(cuMemRelease),
    FAKE(cuMemMap), FAKE(cuMemUnmap), FAKE(cuMemSetAccess), FAKE(cuMemGetAccess),
    FAKE(cuMemGetAllocationPropertiesFromHandle), FAKE(cuMemExportToShareableHandle),
    FAKE(cuMemImportFromShareableHandle), FAKE(cuCtxPushCurrent), FAKE(cuCtxPopCurrent),
    FAKE(cuCtxSynchronize), FAKE(cuStreamCreateWithPriority), FAKE(cuStreamDestroy),
    FAKE(cuStreamGetId), FAKE(cuStreamGetCtx), FAKE(cuStreamSynchronize), FAKE(cuStreamQuery),
    FAKE(cuStreamWaitEvent), FAKE(cuEventCreate), FAKE(cuEventDestroy), FAKE(cuEventRecord),
    FAKE(cuEventQuery), FAKE(cuEventSynchronize),
};
#undef FAKE

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* name, void** fn, int version, cuuint64_t, CUdriverProcAddressQueryResult* status) {
  {
    std::lock_guard lock(S().m);
    S().lookups[name]++;
  }
  const char* missing = std::getenv("FAKE_CUDA_MISSING");
  for (const versioned& v : newer_abis) {
    if (std::strcmp(v.name, name) == 0 && version >= v.since) {
      *fn = reinterpret_cast<void*>(&fake_newer_abi);
      if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  }
  for (const symbol& s : symbols) {
    if (std::strcmp(s.name, name) == 0 && !(missing != nullptr && std::strcmp(missing, name) == 0)) {
      *fn = s.fn;
      if (status) *status = version >= 12000 ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_SUCCESS;
    }
  }
  *fn = nullptr;
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}

/// For the tests: how many objects the fake driver holds now.
struct fake_cuda_counts {
  int reservations;
  int handles;
  int physicals;
  int mappings;
  std::size_t used_device0;
  int streams;
  int events;
};

__attribute__((visibility("default"))) fake_cuda_counts fake_cuda_live() {
  std::lock_guard lock(S().m);
  return {static_cast<int>(S().reservations.size()), static_cast<int>(S().handles.size()),
          static_cast<int>(S().physicals.size()), static_cast<int>(S().mappings.size()),
          S().used[0], live_streams.load(), live_events.load()};
}

/// For the tests: how many times cuGetProcAddress was asked for `name`.
__attribute__((visibility("default"))) int fake_cuda_lookups(const char* name) {
  std::lock_guard lock(S().m);
  auto it = S().lookups.find(name);
  return it == S().lookups.end() ? 0 : it->second;
}
}
