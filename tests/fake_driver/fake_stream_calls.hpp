#pragma once

// What the fake driver counts of a thread's stream-ordered calls (fake_cuda_stream_calls), one
// definition for the fake, the tests that read it (support/fake_driver.hpp) and
// bench_fake_replay: the counts cross a dlsym boundary, so all three must agree field for field.

/// A thread's stream-ordered driver calls since the fake was loaded.
struct fake_stream_call_counts {
  long long capture_questions;  // cuStreamIsCapturing and cuStreamGetCaptureInfo
  long long stream_ids;         // cuStreamGetId
  long long stream_queries;     // cuStreamQuery
  long long event_records;      // cuEventRecord
  long long event_queries;      // cuEventQuery
  long long stream_waits;       // cuStreamWaitEvent
};
