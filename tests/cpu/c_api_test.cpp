// The C interface (include/streamalloc/c_api.h) through the shared library PyTorch and CuPy
// load (libstreamalloc_c.so), against the fake driver with two devices. The library holds its
// own copy of streamalloc (its internals are hidden), so everything here is checked through
// the C functions alone, as a C or Python caller sees them: results, statistics, the thread's
// last error, and that bad input changes nothing. tests/gpu/c_api_test.cu does the same on a
// GPU with kernels.

#include <streamalloc/c_api.h>
#include <streamalloc/stream.hpp>
#include <streamalloc/version.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace {
using streamalloc_test::contains;
using streamalloc_test::MiB;

/// A stream of `device`, passed to the C functions as its raw handle. Made by the test's own
/// copy of streamalloc, which loads the same fake driver as the C library's copy.
class c_api_stream {
 public:
  explicit c_api_stream(int device) : s_(device) {}
  [[nodiscard]] streamalloc_stream get() const noexcept { return s_.get(); }

 private:
  streamalloc::stream s_;
};

streamalloc_statistics stats_of(int device) {
  streamalloc_statistics s{};
  REQUIRE(streamalloc_get_statistics(device, &s, sizeof s) == 0);
  return s;
}

std::string last_error() { return streamalloc_last_error(); }
}  // namespace

