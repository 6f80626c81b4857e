// What a pool shows of itself, against the fake driver: pool::snapshot (every block by address
// with its state, the streams' live and pending bytes, reservations and chunks, statistics),
// the history kept by keep_history (the last N events in order, the dropped ones counted), the
// words of out_of_memory (what was asked, live, free, pending on which stream, the limit, the
// device's memory) and the out-of-memory handler (called once per failure, retries on true).

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

using namespace streamalloc;
using streamalloc_test::MiB;

namespace {

std::string addr(const void* p) { return std::to_string(reinterpret_cast<std::uintptr_t>(p)); }

/// The JSON text of the block at `p`, as pool::snapshot writes it (up to its closing brace).
std::string block_at(const std::string& doc, const void* p) {
  const std::string key = "{\"address\": " + addr(p) + ", ";
  const auto at = doc.find(key, doc.find("\"blocks\": ["));
  if (at == std::string::npos) return {};
  return doc.substr(at, doc.find('}', at) - at + 1);
}

std::size_t count_of(const std::string& doc, const std::string& part) {
  std::size_t n = 0;
  for (auto at = doc.find(part); at != std::string::npos; at = doc.find(part, at + 1)) ++n;
  return n;
}

/// The age_ms of a block's JSON text; -1 without one.
long long age_of(const std::string& block) {
  const auto at = block.find("\"age_ms\": ");
  return at == std::string::npos ? -1 : std::stoll(block.substr(at + 10));
}

pool_properties limited(std::size_t max) {
  pool_properties p;
  p.chunk_size = 2 * MiB;
  p.max_size = max;
  p.release_threshold = SIZE_MAX;
  return p;
}

}  // namespace

