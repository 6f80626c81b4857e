// The pool's allocator on a simulated device: defragmentation by remapping free chunks, a
// stream's own pending frees moved as aliases, mappings refused or failed on the way (nothing
// lost), and the limit and the device's memory running out.

#include "pool_core_support.hpp"

#include <stdexcept>
#include <string>
#include <vector>

TEST_CASE("defragmentation: a request that fits only after remapping, without growing") {
  core_options o;
  o.chunk_size = 2 * MiB;  // the granularity: chunks small enough to move
  o.max_size = 8 * MiB;
  o.release_threshold = ~0ull;  // keep free memory at synchronization points
  fixture f(o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  CHECK(f.pool->statistics().reserved_current == 8 * MiB);
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  host_sync(*f.dev, s);
  // 4 MiB are free, in two separate holes: no 4 MiB range, and the pool cannot grow.
  const auto q = f.pool->allocate(4 * MiB, s.key());
  CHECK(f.dev->is_mapped(q, 4 * MiB));
  const auto st = f.pool->statistics();
  CHECK(st.reserved_current == 8 * MiB);
  CHECK(st.remapped_chunks >= 1);  // one when the holes have room after them, two otherwise
  CHECK(st.reserved_high == 8 * MiB);
  // The live blocks kept their memory.
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
}

TEST_CASE("defragmentation and growth: free chunks remapped next to a new handle for what they lack") {
  for (const bool synchronized : {true, false}) {
    CAPTURE(synchronized);
    core_options o;
    o.chunk_size = 2 * MiB;
    o.release_threshold = ~0ull;
    fixture f(o);
    auto s = make_stream();
    std::vector<std::uint64_t> p;
    for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
    if (!synchronized) f.dev->busy.insert(s.native);  // s's work has not run: its frees neither
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
    if (synchronized) host_sync(*f.dev, s);
    // 6 MiB asked, 4 MiB free in two whole chunks, two holes between live blocks.
    auto other = make_stream();  // a stream without proof of s's order: only clear chunks help it
    const auto q = f.pool->allocate(6 * MiB, other.key());
    CHECK(f.dev->is_mapped(q, 6 * MiB));
    const auto st = f.pool->statistics();
    if (synchronized) {
      // The two free chunks moved next to a new 2 MiB handle: the pool grew by what they lacked.
      CHECK(st.reserved_current == 10 * MiB);
      CHECK(st.remapped_chunks == 2);
    } else {
      // Freed but not known complete: their memory may still be in use, so nothing moves.
      CHECK(st.reserved_current == 14 * MiB);
      CHECK(st.remapped_chunks == 0);
      CHECK(f.dev->is_mapped(p[0], 2 * MiB));
      CHECK(f.dev->is_mapped(p[2], 2 * MiB));
    }
    CHECK(f.dev->is_mapped(p[1], 2 * MiB));
    CHECK(f.dev->is_mapped(p[3], 2 * MiB));
    f.pool->deallocate(q, other.key());
    f.pool->deallocate(p[1], s.key());
    f.pool->deallocate(p[3], s.key());
    f.dev->run_all();
  }
}

TEST_CASE("a stream's own frees, not yet run, move as aliases: its large request remaps them without waiting") {
  fixture f(movable_chunks());
  auto s = make_stream(), other = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const std::uint64_t h0 = f.dev->mapped_handle.at(p[0]), h2 = f.dev->mapped_handle.at(p[2]);
  f.dev->busy.insert(s.native);  // a host running ahead: s's work, its frees included, has not run
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  // Another stream may not have that memory: its request grows the pool.
  const auto before_other = f.pool->statistics().reserved_current;
  const auto elsewhere = f.pool->allocate(4 * MiB, other.key());
  CHECK(f.pool->statistics().reserved_current == before_other + 4 * MiB);
  CHECK(f.dev->mapped_handle.at(elsewhere) != h0);
  CHECK(f.dev->mapped_handle.at(elsewhere) != h2);
  // 6 MiB on s: its own 4 MiB of frees lie in two holes between live blocks, not yet run. The
  // two chunks are mapped again next to 2 MiB of new memory; their old addresses stay mapped.
  const auto before = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(6 * MiB, s.key());
  const auto st = f.pool->statistics();
  CHECK(f.dev->host_waits == 0);
  CHECK(st.reserved_current == before + 2 * MiB);
  CHECK(st.remapped_chunks == 2);
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  CHECK(f.dev->mapped_handle.at(q) == h0);
  CHECK(f.dev->mapped_handle.at(q + 2 * MiB) == h2);
  CHECK(f.dev->is_mapped(p[0], 2 * MiB));  // work before the frees may still use these
  CHECK(f.dev->is_mapped(p[2], 2 * MiB));
  CHECK(f.pool->frees_in_flight());
  // Once s has run and the pool learns it, the old addresses go.
  host_sync(*f.dev, s);
  f.pool->on_synchronize(s.record->id());
  CHECK_FALSE(f.dev->is_mapped(p[0], 2 * MiB));
  CHECK_FALSE(f.dev->is_mapped(p[2], 2 * MiB));
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  CHECK(f.pool->statistics().reserved_current == before + 2 * MiB);
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  f.pool->deallocate(elsewhere, other.key());
  host_sync(*f.dev, s);
  host_sync(*f.dev, other);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);
  CHECK(f.dev->mapped.empty());
}

