#pragma once
// Catch2 v2 (Debian 12) and v3 (Ubuntu 24.04) behind one include.
// c10's logging (glog or its own) defines CHECK too: take it in first, drop its
// CHECK, and let Catch's stand; c10's include guards keep it from coming back.
#include <c10/util/Logging.h>

#include <string>
#undef CHECK
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_session.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#define BULKHEAD_CATCH3 1
#else
#include <catch2/catch.hpp>
#endif

// One spelling of Approx for both: v3 has Catch::Approx, v2 Catch::Detail::Approx.
namespace bulkhead::testing {
#ifdef BULKHEAD_CATCH3
using Approx = Catch::Approx;
#else
using Approx = Catch::Detail::Approx;
#endif

// The substring matcher: v3's ContainsSubstring, v2's Contains.
inline auto Contains(const std::string& part) {
#ifdef BULKHEAD_CATCH3
  return Catch::Matchers::ContainsSubstring(part);
#else
  return Catch::Matchers::Contains(part);
#endif
}
}  // namespace bulkhead::testing
