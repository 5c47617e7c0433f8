// Minimal assertion helpers shared by the C++ unit tests (no test framework needed).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>

inline int& check_failures() {
  static int n = 0;
  return n;
}

// c10's logging header (included with torch) defines a CHECK of its own: the tests use this one.
#ifdef CHECK
#undef CHECK
#endif
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++check_failures();                                                           \
    }                                                                               \
  } while (0)

inline bool throws(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception&) {
    return true;
  }
  return false;
}

// Exit status of a test program, with a one-line summary.
inline int check_report(const char* suite) {
  if (check_failures()) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", suite, check_failures());
    return EXIT_FAILURE;
  }
  std::printf("%s: all checks passed\n", suite);
  return EXIT_SUCCESS;
}
