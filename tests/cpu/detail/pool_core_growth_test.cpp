// The pool's allocator on a simulated device: growth and release. Large requests built from
// chunks, compact growth, grow_in_place and shrink_in_place, trim, the release threshold and
// retiring streams, address reservations, and where large allocations are placed.

#include "pool_core_support.hpp"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

TEST_CASE("a large request is built from chunks: small blocks placed in its memory after its free pin one") {
  // A training step's logits (1,020 MiB here) are freed, the optimizer's first state lands at
  // the start of their memory and lives on, and the next step asks for the logits again.
  // With one handle of its own per large request, those few MiB pinned the whole 1,000 MiB
  // and the pool grew by another 1,020 MiB; built from 64 MiB chunks, it grows by one chunk.
  for (const bool own : {false, true}) {
    CAPTURE(own);
    core_options o;
    o.own_chunk_for_large = own;
    o.release_threshold = ~std::uint64_t{0};
    fixture f(o);
    auto s = make_stream();
    const auto logits = f.pool->allocate(1020 * MiB, s.key());
    CHECK(f.pool->statistics().chunks == (own ? 1u : 16u));  // 1,024 MiB in chunks
    f.pool->deallocate(logits, s.key());
    host_sync(*f.dev, s);
    const auto state = f.pool->allocate(9 * MiB, s.key());
    CHECK(state == logits);  // best fit: the freed memory's start
    const auto again = f.pool->allocate(1020 * MiB, s.key());
    CHECK(f.dev->is_mapped(again, 1020 * MiB));
    CHECK((again >= state + 9 * MiB || again + 1020 * MiB <= state));
    const auto held = f.pool->statistics().reserved_current;
    if (own) {
      CHECK(held == 2040 * MiB);
    } else {
      CHECK(held == 1088 * MiB);  // one more chunk, after the 1,015 MiB left free
      CHECK(again == state + 9 * MiB);
    }
    f.pool->deallocate(again, s.key());
    f.pool->deallocate(state, s.key());
  }
}

TEST_CASE("compact growth: a request no address run can hold fails at once, before any chunk is made") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.own_chunk_for_large = false;  // large requests built from chunks, as `compact` does
  fixture f(o);
  auto s = make_stream();
  // 2^60 bytes would be 2^39 chunks: listed one by one, that exhausted the host's memory.
  CHECK_THROWS_AS((void)f.pool->allocate(1ull << 60, s.key()), core_out_of_memory);
  CHECK(f.dev->physical_used == 0);
  CHECK(f.pool->statistics().reserved_current == 0);
}

TEST_CASE("compact growth: when releasing free chunks takes the tail it was sized for, it sizes afresh") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.own_chunk_for_large = false;
  o.release_threshold = ~std::uint64_t{0};  // free chunks stay until growth needs their memory
  fixture f(o);
  f.dev->capacity = 64 * MiB;
  auto s = make_stream();
  // One run: [x free 20 MiB][a live 2 MiB][t free 10 MiB, the run's tail].
  const auto x = f.pool->allocate(20 * MiB, s.key());
  const auto a = f.pool->allocate(2 * MiB, s.key());
  const auto t = f.pool->allocate(10 * MiB, s.key());
  REQUIRE(a == x + 20 * MiB);
  REQUIRE(t == a + 2 * MiB);
  f.pool->deallocate(x, s.key());
  f.pool->deallocate(t, s.key());
  host_sync(*f.dev, s);
  REQUIRE(f.dev->physical_used == 32 * MiB);
  // 50 MiB: extending the tail needs 40 MiB more, and the device has 32 MiB free, so the pool
  // gives back its free chunks (the tail among them). Then 50 MiB of fresh chunks fit.
  const auto p = f.pool->allocate(50 * MiB, s.key());
  CHECK(f.pool->find_live(p)->second == 50 * MiB);
  CHECK(f.dev->is_mapped(p, 50 * MiB));
  CHECK(f.dev->is_mapped(a, 2 * MiB));
  CHECK(f.dev->physical_used == 52 * MiB);
  f.pool->deallocate(p, s.key());
  f.pool->deallocate(a, s.key());
}

TEST_CASE("shrink_in_place: a size within 255 bytes of 2^64 leaves the block as it is") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(4 * MiB, s.key());
  for (const std::uint64_t huge : {~std::uint64_t{0}, ~std::uint64_t{0} - 255, ~std::uint64_t{0} - 100}) {
    CAPTURE(huge);
    CHECK(f.pool->shrink_in_place(p, huge, s.key()) == 4 * MiB);
    CHECK(f.pool->find_live(p)->second == 4 * MiB);
  }
  CHECK(f.pool->statistics().used_current == 4 * MiB);
  f.pool->deallocate(p, s.key());
}

