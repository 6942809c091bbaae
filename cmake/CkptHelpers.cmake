# ckpt_cc_library(NAME name SRCS ... [HDRS ...] [DEPS ...])
#   One static library per folder; sources are listed by hand. Includes are
#   rooted at the source tree ("base/status.h"); that path is a
#   build-tree one only, so the libraries that are installed and exported
#   (cmake/CkptInstall.cmake) carry no source path.
function(ckpt_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;HDRS;DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS} ${A_HDRS})
  target_include_directories(${A_NAME} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>)
  target_link_libraries(${A_NAME} PUBLIC ${A_DEPS})
  target_compile_options(${A_NAME} PRIVATE ${CKPT_WARNINGS})
endfunction()

# ckpt_cc_test(NAME name SRCS ... [DEPS ...] [LABELS ...])
#   One gtest binary; every TEST becomes a ctest case with the given labels.
function(ckpt_cc_test)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT A_LABELS)
    set(A_LABELS unit)
  endif()
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${A_NAME} PRIVATE ${CKPT_WARNINGS})
  gtest_discover_tests(${A_NAME}
    PROPERTIES LABELS "${A_LABELS}" ENVIRONMENT "CKPT_BUILD_DIR=${PROJECT_BINARY_DIR}"
    DISCOVERY_TIMEOUT 60)
endfunction()
