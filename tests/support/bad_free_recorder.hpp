#pragma once

// While alive, makes the bad-free handler record each bad free instead of aborting, so a test
// can call a free that may not throw with a bad pointer and check what was reported.

#include <streamalloc/pool.hpp>

#include <optional>
#include <string>

namespace streamalloc_test {

class bad_free_recorder {
 public:
  bad_free_recorder() {
    reports() = 0;
    last() = {};
    previous_ = streamalloc::set_bad_free_handler(&record);
  }
  bad_free_recorder(const bad_free_recorder&) = delete;
  bad_free_recorder& operator=(const bad_free_recorder&) = delete;
  ~bad_free_recorder() { streamalloc::set_bad_free_handler(previous_); }

  struct report {
    const void* pointer = nullptr;
    std::optional<streamalloc::pool_ref> owner;
    std::string operation, reason;
  };
  /// Bad frees reported since this recorder was made.
  [[nodiscard]] int count() const { return reports(); }
  /// The latest one.
  [[nodiscard]] const report& latest() const { return last(); }

 private:
  static int& reports() {
    static int n = 0;
    return n;
  }
  static report& last() {
    static report r;
    return r;
  }
  static void record(const streamalloc::bad_free& b) noexcept {
    ++reports();
    try {
      last() = {b.pointer, b.owner, b.operation, b.reason};
    } catch (...) {  // out of memory in a test: the count still tells
    }
  }

  streamalloc::bad_free_handler previous_;
};

}  // namespace streamalloc_test
