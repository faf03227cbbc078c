# Script mode (cmake -P), run after a GoogleTest binary is built: lists its
# tests and writes CTEST_FILE with one ctest test per test suite, named
# <TARGET_NAME>.<suite>, running that suite alone (--gtest_filter). One
# process per suite rather than per test: each start of a LibTorch program
# costs about as much as a whole suite of small tests.
#
#   -D TEST_EXECUTABLE=... -D TARGET_NAME=... -D CTEST_FILE=... -D TIMEOUT=...

execute_process(
  COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
  OUTPUT_VARIABLE listing
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR
    "${TEST_EXECUTABLE} --gtest_list_tests exited ${result}:\n${listing}")
endif()

string(REPLACE "\n" ";" lines "${listing}")
set(content "")
set(count 0)
foreach(line IN LISTS lines)
  # Suites are the unindented lines, "Suite." or "Prefix/Suite." (a value-
  # parameterised suite's instantiation), maybe with a "# TypeParam" comment.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND content
      "add_test([=[${TARGET_NAME}.${suite}]=] [==[${TEST_EXECUTABLE}]==] "
      "[=[--gtest_filter=${suite}.*]=])\n"
      "set_tests_properties([=[${TARGET_NAME}.${suite}]=] PROPERTIES "
      "TIMEOUT ${TIMEOUT})\n")
    math(EXPR count "${count} + 1")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no test suite:\n${listing}")
endif()
file(WRITE "${CTEST_FILE}" "${content}")
