/**
 * @file
 * streamalloc's C interface: the device's current pool (streamalloc::current_pool) behind plain
 * functions, for programs and languages that cannot use the C++ headers: PyTorch's
 * CUDAPluggableAllocator, CuPy and anything else that loads a shared library (Python's
 * ctypes, cffi). The shared library `streamalloc_c` (CMake target `streamalloc::c`, file
 * libstreamalloc_c.so) exports these; the Python package in python/streamalloc wraps them.
 *
 * Streams are raw CUDA stream handles (cudaStream_t and CUstream are the same type); 0 is the
 * legacy default stream, or the per-thread one in code built for it. The ordering rule is the
 * pools': memory allocated on a stream is usable by work enqueued on it afterwards; a free on a
 * stream lets work enqueued on it before the free still use the memory, and every other
 * stream that used it must be ordered before the free.
 *
 * Errors: every function but streamalloc_torch_malloc returns a status or a null pointer and
 * never throws; streamalloc_last_error() then says what went wrong on the calling thread.
 *
 * Thread safety: every function may be called from any thread at any time.
 */
#ifndef STREAMALLOC_C_API_H
#define STREAMALLOC_C_API_H

#include <stddef.h>
#include <stdint.h>

/** Marks the functions the shared library exports (everything else in it is hidden). */
#if defined(_WIN32)
#define STREAMALLOC_C_EXPORT __declspec(dllexport)
#else
#define STREAMALLOC_C_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;
/** The CUDA stream type, declared as CUDA's headers declare it (no CUDA header needed here). */
typedef struct CUstream_st* streamalloc_stream;

/** The version of this interface: the library's major * 10000 + minor * 100 + patch. */
STREAMALLOC_C_EXPORT int streamalloc_version(void);

/**
 * Allocates `size` bytes from device `device`'s current pool in the order of `stream` (a
 * stream of that device, or of a device the pool granted access). Returns NULL for size 0 and
 * on failure (out of memory, a bad device or stream): streamalloc_last_error() says which.
 */
STREAMALLOC_C_EXPORT void* streamalloc_malloc(size_t size, int device, streamalloc_stream stream);

/**
 * Frees `ptr` in the order of `stream`. `size` and `device` are the allocation's (PyTorch's
 * signature). `size` is not needed; `device` only says where to look first (that device's
 * default pool, when no other is current there): a pointer is found by its address whatever
 * device is named. NULL is ignored. A pointer that is no live
 * allocation of a streamalloc pool (foreign, interior, freed already) changes nothing: the
 * error is written to standard error and kept for streamalloc_last_error().
 */
STREAMALLOC_C_EXPORT void streamalloc_free(void* ptr, size_t size, int device, streamalloc_stream stream);

/**
 * As streamalloc_malloc, for callers written in C++ that turn exceptions into errors of their
 * own, as PyTorch does (an out-of-memory exception becomes a Python RuntimeError naming the
 * request and the pool's state instead of a null pointer PyTorch would not check). Never call
 * it through ctypes or from C: an exception cannot cross those frames.
 */
STREAMALLOC_C_EXPORT void* streamalloc_torch_malloc(size_t size, int device, streamalloc_stream stream);

/** What a device's current pool holds; the fields of streamalloc::pool_statistics. */
typedef struct streamalloc_statistics {
  uint64_t reserved_current;   /**< physical memory the pool holds */
  uint64_t reserved_high;      /**< its high-water mark since creation or reset */
  uint64_t used_current;       /**< bytes of live allocations (rounded to 256) */
  uint64_t used_high;          /**< its high-water mark since creation or reset */
  uint64_t live_allocations;   /**< allocations not yet freed */
  uint64_t free_clear;         /**< free bytes every stream may reuse now */
  uint64_t free_pending;       /**< free bytes awaiting proof of stream order */
  uint64_t largest_free_block; /**< the largest free block, clear or pending */
  uint64_t chunks;             /**< physical allocations mapped */
  uint64_t remapped_chunks;    /**< chunks moved to defragment, since creation */
  uint64_t grows;              /**< times the pool mapped new physical memory, since creation */
  /* Graphs made by stream capture: their memory is part of reserved_current, not of the rest. */
  uint64_t graph_reserved_current; /**< bytes held by graphs alive */
  uint64_t graph_reserved_high;    /**< its high-water mark since creation or reset */
  uint64_t graph_allocations;      /**< blocks held by graphs alive */
  uint64_t graphs;                 /**< graphs alive that hold memory of the pool */
} streamalloc_statistics;

/**
 * Fills `*out` with the statistics of device `device`'s current pool. `out_size` is
 * sizeof(streamalloc_statistics) as the caller knows it: fields past it are not written, so
 * an older caller keeps working with a newer library. Returns 0, or -1 on error.
 */
STREAMALLOC_C_EXPORT int streamalloc_get_statistics(int device, streamalloc_statistics* out, size_t out_size);

/** Resets the high-water marks (reserved_high, used_high) to the current values. 0 or -1. */
STREAMALLOC_C_EXPORT int streamalloc_reset_peaks(int device);

/**
 * Waits for all work on device `device` (cuCtxSynchronize), through streamalloc, so that its
 * pools learn that every pending free has run: a synchronization made with CUDA directly
 * (cudaDeviceSynchronize, torch.cuda.synchronize) is invisible to them. Returns 0, or -1.
 */
STREAMALLOC_C_EXPORT int streamalloc_synchronize(int device);

/**
 * Releases free physical memory of device `device`'s current pool down to `keep` bytes held,
 * what no stream's pending free still covers (like cudaMemPoolTrimTo, it does not wait; call
 * streamalloc_synchronize first to release everything free). Returns 0, or -1.
 */
STREAMALLOC_C_EXPORT int streamalloc_trim(int device, size_t keep);

/**
 * Sets how much free memory device `device`'s current pool keeps between uses before it gives
 * memory back to the device at synchronizations (like cudaMemPoolAttrReleaseThreshold).
 * SIZE_MAX: keep everything. Returns 0, or -1.
 */
STREAMALLOC_C_EXPORT int streamalloc_set_release_threshold(int device, size_t bytes);

/**
 * Sets which free memory device `device`'s current pool lets a stream reuse, from now on
 * (streamalloc::reuse_policy; each argument 0 or 1): memory freed on another stream it waited
 * on through streamalloc, memory whose free the device has run, and waiting on another
 * stream's free instead of failing at the pool's limit. Returns 0, or -1.
 */
STREAMALLOC_C_EXPORT int streamalloc_set_reuse_policy(int device, int follow_event_dependencies, int opportunistic,
                                                      int internal_dependencies);

/**
 * Writes a JSON object describing device `device`'s current pool (its properties, statistics,
 * reservations, chunks, blocks, streams and, when kept, history: pool::snapshot) into
 * `buffer`, NUL-terminated, if it fits in `capacity` bytes. Returns the length the document
 * needs without the NUL (call with capacity 0 to ask), or -1 on error.
 */
STREAMALLOC_C_EXPORT long long streamalloc_snapshot(int device, char* buffer, size_t capacity);

/**
 * Makes device `device`'s current pool keep its last `events` allocations, frees, growths,
 * releases and remaps for streamalloc_snapshot (pool::keep_history); 0 keeps none. Each call
 * starts a new history. Returns 0, or -1.
 */
STREAMALLOC_C_EXPORT int streamalloc_keep_history(int device, size_t events);

/** The last error of a streamalloc_* call on the calling thread ("" if none). Valid until the
 * thread's next failing call. */
STREAMALLOC_C_EXPORT const char* streamalloc_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* STREAMALLOC_C_API_H */
