// Run-time switches from the environment, one spelling for all of them: a flag is on or off only when
// set to exactly "1" or "0"; a number is read with atoll, its default where unset or empty. Most are read
// per call (tens of ns), so that benchmarks and tests can flip them within one process.
#pragma once

#include <cstdlib>

namespace hs {

inline bool env_is(const char* name, char value) {
  const char* v = std::getenv(name);
  return v && v[0] == value && v[1] == 0;
}
inline bool env_on(const char* name) { return env_is(name, '1'); }
inline bool env_off(const char* name) { return env_is(name, '0'); }

inline long long env_int(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

}  // namespace hs
