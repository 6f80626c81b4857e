#include <streamalloc/detail/core/block_chain.hpp>

#include <doctest/doctest.h>

#include "failing_new.hpp"

#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

using streamalloc::detail::block;
using streamalloc::detail::block_chain;

using test_support::allocations_until_failure;


namespace {

constexpr std::uint64_t unit = 256;

// Checks the chain against the blocks it should hold (start -> size): each found by its
// start and by any address inside it, linked to its neighbours exactly within each run, and
// the runs the union of the blocks' ranges.
void check_matches(const block_chain& c, const std::map<std::uint64_t, std::uint64_t>& want) {
  REQUIRE(c.size() == want.size());
  std::map<std::uint64_t, std::uint64_t> runs;
  const block* prev = nullptr;
  std::uint64_t prev_end = 0;
  for (const auto& [addr, size] : want) {
    const block* b = c.starting_at(addr);
    REQUIRE(b != nullptr);
    CHECK(b->addr == addr);
    CHECK(b->size == size);
    CHECK(c.at_or_before(addr + size - 1) == b);
    const bool joined = prev != nullptr && prev_end == addr;
    CHECK(b->prev_addr == (joined ? prev : nullptr));
    if (prev != nullptr) CHECK(prev->next_addr == (joined ? b : nullptr));
    if (joined) {
      std::prev(runs.end())->second = addr + size;
    } else {
      runs[addr] = addr + size;
    }
    prev = b;
    prev_end = addr + size;
  }
  if (prev != nullptr) CHECK(prev->next_addr == nullptr);
  CHECK(c.runs() == runs);
}

}  // namespace

TEST_CASE("place joins the runs on both sides; split, give_front and unlink keep the chain") {
  block_chain c;
  block* a = c.place(0x10000, 0x1000);
  block* z = c.place(0x12000, 0x1000);
  check_matches(c, {{0x10000, 0x1000}, {0x12000, 0x1000}});
  CHECK(c.runs().size() == 2);
  block* m = c.place(0x11000, 0x1000);  // fills the gap: one run
  check_matches(c, {{0x10000, 0x1000}, {0x11000, 0x1000}, {0x12000, 0x1000}});
  CHECK(a->next_addr == m);
  CHECK(z->prev_addr == m);

  block* rest = c.split(m, 0x400);
  check_matches(c, {{0x10000, 0x1000}, {0x11000, 0x400}, {0x11400, 0xc00}, {0x12000, 0x1000}});
  CHECK(rest->addr == 0x11400);

  m->size += 0x100;  // m takes the first 0x100 bytes of rest
  c.give_front(rest, 0x100);
  check_matches(c, {{0x10000, 0x1000}, {0x11000, 0x500}, {0x11500, 0xb00}, {0x12000, 0x1000}});

  a->size += m->size;  // a absorbs m
  c.unlink(m);
  check_matches(c, {{0x10000, 0x1500}, {0x11500, 0xb00}, {0x12000, 0x1000}});
  CHECK(c.at_or_before(0xffff) == nullptr);
  CHECK(c.before(0x10000) == nullptr);
  CHECK(c.before(0x11500) == a);
}

TEST_CASE("cut takes a range out of a block, returns the pieces around it and splits the run") {
  block_chain c;
  block* a = c.place(0x20000, 0x1000);
  block* b = c.place(0x21000, 0x3000);
  c.place(0x24000, 0x1000);
  const auto [before, after] = c.cut(b, 0x22000, 0x1000);
  REQUIRE(before != nullptr);
  REQUIRE(after != nullptr);
  check_matches(c, {{0x20000, 0x1000}, {0x21000, 0x1000}, {0x23000, 0x1000}, {0x24000, 0x1000}});
  CHECK(c.runs() == std::map<std::uint64_t, std::uint64_t>{{0x20000, 0x22000}, {0x23000, 0x25000}});
  CHECK(a->next_addr == before);
  // A cut of a whole block at a run's end leaves no pieces.
  block* last = c.starting_at(0x24000);
  const auto [none_before, none_after] = c.cut(last, 0x24000, 0x1000);
  CHECK(none_before == nullptr);
  CHECK(none_after == nullptr);
  check_matches(c, {{0x20000, 0x1000}, {0x21000, 0x1000}, {0x23000, 0x1000}});
}

