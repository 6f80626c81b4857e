// logging_resource against the fake driver, beyond one call at a time: threads' lines never tear
// and keep each thread's order; a free is logged before its address can be allocated again;
// equality, moves, unwritable logs, flush_every_line, the pool's other users, other upstreams.

#include <streamalloc/logging_resource.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "logging_resource_support.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace logging_resource_test {

// --- resources for ordering and for logs that cannot be written ---------------------------------

/// A resource whose free hands the address to another thread and returns only once that thread
/// has allocated it again, through the logging resource: what a pool does when another thread
/// reuses a block at once, made certain. The log must still show the free first.
struct handoff_resource {
  struct state {
    std::mutex m;
    std::condition_variable cv;
    void* handed = nullptr;      // freed, not yet taken
    bool reallocated = false;    // the taker's allocation through the logging resource returned
    std::uintptr_t next = 0x10000;
  };
  std::shared_ptr<state> st = std::make_shared<state>();
  void* take_or_new() {
    std::lock_guard lock(st->m);
    if (void* p = std::exchange(st->handed, nullptr)) return p;
    return reinterpret_cast<void*>(st->next += 0x1000);
  }
  void hand_over(void* p) {
    std::unique_lock lock(st->m);
    st->handed = p;
    st->reallocated = false;
    st->cv.notify_all();
    st->cv.wait(lock, [&] { return st->reallocated; });
  }
  void* allocate(std::size_t, std::size_t) { return take_or_new(); }
  void deallocate(void* p, std::size_t, std::size_t) { hand_over(p); }
  void* allocate_async(std::size_t, std::size_t, ::cuda::stream_ref) { return take_or_new(); }
  void deallocate_async(void* p, std::size_t, std::size_t, ::cuda::stream_ref) { hand_over(p); }
  friend bool operator==(const handoff_resource& a, const handoff_resource& b) { return a.st == b.st; }
  friend void get_property(const handoff_resource&, device_accessible) noexcept {}
};

/// A streambuf that refuses every write, as a full disk does.
struct refusing_buffer : std::streambuf {
  int_type overflow(int_type) override { return traits_type::eof(); }
  std::streamsize xsputn(const char*, std::streamsize) override { return 0; }
};

}  // namespace logging_resource_test

