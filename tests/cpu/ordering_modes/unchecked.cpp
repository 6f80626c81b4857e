#define STREAMALLOC_CHECK_ORDERING 0
#define PROBE_NAME probe_unchecked
#include "mode_probe.inc"