TEST_CASE("releasing: trim and the release threshold give back whole free chunks only when complete") {
  core_options o;
  o.chunk_size = 2 * MiB;
  o.release_threshold = 0;
  fixture f(o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  for (int i = 0; i < 8; i += 2) f.pool->deallocate(p[i], s.key());
  // Not yet known complete: nothing may go back.
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 16 * MiB);
  // A synchronization point applies the release threshold (0): the four free chunks go.
  host_sync(*f.dev, s);
  CHECK(f.pool->statistics().reserved_current == 8 * MiB);
  CHECK(f.dev->physical_used == 8 * MiB);
  for (int i = 1; i < 8; i += 2) CHECK(f.dev->is_mapped(p[i], 2 * MiB));
}

TEST_CASE("trim: a busy stream's cached free beside clear chunks does not keep them from release") {
  fixture f(movable_chunks());
  auto s = make_stream();
  // Eight chunks freed and known complete (clear), then a small live block and the rest of
  // the ninth chunk, still in use.
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const auto small = f.pool->allocate(4096, s.key());
  const auto rest = f.pool->allocate(2 * MiB - 4096, s.key());
  REQUIRE(small == p[7] + 2 * MiB);
  for (auto x : p) f.pool->deallocate(x, s.key());
  host_sync(*f.dev, s);
  REQUIRE(f.pool->statistics().reserved_current == 18 * MiB);
  // A kernel on s still uses `small` when it is freed: the free sits in s's cache, right after
  // the clear chunks. The trim flushes it; absorbing the clear chunks into that pending free
  // would keep all 16 MiB until an event on s had run.
  f.dev->busy.insert(s.native);
  f.pool->deallocate(small, s.key());
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 2 * MiB);
  CHECK(f.dev->is_mapped(small, 2 * MiB));  // the chunk of the running free stays
  // And once the free has run, its chunk goes too.
  f.pool->deallocate(rest, s.key());
  host_sync(*f.dev, s);
  f.pool->trim_to(0);
  CHECK(f.pool->statistics().reserved_current == 0);
}

TEST_CASE("retiring: a busy stream's last cached free does not take the clear memory beside it") {
  core_options o = movable_chunks();
  o.reuse = {false, true, false};  // opportunistic only: no waiting on the retired stream's frees
  fixture f(o);
  auto s = make_stream();
  auto other = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  const auto small = f.pool->allocate(4096, s.key());
  REQUIRE(small == p[7] + 2 * MiB);
  for (auto x : p) f.pool->deallocate(x, s.key());
  host_sync(*f.dev, s);  // 16 MiB clear, right before `small`
  // s is destroyed while a kernel on it still uses `small`: the free sits in its cache, and
  // the retirement flushes it. Absorbed into that pending free, the clear 16 MiB would wait
  // for s's last event; left apart, another stream takes them at once.
  f.dev->busy.insert(s.native);
  f.pool->deallocate(small, s.key());
  f.pool->on_retire(s.record->id(), /*handle_valid=*/true);
  const auto reserved = f.pool->statistics().reserved_current;
  const auto q = f.pool->allocate(16 * MiB, other.key());
  CHECK(q == p[0]);
  CHECK(f.pool->statistics().reserved_current == reserved);  // served without growing
  f.pool->deallocate(q, other.key());
  f.dev->run_all();
}

TEST_CASE("grow_in_place: takes the free memory after a block, then maps more behind it") {
  fixture f;
  auto s = make_stream();
  const auto p = f.pool->allocate(1 * MiB, s.key());
  const auto used = f.pool->statistics().used_current;
  // Inside the first 64 MiB chunk: no driver call.
  const auto creates = f.dev->creates;
  CHECK(f.pool->grow_in_place(p, 40 * MiB, s.key()) == 40 * MiB);
  CHECK(f.dev->creates == creates);
  CHECK(f.pool->statistics().used_current == used + 39 * MiB);
  // Past the chunk: new physical memory mapped right after it, the address unchanged.
  CHECK(f.pool->grow_in_place(p, 1000 * MiB, s.key()) == 1000 * MiB);
  CHECK(f.dev->creates > creates);
  CHECK(f.dev->is_mapped(p, 1000 * MiB));
  CHECK(f.pool->find_live(p) == std::pair{p, 1000 * MiB});
  // A smaller size changes nothing.
  CHECK(f.pool->grow_in_place(p, 10, s.key()) == 1000 * MiB);
  // The whole block goes back with one free, and is reused whole.
  f.pool->deallocate(p, s.key());
  CHECK(f.pool->statistics().used_current == used - 1 * MiB);
  CHECK(f.pool->allocate(1000 * MiB, s.key()) == p);
}

