#include <streamalloc/detail/core/live_table.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <thread>
#include <vector>

using namespace streamalloc::detail;

TEST_CASE("the live table finds what was inserted and forgets what was erased") {
  live_table t;
  std::vector<block> blocks(5000);
  for (std::size_t i = 0; i < blocks.size(); ++i) t.insert(0x7000000000ull + i * 256, &blocks[i]);
  CHECK(t.size() == blocks.size());
  for (std::size_t i = 0; i < blocks.size(); i += 2) CHECK(t.erase(0x7000000000ull + i * 256) == &blocks[i]);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    CHECK(t.find(0x7000000000ull + i * 256) == (i % 2 ? &blocks[i] : nullptr));
  }
  CHECK(t.erase(0x7000000000ull) == nullptr);  // twice: gone
  CHECK(t.erase(0x1234500) == nullptr);       // never there
  CHECK(t.size() == blocks.size() / 2);
}

TEST_CASE("threads inserting and erasing their own addresses never see each other's") {
  live_table t;
  constexpr int threads = 8, per = 20000;
  std::vector<block> blocks(threads);
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int k = 0; k < threads; ++k) {
    ts.emplace_back([&, k] {
      for (int i = 0; i < per; ++i) {
        const std::uint64_t a = (std::uint64_t(k + 1) << 36) + std::uint64_t(i % 97) * 256;
        t.insert(a, &blocks[k]);
        if (t.erase(a) != &blocks[k]) ++wrong;
      }
    });
  }
  for (auto& x : ts) x.join();
  CHECK(wrong == 0);
  CHECK(t.size() == 0);
}
