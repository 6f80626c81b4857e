// Translation units built with the run-time ordering checks on and off, linked into one
// program, each keep their own behaviour. Without the mode's inline namespace the linker keeps
// one body of each inline function and template for both, and one of the two probes below
// answers for the other mode.

#include "mode_probe.hpp"

#include <doctest/doctest.h>

TEST_SUITE("ordering_modes") {
  TEST_CASE("a checked and an unchecked translation unit in one program keep their own checks") {
    const ordering_modes::probe_result on = ordering_modes::probe_checked();
    const ordering_modes::probe_result off = ordering_modes::probe_unchecked();
    CHECK(on.proof_refused);
    CHECK_FALSE(off.proof_refused);
    // Two distinct types: a stream buffer cannot pass from one mode to the other unnoticed.
    CHECK(on.mode != off.mode);
    CHECK(on.mode.find("ordering_checked") != std::string::npos);
    CHECK(off.mode.find("ordering_unchecked") != std::string::npos);
  }
}