TEST_CASE("addresses are reserved as the pool grows, each mapping inside one reservation, up to the limit") {
  core_options o;
  o.address_space = 64ull << 30;
  fixture f(o);
  auto s = make_stream();
  CHECK(f.pool->reservations().size() == 1);
  CHECK(f.pool->addresses_reserved() == 8ull << 30);  // the first: 8 GiB
  std::vector<std::uint64_t> p;
  std::uint64_t bytes = 0;
  try {
    for (;;) {
      p.push_back(f.pool->allocate(3ull << 30, s.key()));  // each its own chunk, mapped inside one reservation
      bytes += 3ull << 30;
    }
  } catch (const core_out_of_memory&) {
  }
  // Reservations at least double what was reserved: a few cover the limit, never more.
  const auto list = f.pool->reservations();
  CHECK(list.size() >= 3);
  CHECK(list.size() <= 6);
  CHECK(f.pool->addresses_reserved() <= o.address_space);
  CHECK(bytes >= 30ull << 30);  // most of the 64 GiB hold 3 GiB pieces, fragmented by the steps
  for (auto q : p) {
    CHECK(f.dev->is_mapped(q, 3ull << 30));
    CHECK(f.pool->owns(q));
    CHECK(f.pool->owns(q + (3ull << 30) - 1));
  }
  CHECK_FALSE(f.pool->owns(list.back().first + list.back().second));
  CHECK(f.pool->refused_reservation() == 0);  // the limit stopped it, not the driver
  for (auto q : p) f.pool->deallocate(q, s.key());
}

TEST_CASE("the process's addresses running out ends growth with core_out_of_memory, the refusal kept") {
  fixture f;
  auto s = make_stream();
  f.dev->addresses_left = 4ull << 30;  // less than any further reservation
  CHECK_THROWS_AS((void)f.pool->allocate(10ull << 30, s.key()), core_out_of_memory);
  CHECK(f.pool->refused_reservation() >= 10ull << 30);
  CHECK(f.pool->reservations().size() == 1);
  // What fits in the first reservation still works.
  const auto q = f.pool->allocate(1ull << 30, s.key());
  CHECK(f.dev->is_mapped(q, 1ull << 30));
  f.pool->deallocate(q, s.key());
}

TEST_CASE("addresses held by aliases are named when a small address space runs out") {
  core_options o = movable_chunks();
  o.address_space = 16 * MiB;  // one reservation of eight chunks
  fixture f(o);
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(2 * MiB, s.key()));
  f.dev->busy.insert(s.native);  // s's frees have not run
  f.pool->deallocate(p[0], s.key());
  f.pool->deallocate(p[2], s.key());
  const auto q = f.pool->allocate(4 * MiB, s.key());  // the two chunks, moved: 12 MiB of addresses taken
  CHECK(f.pool->statistics().remapped_chunks == 2);
  try {
    (void)f.pool->allocate(6 * MiB, s.key());
    FAIL("6 MiB fit in the 4 MiB of addresses left");
  } catch (const core_out_of_memory& e) {
    CHECK(e.reason.find("4194304 bytes of addresses held by chunks moved before the frees in them ran") !=
          std::string::npos);
  }
  // Once s has run, the old addresses come back: 8 MiB of them, in three ranges.
  host_sync(*f.dev, s);
  f.pool->on_synchronize(s.record->id());
  std::vector<std::uint64_t> more;
  for (const std::uint64_t n : {4 * MiB, 2 * MiB, 2 * MiB}) {
    more.push_back(f.pool->allocate(n, s.key()));
    CHECK(f.dev->is_mapped(more.back(), n));
  }
  for (const auto x : {q, p[1], p[3], more[0], more[1], more[2]}) f.pool->deallocate(x, s.key());
  check_nothing_lost(f, {&s});
}

TEST_CASE("grow_in_place: large allocations with room_to_grow have room after them, so several grow in turn") {
  fixture f;
  auto s = make_stream();
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 8; ++i) p.push_back(f.pool->allocate(64 * MiB, s.key(), streamalloc::placement::room_to_grow));
  for (std::uint64_t size = 128 * MiB; size <= 1024 * MiB; size *= 2) {
    for (auto q : p) CHECK(f.pool->grow_in_place(q, size, s.key()) == size);
  }
  for (auto q : p) CHECK(f.dev->is_mapped(q, 1024 * MiB));
}

