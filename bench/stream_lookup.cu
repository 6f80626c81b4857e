// What a raw cudaStream_t costs streamalloc per call, piece by piece: a `stream` carries its
// ordering record, a raw handle has to be identified on every use (CUDA reuses handle values
// of destroyed streams, so a handle alone is no identity), which takes driver calls. This
// measures each of them, the lookup as a whole, and the allocate + free pair both ways, at 1
// and 8 threads (PyTorch and CuPy hand raw handles, from several threads).
//
// It also asks the driver the question the lookup's cost hangs on: may a thread call
// cuStreamGetId while another thread captures a stream in global mode, without first
// switching itself to relaxed mode? (If the call were refused there, it would also invalidate
// that other thread's capture.) And what the calls a pool makes on a `stream` it settles
// (idle query, event record) do to a capture another thread has begun on that stream, and
// what each question about the legacy default stream does to a blocking stream's capture.
//
//   bench_stream_lookup [--json FILE]

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {
namespace cu = streamalloc::detail::cu;
using bench::clk;
using bench::seconds_since;

template <class Op>
double ns_per(int n, Op op) {
  for (int i = 0; i < n / 10; ++i) op();  // warm
  const auto t = clk::now();
  for (int i = 0; i < n; ++i) op();
  return seconds_since(t) * 1e9 / n;
}

/// As ns_per, for an `op` that enqueues work: in batches of 256 with the device drained between
/// them (not timed), so that the host never waits for room in a stream's queue, and what is
/// timed is the host's cost of enqueueing, not the device's of running.
template <class Op>
double ns_per_enqueued(int n, Op op) {
  constexpr int batch = 256;
  double total = 0;
  int done = 0;
  for (int warm = 0; warm < batch; ++warm) op();
  while (done < n) {
    BENCH_CHECK(cudaDeviceSynchronize());
    const auto t = clk::now();
    for (int i = 0; i < batch; ++i) op();
    total += seconds_since(t);
    done += batch;
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  return total * 1e9 / done;
}

/// ns per call of `op` with `threads` threads each on a stream of its own, started together.
template <class Op>
double ns_per_threaded(int threads, int n, Op op) {
  std::vector<double> each(threads);
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      BENCH_CHECK(cudaSetDevice(0));
      cudaStream_t s;
      BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (int i = 0; i < n / 10; ++i) op(s);
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      const auto t0 = clk::now();
      for (int i = 0; i < n; ++i) op(s);
      each[t] = seconds_since(t0) * 1e9 / n;
      BENCH_CHECK(cudaStreamSynchronize(s));
      BENCH_CHECK(cudaStreamDestroy(s));
    });
  }
  for (auto& th : pool) th.join();
  return bench::median(each);
}

std::string result_name(CUresult r) {
  // 0 is success, 900 CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, 901 ..._INVALIDATED.
  return "CUresult " + std::to_string(static_cast<int>(r));
}

/// Captures `captured` in `mode` on another thread and runs `call()` on this one while that
/// capture is active; returns how the capture ended.
template <class Call>
cudaError_t during_capture_on_another_thread(cudaStream_t captured, cudaStreamCaptureMode mode, Call&& call) {
  cudaError_t end = cudaSuccess;
  std::atomic<int> phase{0};
  std::thread capturer([&] {
    BENCH_CHECK(cudaSetDevice(0));
    BENCH_CHECK(cudaStreamBeginCapture(captured, mode));
    phase = 1;
    while (phase.load() != 2) {
    }
    cudaGraph_t g = nullptr;
    end = cudaStreamEndCapture(captured, &g);
    if (g != nullptr) cudaGraphDestroy(g);
  });
  while (phase.load() != 1) {
  }
  call();
  phase = 2;
  capturer.join();
  (void)cudaGetLastError();
  return end;
}