TEST_CASE("aliases still mapped at their old addresses are unmapped before a closing pool releases them") {
  fixture f(movable_chunks());
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.dev->busy.insert(s.native);
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  const auto q = f.pool->allocate(4 * MiB, s.key());
  CHECK(f.pool->statistics().remapped_chunks == 2);
  CHECK(f.dev->is_mapped(p[0], 2 * MiB));
  f.dev->run_all();  // what a closing pool waits for (pool_state synchronizes the devices)
  (void)f.pool->shutdown();  // the simulated device aborts on releasing a handle still mapped
  CHECK(f.dev->mapped.empty());
  CHECK(f.dev->handles.empty());
  (void)q;
}

TEST_CASE("an alias of frees with different stamps stays mapped until the newest has run") {
  // One chunk holds two of s's frees kept apart by an event between them: A's, covered by the
  // event, and B's, newer. When the event completes, A's old addresses may still be read by
  // nothing, but B's may: the chunk's old mapping must wait for B's free, the newest.
  fixture f(movable_chunks());
  auto s = make_stream();
  const auto a = f.pool->allocate(1 * MiB, s.key());
  const auto b = f.pool->allocate(1 * MiB, s.key());
  const auto l = f.pool->allocate(2 * MiB, s.key());
  const auto x = f.pool->allocate(2 * MiB, s.key());
  const auto l2 = f.pool->allocate(2 * MiB, s.key());
  REQUIRE(b == a + 1 * MiB);  // a and b share the first chunk
  f.dev->busy.insert(s.native);
  f.pool->deallocate(x, s.key());
  f.pool->deallocate(a, s.key());
  (void)f.pool->frees_in_flight();  // an event on s covering the frees of a and x
  f.pool->deallocate(b, s.key());   // newer than the event
  f.dev->streams[s.native].completed = 0;
  const auto q = f.pool->allocate(4 * MiB, s.key());  // the chunks of a+b and of x, moved
  CHECK(f.pool->statistics().remapped_chunks == 2);
  f.dev->streams[s.native].completed = 1;  // the event has run; b's free has not
  f.pool->trim_to(~0ull);
  CHECK(f.dev->is_mapped(a, 2 * MiB));  // b's free may still run there
  for (const auto p : {q, l, l2}) f.pool->deallocate(p, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK_FALSE(f.dev->is_mapped(a, 2 * MiB));
  CHECK(f.dev->mapped.empty());
}

TEST_CASE("no alias when the stream's frees leave a live block in every chunk: the pool grows") {
  fixture f(movable_chunks());
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(1 * MiB, s.key()));  // two per chunk
  f.dev->busy.insert(s.native);
  for (int i = 0; i < 8; i += 2) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  const auto held = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(4 * MiB, s.key());  // 4 MiB pending on s, in 1 MiB holes
  CHECK(f.pool->statistics().reserved_current == held + 4 * MiB);
  CHECK(f.pool->statistics().remapped_chunks == 0);
  for (int i = 0; i < 8; i += 2) CHECK(f.dev->is_mapped(p[static_cast<std::size_t>(i)], 1 * MiB));
  for (int i = 1; i < 8; i += 2) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
  f.pool->deallocate(q, s.key());
  f.dev->run_all();
}

namespace {
/// The history, kept from the pool's start: every test below that refuses or fails a mapping.
void keep_history(fixture& f) { f.pool->history().keep(1 << 14); }
}  // namespace

