#pragma once

// Finds the CUDA driver at run time. Nothing here links against libcuda: the library is opened
// with dlopen on first use and every entry point is looked up through cuGetProcAddress, so a
// program using streamalloc starts on a machine with no driver and fails only when it asks for
// the GPU, with an exception that says why (see error.hpp).

#include <streamalloc/detail/config.hpp>

#include <dlfcn.h>

#include <cstdlib>
#include <string>

namespace streamalloc::detail {

/// The oldest driver streamalloc runs on: cuGetProcAddress_v2 (which reports why a symbol is
/// missing) and the VMM calls used here exist from the 12.0 driver on.
inline constexpr int minimum_driver_version = 12000;

/// Environment variable naming the driver library to load instead of libcuda.so.1. Meant for
/// unusual installations and for streamalloc's own tests, which load a fake driver through it.
inline constexpr const char* driver_library_variable = "STREAMALLOC_LIBCUDA";

using get_proc_address_fn = CUresult (*)(const char*, void**, int, cuuint64_t,
                                         CUdriverProcAddressQueryResult*);

/// What loading the driver found. Built once per process, then read-only.
struct driver_state {
  get_proc_address_fn get_proc = nullptr;  ///< null when the library could not be used at all
  int version = 0;                         ///< cuDriverGetVersion, 0 when unknown
  CUresult status = CUDA_SUCCESS;          ///< CUDA_SUCCESS when the driver is usable
  std::string problem;                     ///< why not, for error messages
};

// Driver symbols come in a legacy and a per-thread-default-stream flavour; pick the one matching
// how this translation unit treats stream 0, as cuda.h's own inline wrapper does.
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
inline constexpr cuuint64_t proc_address_flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
#else
inline constexpr cuuint64_t proc_address_flags = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
#endif

inline driver_state load_driver() noexcept {
  driver_state s;
  try {
    const char* override_path = std::getenv(driver_library_variable);
    const char* path = (override_path != nullptr && *override_path != '\0') ? override_path
                                                                             : "libcuda.so.1";
    // The handle is never closed: driver objects may be released from static destructors of
    // the program, after any destructor of ours could have run.
    void* library = ::dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = ::dlerror();
      s.status = CUDA_ERROR_NO_DEVICE;
      s.problem = std::string("the CUDA driver library ") + path + " could not be loaded (" +
                  (why != nullptr ? why : "unknown reason") +
                  "); is an NVIDIA driver installed on this machine?";
      return s;
    }
    s.get_proc = reinterpret_cast<get_proc_address_fn>(::dlsym(library, "cuGetProcAddress_v2"));
    if (s.get_proc == nullptr) {
      s.status = CUDA_ERROR_NOT_SUPPORTED;
      s.problem = std::string("the CUDA driver ") + path +
                  " is too old: it has no cuGetProcAddress_v2; streamalloc needs a driver for "
                  "CUDA 12.0 or newer";
      return s;
    }
    CUresult lookup_status = CUDA_SUCCESS;
    auto lookup = [&](const char* name) noexcept -> void* {
      void* fn = nullptr;
      CUdriverProcAddressQueryResult found{};
      lookup_status = s.get_proc(name, &fn, 12000, proc_address_flags, &found);  // one ABI each
      return lookup_status == CUDA_SUCCESS && found == CU_GET_PROC_ADDRESS_SUCCESS ? fn : nullptr;
    };
    auto get_version = reinterpret_cast<CUresult (*)(int*)>(lookup("cuDriverGetVersion"));
    if (lookup_status == CUDA_ERROR_STUB_LIBRARY) {
      s.status = CUDA_ERROR_NO_DEVICE;
      s.problem = std::string(path) +
                  " is the CUDA toolkit's stub library, not a driver; no GPU driver is installed "
                  "on this machine (or the stub comes first on the library path)";
      s.get_proc = nullptr;
      return s;
    }
    auto init = reinterpret_cast<CUresult (*)(unsigned)>(lookup("cuInit"));
    if (get_version == nullptr || init == nullptr || get_version(&s.version) != CUDA_SUCCESS) {
      s.status = CUDA_ERROR_NOT_SUPPORTED;
      s.problem = std::string("the CUDA driver ") + path + " does not answer cuDriverGetVersion";
      return s;
    }
    if (s.version < minimum_driver_version) {
      s.status = CUDA_ERROR_NOT_SUPPORTED;
      s.problem = "the CUDA driver is too old: it supports CUDA " +
                  std::to_string(s.version / 1000) + "." + std::to_string(s.version % 1000 / 10) +
                  "; streamalloc needs a driver for CUDA 12.0 or newer";
      return s;
    }
    if (CUresult r = init(0); r != CUDA_SUCCESS) {
      s.status = r;
      s.problem = r == CUDA_ERROR_NO_DEVICE
                      ? "the CUDA driver is installed but finds no CUDA device (cuInit: "
                        "CUDA_ERROR_NO_DEVICE)"
                      : "cuInit failed with CUresult " + std::to_string(static_cast<int>(r));
      return s;
    }
  } catch (...) {  // std::bad_alloc while building a message: report it without the text
    s.status = CUDA_ERROR_OUT_OF_MEMORY;
  }
  return s;
}

/// The process-wide driver state. The first call loads the driver; C++ guarantees that
/// concurrent first calls wait for one load.
inline const driver_state& driver() noexcept {
  static const driver_state state = load_driver();
  return state;
}

/// Looks up one driver symbol in the ABI of CUDA `version`; `status` says why when it returns
/// null. The version matters: the driver answers with the newest ABI up to it, and some
/// functions changed signature under the same name (cuStreamGetCtx became three-argument in
/// 12.5, cuCtxGetDevice and cuCtxSynchronize in 13.0), so asking with the headers' CUDA_VERSION
/// would hand back a pointer of another signature than the declaration called through.
inline void* find_driver_symbol(const char* name, int version, CUresult& status) noexcept {
  const driver_state& d = driver();
  if (d.get_proc == nullptr) {
    status = d.status;
    return nullptr;
  }
  void* fn = nullptr;
  CUdriverProcAddressQueryResult found{};
  CUresult r = d.get_proc(name, &fn, version, proc_address_flags, &found);
  if (r == CUDA_SUCCESS && found == CU_GET_PROC_ADDRESS_SUCCESS && fn != nullptr) {
    status = CUDA_SUCCESS;
    return fn;
  }
  // An unusable driver explains more than "symbol not found" would.
  status = d.status != CUDA_SUCCESS ? d.status
           : (r == CUDA_SUCCESS && found == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
               ? CUDA_ERROR_NOT_SUPPORTED
               : CUDA_ERROR_NOT_FOUND;
  return nullptr;
}

/// One cached pointer per driver function. `Entry` names the function (`Entry::name`), its
/// pointer type (`Entry::pointer`) and the CUDA version whose ABI to ask for
/// (`Entry::version`); the lookup runs once, thread-safe, on first use.
template <class Entry>
typename Entry::pointer driver_entry(CUresult& status) noexcept {
  struct slot {
    typename Entry::pointer fn;
    CUresult status;
  };
  static const slot cached = [] {
    CUresult st = CUDA_SUCCESS;
    void* fn = find_driver_symbol(Entry::name, Entry::version, st);
    return slot{reinterpret_cast<typename Entry::pointer>(fn), st};
  }();
  status = cached.status;
  return cached.fn;
}

}  // namespace streamalloc::detail
