// The fake driver's virtual memory management: address reservations, physical allocations
// and their handles, mappings, access rights, and handles shared through file descriptors.

#include "fake_calls.hpp"
#include "fake_state.hpp"

#include <cuda.h>

#include <sys/eventfd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <mutex>

namespace [[gnu::visibility("hidden")]] fake_cuda {

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
  if (CUresult r = refuse_if_unsafe()) return r;
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
  if (CUresult r = refuse_if_unsafe()) return r;
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
  if (CUresult r = refuse_if_unsafe()) return r;
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
  if (maps_refused != 0 && maps_before_refusal != 0) {
    --maps_before_refusal;
  } else if (maps_refused != 0) {
    --maps_refused;
    return CUDA_ERROR_OUT_OF_MEMORY;
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
  ++set_access_calls;
  std::lock_guard lock(S().m);
  for (std::size_t i = 0; i < n; ++i) {
    if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && (d[i].location.id < 0 || d[i].location.id >= devices()))
      return CUDA_ERROR_INVALID_DEVICE;
  }
  CUresult covered = for_each_mapping(p, size, [](mapped&) {});
  if (covered != CUDA_SUCCESS) return covered;
  // A device given access to another device's memory must be its peer (the driver's check,
  // made only over memory that is mapped: hence the trap of granting on an empty pool).
  bool refused = false;
  (void)for_each_mapping(p, size, [&](mapped& m) {
    const CUmemLocation& where = S().physicals[m.handle].location;
    if (where.type != CU_MEM_LOCATION_TYPE_DEVICE) return;
    for (std::size_t i = 0; i < n; ++i) {
      if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && d[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
          d[i].location.id != where.id && !peers(d[i].location.id, where.id)) {
        refused = true;
      }
    }
  });
  if (refused) return CUDA_ERROR_INVALID_DEVICE;
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

}  // namespace fake_cuda
