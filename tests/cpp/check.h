// The C++ host tests' assertion: CHECK(cond, printf-format, ...) counts the check and, when cond is false,
// prints the file, line and message and counts a failure, then carries on, so that one run reports every
// failing case rather than the first.  main() ends with `return check_summary();`.
#pragma once

#include <cstdio>

inline int g_failures = 0;
inline int g_checks = 0;

#define CHECK(cond, ...)                               \
  do {                                                 \
    ++g_checks;                                        \
    if (!(cond)) {                                     \
      ++g_failures;                                    \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                        \
      std::printf("\n");                               \
    }                                                  \
  } while (0)

// Prints the totals; the process's exit status (0: every check passed).
inline int check_summary() {
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
