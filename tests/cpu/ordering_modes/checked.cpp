#define STREAMALLOC_CHECK_ORDERING 1
#define PROBE_NAME probe_checked
#include "mode_probe.inc"
