#pragma once

// What the public pool's tests against the fake driver share (pool_test.cpp,
// pool_streams_test.cpp, pool_ownership_test.cpp): the names they use from the test support, a
// scoped setting of one of the fake driver's knobs, and the message a closed pool's refusal
// carries. Those files are compiled as one translation unit with the other fake-driver tests
// (tests/CMakeLists.txt), so what they share is defined here once, and a name at file scope must
// not be defined by two of them.
//
// The fake device runs work at once, so every event is complete when queried: these tests check
// everything but the device's own work, on any machine; the GPU tests check the same API on real
// memory.

#include <streamalloc/pool.hpp>

#include <doctest/doctest.h>

#include "bad_free_recorder.hpp"
#include "fake_driver.hpp"

#include <cstdlib>
#include <string>

using namespace streamalloc;
using streamalloc_test::bad_free_recorder;
using streamalloc_test::contains;
using streamalloc_test::fake_live;
using streamalloc_test::message_of;
using streamalloc_test::MiB;

namespace pool_test_support {

// Sets one of the fake driver's knobs for a scope: it reads them on every call.
class fake_knob {
 public:
  fake_knob(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~fake_knob() { ::unsetenv(name_); }
  fake_knob(const fake_knob&) = delete;
  fake_knob& operator=(const fake_knob&) = delete;

 private:
  const char* name_;
};

inline doctest::Contains closed_in(const char* member) {
  return doctest::Contains((std::string("streamalloc::pool::") + member + ": the pool is closed").c_str());
}

}  // namespace pool_test_support

using pool_test_support::closed_in;
using pool_test_support::fake_knob;