TEST_SUITE("c_api") {
  TEST_CASE("malloc and free on a stream, counted in the device's pool's statistics") {
    CHECK(streamalloc_version() == STREAMALLOC_VERSION);
    const c_api_stream s(0);
    void* a = streamalloc_malloc(MiB, 0, s.get());
    void* b = streamalloc_malloc(3 * MiB + 1, 0, s.get());
    REQUIRE(a != nullptr);
    REQUIRE(b != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
    streamalloc_statistics st = stats_of(0);
    CHECK(st.live_allocations == 2);
    CHECK(st.used_current == MiB + 3 * MiB + 256);  // sizes rounded up to 256 bytes
    CHECK(st.reserved_current >= st.used_current);
    streamalloc_free(a, MiB, 0, s.get());
    streamalloc_free(b, 3 * MiB + 1, 0, s.get());
    st = stats_of(0);
    CHECK(st.live_allocations == 0);
    CHECK(st.used_current == 0);
    CHECK(st.used_high == 4 * MiB + 256);
    // Freed in the stream's order: the same stream gets the memory back at once.
    void* again = streamalloc_malloc(MiB, 0, s.get());
    CHECK(again == a);
    streamalloc_free(again, MiB, 0, s.get());
    CHECK(streamalloc_malloc(0, 0, s.get()) == nullptr);  // size 0: nothing, and no error
    streamalloc_free(nullptr, 0, 0, s.get());             // ignored
  }

  TEST_CASE("the default stream, from a thread with no context yet, and from many threads at once") {
    std::thread([] {
      void* p = streamalloc_malloc(4096, 1, nullptr);  // device 1's legacy stream
      REQUIRE(p != nullptr);
      CHECK(stats_of(1).live_allocations == 1);
      streamalloc_free(p, 4096, 1, nullptr);
      CHECK(stats_of(1).live_allocations == 0);
    }).join();
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([] {
        const c_api_stream s(0);
        for (int i = 0; i < 500; ++i) {
          void* p = streamalloc_malloc(256 + 64 * static_cast<std::size_t>(i), 0, s.get());
          REQUIRE(p != nullptr);
          streamalloc_free(p, 0, 0, s.get());
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(stats_of(0).live_allocations == 0);
  }

  TEST_CASE("a thread that has a context is not asked for it on every call") {
    // In a PyTorch step the question (cuCtxGetCurrent) cost more than the allocation once the
    // launches between allocations had evicted the CPU's caches: it is asked only when a
    // call about the default stream is refused for want of a context.
    // Checked on this thread: a failed REQUIRE in another would end the whole suite.
    int allocated = 0;
    long long questions = -1;
    std::thread([&] {
      void* first = streamalloc_malloc(4096, 1, nullptr);  // no context yet: device 1's is made current
      if (first == nullptr) return;
      streamalloc_free(first, 4096, 1, nullptr);
      const long long asked = streamalloc_test::fake_context_queries();
      for (int i = 0; i < 100; ++i) {
        void* p = streamalloc_malloc(4096 + 256 * static_cast<std::size_t>(i), 1, nullptr);
        if (p == nullptr) break;
        ++allocated;
        streamalloc_free(p, 0, 1, nullptr);
      }
      questions = streamalloc_test::fake_context_queries() - asked;
    }).join();
    CHECK(allocated == 100);
    CHECK(questions == 0);  // 200 when every call asked
    CHECK(stats_of(1).live_allocations == 0);
  }

  TEST_CASE("a free given another device than its pool's still reaches its pool") {
    const c_api_stream s0(0), s1(1);
    void* on_1 = streamalloc_malloc(MiB, 1, s1.get());
    REQUIRE(on_1 != nullptr);
    CHECK(stats_of(1).live_allocations == 1);
    streamalloc_free(on_1, MiB, 0, s1.get());  // device 0 named: its pool does not hold it
    CHECK(stats_of(1).live_allocations == 0);
    CHECK(stats_of(0).live_allocations == 0);
    void* on_0 = streamalloc_malloc(MiB, 0, s0.get());
    REQUIRE(on_0 != nullptr);
    streamalloc_free(on_0, MiB, 9, s0.get());  // a device there is not: the pool is found by address
    CHECK(stats_of(0).live_allocations == 0);
  }

  TEST_CASE("a free on the default stream given as a null handle is reused by another stream once it ran") {
    // A null handle is the legacy default stream (PyTorch's default stream arrives so). The
    // pool keyed it by that null handle, which to it means no stream: it never asked the stream
    // about its work, and another stream grew the pool instead of reusing the block.
    const c_api_stream other(0);
    REQUIRE(streamalloc_synchronize(0) == 0);
    REQUIRE(streamalloc_trim(0, 0) == 0);  // nothing free: which block comes back is certain
    void* p = streamalloc_malloc(40 * MiB, 0, nullptr);
    REQUIRE(p != nullptr);
    const std::uint64_t reserved = stats_of(0).reserved_current;
    streamalloc_free(p, 40 * MiB, 0, nullptr);
    const long long asked = streamalloc_test::fake_legacy_stream_calls(0);
    void* q = streamalloc_malloc(40 * MiB, 0, other.get());
    CHECK(q == p);
    CHECK(stats_of(0).reserved_current == reserved);
    CHECK(streamalloc_test::fake_legacy_stream_calls(0) > asked);  // it asked the stream
    streamalloc_free(q, 40 * MiB, 0, other.get());
  }

  TEST_CASE("bad requests return null and say why; nothing is held") {
    const c_api_stream s(0), other_device(1);
    const std::uint64_t reserved = stats_of(0).reserved_current;
    CHECK(streamalloc_malloc(MiB, -1, s.get()) == nullptr);
    CHECK(last_error() == "streamalloc_malloc: streamalloc: there is no device -1");
    CHECK(streamalloc_malloc(MiB, 7, s.get()) == nullptr);  // two fake devices
    CHECK(last_error() == "streamalloc_malloc: streamalloc: there is no device 7");
    CHECK(streamalloc_malloc(64ULL << 30, 0, s.get()) == nullptr);  // the fake device has 8 GiB
    CHECK(contains(last_error(), "cannot allocate 68719476736 bytes"));
    // A stream of device 1 on device 0's pool, which granted it no access.
    CHECK(streamalloc_malloc(MiB, 0, other_device.get()) == nullptr);
    CHECK(contains(last_error(), "the stream belongs to device 1"));
    const streamalloc_statistics st = stats_of(0);
    CHECK(st.live_allocations == 0);
    CHECK(st.reserved_current == reserved);
  }

  TEST_CASE("streamalloc_torch_malloc lets the exception through, for PyTorch to report") {
    const c_api_stream s(0);
    bool caught = false;
    try {
      (void)streamalloc_torch_malloc(64ULL << 30, 0, s.get());
    } catch (const std::bad_alloc& e) {
      caught = true;
      CHECK(contains(e.what(), "cannot allocate 68719476736 bytes"));
    }
    CHECK(caught);
    void* p = streamalloc_torch_malloc(MiB, 0, s.get());
    CHECK(p != nullptr);
    streamalloc_free(p, MiB, 0, s.get());
  }

  TEST_CASE("bad frees change nothing and are reported") {
    const c_api_stream s(0);
    void* p = streamalloc_malloc(MiB, 0, s.get());
    REQUIRE(p != nullptr);
    int on_host = 0;
    streamalloc_free(&on_host, sizeof on_host, 0, s.get());
    CHECK(contains(last_error(), "streamalloc_free: "));
    CHECK(contains(last_error(), "belongs to no streamalloc pool"));
    streamalloc_free(static_cast<char*>(p) + 256, MiB, 0, s.get());  // interior
    CHECK(contains(last_error(), "points inside an allocation, not at its start"));
    CHECK(stats_of(0).live_allocations == 1);
    streamalloc_free(p, MiB, 0, s.get());
    streamalloc_free(p, MiB, 0, s.get());  // twice
    CHECK(contains(last_error(), "is already free (double free)"));
    CHECK(stats_of(0).live_allocations == 0);
  }

  TEST_CASE("statistics of an older caller's size, peaks, trim, release threshold, snapshot") {
    const c_api_stream s(0);
    // A caller that knows only the first two fields: the third is not written.
    std::uint64_t prefix[3] = {0, 0, 0xfeedULL};
    void* p = streamalloc_malloc(8 * MiB, 0, s.get());
    REQUIRE(p != nullptr);
    REQUIRE(streamalloc_get_statistics(0, reinterpret_cast<streamalloc_statistics*>(prefix), 2 * sizeof(std::uint64_t)) == 0);
    CHECK(prefix[0] >= 8 * MiB);
    CHECK(prefix[2] == 0xfeedULL);
    CHECK(streamalloc_get_statistics(0, nullptr, sizeof(streamalloc_statistics)) == -1);
    CHECK(contains(last_error(), "null"));

    const long long need = streamalloc_snapshot(0, nullptr, 0);
    REQUIRE(need > 0);
    std::string small(8, 'x');
    CHECK(streamalloc_snapshot(0, small.data(), small.size()) == need);
    CHECK(small == std::string(8, 'x'));  // too small: not written
    std::vector<char> doc(static_cast<std::size_t>(need) + 1);
    CHECK(streamalloc_snapshot(0, doc.data(), doc.size()) == need);
    const std::string json(doc.data());
    CHECK(json.size() == static_cast<std::size_t>(need));
    CHECK(contains(json, "\"live_allocations\": 1"));
    CHECK(contains(json, "\"used_current\": " + std::to_string(8 * MiB)));
    CHECK(contains(json, "\"location\": \"device 0\""));
    CHECK(json.front() == '{');
    CHECK(json.back() == '}');

    streamalloc_free(p, 8 * MiB, 0, s.get());

    // A history kept through the C interface shows up in the snapshot: an allocation and its
    // free, with their address and size.
    REQUIRE(streamalloc_keep_history(0, 16) == 0);
    void* q = streamalloc_malloc(3 * MiB, 0, s.get());
    REQUIRE(q != nullptr);
    streamalloc_free(q, 3 * MiB, 0, s.get());
    std::vector<char> with_history(static_cast<std::size_t>(streamalloc_snapshot(0, nullptr, 0)) + 1);
    REQUIRE(streamalloc_snapshot(0, with_history.data(), with_history.size()) > 0);
    const std::string hist(with_history.data());
    const std::string at = "\"address\": " + std::to_string(reinterpret_cast<std::uintptr_t>(q));
    CHECK(contains(hist, "\"op\": \"allocate\", \"stream\": "));
    CHECK(contains(hist, "\"op\": \"free\", \"stream\": "));
    CHECK(contains(hist, at + ", \"bytes\": " + std::to_string(3 * MiB)));
    REQUIRE(streamalloc_keep_history(0, 0) == 0);
    CHECK(streamalloc_keep_history(7, 16) == -1);
    CHECK(contains(last_error(), "streamalloc_keep_history: "));

    // The policy in force shows in the snapshot's properties.
    auto reuse_in_snapshot = [] {
      std::vector<char> doc(static_cast<std::size_t>(streamalloc_snapshot(0, nullptr, 0)) + 1);
      REQUIRE(streamalloc_snapshot(0, doc.data(), doc.size()) > 0);
      const std::string text(doc.data());
      const auto at = text.find("\"reuse\": {");
      REQUIRE(at != std::string::npos);
      return text.substr(at, text.find('}', at) - at);
    };
    CHECK(contains(reuse_in_snapshot(), "\"opportunistic\": true"));
    CHECK(streamalloc_set_reuse_policy(0, 1, 0, 0) == 0);
    CHECK(contains(reuse_in_snapshot(), "\"follow_event_dependencies\": true, \"opportunistic\": false, "
                                        "\"internal_dependencies\": false"));
    CHECK(streamalloc_set_reuse_policy(0, 1, 1, 1) == 0);  // the defaults again
    CHECK(contains(reuse_in_snapshot(), "\"opportunistic\": true, \"internal_dependencies\": true"));
    CHECK(streamalloc_set_reuse_policy(7, 1, 1, 1) == -1);
    CHECK(contains(last_error(), "streamalloc_set_reuse_policy: "));

    CHECK(streamalloc_set_release_threshold(0, SIZE_MAX) == 0);
    CHECK(stats_of(0).reserved_current > 0);
    // Frees on streams the library saw no synchronization of stay pending (earlier cases'
    // threads destroyed theirs): trim keeps them, as cudaMemPoolTrimTo does...
    CHECK(stats_of(0).free_pending > 0);
    CHECK(streamalloc_trim(0, 0) == 0);
    CHECK(stats_of(0).reserved_current > 0);
    // ...until a synchronization through streamalloc shows they ran.
    CHECK(streamalloc_synchronize(0) == 0);
    CHECK(stats_of(0).free_pending == 0);
    CHECK(streamalloc_trim(0, 0) == 0);
    CHECK(stats_of(0).reserved_current == 0);
    CHECK(stats_of(0).reserved_high > 0);
    CHECK(streamalloc_reset_peaks(0) == 0);  // to the current values: nothing held now
    CHECK(stats_of(0).reserved_high == 0);
    CHECK(stats_of(0).used_high == 0);
    CHECK(streamalloc_synchronize(9) == -1);
    CHECK(contains(last_error(), "streamalloc_synchronize: "));
    CHECK(streamalloc_trim(-3, 0) == -1);
    CHECK(contains(last_error(), "streamalloc_trim: "));
  }
}