TEST_SUITE("logging_resource") {
  using namespace logging_resource_test;

  TEST_CASE_TEMPLATE_DEFINE("threads: exactly the lines expected, none torn, each thread's in its order", F,
                            logging_threads) {
    constexpr log_format format = F::value;
    constexpr int threads = 8;
    constexpr int rounds = 8000;
    pool p;
    std::vector<stream> streams;
    for (int t = 0; t < threads; ++t) streams.emplace_back(0);
    // The smallest ring for CSV (16 slots: threads wait for slots and drain the ring themselves
    // all the time, which is what is under test), the default for JSON.
    temp_file file;
    std::ostringstream out;
    std::vector<std::vector<expected>> did(threads);
    std::vector<std::uint32_t> ids(threads);
    {
      std::optional<logging_resource<device_resource>> mr;
      if (format == log_format::csv) {
        mr.emplace(device_resource(p), file.path, logging_options{.format = format, .buffer_bytes = 512});
      } else {
        mr.emplace(device_resource(p), out, logging_options{.format = format});
      }
      std::atomic<int> ready{0};
      std::vector<std::thread> pool_threads;
      for (int t = 0; t < threads; ++t) {
        pool_threads.emplace_back([&, t] {
          ids[t] = detail::log_thread_id();
          const auto h = handle_of(streams[t].get());
          std::mt19937 rng(static_cast<unsigned>(t) + 1);
          std::vector<std::pair<void*, std::size_t>> live;
          ready.fetch_add(1);
          while (ready.load() < threads) std::this_thread::yield();
          for (int i = 0; i < rounds; ++i) {
            const bool sync = rng() % 8 == 0;
            if (live.size() < 6 && (live.empty() || rng() % 2 == 0)) {
              const std::size_t bytes = 256 * (1 + rng() % 64);
              void* q = sync ? mr->allocate(bytes) : mr->allocate_async(bytes, 256, streams[t]);
              did[t].push_back({sync ? "allocate" : "allocate_async", address(q), bytes, 256,
                                sync ? std::nullopt : std::optional<std::uintptr_t>(h)});
              live.emplace_back(q, bytes);
            } else {
              const std::size_t k = rng() % live.size();
              const auto [q, bytes] = live[k];
              live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
              if (sync) {
                streams[t].synchronize();
                mr->deallocate(q, bytes);
              } else {
                mr->deallocate_async(q, bytes, 256, streams[t]);
              }
              did[t].push_back({sync ? "free" : "free_async", address(q), bytes, 256,
                                sync ? std::nullopt : std::optional<std::uintptr_t>(h)});
            }
          }
          for (const auto& [q, bytes] : live) {
            mr->deallocate_async(q, bytes, 256, streams[t]);
            did[t].push_back({"free_async", address(q), bytes, 256, h});
          }
        });
      }
      for (auto& th : pool_threads) th.join();
      CHECK(mr->good());
    }
    CHECK(p.statistics().live_allocations == 0);
    const auto got = parse(format == log_format::csv ? file.read() : out.str(), format);
    std::size_t total = 0;
    for (const auto& d : did) total += d.size();
    REQUIRE(got.size() == total);
    CHECK(std::set<std::uint32_t>(ids.begin(), ids.end()).size() == threads);
    // Each thread's lines, in file order, are what it did, in its order.
    std::map<std::uint32_t, std::vector<const line*>> by_thread;
    for (const auto& l : got) by_thread[l.thread].push_back(&l);
    REQUIRE(by_thread.size() == threads);
    for (int t = 0; t < threads; ++t) {
      CAPTURE(t);
      const auto& mine = by_thread[ids[t]];
      REQUIRE(mine.size() == did[t].size());
      int wrong = 0;
      for (std::size_t i = 0; i < mine.size(); ++i) {
        if (!same(*mine[i], did[t][i]) && wrong++ < 3) {
          FAIL_CHECK("line " << i << ": logged " << describe(*mine[i]) << ", did " << describe(did[t][i]));
        }
      }
      CHECK(wrong == 0);
    }
    // Each thread's times never decrease (two threads' lines may show theirs a few ns out of
    // order: a time is read before the line takes its place).
    for (const auto& [id, mine] : by_thread) {
      for (std::size_t i = 1; i < mine.size(); ++i) CHECK(mine[i]->time_ns >= mine[i - 1]->time_ns);
    }
    // Down the file an address is never allocated while live: its free comes first, whichever
    // thread freed it and whichever allocated it again.
    std::map<std::uintptr_t, std::uint32_t> live;  // address -> the thread that allocated it
    std::size_t reused_by_another = 0, misordered = 0;
    std::map<std::uintptr_t, std::uint32_t> last_owner;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const auto& l = got[i];
      REQUIRE(l.pointer.has_value());
      if (l.operation.rfind("allocate", 0) == 0) {
        if (!live.emplace(*l.pointer, l.thread).second) ++misordered;
        const auto before = last_owner.find(*l.pointer);
        if (before != last_owner.end() && before->second != l.thread) ++reused_by_another;
        last_owner[*l.pointer] = l.thread;
      } else if (live.erase(*l.pointer) != 1) {
        ++misordered;
      }
    }
    CHECK(misordered == 0);
    CHECK(live.empty());
    // The check above means something only if threads did get each other's addresses.
    CHECK(reused_by_another > 0);
    MESSAGE(got.size() << " lines; " << reused_by_another << " allocations of an address another thread had");
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_threads, csv_format, json_format);

  TEST_CASE("a free is in the log before its address can be allocated again, by any thread") {
    // The upstream's free returns only after another thread got the address again through the
    // logging resource: a free logged after the upstream returned would come after that
    // allocation in the log, every time.
    handoff_resource up;
    std::ostringstream out;
    const stream s(0);
    constexpr int rounds = 50;
    {
      logging_resource mr(up, out, log_format::json_lines);
      std::thread taker([&] {
        for (int i = 0; i < 2 * rounds; ++i) {
          {
            std::unique_lock lock(up.st->m);
            up.st->cv.wait(lock, [&] { return up.st->handed != nullptr; });
          }
          void* q = i % 2 == 0 ? mr.allocate_async(64, 256, s) : mr.allocate(64, 256);
          std::lock_guard lock(up.st->m);
          CHECK(up.st->handed == nullptr);  // it took the handed address
          (void)q;
          up.st->reallocated = true;
          up.st->cv.notify_all();
        }
      });
      for (int i = 0; i < rounds; ++i) {
        void* q = mr.allocate_async(64, 256, s);
        mr.deallocate_async(q, 64, 256, s);  // returns once the taker has q again
        void* r = mr.allocate(64, 256);
        mr.deallocate(r, 64, 256);
      }
      taker.join();
    }
    const auto got = parse_json(out.str());
    REQUIRE(got.size() == 6 * rounds);  // 4 calls a round here, 2 by the taker
    std::set<std::uintptr_t> live;
    std::size_t misordered = 0;
    for (const auto& l : got) {
      const bool allocation = l.operation.rfind("allocate", 0) == 0;
      misordered += allocation ? !live.insert(*l.pointer).second : live.erase(*l.pointer) != 1;
    }
    CHECK(misordered == 0);
    // Every free was of an address that was then allocated again by the other thread.
    std::size_t reallocated_elsewhere = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i].operation.rfind("free", 0) != 0) continue;
      for (std::size_t j = i + 1; j < got.size(); ++j) {
        if (got[j].pointer == got[i].pointer && got[j].operation.rfind("allocate", 0) == 0) {
          reallocated_elsewhere += got[j].thread != got[i].thread;
          break;
        }
      }
    }
    CHECK(reallocated_elsewhere == 2 * rounds);
  }

  TEST_CASE("equal when writing to the same log over equal upstreams; lines of both in one log") {
    pool p, other;
    stream s(0);
    std::ostringstream out, elsewhere;
    logging_resource first(device_resource(p), out);
    logging_resource second(device_resource(p), first);                    // the same log
    logging_resource third(device_resource(p), elsewhere);                 // another log
    logging_resource fourth(device_resource(other), first);                // the same log, another pool
    logging_resource<host_only_resource> host_side(host_only_resource{}, first);  // any upstream type
    CHECK(first == first);
    CHECK(first == second);
    CHECK(first != third);
    CHECK(first != fourth);
    CHECK(second.format() == log_format::csv);
    // Through CCCL's type erasure, the same answers.
    CHECK(device_ref(first) == device_ref(second));
    CHECK(device_ref(first) != device_ref(third));
    // Allocated through one, freed through the other: both in the one log, in order.
    // Addresses are kept as numbers before the frees: a freed pointer's value is not to be used.
    void* q = first.allocate_async(1000, 256, s);
    const std::uintptr_t qa = address(q);
    second.deallocate_async(q, 1000, 256, s);
    void* r = fourth.allocate(2000);
    const std::uintptr_t ra = address(r);
    void* h = host_side.allocate(64, 64);
    const std::uintptr_t ha = address(h);
    host_side.deallocate(h, 64, 64);
    fourth.deallocate(r, 2000);
    first.flush();
    const auto hs = handle_of(s.get());
    check_lines(parse_csv(out.str()), {{"allocate_async", qa, 1000, 256, hs},
                                       {"free_async", qa, 1000, 256, hs},
                                       {"allocate", ra, 2000, 256, std::nullopt},
                                       {"allocate", ha, 64, 64, std::nullopt},
                                       {"free", ha, 64, 64, std::nullopt},
                                       {"free", ra, 2000, 256, std::nullopt}},
                UINT64_MAX);
    CHECK(elsewhere.str().empty());  // third logged nothing
    CHECK(p.statistics().live_allocations == 0);
    CHECK(other.statistics().live_allocations == 0);
  }

  TEST_CASE("moves: the log goes with the resource; a moved-from one refuses allocations, passes frees on") {
    pool p;
    stream s(0);
    std::ostringstream out;
    logging_resource a(device_resource(p), out, log_format::json_lines);
    void* q = a.allocate_async(512, 256, s);
    logging_resource b(std::move(a));
    CHECK(b.good());
    CHECK_FALSE(a.good());  // NOLINT(bugprone-use-after-move): what a moved-from resource does is the point
    CHECK_THROWS_WITH_AS((void)a.allocate_async(512, 256, s), doctest::Contains("allocate_async: the resource was moved from"),
                         std::logic_error);
    CHECK_THROWS_WITH_AS((void)a.allocate(512), doctest::Contains("allocate: the resource was moved from"), std::logic_error);
    CHECK_THROWS_AS((void)a.format(), std::logic_error);
    CHECK_THROWS_AS(logging_resource(device_resource(p), a), std::invalid_argument);
    CHECK_NOTHROW(a.flush());
    void* r = b.allocate(1024);
    a.deallocate(r, 1024);  // reaches the pool, unlogged
    CHECK(p.statistics().live_allocations == 1);
    // Move assignment: the target's own log is flushed before it takes the other's.
    std::ostringstream out2;
    logging_resource c(device_resource(p), out2, log_format::json_lines);
    void* t = c.allocate(256);
    c.deallocate(t, 256);
    CHECK(out2.str().empty());
    c = std::move(b);
    CHECK(parse_json(out2.str()).size() == 2);
    c.deallocate_async(q, 512, 256, s);
    c.flush();
    const auto hs = handle_of(s.get());
    check_lines(parse_json(out.str()), {{"allocate_async", address(q), 512, 256, hs},
                                        {"allocate", address(r), 1024, 256, std::nullopt},
                                        {"free_async", address(q), 512, 256, hs}},
                UINT64_MAX);
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("a log that cannot be written never fails an allocation; flush() says what was lost") {
    pool p;
    stream s(0);
    refusing_buffer refusing;
    std::ostream broken(&refusing);
    for (const bool every_line : {true, false}) {
      CAPTURE(every_line);
      broken.clear();
      logging_resource mr(device_resource(p), broken, logging_options{.flush_every_line = every_line});
      CHECK(mr.good());
      void* q = nullptr;
      CHECK_NOTHROW(q = mr.allocate_async(4096, 256, s));
      CHECK(q != nullptr);
      CHECK_NOTHROW(mr.deallocate_async(q, 4096, 256, s));
      CHECK(mr.good() == !every_line);  // written (and failed) at once, or still waiting
      CHECK_THROWS_WITH_AS(mr.flush(), doctest::Contains("writing the log failed"), std::runtime_error);
      CHECK_FALSE(mr.good());
      CHECK_THROWS_WITH_AS(mr.flush(), doctest::Contains("bytes of it are lost"), std::runtime_error);
    }  // the destructors do not throw
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("flush_every_line: each line is in the stream as soon as the call returns") {
    pool p;
    stream s(0);
    std::ostringstream out;
    logging_resource mr(device_resource(p), out, logging_options{.format = log_format::json_lines, .flush_every_line = true});
    void* q = mr.allocate_async(300, 256, s);
    CHECK(parse_json(out.str()).size() == 1);
    mr.deallocate_async(q, 300, 256, s);
    const auto got = parse_json(out.str());
    REQUIRE(got.size() == 2);
    CHECK(got[1].operation == "free_async");
    CHECK(got[1].pointer == address(q));
  }

  TEST_CASE_TEMPLATE_DEFINE("the pool's other users write to the log: stream_buffer and pmr_resource", F, logging_users) {
    pool p;
    pool host_pool(pool_properties{.location = memory_location::host_numa(0)});
    stream s(0);
    const auto hs = handle_of(s.get());
    std::ostringstream out;
    const auto made = std::chrono::steady_clock::now();
    std::vector<expected> did;
    {
      logging_resource mr(device_resource(p), out, F::value);
      logging_resource host_mr(host_resource(host_pool), mr);  // the same log
      {
        stream_buffer<int> b(1000, s, mr);
        did.push_back({"allocate_async", address(b.data()), 4000, 256, hs});
        CHECK(p.owns(b.data()));
        CHECK(p.statistics().used_current >= 4000);
        // Growth in place is a resize of the same address; the capacity it reports is logged.
        REQUIRE(b.try_reserve_in_place(100000));
        CHECK(b.capacity() >= 100000);
        did.push_back({"resize_async", address(b.data()), b.capacity() * sizeof(int), 256, hs});
        b.shrink_to_fit();  // size 1000: back to what the elements need, in the pool's blocks
        CHECK(b.capacity() >= 1000);
        CHECK(b.capacity() < 100000);
        const std::size_t kept = b.capacity() * sizeof(int);
        did.push_back({"resize_async", address(b.data()), kept, 256, hs});
        // A moved buffer keeps the log; the moved-from one too (it allocates again on resize).
        stream_buffer<int> taken(std::move(b));
        (void)b.resize(10);
        did.push_back({"allocate_async", address(b.data()), 40, 256, hs});
        const void* first = taken.data();
        taken = stream_buffer<int>(0, s, mr);  // an empty buffer allocates nothing, logs nothing
        did.push_back({"free_async", address(first), kept, 256, hs});
        did.push_back({"free_async", address(b.data()), 40, 256, hs});  // b's destructor, below
      }
      CHECK(p.statistics().live_allocations == 0);
      {
        // A std::pmr resource over the host pool under a logging resource: synchronous...
        pmr_resource sync_mr(host_mr);
        std::pmr::memory_resource& base = sync_mr;
        void* x = base.allocate(3000, 512);
        did.push_back({"allocate", address(x), 3000, 512, std::nullopt});
        CHECK(host_pool.owns(x));
        base.deallocate(x, 3000, 512);
        did.push_back({"free", address(x), 3000, 512, std::nullopt});
        // Equal to another over the same pool writing to the same log, not to one without it.
        CHECK(sync_mr == pmr_resource(host_mr));
        CHECK(sync_mr != pmr_resource(host_resource(host_pool)));
        // ... and in the order of a stream.
        pmr_resource ordered_mr(host_mr, s);
        void* y = static_cast<std::pmr::memory_resource&>(ordered_mr).allocate(64, 8);
        did.push_back({"allocate_async", address(y), 64, 8, hs});
        static_cast<std::pmr::memory_resource&>(ordered_mr).deallocate(y, 64, 8);
        did.push_back({"free_async", address(y), 64, 8, hs});
        // A failure is logged with its exception, then thrown.
        host_pool.set_release_threshold(0);
        CHECK_THROWS_AS((void)base.allocate(std::size_t{1} << 61, 256), out_of_memory);
        did.push_back({"allocate", std::nullopt, std::size_t{1} << 61, 256, std::nullopt, "failed",
                       "streamalloc::out_of_memory", ""});
      }
      CHECK(host_pool.statistics().live_allocations == 0);
      // A moved-from logging resource has no log to give.
      logging_resource moved(std::move(mr));
      CHECK_THROWS_WITH_AS((stream_buffer<int>(10, s, mr)), doctest::Contains("moved from"), std::invalid_argument);
      logging_resource moved_host(std::move(host_mr));
      CHECK_THROWS_WITH_AS((pmr_resource(host_mr)), doctest::Contains("moved from"), std::invalid_argument);
    }
    auto got = parse(out.str(), F::value);
    // The failure's message is the pool's; the test checks that it names the request.
    REQUIRE(got.size() == did.size());
    CHECK(got.back().message.find(std::to_string(std::size_t{1} << 61)) != std::string::npos);
    did.back().message = got.back().message;
    check_lines(got, did, ns_since(made));
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_users, csv_format, json_format);

  TEST_CASE("over any resource: CCCL's resource ref, another logging_resource, a synchronous-only one") {
    pool p;
    stream s(0);
    const auto hs = handle_of(s.get());
    std::ostringstream inner_log, outer_log, ref_log, host_log;
    void* chained = nullptr;
    {
      // A logging_resource over a logging_resource (moved in): each call in both logs.
      logging_resource<logging_resource<device_resource>> outer(logging_resource(device_resource(p), inner_log),
                                                               outer_log);
      chained = outer.allocate_async(700, 1024, s);
      outer.deallocate_async(chained, 700, 1024, s);
      outer.flush();
      CHECK(inner_log.str().empty());  // the inner one writes at its own pace
    }
    const std::vector<expected> both = {{"allocate_async", address(chained), 700, 1024, hs},
                                        {"free_async", address(chained), 700, 1024, hs}};
    check_lines(parse_csv(outer_log.str()), both, UINT64_MAX);
    check_lines(parse_csv(inner_log.str()), both, UINT64_MAX);
    {
      // Over CCCL's type-erased reference: the stream reaches it as a cuda::stream_ref.
      device_resource dr(p);
      logging_resource<device_ref> mr(device_ref(dr), ref_log, log_format::json_lines);
      void* q = mr.allocate_async(4096, 256, stream_ref(s));
      CHECK(p.owns(q));
      mr.deallocate_async(q, 4096, 256, stream_ref(s));
      mr.flush();
      check_lines(parse_json(ref_log.str()), {{"allocate_async", address(q), 4096, 256, hs},
                                              {"free_async", address(q), 4096, 256, hs}},
                  UINT64_MAX);
    }
    {
      // Synchronous only, with a property that has a value: forwarded.
      logging_resource mr(host_only_resource{}, host_log, log_format::json_lines);
      CHECK(get_property(mr, numa_node_property{}) == 3);
      void* q = mr.allocate(100, 128);
      const std::uintptr_t qa = address(q);
      CHECK(qa % 128 == 0);
      mr.deallocate(q, 100, 128);
      mr.flush();
      check_lines(parse_json(host_log.str()), {{"allocate", qa, 100, 128, std::nullopt},
                                               {"free", qa, 100, 128, std::nullopt}},
                  UINT64_MAX);
    }
    CHECK(p.statistics().live_allocations == 0);
  }
}
