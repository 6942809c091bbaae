# Include paths follow the dependency graph (docs/architecture.md, "Dependency
# graph"). No target has the source tree on its include path: each library's
# headers are linked, at configure time, into a tree of its own under the build
# directory that mirrors their source paths,
#
#   <build>/include/<target>/public/daemon/engine/engine.h -> <src>/daemon/engine/engine.h
#   <build>/include/<target>/private/...                    (PRIVATE_HDRS)
#
# and the library exposes only its public tree. A source therefore finds
# "daemon/engine/engine.h" only when its target links ckpt_engine, directly or
# through a PUBLIC dependency; any other include fails to compile. The links
# are symbolic, so an edited header needs no reconfigure; a header added to or
# dropped from HDRS re-runs CMake (the CMakeLists changed), which rebuilds the
# tree. The test layering.build (tests/layering/) compiles includes that must
# fail and ones that must not.

# ckpt_target_headers(target PUBLIC|PRIVATE|INTERFACE [ROOT dir] headers...)
#   Links the headers (relative to the calling folder, or absolute) into the
#   target's public or private tree, at their path relative to ROOT (default:
#   the source tree, so that "base/status.h" is included as such), and puts
#   that tree on the target's include path with the given scope. Call it at
#   most once per target and tree: the tree is rebuilt from scratch.
function(ckpt_target_headers target scope)
  cmake_parse_arguments(A "" "ROOT" "" ${ARGN})
  if(NOT A_ROOT)
    set(A_ROOT ${PROJECT_SOURCE_DIR})
  endif()
  if(scope STREQUAL "PRIVATE")
    set(tree ${PROJECT_BINARY_DIR}/include/${target}/private)
  else()
    set(tree ${PROJECT_BINARY_DIR}/include/${target}/public)
  endif()
  file(REMOVE_RECURSE ${tree})
  file(MAKE_DIRECTORY ${tree})
  foreach(h ${A_UNPARSED_ARGUMENTS})
    get_filename_component(abs "${h}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    file(RELATIVE_PATH rel "${A_ROOT}" "${abs}")
    if(NOT EXISTS "${abs}" OR rel MATCHES "^\\.\\./")
      message(FATAL_ERROR "${target}: header ${h} is not a file under ${A_ROOT}")
    endif()
    get_filename_component(dir "${tree}/${rel}" DIRECTORY)
    file(MAKE_DIRECTORY "${dir}")
    file(CREATE_LINK "${abs}" "${tree}/${rel}" SYMBOLIC)
  endforeach()
  target_include_directories(${target} ${scope} $<BUILD_INTERFACE:${tree}>)
endfunction()

# ckpt_cc_library(NAME name SRCS ... [HDRS ...] [PRIVATE_HDRS ...] [HDRS_ROOT dir]
#                 [DEPS ...] [PRIVATE_DEPS ...])
#   One static library per folder; sources are listed by hand.
#   HDRS          the headers other targets may include ("base/status.h"); they
#                 are the library's public tree (see above).
#   PRIVATE_HDRS  headers only the library's own sources include.
#   HDRS_ROOT     where the include paths of the headers start (default: the
#                 source tree; the client's are under client/include).
#   DEPS          libraries the HDRS include: PUBLIC, so users see them too.
#   PRIVATE_DEPS  libraries only the sources include: linked, not visible.
#   The trees are build-tree paths only ($<BUILD_INTERFACE>), so the libraries
#   that are installed and exported (cmake/CkptInstall.cmake) carry none.
function(ckpt_cc_library)
  cmake_parse_arguments(A "" "NAME;HDRS_ROOT" "SRCS;HDRS;PRIVATE_HDRS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS} ${A_HDRS} ${A_PRIVATE_HDRS})
  set(root)
  if(A_HDRS_ROOT)
    set(root ROOT ${A_HDRS_ROOT})
  endif()
  if(A_HDRS)
    ckpt_target_headers(${A_NAME} PUBLIC ${root} ${A_HDRS})
  endif()
  if(A_PRIVATE_HDRS)
    ckpt_target_headers(${A_NAME} PRIVATE ${root} ${A_PRIVATE_HDRS})
  endif()
  target_link_libraries(${A_NAME} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  target_compile_options(${A_NAME} PRIVATE ${CKPT_WARNINGS})
endfunction()

# ckpt_cc_test(NAME name SRCS ... [HDRS ...] [DEPS ...] [LABELS ...])
#   One gtest binary; every TEST becomes a ctest case with the given labels.
#   HDRS are test headers its sources include by their source path
#   ("tests/daemon/store/store_test_util.h"); they may lie in another folder.
function(ckpt_cc_test)
  cmake_parse_arguments(A "" "NAME" "SRCS;HDRS;DEPS;LABELS" ${ARGN})
  if(NOT A_LABELS)
    set(A_LABELS unit)
  endif()
  add_executable(${A_NAME} ${A_SRCS} ${A_HDRS})
  if(A_HDRS)
    ckpt_target_headers(${A_NAME} PRIVATE ${A_HDRS})
  endif()
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${A_NAME} PRIVATE ${CKPT_WARNINGS})
  gtest_discover_tests(${A_NAME}
    PROPERTIES LABELS "${A_LABELS}" ENVIRONMENT "CKPT_BUILD_DIR=${PROJECT_BINARY_DIR}"
    DISCOVERY_TIMEOUT 60)
endfunction()
