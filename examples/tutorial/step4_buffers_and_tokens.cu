// Tutorial step 4: stream_buffer<T> and ordering tokens instead of raw pointers. The pipeline
// of step 3 with typed, move-only buffers: each belongs to one stream at a time, moves to
// another only with proof that the new stream runs after its last use, and is freed in its
// stream's order when it goes out of scope. Mistakes the raw pointers of step 3 allowed now
// fail to compile (docs/tutorial.md lists them); what types cannot see is checked at run time
// in debug builds, which this program shows.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include "../common.cuh"
#include "kernels.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// The kernels the steps share (examples/tutorial/kernels.cuh).
using tutorial::fill;
using tutorial::square;

constexpr std::size_t n = std::size_t{1} << 21;
constexpr int batches = 12;

int run() {
  streamalloc::pool pool({.release_threshold = SIZE_MAX});
  streamalloc::stream producer(0), consumer(0);
  streamalloc::event consumed[2];
  std::vector<std::vector<std::uint32_t>> results(batches, std::vector<std::uint32_t>(n));

  for (int b = 0; b < batches; ++b) {
    if (b >= 2) producer.wait(consumed[b % 2]);
    {
      // n elements (uninitialized) on the producer, from the pool; data() is for work on the producer.
      streamalloc::stream_buffer<std::uint32_t> in(n, producer, pool);
      fill<<<256, 256, 0, producer.get()>>>(in.data(), in.size(), static_cast<std::uint32_t>(b));
      example::check_cuda(cudaGetLastError(), "fill");

      // Hand it to the consumer. order_after records an event on the producer and makes the
      // consumer wait for it; the stream_order it returns is the proof set_stream asks for.
      // `in.set_stream(consumer);` alone does not compile.
      in.set_stream(consumer, streamalloc::order_after(consumer, producer));

      streamalloc::stream_buffer<std::uint32_t> out(n, consumer, pool);
      square<<<256, 256, 0, consumer.get()>>>(in.data(), out.data(), n);
      example::check_cuda(cudaGetLastError(), "square");
      out.copy_to(results[b]);  // cudaMemcpyAsync on the consumer; complete once the consumer has run it
    }  // `out` and `in` are freed here, each on its stream (now both the consumer), after the copy
    consumed[b % 2].record(consumer);  // after the frees: the producer's wait at b + 2 covers them
  }
  (void)consumer.synchronize();

  std::size_t wrong = 0;
  for (int b = 0; b < batches; ++b) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t v = static_cast<std::uint32_t>(i % 1000) + static_cast<std::uint32_t>(b);
      wrong += results[b][i] != v * v ? 1 : 0;
    }
  }
  std::printf("step 4 (stream_buffer and tokens): %d batches, %zu wrong values\n", batches, wrong);
  example::expect(wrong == 0, "results");
  example::expect(pool.statistics().live_allocations == 0, "every buffer freed at the end of its scope");

  // What the compiler cannot see: a token made before the buffer's last use. With the
  // run-time checks on (STREAMALLOC_CHECK_ORDERING, the default without NDEBUG), set_stream
  // refuses it and changes nothing.
  if constexpr (STREAMALLOC_CHECK_ORDERING != 0) {
    streamalloc::stream_buffer<std::uint32_t> x(1024, producer, pool);
    const streamalloc::stream_order early = streamalloc::order_after(consumer, producer);
    x.fill_zero();  // a use on the producer after the token was made: the token does not cover it
    std::string refused;
    try {
      x.set_stream(consumer, early);
    } catch (const streamalloc::ordering_error& e) {
      refused = e.what();
    }
    std::printf("a stale token is refused at run time: %s\n", refused.c_str());
    example::expect(!refused.empty() && x.stream() == streamalloc::stream_ref(producer), "stale token refused");
    x.set_stream(consumer, streamalloc::order_after(consumer, producer));  // a fresh token is accepted
    example::expect(x.stream() == streamalloc::stream_ref(consumer), "fresh token accepted");
  } else {
    std::printf("(run-time ordering checks are off in this build: NDEBUG is defined)\n");
  }
  std::printf("step 4 OK\n");
  return 0;
}

}  // namespace

int main() { return example::main_of(run); }