TEST_CASE("cut_whole takes a block out with a run entry made ahead, needing no host memory") {
  block_chain c;
  c.place(0x30000, 0x1000);
  block* mid = c.place(0x31000, 0x2000);
  block* last = c.place(0x33000, 0x1000);
  auto spare_mid = block_chain::spare_run();
  auto spare_last = block_chain::spare_run();
  allocations_until_failure = 0;
  c.cut_whole(mid, spare_mid);  // splits the run: the spare entry becomes its second part
  c.cut_whole(last, spare_last);  // at the run's end: its spare stays unused
  allocations_until_failure = -1;
  CHECK(spare_mid.empty());
  CHECK(!spare_last.empty());
  check_matches(c, {{0x30000, 0x1000}});
  CHECK(c.runs() == std::map<std::uint64_t, std::uint64_t>{{0x30000, 0x31000}});
}

TEST_CASE("out of host memory, place and cut throw having changed nothing") {
  // The pool maps memory, then places it in the chain; it cuts a chunk out before unmapping it.
  // Either may run out of host memory: the chain must then be as it was, for the caller to
  // undo its own step. Each allocation they make fails in turn until they succeed.
  const std::map<std::uint64_t, std::uint64_t> start{{0x10000, 0x1000}, {0x12000, 0x4000}, {0x20000, 0x1000}};
  auto fill = [&](block_chain& c) {
    for (const auto& [addr, size] : start) c.place(addr, size);
  };
  struct step {
    const char* name;
    void (*run)(block_chain&);
    std::map<std::uint64_t, std::uint64_t> after;
  };
  const step steps[] = {
      {"place joining two runs", [](block_chain& c) { (void)c.place(0x11000, 0x1000); },
       {{0x10000, 0x1000}, {0x11000, 0x1000}, {0x12000, 0x4000}, {0x20000, 0x1000}}},
      {"place on its own", [](block_chain& c) { (void)c.place(0x30000, 0x1000); },
       {{0x10000, 0x1000}, {0x12000, 0x4000}, {0x20000, 0x1000}, {0x30000, 0x1000}}},
      {"cut from the middle of a block", [](block_chain& c) { (void)c.cut(c.starting_at(0x12000), 0x13000, 0x1000); },
       {{0x10000, 0x1000}, {0x12000, 0x1000}, {0x14000, 0x2000}, {0x20000, 0x1000}}},
      {"cut a whole block", [](block_chain& c) { (void)c.cut(c.starting_at(0x20000), 0x20000, 0x1000); },
       {{0x10000, 0x1000}, {0x12000, 0x4000}}},
  };
  for (const step& st : steps) {
    CAPTURE(st.name);
    int failures = 0;
    for (int k = 0;; ++k) {
      block_chain c;
      fill(c);
      allocations_until_failure = k;
      bool threw = false;
      try {
        st.run(c);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      allocations_until_failure = -1;
      if (!threw) {
        check_matches(c, st.after);
        break;
      }
      ++failures;
      check_matches(c, start);
      c.place(0x40000, 0x1000);  // and the chain still works
      CHECK(c.starting_at(0x40000) != nullptr);
    }
    MESSAGE(std::string(st.name) << ": " << failures << " allocations failed in turn");
  }
}

TEST_CASE("a place prepared before a cut in the run ending there: the cut runs, then the place joins what is left") {
  // The pool's order when it moves a chunk as an alias: the new place is prepared (all the host
  // memory it needs) before the old one is cut out, possibly from the run that ends right
  // where the new place starts.
  block_chain c;
  c.place(0x10000, 0x2000);  // a run [0x10000, 0x12000) of two blocks
  block* second = c.split(c.starting_at(0x10000), 0x1000);
  const auto slot = c.prepare_place(0x12000, 0x1000);
  (void)c.cut(second, 0x11000, 0x1000);  // the run now ends at 0x11000: nothing ends at 0x12000
  block* b = c.finish_place(slot);
  check_matches(c, {{0x10000, 0x1000}, {0x12000, 0x1000}});
  CHECK(b->prev_addr == nullptr);
  // Prepared right after a run that still ends there: joined to it.
  const auto joined = c.prepare_place(0x13000, 0x1000);
  block* j = c.finish_place(joined);
  check_matches(c, {{0x10000, 0x1000}, {0x12000, 0x1000}, {0x13000, 0x1000}});
  CHECK(j->prev_addr == b);
  // Abandoned: as if never prepared.
  const auto dropped = c.prepare_place(0x20000, 0x1000);
  c.abandon_place(dropped);
  check_matches(c, {{0x10000, 0x1000}, {0x12000, 0x1000}, {0x13000, 0x1000}});
}

TEST_CASE("prepare_cut over several blocks: the pieces come from the first and the last") {
  block_chain c;
  c.place(0x30000, 0x4000);
  block* first = c.starting_at(0x30000);
  block* mid = c.split(first, 0x1800);
  block* last = c.split(mid, 0x1000);  // [0x30000,+0x1800) [0x31800,+0x1000) [0x32800,+0x1800)
  const auto pieces = c.prepare_cut(first, last, 0x31000, 0x2000);
  // The caller joins the blocks into the first, then finishes.
  first->size += mid->size;
  c.unlink(mid);
  first->size += last->size;
  c.unlink(last);
  const auto [before, after] = c.finish_cut(first, pieces);
  REQUIRE(before != nullptr);
  REQUIRE(after != nullptr);
  check_matches(c, {{0x30000, 0x1000}, {0x33000, 0x1000}});
  CHECK(c.runs() == std::map<std::uint64_t, std::uint64_t>{{0x30000, 0x31000}, {0x33000, 0x34000}});
}

TEST_CASE("random places, splits, merges and cuts agree with a map of blocks") {
  std::mt19937_64 rng(11);
  block_chain c;
  std::map<std::uint64_t, std::uint64_t> want;
  // Slots of 64 units; each is mapped or not, placed in random order so runs join both ways.
  constexpr std::uint64_t slot = 64 * unit, slots = 200, base = 0x100000;
  std::vector<bool> mapped(slots, false);
  for (int step = 0; step < 20000; ++step) {
    const std::uint64_t s = rng() % slots;
    const std::uint64_t va = base + s * slot;
    const int op = static_cast<int>(rng() % 4);
    if (!mapped[s]) {
      c.place(va, slot);
      want[va] = slot;
      mapped[s] = true;
    } else if (op == 0) {  // split a random block of the slot
      auto it = want.upper_bound(va + (rng() % 64) * unit);
      --it;
      if (it->second > unit) {
        const std::uint64_t n = (1 + rng() % (it->second / unit - 1)) * unit;
        block* rest = c.split(c.starting_at(it->first), n);
        CHECK(rest->addr == it->first + n);
        want[it->first + n] = it->second - n;
        it->second = n;
      }
    } else if (op == 1) {  // merge a block with its successor inside the slot
      auto it = want.upper_bound(va + (rng() % 64) * unit);
      --it;
      const auto next = std::next(it);
      if (next != want.end() && next->first == it->first + it->second && next->first < va + slot) {
        block* b = c.starting_at(it->first);
        block* x = b->next_addr;
        REQUIRE(x == c.starting_at(next->first));
        if (rng() % 2 == 0 || x->size == unit) {
          b->size += x->size;
          c.unlink(x);
          it->second += next->second;
          want.erase(next);
        } else {  // take part of it
          const std::uint64_t part = (1 + rng() % (x->size / unit - 1)) * unit;
          b->size += part;
          c.give_front(x, part);
          it->second += part;
          const std::uint64_t rest_size = next->second - part, rest_at = next->first + part;
          want.erase(next);
          want[rest_at] = rest_size;
        }
      }
    } else if (op == 2) {  // unmap the slot: first make it one block, then cut it out
      block* b = c.starting_at(va);
      if (b != nullptr && b->size == slot) {
        const auto [before, after] = c.cut(b, va, slot);
        CHECK(before == nullptr);
        CHECK(after == nullptr);
        want.erase(va);
        mapped[s] = false;
      } else if (b != nullptr) {
        while (b->size < slot) {  // merge the slot's blocks into its first
          block* x = b->next_addr;
          b->size += x->size;
          want[va] += want[x->addr];
          want.erase(x->addr);
          c.unlink(x);
        }
      }
    }
    if (step % 500 == 0) check_matches(c, want);
  }
  check_matches(c, want);
}

TEST_CASE("thousands of blocks made, merged and made again between lookups: fresh and indexed ones alike") {
  // Blocks made lately wait in a hash table for the address index (fresh_blocks.hpp); the
  // table holds 1,024. Splits without merges fill it (and then go straight to the index for a
  // while); splits undone by merges leave it; lookups take it in. All must stay invisible.
  std::mt19937_64 rng(17);
  block_chain c;
  std::map<std::uint64_t, std::uint64_t> want;
  constexpr std::uint64_t base = 0x40000000, size = 64ull << 20;
  c.place(base, size);
  want[base] = size;
  // Carve 6,000 blocks off the front one after another, as a pool growing by small blocks does.
  block* rest = c.starting_at(base);
  for (int i = 0; i < 6000; ++i) {
    const std::uint64_t n = (1 + rng() % 16) * unit;
    const std::uint64_t at = rest->addr;
    rest = c.split(rest, n);
    want[at] = n;
    want[rest->addr] = rest->size;
  }
  check_matches(c, want);
  // Churn: split a random block and merge it back right away, or merge two neighbours, with a
  // lookup every few steps (each lookup takes the table in).
  for (int step = 0; step < 40000; ++step) {
    auto it = std::next(want.begin(), static_cast<long>(rng() % want.size()));
    block* b = c.starting_at(it->first);
    REQUIRE(b != nullptr);
    if (rng() % 3 != 0 && b->size > unit) {
      const std::uint64_t n = (1 + rng() % (b->size / unit - 1)) * unit;
      block* x = c.split(b, n);
      if (rng() % 2 == 0) {  // merged back at once: the table's insert and erase cancel
        b->size += x->size;
        c.unlink(x);
      } else {
        want[x->addr] = x->size;
        it->second = n;
      }
    } else if (block* x = b->next_addr; x != nullptr) {
      b->size += x->size;
      want.erase(x->addr);
      it->second = b->size;
      c.unlink(x);
    }
    if (step % 97 == 0) {
      const std::uint64_t probe = base + rng() % size;
      auto w = std::prev(want.upper_bound(probe));
      block* found = c.at_or_before(probe);
      REQUIRE(found != nullptr);
      CHECK(found->addr == w->first);
    }
    if (step % 5000 == 0) check_matches(c, want);
  }
  check_matches(c, want);
}

TEST_CASE("out of host memory, blocks the index could not take in are still found") {
  // A lookup takes the table of fresh blocks into the index; when the index cannot grow, what
  // it could not take stays in the table, and lookups compare the index's answer with the
  // table's. Some blocks are in the index before (a lookup took them in), the rest are fresh;
  // the index's allocations fail from the k-th on, for k = 0, 1, 2, ... until none fails.
  constexpr std::uint64_t base = 0x80000000;
  int failed_runs = 0;
  for (int k = 0; k < 64; ++k) {
    CAPTURE(k);
    block_chain c;
    std::map<std::uint64_t, std::uint64_t> want;
    c.place(base, 4096 * unit);
    want[base] = 4096 * unit;
    block* rest = c.starting_at(base);
    for (int i = 0; i < 700; ++i) {  // several index leaves' worth
      const std::uint64_t at = rest->addr;
      rest = c.split(rest, 2 * unit);
      want[at] = 2 * unit;
      want[rest->addr] = rest->size;
      if (i == 150) (void)c.at_or_before(base);  // the first 150 or so into the index
    }
    std::size_t index_size_hint = 0;
    {
      test_support::refusing_allocations refuse(k);
      for (const auto& [addr, size] : want) {
        const block* b = c.at_or_before(addr + size - 1);
        REQUIRE(b != nullptr);
        CHECK(b->addr == addr);
        CHECK(c.at_or_before(addr) == b);
        CHECK(c.starting_at(addr) == b);
      }
      index_size_hint = c.size();
      // Merges work without host memory, whichever side a block is on.
      for (int i = 0; i < 300; i += 3) {
        block* b = c.starting_at(base + static_cast<std::uint64_t>(i) * 2 * unit);
        block* x = b->next_addr;
        want.erase(x->addr);
        b->size += x->size;
        want[b->addr] = b->size;
        c.unlink(x);
      }
      failed_runs += test_support::allocations_until_failure == 0 ? 1 : 0;
    }
    CHECK(index_size_hint == want.size() + 100);
    check_matches(c, want);
    if (failed_runs == 0) break;  // the allocations ran out nowhere: every k beyond is the same
    failed_runs = 0;
  }
}

TEST_CASE("the table of fresh blocks fills with blocks merged away in between: drained, it goes on") {
  // Many split-and-merge pairs between lookups, leaving about 1,100 blocks that stay: the
  // table fills having seen most of its blocks merged away, so it is drained into the index
  // and used again (not bypassed); then blocks that stay fill it again and it is bypassed.
  std::mt19937_64 rng(23);
  block_chain c;
  std::map<std::uint64_t, std::uint64_t> want;
  constexpr std::uint64_t base = 0xc0000000, size = 256ull << 20;
  c.place(base, size);
  want[base] = size;
  block* tail = c.starting_at(base);
  auto keep_one = [&] {  // a block that stays, carved off the tail
    const std::uint64_t at = tail->addr, n = (1 + rng() % 8) * unit;
    tail = c.split(tail, n);
    want[at] = n;
    want[tail->addr] = tail->size;
  };
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 1100; ++i) {
      for (int j = 0; j < 3; ++j) {  // made and merged away: each cancels in the table
        block* x = c.split(tail, unit);
        block* prev = x->prev_addr;
        prev->size += x->size;
        c.unlink(x);
      }
      keep_one();
    }
    check_matches(c, want);  // a lookup: everything taken in
  }
  for (int i = 0; i < 20000; ++i) keep_one();  // only blocks that stay: the bypass
  check_matches(c, want);
}
