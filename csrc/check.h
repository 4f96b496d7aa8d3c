// HS_CHECK: TORCH_CHECK with a message built without iostreams.
//
// TORCH_CHECK formats its arguments through a std::ostringstream compiled into this extension. On the
// GPU machine (torch 2.11, CUDA 13) writing a number that way crashed the process (SIGSEGV) instead
// of raising: a failed check with only string arguments raised, one with an integer did not. So
// messages are joined here with std::to_string and handed to TORCH_CHECK as one C string, the form
// it passes through untouched.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace hs {

inline void msg_part(std::string& s, const char* v) { s += v; }
inline void msg_part(std::string& s, const std::string& v) { s += v; }
inline void msg_part(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void msg_part(std::string& s, T v) { s += std::to_string(v); }

template <typename... A>
std::string msg(const A&... a) {
  std::string s;
  (msg_part(s, a), ...);
  return s;
}

}  // namespace hs

#define HS_CHECK(cond, ...) TORCH_CHECK(cond, ::hs::msg(__VA_ARGS__).c_str())
