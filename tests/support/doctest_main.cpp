// The doctest runner shared by every gpuq test executable (target gpuq_test_main).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
