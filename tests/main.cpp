// The doctest main for halfgrad_tests. Test cases live in the other tests/*.cpp files.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