/// A capture in global mode, begun by this thread or another, and a cuStreamGetId made meanwhile
/// by this thread without leaving global mode, on the captured stream or on another one. Says
/// what the call and the capture's end returned. (If such calls were refused, they would also
/// invalidate the capture: that is why streamalloc switches to relaxed mode around them.)
std::string get_id_during_global_capture(bool same_thread, bool of_captured_stream) {
  cudaStream_t captured, mine;
  BENCH_CHECK(cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking));
  BENCH_CHECK(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking));
  const CUstream asked = of_captured_stream ? captured : mine;
  CUresult get_id = CUDA_SUCCESS;
  cudaError_t end = cudaSuccess;
  unsigned long long id = 0;
  if (same_thread) {
    BENCH_CHECK(cudaStreamBeginCapture(captured, cudaStreamCaptureModeGlobal));
    get_id = cu::cuStreamGetId_nothrow(asked, &id);
    cudaGraph_t g = nullptr;
    end = cudaStreamEndCapture(captured, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    (void)cudaGetLastError();
  } else {
    end = during_capture_on_another_thread(captured, cudaStreamCaptureModeGlobal,
                                           [&] { get_id = cu::cuStreamGetId_nothrow(asked, &id); });
  }
  cudaStreamDestroy(captured);
  cudaStreamDestroy(mine);
  return "cuStreamGetId: " + result_name(get_id) + ", the capture: " + cudaGetErrorName(end);
}

/// Another thread captures a stream in `mode`; this thread, in its own default mode (global) or
/// switched to relaxed, makes one call on that stream, the kind of call a pool makes on a
/// `stream` it settles: is it idle (cuStreamQuery), an event to cover its frees (cuEventRecord),
/// is it capturing, its id. Says what the call and the capture's end returned: a call that
/// invalidates the capture breaks that other thread's program, one merely refused does not.
std::string call_during_others_capture(cudaStreamCaptureMode mode, bool relaxed, int call) {
  cudaStream_t captured;
  BENCH_CHECK(cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking));
  cudaEvent_t ev;
  BENCH_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUresult r = CUDA_SUCCESS;
  const cudaError_t end = during_capture_on_another_thread(captured, mode, [&] {
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (relaxed) (void)cu::cuThreadExchangeStreamCaptureMode_nothrow(&m);
    const auto s = static_cast<CUstream>(captured);
    if (call == 0) {
      r = cu::cuStreamQuery_nothrow(s);
    } else if (call == 1) {
      r = cu::cuEventRecord_nothrow(static_cast<CUevent>(ev), s);
    } else if (call == 2) {
      CUstreamCaptureStatus st;
      r = cu::cuStreamIsCapturing_nothrow(s, &st);
    } else {
      unsigned long long id = 0;
      r = cu::cuStreamGetId_nothrow(s, &id);
    }
    if (relaxed) (void)cu::cuThreadExchangeStreamCaptureMode_nothrow(&m);
  });
  cudaEventDestroy(ev);
  cudaStreamDestroy(captured);
  return result_name(r) + ", the capture: " + cudaGetErrorName(end);
}