TEST_CASE("a mapping refused while defragmenting: the request is served by growth, nothing lost") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  host_sync(*f.dev, s);
  // Two clear chunks in two holes; the first one's new mapping is refused. Its memory goes back
  // to the device, and the other chunk moves next to 2 MiB of new memory instead.
  f.dev->refuse_maps = 1;
  const auto q = f.pool->allocate(4 * MiB, s.key());
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.dev->is_mapped(q, 4 * MiB));
  const auto st = f.pool->statistics();
  CHECK(st.remapped_chunks == 1);
  CHECK(st.reserved_current == 8 * MiB);
  CHECK(f.dev->handles.size() == 4);
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("a mapping refused while moving a stream's own frees as aliases: they stay, the pool grows") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const std::uint64_t h0 = f.dev->mapped_handle.at(p[0]), h2 = f.dev->mapped_handle.at(p[2]);
  f.dev->busy.insert(s.native);  // s's frees have not run
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  f.dev->refuse_maps = 1;
  const auto held = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(6 * MiB, s.key());
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  CHECK(f.pool->statistics().remapped_chunks == 0);
  CHECK(f.pool->statistics().reserved_current == held + 6 * MiB);
  for (std::uint64_t at = q; at < q + 6 * MiB; at += 2 * MiB) {
    CHECK(f.dev->mapped_handle.at(at) != h0);  // the refused alias left no second mapping
    CHECK(f.dev->mapped_handle.at(at) != h2);
  }
  CHECK(f.dev->is_mapped(p[0], 2 * MiB));  // s's frees may still run there
  CHECK(f.dev->is_mapped(p[2], 2 * MiB));
  f.dev->busy.erase(s.native);
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("a refused mapping of the new memory beside moved chunks: the error reaches the caller, nothing lost") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream(), other = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  host_sync(*f.dev, s);
  // 6 MiB: the two clear chunks move (refused: the first), then the new memory after them is
  // refused too. Growth fails as it would on its own: the driver's error is thrown.
  f.dev->refuse_maps = 2;
  CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, other.key()), std::runtime_error);
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
  // The pool still serves the request once the driver maps again.
  const auto q = f.pool->allocate(6 * MiB, other.key());
  CHECK(f.dev->is_mapped(q, 6 * MiB));
  f.pool->deallocate(q, other.key());
  for (const auto x : {p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s, &other});
}

