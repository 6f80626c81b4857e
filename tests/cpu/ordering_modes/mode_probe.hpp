#pragma once

// One probe, compiled twice: once with the run-time ordering checks on and once with them off,
// into one test binary (ordering_modes_test.cpp). Each copy reports what the checks did in its
// own translation unit.

#include <string>

namespace ordering_modes {

struct probe_result {
  bool proof_refused;        ///< detail::check_proof threw ordering_error for a proof that covers nothing
  std::string mode;          ///< the inline namespace the translation unit's stream_buffer lives in
};

probe_result probe_checked();
probe_result probe_unchecked();

}  // namespace ordering_modes
