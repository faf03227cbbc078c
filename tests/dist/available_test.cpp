// gpipe::dist::is_available() says whether the build has gpipe::dist, and
// without it, joining a job is a c10::Error that says why.

#include <gpipe/dist.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace {

TEST(DistAvailableTest, IsAvailableSaysWhatWasBuilt) {
  EXPECT_EQ(
      gpipe::dist::is_available(), static_cast<bool>(GPIPE_DIST_EXPECTED));
  if (!gpipe::dist::is_available()) {
    try {
      gpipe::dist::init_from_env();
      ADD_FAILURE() << "init_from_env did not throw";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("built without c10d"), std::string::npos) << what;
    }
  }
}

}  // namespace