TEST_CASE("placement: packed large allocations sit next to each other, away from the chunks") {
  core_options o;
  o.own_chunk_for_large = true;  // each large request one handle of its own (not the default)
  fixture f(o);
  auto s = make_stream();
  const auto small = f.pool->allocate(1 * MiB, s.key());
  std::vector<std::uint64_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(f.pool->allocate(64 * MiB, s.key()));
  // Downward from the top of the addresses, each right before the one made before it.
  for (int i = 1; i < 4; ++i) CHECK(p[i] + 64 * MiB == p[i - 1]);
  CHECK(p[0] > small + 4ull * 1024 * MiB);  // the first reservation is 8 GiB
  // So the chunk run of small allocations still grows in place behind its end...
  CHECK(f.pool->grow_in_place(small, 512 * MiB, s.key()) == 512 * MiB);
  // ...while a packed allocation has its neighbour right after it.
  CHECK(f.pool->grow_in_place(p[1], 128 * MiB, s.key()) == 0);
  CHECK(f.pool->find_live(p[1]) == std::pair{p[1], 64 * MiB});
  // The topmost one ends its reservation: a new one reserved right after it gives it room.
  CHECK(f.pool->reservations().size() == 1);
  CHECK(f.pool->grow_in_place(p[0], 128 * MiB, s.key()) == 128 * MiB);
  CHECK(f.pool->reservations().size() == 2);
  CHECK(f.pool->reservations()[1].first == p[0] + 64 * MiB);
  CHECK(f.dev->is_mapped(p[0], 128 * MiB));
  CHECK(f.pool->find_live(p[0]) == std::pair{p[0], 128 * MiB});
  // Freed neighbours coalesce across their handles: 256 MiB in one block, no growth.
  for (auto q : p) f.pool->deallocate(q, s.key());
  const auto creates = f.dev->creates;
  const auto big = f.pool->allocate(256 * MiB, s.key());
  CHECK(f.dev->creates == creates);
  CHECK(big == p[3]);
}

TEST_CASE("shrink_in_place: the rest is freed on the stream, reusable there at once") {
  core_options o;
  o.reuse = {false, false, false};
  o.chunk_size = 8 * MiB;
  o.max_size = 8 * MiB;  // the shrunk block's chunk is all there is
  fixture f(o);
  auto a = make_stream(), b = make_stream();
  const auto p = f.pool->allocate(8 * MiB, a.key());
  const auto used = f.pool->statistics().used_current;
  CHECK(f.pool->shrink_in_place(p, 1000, a.key()) == 1024);
  CHECK(f.pool->find_live(p) == std::pair{p, std::uint64_t{1024}});
  CHECK(f.pool->statistics().used_current == used - (8 * MiB - 1024));
  CHECK(f.pool->shrink_in_place(p, 1 * MiB, a.key()) == 1024);  // never grows
  // The freed tail: pending on a, so b (no proof) does not get it, a does.
  f.dev->busy.insert(a.native);
  CHECK_THROWS_AS((void)f.pool->allocate(4 * MiB, b.key()), core_out_of_memory);
  const auto r = f.pool->allocate(4 * MiB, a.key());
  CHECK(r == p + 1024);
  // And the block grows back in place once the tail is free again.
  f.pool->deallocate(r, a.key());
  CHECK(f.pool->grow_in_place(p, 8 * MiB, a.key()) == 8 * MiB);
  CHECK_THROWS_AS(f.pool->shrink_in_place(p + 256, 256, a.key()), std::invalid_argument);
}

TEST_CASE("grow_in_place: a live block in the way, or another stream's unproven free, says no") {
  core_options o;
  o.reuse = {true, false, false};
  fixture f(o);
  auto a = make_stream(), b = make_stream();
  const auto p = f.pool->allocate(1 * MiB, a.key());
  const auto q = f.pool->allocate(1 * MiB, a.key());
  REQUIRE(q == p + 1 * MiB);
  CHECK(f.pool->grow_in_place(p, 2 * MiB, a.key()) == 0);  // q is live
  CHECK(f.pool->find_live(p) == std::pair{p, 1 * MiB});
  f.dev->busy.insert(b.native);
  f.pool->deallocate(q, b.key());  // freed on b, b still busy: a may not take it
  CHECK(f.pool->grow_in_place(p, 2 * MiB, a.key()) == 0);
  a.record->wait_for(b.record->capture());  // a now runs after the free
  CHECK(f.pool->grow_in_place(p, 2 * MiB, a.key()) == 2 * MiB);
  CHECK_THROWS_AS(f.pool->grow_in_place(p + 256, 4 * MiB, a.key()), std::invalid_argument);
}

TEST_CASE("grow_in_place: the limit says no and leaves the block as it was") {
  core_options o;
  o.max_size = 128 * MiB;
  fixture f(o);
  auto s = make_stream();
  const auto p = f.pool->allocate(1 * MiB, s.key());
  CHECK(f.pool->grow_in_place(p, 100 * MiB, s.key()) == 100 * MiB);
  CHECK(f.pool->grow_in_place(p, 200 * MiB, s.key()) == 0);
  CHECK(f.pool->find_live(p) == std::pair{p, 100 * MiB});
  CHECK(f.pool->statistics().reserved_current <= 128 * MiB);
}
