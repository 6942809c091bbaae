# Runs the layering probes of tests/layering/CMakeLists.txt in a build tree:
#
#   cmake -DBUILD_DIR=<build> -DPROBES=name|ok|library|header,... -P check_build_layering.cmake
#
# Each probe is the target ckpt_probe_<name>, one #include compiled with the
# include path of a user of <library>. `ok`: it must compile. `fails`: it must
# not, and the compiler must name the probed header as not found (gcc: "h: No
# such file or directory", clang: "'h' file not found"), so that an unrelated
# compile error does not pass for a layering one. Exits non-zero on the first
# probe that does otherwise.
if(NOT BUILD_DIR OR NOT PROBES)
  message(FATAL_ERROR "usage: cmake -DBUILD_DIR=<build> -DPROBES=<probes> -P ${CMAKE_SCRIPT_MODE_FILE}")
endif()
string(REPLACE "," ";" probes "${PROBES}")
set(failed 0)
foreach(probe ${probes})
  string(REPLACE "|" ";" fields "${probe}")
  list(GET fields 0 name)
  list(GET fields 1 expect)
  list(GET fields 2 library)
  list(GET fields 3 header)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ckpt_probe_${name}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "([][.+*?^$()|\\\\])" "\\\\\\1" header_re "${header}")
  set(not_found "(${header_re}: No such file or directory|'${header_re}' file not found)")
  if(expect STREQUAL "ok")
    if(rc EQUAL 0)
      message(STATUS "ok     ${name}: a user of ${library} compiles #include \"${header}\"")
    else()
      message(SEND_ERROR "FAILED ${name}: a user of ${library} must be able to include "
                         "${header}, but the compile failed:\n${out}")
      set(failed 1)
    endif()
  else()
    string(REGEX MATCH "[^\n]*${not_found}[^\n]*" line "${out}")
    if(NOT rc EQUAL 0 AND line)
      message(STATUS "ok     ${name}: a user of ${library} cannot include ${header}:\n"
                     "         ${line}")
    elseif(rc EQUAL 0)
      message(SEND_ERROR "FAILED ${name}: a user of ${library} compiled #include \"${header}\"; "
                         "the include path lets it see a header it does not depend on")
      set(failed 1)
    else()
      message(SEND_ERROR "FAILED ${name}: the compile failed, but not because ${header} "
                         "was not found:\n${out}")
      set(failed 1)
    endif()
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "layering.build: a probe did not compile as the dependency graph says")
endif()