/// A blocking stream captured in `mode`, by this thread or another, and one question about the
/// legacy default stream asked meanwhile by this thread in its default mode: is it capturing
/// (call 0), its id (call 1), its capture in full (call 2). The legacy stream cannot be captured, but work on it would join a
/// blocking stream's capture implicitly, which CUDA forbids. Says what the question and the
/// capture's end returned: whether asking alone breaks the capture, and whether the id
/// question refuses as the capture one does (what a pool may skip for that stream).
std::string legacy_question_during_capture(cudaStreamCaptureMode mode, bool same_thread, int call) {
  cudaStream_t blocking;
  BENCH_CHECK(cudaStreamCreate(&blocking));
  CUresult r = CUDA_SUCCESS;
  auto ask = [&] {
    if (call == 0) {
      CUstreamCaptureStatus st;
      r = cu::cuStreamIsCapturing_nothrow(CU_STREAM_LEGACY, &st);
    } else if (call == 2) {
      CUstreamCaptureStatus st;
      cuuint64_t capture_id = 0;
      r = cu::cuStreamGetCaptureInfo_nothrow(CU_STREAM_LEGACY, &st, &capture_id, nullptr, nullptr, nullptr, nullptr);
    } else {
      unsigned long long id = 0;
      r = cu::cuStreamGetId_nothrow(CU_STREAM_LEGACY, &id);
    }
  };
  cudaError_t end = cudaSuccess;
  if (same_thread) {
    BENCH_CHECK(cudaStreamBeginCapture(blocking, mode));
    ask();
    cudaGraph_t g = nullptr;
    end = cudaStreamEndCapture(blocking, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    (void)cudaGetLastError();
  } else {
    end = during_capture_on_another_thread(blocking, mode, ask);
  }
  cudaStreamDestroy(blocking);
  return result_name(r) + ", the capture: " + cudaGetErrorName(end);
}
}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  bench::require_gpu("bench_stream_lookup");
  const bench::gpu_info gpu = bench::describe_gpu();
  bench::json_rows rows;
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  cudaStream_t raw;
  BENCH_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  const int n = 400000;

  std::printf("\none thread, ns per call\n");
  auto row = [&](const char* what, double ns) {
    std::printf("  %-58s %8.1f\n", what, ns);
    rows.add(what, "\"ns\": " + std::to_string(ns));
  };
  row("cuStreamGetCaptureInfo (every stream-ordered call)", ns_per(n, [&] {
        CUstreamCaptureStatus st;
        cuuint64_t id;
        (void)cu::cuStreamGetCaptureInfo_nothrow(raw, &st, &id, nullptr, nullptr, nullptr, nullptr);
      }));
  // What capture_of asks first: the status alone (the capture's id and graph only when active).
  row("cuStreamIsCapturing (what capture_of asks first)", ns_per(n, [&] {
        CUstreamCaptureStatus st;
        (void)cu::cuStreamIsCapturing_nothrow(raw, &st);
      }));
  row("cuStreamGetCaptureInfo with the graph, again after it", ns_per(n, [&] {
        CUstreamCaptureStatus st;
        cuuint64_t id;
        CUgraph g;
        (void)cu::cuStreamGetCaptureInfo_nothrow(raw, &st, &id, &g, nullptr, nullptr, nullptr);
      }));
  row("cuThreadExchangeStreamCaptureMode, there and back", ns_per(n, [&] {
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
        (void)cu::cuThreadExchangeStreamCaptureMode_nothrow(&m);
        (void)cu::cuThreadExchangeStreamCaptureMode_nothrow(&m);
      }));
  row("cuStreamGetId", ns_per(n, [&] {
        unsigned long long id;
        (void)cu::cuStreamGetId_nothrow(raw, &id);
      }));
  row("cuStreamIsCapturing, the legacy default stream", ns_per(n, [&] {
        CUstreamCaptureStatus st;
        (void)cu::cuStreamIsCapturing_nothrow(CU_STREAM_LEGACY, &st);
      }));
  row("cuStreamGetId, the legacy default stream", ns_per(n, [&] {
        unsigned long long id;
        (void)cu::cuStreamGetId_nothrow(CU_STREAM_LEGACY, &id);
      }));
  row("resolve_stream (a raw handle's record, whole)",
      ns_per(n, [&] { (void)&streamalloc::detail::resolve_stream(raw); }));
  row("resolve_uncaptured_stream (the pools' calls, after the capture check)",
      ns_per(n, [&] { (void)&streamalloc::detail::resolve_uncaptured_stream(raw); }));

  streamalloc::pool p;
  streamalloc::stream owned(0);
  const streamalloc::stream_ref by_handle{raw};
  const streamalloc::stream_ref owned_ref = owned;
  const double pair_stream = ns_per(n, [&] { p.deallocate(p.allocate(4096, owned_ref), owned_ref); });
  const double pair_raw = ns_per(n, [&] { p.deallocate(p.allocate(4096, by_handle), by_handle); });
  row("allocate + free 4 KiB, a stream", pair_stream);
  row("allocate + free 4 KiB, a raw handle", pair_raw);
  const streamalloc::stream_ref legacy = streamalloc::stream_ref::legacy_default();
  row("allocate + free 4 KiB, the legacy default stream",
      ns_per(n, [&] { p.deallocate(p.allocate(4096, legacy), legacy); }));

  const double async = ns_per(n / 4, [&] {
    void* q;
    BENCH_CHECK(cudaMallocAsync(&q, 4096, raw));
    BENCH_CHECK(cudaFreeAsync(q, raw));
  });
  row("cudaMallocAsync + cudaFreeAsync 4 KiB", async);
  std::printf("  raw handle / stream: %.2fx\n", pair_raw / pair_stream);

  // A hand-off as the pools learn it: an event recorded on one stream, waited for by another.
  // Through streamalloc each record and wait also asks whether its stream is capturing (after
  // the call; a raw handle before it too, instead of switching the capture mode to be
  // identified): expected about 2 x cuStreamIsCapturing over the raw calls for streams, and
  // about 2 x (cuStreamIsCapturing + cuStreamGetId) more for raw handles.
  streamalloc::stream other(0);
  cudaStream_t raw_other;
  BENCH_CHECK(cudaStreamCreateWithFlags(&raw_other, cudaStreamNonBlocking));
  cudaEvent_t raw_event;
  BENCH_CHECK(cudaEventCreateWithFlags(&raw_event, cudaEventDisableTiming));
  streamalloc::event e;
  const int m = n / 8;
  row("cudaEventRecord + cudaStreamWaitEvent", ns_per_enqueued(m, [&] {
        BENCH_CHECK(cudaEventRecord(raw_event, raw));
        BENCH_CHECK(cudaStreamWaitEvent(raw_other, raw_event, 0));
      }));
  row("event::record + stream_ref::wait, streams", ns_per_enqueued(m, [&] {
        e.record(owned);
        (void)other.wait(e);
      }));
  const streamalloc::stream_ref other_by_handle{raw_other};
  row("event::record + stream_ref::wait, raw handles", ns_per_enqueued(m, [&] {
        e.record(by_handle);
        (void)other_by_handle.wait(e);
      }));
  row("order_after, streams", ns_per_enqueued(m, [&] { (void)streamalloc::order_after(other, owned); }));
  BENCH_CHECK(cudaDeviceSynchronize());
  BENCH_CHECK(cudaEventDestroy(raw_event));
  BENCH_CHECK(cudaStreamDestroy(raw_other));

  std::printf("\n8 threads, each its own raw handle, ns per call (median thread)\n");
  row("8 threads: resolve_stream", ns_per_threaded(8, n, [](cudaStream_t s) {
        (void)&streamalloc::detail::resolve_stream(s);
      }));
  row("8 threads: allocate + free 4 KiB, a raw handle", ns_per_threaded(8, n, [&](cudaStream_t s) {
        const streamalloc::stream_ref r{s};
        p.deallocate(p.allocate(4096, r), r);
      }));

  std::printf("\ncuStreamGetId without leaving global mode while a stream is captured in global mode\n");
  for (const bool same_thread : {false, true}) {
    for (const bool of_captured : {false, true}) {
      const std::string answer = get_id_during_global_capture(same_thread, of_captured);
      const std::string what = std::string("captured by ") + (same_thread ? "this thread" : "another thread") +
                               ", asking of " + (of_captured ? "the captured stream" : "another stream");
      std::printf("  %-62s %s\n", what.c_str(), answer.c_str());
      rows.add("get_id_during_global_capture: " + what, "\"answer\": \"" + answer + "\"");
    }
  }
  std::printf("\na call on a stream that another thread captures, made in this thread's default mode or relaxed\n");
  static const char* calls[] = {"cuStreamQuery", "cuEventRecord", "cuStreamIsCapturing", "cuStreamGetId"};
  static const char* modes[] = {"global", "thread-local", "relaxed"};
  const cudaStreamCaptureMode mode_of[] = {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                                           cudaStreamCaptureModeRelaxed};
  for (int m = 0; m < 3; ++m) {
    for (const bool relaxed : {false, true}) {
      for (int c = 0; c < 4; ++c) {
        const std::string answer = call_during_others_capture(mode_of[m], relaxed, c);
        const std::string what = std::string(modes[m]) + " capture, " + (relaxed ? "relaxed " : "default ") + calls[c];
        std::printf("  %-48s %s\n", what.c_str(), answer.c_str());
        rows.add("call_during_others_capture: " + what, "\"answer\": \"" + answer + "\"");
      }
    }
  }
  std::printf("\nthe legacy default stream asked, in this thread's default mode, while a blocking stream is captured\n");
  static const char* legacy_calls[] = {"cuStreamIsCapturing", "cuStreamGetId", "cuStreamGetCaptureInfo"};
  for (int m = 0; m < 3; ++m) {
    for (const bool same_thread : {false, true}) {
      for (int c = 0; c < 3; ++c) {
        const std::string answer = legacy_question_during_capture(mode_of[m], same_thread, c);
        const std::string what = std::string(modes[m]) + " capture by " + (same_thread ? "this thread, " : "another thread, ") +
                                 legacy_calls[c];
        std::printf("  %-58s %s\n", what.c_str(), answer.c_str());
        rows.add("legacy_question_during_capture: " + what, "\"answer\": \"" + answer + "\"");
      }
    }
  }
  BENCH_CHECK(cudaStreamSynchronize(raw));
  BENCH_CHECK(cudaStreamDestroy(raw));
  if (json != nullptr) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"stream_lookup\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"rows\": [\n" << rows.str() << "\n  ]\n}\n";
    std::printf("wrote %s\n", json);
  }
  return 0;
}
