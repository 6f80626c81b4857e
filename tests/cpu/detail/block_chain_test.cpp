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