TEST_CASE("growth whose mapping is refused: the error reaches the caller, the unmapped chunks go back") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  f.dev->refuse_maps = 1;  // a 6 MiB request grows by three 2 MiB chunks: the first is refused
  CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, s.key()), std::runtime_error);
  CHECK(f.dev->handles.empty());
  CHECK(f.pool->statistics().reserved_current == 0);
  const auto p = f.pool->allocate(6 * MiB, s.key());
  CHECK(f.dev->is_mapped(p, 6 * MiB));
  // grow_in_place says no, changing nothing, when the mapping behind the block is refused.
  f.dev->refuse_maps = 2;  // it tries twice: again after learning what completed
  CHECK(f.pool->grow_in_place(p, 10 * MiB, s.key()) == 0);
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.pool->statistics().reserved_current == 6 * MiB);
  CHECK(f.pool->grow_in_place(p, 10 * MiB, s.key()) == 10 * MiB);
  f.pool->deallocate(p, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("a mapping refused part-way: what was mapped stays, the rest goes back, nothing lost") {
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream(), other = make_stream();
  SUBCASE("growth: the second of three chunks refused") {
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    CHECK_THROWS_AS((void)f.pool->allocate(6 * MiB, s.key()), std::runtime_error);
    CHECK(f.pool->addresses_consistent());
    CHECK(f.dev->handles.size() == 1);  // the first, mapped, is the pool's free memory
    CHECK(f.pool->statistics().reserved_current == 2 * MiB);
    const auto p = f.pool->allocate(6 * MiB, s.key());
    CHECK(f.dev->is_mapped(p, 6 * MiB));
    f.pool->deallocate(p, s.key());
    check_nothing_lost(f, {&s, &other});
    return;
  }
  // Six chunks, three of them free and clear, in three holes between live blocks.
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 6; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  auto finish = [&](std::initializer_list<std::uint64_t> more) {
    CHECK(f.pool->addresses_consistent());
    for (int i : {1, 3, 5}) CHECK(f.dev->is_mapped(p[static_cast<std::size_t>(i)], 2 * MiB));
    f.dev->busy.clear();
    for (int i : {1, 3, 5}) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
    for (const auto x : more) f.pool->deallocate(x, s.key());
    check_nothing_lost(f, {&s, &other});
  };
  SUBCASE("defragmenting for 6 MiB: the second of three moves refused") {
    for (int i : {0, 2, 4}) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
    host_sync(*f.dev, s);
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    const auto q = f.pool->allocate(6 * MiB, s.key());
    CHECK(f.dev->refuse_maps == 0);
    CHECK(f.dev->is_mapped(q, 6 * MiB));
    // The refused chunk went back to the device; the two others moved next to 2 MiB of new memory.
    CHECK(f.pool->statistics().reserved_current == 12 * MiB);
    CHECK(f.dev->handles.size() == 6);
    finish({q});
  }
  SUBCASE("defragmenting and growing for 8 MiB: the second move refused, so no new memory beside them") {
    for (int i : {0, 2, 4}) f.pool->deallocate(p[static_cast<std::size_t>(i)], s.key());
    host_sync(*f.dev, s);
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    const auto creates = f.dev->creates;
    const auto q = f.pool->allocate(8 * MiB, other.key());
    CHECK(f.dev->refuse_maps == 0);
    CHECK(f.dev->is_mapped(q, 8 * MiB));
    // One chunk moved, one went back; growth extended the moved one by three new chunks.
    CHECK(f.pool->statistics().reserved_current == 16 * MiB);
    CHECK(f.dev->creates == creates + 1 + 3);  // the handle made for the rest, released unmapped
    f.pool->deallocate(q, other.key());
    host_sync(*f.dev, other);
    finish({});
  }
  SUBCASE("a clear chunk moved, then a stream's own pending one refused as an alias") {
    f.pool->deallocate(p[0], s.key());
    host_sync(*f.dev, s);
    f.dev->busy.insert(s.native);  // s's later frees have not run
    f.pool->deallocate(p[2], s.key());
    f.pool->deallocate(p[4], s.key());
    f.dev->maps_before_refusal = 1;
    f.dev->refuse_maps = 1;
    const auto q = f.pool->allocate(6 * MiB, s.key());
    CHECK(f.dev->refuse_maps == 0);
    CHECK(f.dev->is_mapped(q, 6 * MiB));
    CHECK(f.pool->statistics().remapped_chunks == 1);
    CHECK(f.dev->is_mapped(p[2], 2 * MiB));  // not moved: s's frees may still run there
    CHECK(f.dev->is_mapped(p[4], 2 * MiB));
    CHECK(f.dev->mapped.size() == 6 + 2);   // no alias: six chunks where they were or moved, two new
    finish({q});
  }
}

TEST_CASE("a map that fails for another reason than a shortage: the error reaches the caller, nothing lost") {
  // Only a refusal for lack of memory lets remapping and growth in place go on without the
  // mapping; a sticky error or a lost context must not be hidden until the next growth.
  fixture f(movable_chunks());
  keep_history(f);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const char* failed = "map: failed (simulated error, not a shortage)";
  auto fail_next_map = [&] {
    f.dev->fail_maps = true;
    f.dev->refuse_maps = 1;
  };
  SUBCASE("moving a clear chunk") {
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
    host_sync(*f.dev, s);
    fail_next_map();
    const auto creates = f.dev->creates;
    CHECK_THROWS_WITH_AS((void)f.pool->allocate(4 * MiB, s.key()), failed, std::runtime_error);
    CHECK(f.dev->creates == creates);  // not served by growth behind the error's back
    CHECK(f.pool->statistics().reserved_current == 6 * MiB);  // the chunk in the failed move went back
  }
  SUBCASE("moving a stream's own pending chunk as an alias") {
    f.dev->busy.insert(s.native);
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
    fail_next_map();
    const auto creates = f.dev->creates;
    CHECK_THROWS_WITH_AS((void)f.pool->allocate(4 * MiB, s.key()), failed, std::runtime_error);
    CHECK(f.dev->creates == creates);  // the alias failed, not growth
    CHECK(f.dev->is_mapped(p[0], 2 * MiB));  // nothing changed: s's frees may still run there
    CHECK(f.dev->is_mapped(p[2], 2 * MiB));
    CHECK(f.pool->statistics().reserved_current == 8 * MiB);
    f.dev->busy.clear();
  }
  SUBCASE("growing a block in place") {
    fail_next_map();
    CHECK_THROWS_WITH_AS((void)f.pool->grow_in_place(p[3], 4 * MiB, s.key()), failed, std::runtime_error);
    CHECK(f.pool->statistics().reserved_current == 8 * MiB);
    f.pool->deallocate(p[0], s.key());
    f.pool->deallocate(p[2], s.key());
  }
  f.dev->fail_maps = false;
  CHECK(f.dev->refuse_maps == 0);
  CHECK(f.pool->addresses_consistent());
  CHECK(f.dev->is_mapped(p[1], 2 * MiB));
  CHECK(f.dev->is_mapped(p[3], 2 * MiB));
  const auto q = f.pool->allocate(4 * MiB, s.key());  // served once the device maps again
  CHECK(f.dev->is_mapped(q, 4 * MiB));
  for (const auto x : {q, p[1], p[3]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("the limit and the device's memory end in core_out_of_memory, with the state named") {
  core_options o;
  o.max_size = 64 * MiB;
  fixture f(o);
  auto s = make_stream();
  (void)f.pool->allocate(60 * MiB, s.key());
  try {
    (void)f.pool->allocate(8 * MiB, s.key());
    FAIL("should not fit");
  } catch (const core_out_of_memory& e) {
    CHECK(e.requested == 8 * MiB);
    CHECK(e.reason.find("at most 67108864") != std::string::npos);
  }
  fixture g;
  g.dev->capacity = 128 * MiB;
  CHECK_THROWS_AS(g.pool->allocate(256 * MiB, s.key()), core_out_of_memory);
}
