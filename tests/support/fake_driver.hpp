#pragma once

// Reads the fake driver's counters (tests/fake_driver/, entry points in fake_libcuda.cpp) from a test that runs
// with STREAMALLOC_LIBCUDA pointing at it.

#include <streamalloc/detail/driver/driver_loader.hpp>
#include <streamalloc/detail/pool/graph_reaper.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "../fake_driver/fake_stream_calls.hpp"

#include <dlfcn.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

namespace streamalloc_test {

// The tests against the fake driver are compiled as one translation unit (tests/CMakeLists.txt):
// what several of them use is defined here once, and a name at file scope, unnamed namespace or
// not, must not be used by two of them.
inline constexpr std::size_t MiB = std::size_t{1} << 20;

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The message of what `f` throws; empty if it throws nothing.
template <class F>
std::string message_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

/// The driver's handle of `s`, for calling the driver (or the fake's hooks) directly.
inline CUstream handle(const streamalloc::stream& s) { return reinterpret_cast<CUstream>(s.get()); }

struct fake_counts {
  int reservations;
  int handles;
  int physicals;
  int mappings;
  std::size_t used_device0;
  int streams;
  int events;
};

inline void* fake_library() {
  (void)streamalloc::detail::driver();  // loads it, if nothing has yet
  const char* path = std::getenv("STREAMALLOC_LIBCUDA");
  REQUIRE(path != nullptr);
  void* lib = ::dlopen(path, RTLD_NOW | RTLD_NOLOAD);  // the copy streamalloc loaded
  REQUIRE(lib != nullptr);
  return lib;
}

inline fake_counts fake_live() {
  void* sym = ::dlsym(fake_library(), "fake_cuda_live");
  REQUIRE(sym != nullptr);
  return reinterpret_cast<fake_counts (*)()>(sym)();
}

inline int fake_lookups(const char* name) {
  void* sym = ::dlsym(fake_library(), "fake_cuda_lookups");
  REQUIRE(sym != nullptr);
  return reinterpret_cast<int (*)(const char*)>(sym)(name);
}

/// The fake's stream-capture and graph bookkeeping (fake_cuda_graph_counts there, field for
/// field). Alive counts are objects that exist now; the others count since the fake was loaded,
/// so tests compare differences.
struct fake_graph_counts {
  int active_captures;  // begun and not yet ended, invalidated ones included
  int graphs;           // graphs alive, those still being captured included
  int execs;            // executable graphs alive
  int user_objects;     // user objects with references left
  long long destructors_run;               // user-object destructors run on the driver thread
  long long launches;                      // cuGraphLaunch calls that ran (not captured ones)
  long long uploads;                       // cuGraphUpload calls likewise
  long long captured_event_records;        // cuEventRecord calls captured into a graph
  long long unsafe_call_refusals;          // calls refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
  long long destructor_thread_violations;  // driver calls made from a user-object destructor
};

template <class Fn>
Fn fake_hook(const char* name) {
  void* sym = ::dlsym(fake_library(), name);
  REQUIRE(sym != nullptr);
  return reinterpret_cast<Fn>(sym);
}

inline fake_graph_counts fake_graphs() { return fake_hook<fake_graph_counts (*)()>("fake_cuda_graphs")(); }

/// cuThreadExchangeStreamCaptureMode calls the fake has had from the calling thread so far.
inline long long fake_mode_exchanges() { return fake_hook<long long (*)()>("fake_cuda_mode_exchanges")(); }

/// cuCtxGetCurrent calls the fake has had from the calling thread so far.
inline long long fake_context_queries() { return fake_hook<long long (*)()>("fake_cuda_context_queries")(); }

/// The calling thread's stream-ordered driver calls since the fake was loaded
/// (fake_cuda_stream_calls there); tests compare differences.
using ::fake_stream_call_counts;
inline fake_stream_call_counts fake_stream_calls() {
  return fake_hook<fake_stream_call_counts (*)()>("fake_cuda_stream_calls")();
}

/// Waits until every user-object destructor the fake has queued has run on its driver thread.
inline void fake_quiesce() { fake_hook<void (*)()>("fake_cuda_quiesce")(); }

/// All references `obj` has now (its callers', graphs' and execs'), or -1 once none is left.
inline long long fake_user_object_refs(CUuserObject obj) {
  return fake_hook<long long (*)(CUuserObject)>("fake_cuda_user_object_refs")(obj);
}

/// The flags `exec` was instantiated with, or -1 if the fake knows no such exec.
inline long long fake_exec_flags(CUgraphExec exec) {
  return fake_hook<long long (*)(CUgraphExec)>("fake_cuda_exec_flags")(exec);
}

/// Mappings whose access for `device` (-1: the host) is `flags` now (a CU_MEM_ACCESS_FLAGS_PROT_* value).
inline int fake_mappings_with_access(int device, unsigned long long flags) {
  return fake_hook<int (*)(int, unsigned long long)>("fake_cuda_mappings_with_access")(device, flags);
}

/// After `after` more cuMemMap calls succeed, the next `count` are refused with
/// CUDA_ERROR_OUT_OF_MEMORY (0, 0: none is).
inline void fake_refuse_maps(long long after, long long count) {
  fake_hook<void (*)(long long, long long)>("fake_cuda_refuse_maps")(after, count);
}

/// Runs `hook(arg)` once, inside the next cuEventQuery or cuEventSynchronize, before it answers.
inline void fake_before_next_event_wait(void (*hook)(void*), void* arg) {
  fake_hook<void (*)(void (*)(void*), void*)>("fake_cuda_before_next_event_wait")(hook, arg);
}

/// Runs `hook(arg)` once, inside the next cuEventRecord, before it records.
inline void fake_before_next_event_record(void (*hook)(void*), void* arg) {
  fake_hook<void (*)(void (*)(void*), void*)>("fake_cuda_before_next_event_record")(hook, arg);
}

/// Runs `hook(arg)` once, inside the next cuStreamQuery, before it answers.
inline void fake_before_next_stream_query(void (*hook)(void*), void* arg) {
  fake_hook<void (*)(void (*)(void*), void*)>("fake_cuda_before_next_stream_query")(hook, arg);
}

/// Holds stream `s` busy (its work does not run: queries of it and of events recorded on it
/// say "not ready") or lets it go; a host wait for it lets it go too.
inline void fake_hold_stream(CUstream s, bool hold) {
  fake_hook<void (*)(CUstream, bool)>("fake_cuda_hold_stream")(s, hold);
}

/// cuMemSetAccess calls since the fake was loaded.
inline long long fake_set_access_calls() { return fake_hook<long long (*)()>("fake_cuda_set_access_calls")(); }

/// Calls that reached device `device`'s legacy default stream since the fake was loaded.
inline long long fake_legacy_stream_calls(int device) {
  return fake_hook<long long (*)(int)>("fake_cuda_legacy_stream_calls")(device);
}

/// Waits (10 s at most) for streamalloc's reaper to have let go of every hold on graph memory,
/// after the fake's destructor thread has handed it every user object's end.
inline bool reaper_idle() {
  fake_quiesce();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (streamalloc::detail::graph_reaper::instance().outstanding() != 0) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace streamalloc_test
