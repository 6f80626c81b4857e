// The pool core's side of IPC on a simulated device (pool_exports.hpp): a block another
// process imports is neither reused, released nor remapped until its imports are released,
// whatever this process does with it; stale and forged descriptors are refused.

#include <streamalloc/detail/core/pool_core.hpp>

#include <doctest/doctest.h>

#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <stdexcept>
#include <string>
#include <vector>

using namespace streamalloc::detail;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

namespace {
constexpr std::uint64_t MiB = 1ull << 20;
using core = pool_core<sim_backend>;
using test_support::make_stream;

struct fixture {
  std::shared_ptr<sim_device> dev = std::make_shared<sim_device>();
  std::unique_ptr<core> pool;
  fixture() {
    core_options o;
    o.address_space = 64ull << 30;
    o.chunk_size = 8 * MiB;
    pool = std::make_unique<core>(sim_backend{dev}, o);
  }
  ~fixture() { pool->shutdown(); }
};

void host_sync(sim_device& dev, const test_support::test_stream& s) {
  const auto epoch = s.record->begin_synchronize();
  dev.run(s.native);
  ordering().complete_stream(*s.record, epoch);
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(nothing thrown)";
}
}  // namespace

TEST_CASE("a block freed here while imported is reused only after the import is released") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(4096, s.key());
  const auto exported = f.pool->export_block(p);
  CHECK(exported.serial != 0);
  CHECK(exported.size == 4096);
  CHECK(f.pool->export_block(p).serial == exported.serial);  // exporting again: the same descriptor

  block* held = f.pool->import_block(p, exported.serial, 4096);
  f.pool->deallocate(p, s.key());
  host_sync(*f.dev, s);
  CHECK(f.pool->imported_held() == 4096);
  CHECK(f.pool->statistics().free_pending >= 4096);
  CHECK(f.pool->statistics().used_current == 0);  // freed, as far as this process's accounting goes

  // Neither this stream nor another gets it, nor is its chunk released.
  std::vector<std::uint64_t> others;
  for (int i = 0; i < 64; ++i) {
    others.push_back(f.pool->allocate(4096, s.key()));
    CHECK(others.back() != p);
  }
  for (auto q : others) f.pool->deallocate(q, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK(f.dev->is_mapped(p, 4096));
  CHECK(what_of([&] { f.pool->deallocate(p, s.key()); }).find("double free") != std::string::npos);

  f.pool->release_import(held);
  CHECK(f.pool->imported_held() == 0);
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);  // everything went back
}

TEST_CASE("an import released before the free leaves an ordinary free") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(1000, s.key());
  const auto e = f.pool->export_block(p);
  block* held = f.pool->import_block(p, e.serial, 1000);
  block* again = f.pool->import_block(p, e.serial, 1000);  // a second importer
  CHECK(held == again);
  f.pool->release_import(held);
  f.pool->release_import(again);
  f.pool->deallocate(p, s.key());
  CHECK(f.pool->imported_held() == 0);
  CHECK(f.pool->allocate(1000, s.key()) == p);  // reusable on its stream at once, as any free
}

TEST_CASE("stale and forged descriptors are refused, changing nothing") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(4096, s.key());
  const auto old = f.pool->export_block(p);
  f.pool->deallocate(p, s.key());
  CHECK(what_of([&] { (void)f.pool->import_block(p, old.serial, 4096); }).find("stale") != std::string::npos);

  const auto q = f.pool->allocate(4096, s.key());  // the same address, another allocation
  REQUIRE(q == p);
  CHECK(what_of([&] { (void)f.pool->import_block(q, old.serial, 4096); }).find("stale") != std::string::npos);
  const auto fresh = f.pool->export_block(q);
  CHECK(fresh.serial != old.serial);
  CHECK(what_of([&] { (void)f.pool->import_block(q, fresh.serial, 8192); }).find("forged") != std::string::npos);
  CHECK(what_of([&] { (void)f.pool->import_block(q, fresh.serial, 0); }).find("forged") != std::string::npos);
  CHECK(what_of([&] { (void)f.pool->import_block(q + 256, fresh.serial, 256); }).find("stale") !=
        std::string::npos);
  CHECK(what_of([&] { (void)f.pool->export_block(q + 256); }).find("inside an allocation") != std::string::npos);
  f.pool->deallocate(q, s.key());
  CHECK(f.pool->imported_held() == 0);
}

TEST_CASE("a shrink is refused while imported and makes older descriptors stale otherwise") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(64 * 1024, s.key());
  const auto e = f.pool->export_block(p);
  block* held = f.pool->import_block(p, e.serial, 64 * 1024);
  CHECK(f.pool->shrink_in_place(p, 4096, s.key()) == 64 * 1024);
  f.pool->release_import(held);
  CHECK(f.pool->shrink_in_place(p, 4096, s.key()) == 4096);
  CHECK(what_of([&] { (void)f.pool->import_block(p, e.serial, 4096); }).find("stale") != std::string::npos);
  f.pool->deallocate(p, s.key());
}

TEST_CASE("the freeing stream's state outlives the stream while an import holds its free") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(4096, s.key());
  const auto e = f.pool->export_block(p);
  block* held = f.pool->import_block(p, e.serial, 4096);
  f.pool->deallocate(p, s.key());
  f.pool->on_retire(s.record->id(), true);
  ordering().retire(s.record->id());
  CHECK(f.pool->stream_states().in_use >= 1);
  f.pool->release_import(held);  // back in the retired stream's order
  f.dev->run_all();
  f.pool->on_synchronize(0);
  auto t = make_stream();
  (void)f.pool->allocate(4096, t.key());  // a slow-path look at the retired streams
  CHECK(f.pool->imported_held() == 0);
  CHECK(f.pool->stream_states().in_use == 1);
}

TEST_CASE("the pieces of a block: the chunks under it, with offsets") {
  fixture f;
  auto s = make_stream();
  const auto small = f.pool->allocate(4096, s.key());
  const auto large = f.pool->allocate(20 * MiB, s.key());  // a chunk of its own
  for (auto [p, n] : {std::pair{small, std::uint64_t{4096}}, std::pair{large, 20 * MiB}}) {
    const auto e = f.pool->export_block(p);
    block* b = f.pool->import_block(p, e.serial, n);
    std::uint64_t covered = 0, at = p;
    f.pool->for_each_piece(b, n, [&](std::uint64_t chunk_va, const auto& c, std::uint64_t offset, std::uint64_t length) {
      CHECK(chunk_va + offset == at);
      CHECK(offset + length <= c.size);
      at += length;
      covered += length;
    });
    CHECK(covered == n);
    f.pool->release_import(b);
    f.pool->deallocate(p, s.key());
  }
}