TEST_SUITE("observability") {

TEST_CASE("a snapshot lists every block with its state, and the streams' live and pending bytes") {
  pool p(limited(0));
  stream s0, s1;
  void* a = p.allocate(MiB, s0);
  void* b = p.allocate(3 * 256, s0);
  // Live blocks allocated while the history is on carry their age, also once the history has
  // dropped their events (a ring of 8 here).
  p.keep_history(8);
  void* d = p.allocate(4096, s1);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  void* c = p.allocate(MiB, s1);
  for (int i = 0; i < 10; ++i) p.deallocate(p.allocate(512, s1), s1);
  p.deallocate(b, s0);
  const std::string doc = p.snapshot();
  CHECK(doc.front() == '{');
  CHECK(doc.back() == '}');
  // Allocated with the history off: no age.
  CHECK(block_at(doc, a) == "{\"address\": " + addr(a) + ", \"bytes\": " + std::to_string(MiB) + ", \"state\": \"live\"}");
  CHECK(block_at(doc, c).find("\"state\": \"live\"") != std::string::npos);
  CHECK(doc.find("\"address\": " + addr(d), doc.find("\"history\"")) == std::string::npos);  // its event dropped
  CHECK(age_of(block_at(doc, d)) >= 75);
  CHECK(age_of(block_at(doc, d)) < 60000);
  CHECK(age_of(block_at(doc, c)) >= 0);
  CHECK(age_of(block_at(doc, c)) + 60 <= age_of(block_at(doc, d)));
  CHECK(age_of(block_at(doc, b)) == -1);  // freed: its free's stream and stamp instead
  const std::string freed = block_at(doc, b);
  CHECK(freed.find("\"bytes\": 768") != std::string::npos);
  CHECK((freed.find("\"state\": \"pending\"") != std::string::npos || freed.find("\"state\": \"free\"") != std::string::npos));
  const pool_statistics st = p.statistics();
  CHECK(count_of(doc, "{\"address\": ") == st.chunks + 1 /* reservations */ + count_of(doc, "\"state\": "));
  CHECK(count_of(doc, "\"state\": \"live\"") == st.live_allocations);
  CHECK(doc.find("\"used_current\": " + std::to_string(st.used_current)) != std::string::npos);
  CHECK(doc.find("\"live_bytes\": " + std::to_string(MiB + 4096)) != std::string::npos);  // s1's
  CHECK(doc.find("\"device_memory\": {\"free\": ") != std::string::npos);
  // The blocks tile the chunks: their bytes add up to what is mapped.
  std::size_t tiled = 0;
  for (auto at = doc.find("\"state\": "); at != std::string::npos; at = doc.find("\"state\": ", at + 1)) {
    const auto bytes_at = doc.rfind("\"bytes\": ", at);
    tiled += std::stoull(doc.substr(bytes_at + 9));
  }
  CHECK(tiled == st.reserved_current);
  p.deallocate(a, s0);
  p.deallocate(c, s1);
  p.deallocate(d, s1);
}

TEST_CASE("the history keeps the last N events in order and counts those dropped") {
  pool p(limited(0));
  stream s;
  p.keep_history(4);
  void* x = p.allocate(MiB, s);  // the pool grows first: grow, allocate
  p.deallocate(x, s);
  void* y = p.allocate(MiB, s);
  p.deallocate(y, s);
  const std::string doc = p.snapshot();
  // Five events, four kept: the growth is the one dropped.
  CHECK(doc.find("\"history\": {\"capacity\": 4, \"dropped\": 1, \"events\": [") != std::string::npos);
  const std::string events = doc.substr(doc.find("\"events\""));
  CHECK(count_of(events, "\"op\": ") == 4);
  std::size_t at = 0;
  for (const char* op : {"allocate", "free", "allocate", "free"}) {  // oldest first
    at = events.find(std::string("\"op\": \"") + op + "\"", at);
    REQUIRE(at != std::string::npos);
    ++at;
  }
  CHECK(count_of(events, "\"address\": " + addr(y) + ", \"bytes\": " + std::to_string(MiB)) == 4);  // x's too

  pool q(limited(0));
  q.keep_history(8);
  void* z = q.allocate(3 * MiB, s);
  const std::string grown = q.snapshot();
  CHECK(grown.find("\"op\": \"grow\"") != std::string::npos);
  CHECK(grown.find("\"dropped\": 0") != std::string::npos);
  q.deallocate(z, s);
  p.keep_history(0);
  CHECK(p.snapshot().find("\"history\"") == std::string::npos);
}

TEST_CASE("out_of_memory says what was asked, what is live, free and pending on which stream, and the limit") {
  pool_properties props = limited(4 * MiB);
  props.reuse = {false, false, false};  // s1's free stays pending for s0 whatever the fake driver ran
  pool p(props);
  stream s0, s1;
  void* a = p.allocate(2 * MiB, s0);
  void* b = p.allocate(2 * MiB, s1);
  p.deallocate(b, s1);  // pending on s1: s0 has no proof of it
  std::string what;
  try {
    (void)p.allocate(2 * MiB, s0);
  } catch (const out_of_memory& e) {
    what = e.what();
    CHECK(e.requested() == 2 * MiB);
  }
  MESSAGE(what);
  CHECK(what.find("cannot allocate 2097152 bytes") != std::string::npos);
  CHECK(what.find("of at most 4194304 (max_size)") != std::string::npos);
  CHECK(what.find("live 2097152") != std::string::npos);
  CHECK(what.find("freed but awaiting stream order 2097152 (2097152 on stream ") != std::string::npos);
  CHECK(what.find("the device has ") != std::string::npos);
  p.deallocate(a, s0);
}

TEST_CASE("the out-of-memory handler is called once per failure; true retries, false throws") {
  pool p(limited(4 * MiB));
  stream s;
  void* a = p.allocate(4 * MiB, s);
  int calls = 0;
  p.set_out_of_memory_handler([&](const out_of_memory& e) {
    ++calls;
    CHECK(e.requested() == 2 * MiB);
    if (a == nullptr) return false;
    p.deallocate(a, s);  // makes room on the same stream: the retry finds it
    a = nullptr;
    return true;
  });
  void* b = p.allocate(2 * MiB, s);
  CHECK(b != nullptr);
  CHECK(calls == 1);
  void* c = p.allocate(2 * MiB, s);  // the other half of the freed memory
  CHECK(calls == 1);
  CHECK_THROWS_AS((void)p.allocate(2 * MiB, s), out_of_memory);  // the handler gives up
  CHECK(calls == 2);
  p.set_out_of_memory_handler([](const out_of_memory&) -> bool { throw std::runtime_error("handler says no"); });
  CHECK_THROWS_WITH_AS((void)p.allocate(2 * MiB, s), "handler says no", std::runtime_error);
  p.set_out_of_memory_handler({});
  CHECK_THROWS_AS((void)p.allocate(2 * MiB, s), out_of_memory);
  CHECK(calls == 2);
  p.deallocate(b, s);
  p.deallocate(c, s);
}

}  // TEST_SUITE
