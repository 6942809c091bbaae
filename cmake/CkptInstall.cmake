# Installation: `cmake --install <build> [--prefix P]` (default prefix /usr/local).
#
#   sbin/ckptd                                   the daemon
#   bin/ckptctl, bin/ckpt_example_trainer        admin CLI, example trainer
#   lib/libckpt_{client,shm,proto,common}.a      the client library and what it links
#   include/ckpt/client.h, include/ckpt/v1/      its public headers (+ ckpt.proto)
#   lib/cmake/ckpt/                              find_package(ckpt CONFIG) -> ckpt::client
#   lib/pkgconfig/ckpt.pc                        pkg-config --cflags --libs ckpt
#   lib/python3.X/dist-packages/ckpt/            the Python module (ckpt, ckpt.torch, ckpt.hf)
#   lib/systemd/system/ckptd.service             the unit, ExecStart at the installed paths
#   etc/ckptd/ckptd.conf                         the config, only if none is there yet
#   share/ckptd/ckptd.conf                       the default config, always refreshed
#   share/ckptd/{prometheus,grafana}/            scrape config, alerts, dashboard
#   share/ckptd/install.sh                       host set-up: user, directories, systemctl
#
# lib is GNUInstallDirs' CMAKE_INSTALL_LIBDIR (lib/x86_64-linux-gnu under
# prefix /usr on Debian). The unit, config and Python directories can be
# moved with CKPT_SYSTEMD_UNIT_DIR, CMAKE_INSTALL_SYSCONFDIR (e.g. /etc) and
# CKPT_PYTHON_INSTALL_DIR; relative values are under the prefix, except that
# prefix /usr puts the config in /etc/ckptd. The unit and the config path
# inside it are written at install time, so they follow `--prefix` and
# DESTDIR; GNUInstallDirs picks LIBDIR at configure time, so a package for
# prefix /usr is configured with -DCMAKE_INSTALL_PREFIX=/usr. deploy/install.sh
# does the rest on a host (user, directories, systemctl).
if(CKPT_SANITIZER_FLAGS)
  # Sanitized binaries and libraries are for running tests in the build tree
  # (and the TSan build links every target with ckpt_tsan_absl).
  message(STATUS "ckptd: no install rules in a sanitizer/fuzzing build")
  return()
endif()
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

option(CKPT_INSTALL_EXAMPLE_TRAINER "Install ckpt_example_trainer into bin" ON)
set(CKPT_SYSTEMD_UNIT_DIR "lib/systemd/system" CACHE STRING
  "Where the systemd unit is installed (relative: under the prefix)")
if(CKPT_HAVE_PYTHON_MODULE)
  set(CKPT_PYTHON_INSTALL_DIR "lib/python${CKPT_PYTHON_VERSION}/dist-packages" CACHE STRING
    "Where the Python package ckpt is installed (relative: under the prefix)")
endif()
set(CKPT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/ckpt)

# ---- programs ----
set(CKPT_INSTALLED_PROGRAMS ckptd ckptctl)
install(TARGETS ckptd RUNTIME DESTINATION ${CMAKE_INSTALL_SBINDIR} COMPONENT daemon)
install(TARGETS ckptctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT daemon)
if(CKPT_INSTALL_EXAMPLE_TRAINER)
  install(TARGETS ckpt_example_trainer RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
    COMPONENT daemon)
  list(APPEND CKPT_INSTALLED_PROGRAMS ckpt_example_trainer)
endif()
if(CKPT_HAVE_PYTHON_MODULE)
  list(APPEND CKPT_INSTALLED_PROGRAMS ckpt_python_ext)
endif()
# Libraries outside the linker's default directories (the CUDA runtime in
# /usr/local/cuda) stay findable from the installed files.
set_target_properties(${CKPT_INSTALLED_PROGRAMS} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)

# ---- the client library, as a CMake package and a pkg-config module ----
# ckpt_client is static, so the static libraries of ours it links are
# installed and exported with it.
set(CKPT_EXPORTED_LIBS ckpt_client ckpt_base ckpt_proto)
set_target_properties(ckpt_client PROPERTIES EXPORT_NAME client)
set_target_properties(ckpt_base PROPERTIES EXPORT_NAME base)
set_target_properties(ckpt_proto PROPERTIES EXPORT_NAME proto)

# An exported target may not name a source or build directory as an include
# directory. ckpt_cc_library already marks its header trees
# $<BUILD_INTERFACE:...>; ckpt_proto lists the generated and the source proto
# directory plainly, so they are wrapped here. Installed, all headers are
# under include/.
foreach(lib ${CKPT_EXPORTED_LIBS})
  get_target_property(dirs ${lib} INTERFACE_INCLUDE_DIRECTORIES)
  set(wrapped)
  foreach(dir ${dirs})
    if(dir MATCHES "^\\$<")
      list(APPEND wrapped "${dir}")
    else()
      list(APPEND wrapped "$<BUILD_INTERFACE:${dir}>")
    endif()
  endforeach()
  list(APPEND wrapped "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
  list(REMOVE_DUPLICATES wrapped)
  set_property(TARGET ${lib} PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${wrapped}")
endforeach()

install(TARGETS ${CKPT_EXPORTED_LIBS} EXPORT ckptTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(EXPORT ckptTargets NAMESPACE ckpt:: DESTINATION ${CKPT_INSTALL_CMAKEDIR}
  COMPONENT dev)

# Public headers: client.h includes ckpt/v1/ckpt.pb.h.
# The gRPC stubs (ckpt.grpc.pb.h, compiled into libckpt_proto.a) and the
# .proto itself go along for programs that call the API directly.
get_target_property(CKPT_PROTO_BINARY_DIR ckpt_proto BINARY_DIR)
get_target_property(CKPT_PROTO_SOURCE_DIR ckpt_proto SOURCE_DIR)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/ckpt
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev FILES_MATCHING PATTERN "*.h")
install(FILES
  ${CKPT_PROTO_SOURCE_DIR}/ckpt/v1/ckpt.proto
  ${CKPT_PROTO_BINARY_DIR}/gen/ckpt/v1/ckpt.pb.h
  ${CKPT_PROTO_BINARY_DIR}/gen/ckpt/v1/ckpt.grpc.pb.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ckpt/v1 COMPONENT dev)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ckptConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/ckptConfig.cmake
  INSTALL_DESTINATION ${CKPT_INSTALL_CMAKEDIR})
# 0.x: a minor release may change the client API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/ckptConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/ckptConfig.cmake
  ${PROJECT_BINARY_DIR}/cmake/ckptConfigVersion.cmake
  DESTINATION ${CKPT_INSTALL_CMAKEDIR} COMPONENT dev)

# ckpt.pc finds its prefix from its own location, so it stays right under
# `cmake --install --prefix P`. The names in Requires are Debian's .pc files.
set(CKPT_PC_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  message(FATAL_ERROR "ckpt.pc: CMAKE_INSTALL_LIBDIR and CMAKE_INSTALL_INCLUDEDIR must be "
                      "relative to the prefix")
endif()
file(RELATIVE_PATH CKPT_PC_PREFIX_FROM_PCDIR /p/${CKPT_PC_DIR} /p)
string(REGEX REPLACE "/$" "" CKPT_PC_PREFIX_FROM_PCDIR "${CKPT_PC_PREFIX_FROM_PCDIR}")
set(CKPT_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
set(CKPT_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
set(CKPT_PC_REQUIRES "grpc++ protobuf absl_status absl_statusor absl_strings absl_str_format")
string(APPEND CKPT_PC_REQUIRES " absl_time absl_synchronization absl_span")
set(CKPT_PC_EXTRA_LIBS "-pthread")
if(CKPT_HAVE_CUDA)
  # No .pc file for the CUDA runtime; the rpath lets programs find it at run time.
  string(APPEND CKPT_PC_EXTRA_LIBS
    " -L${CUDAToolkit_LIBRARY_DIR} -Wl,-rpath,${CUDAToolkit_LIBRARY_DIR} -lcudart")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/ckpt.pc.in ${PROJECT_BINARY_DIR}/cmake/ckpt.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/cmake/ckpt.pc DESTINATION ${CKPT_PC_DIR} COMPONENT dev)

# ---- the Python module ----
if(CKPT_HAVE_PYTHON_MODULE)
  install(TARGETS ckpt_python_ext LIBRARY DESTINATION ${CKPT_PYTHON_INSTALL_DIR}/ckpt
    COMPONENT python)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/ckpt/
    DESTINATION ${CKPT_PYTHON_INSTALL_DIR}/ckpt COMPONENT python
    FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed"
    PATTERN "__pycache__" EXCLUDE)
endif()

# ---- deploy files: config, systemd unit, Prometheus and Grafana ----
install(FILES ${PROJECT_SOURCE_DIR}/deploy/ckptd.conf
  DESTINATION ${CMAKE_INSTALL_DATADIR}/ckptd COMPONENT daemon)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/deploy/prometheus ${PROJECT_SOURCE_DIR}/deploy/grafana
  DESTINATION ${CMAKE_INSTALL_DATADIR}/ckptd COMPONENT daemon)
# The host set-up (user, directories, systemctl), run as root after install.
install(PROGRAMS ${PROJECT_SOURCE_DIR}/deploy/install.sh
  DESTINATION ${CMAKE_INSTALL_DATADIR}/ckptd COMPONENT daemon)

# deploy/systemd/ckptd.service stays the one source of the unit. It names
# /usr/local/bin/ckptd and /etc/ckptd/ckptd.conf; the installed copy names the
# installed daemon and config instead. The template is made here and filled in
# at install time, when the prefix is final.
set(CKPT_UNIT_SOURCE ${PROJECT_SOURCE_DIR}/deploy/systemd/ckptd.service)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${CKPT_UNIT_SOURCE})
file(READ ${CKPT_UNIT_SOURCE} CKPT_UNIT_TEXT)
string(REGEX MATCHALL "\nExecStart=[^\n]*" CKPT_UNIT_EXEC "${CKPT_UNIT_TEXT}")
list(LENGTH CKPT_UNIT_EXEC n)
if(NOT n EQUAL 1 OR NOT CKPT_UNIT_EXEC MATCHES "/usr/local/bin/ckptd --config=/etc/ckptd/ckptd.conf")
  message(FATAL_ERROR "${CKPT_UNIT_SOURCE}: expected one ExecStart= running "
    "/usr/local/bin/ckptd --config=/etc/ckptd/ckptd.conf; update cmake/CkptInstall.cmake")
endif()
string(REPLACE "/usr/local/bin/ckptd" "@CKPT_UNIT_CKPTD@" CKPT_UNIT_TEXT "${CKPT_UNIT_TEXT}")
string(REPLACE "/etc/ckptd/ckptd.conf" "@CKPT_UNIT_CONF@" CKPT_UNIT_TEXT "${CKPT_UNIT_TEXT}")
file(WRITE ${PROJECT_BINARY_DIR}/deploy/ckptd.service.in
  "# Installed by `cmake --install` from deploy/systemd/ckptd.service. On a new host,\n"
  "# share/ckptd/install.sh creates the ckptd user and enables the unit.\n"
  "${CKPT_UNIT_TEXT}")

# Runs inside cmake_install.cmake: CMAKE_INSTALL_PREFIX there is the final
# prefix (--prefix), and DESTDIR is honoured. Files are listed in
# install_manifest.txt like the others.
install(CODE "
  # A relative directory is under the prefix, except that prefix /usr keeps
  # its configuration in /etc (as GNUInstallDirs' FULL_SYSCONFDIR does).
  function(ckpt_install_path out dir)
    if(IS_ABSOLUTE \"\${dir}\")
      set(\${out} \"\${dir}\" PARENT_SCOPE)
    elseif(CMAKE_INSTALL_PREFIX STREQUAL \"/usr\" AND dir MATCHES \"^etc(/|$)\")
      set(\${out} \"/\${dir}\" PARENT_SCOPE)
    else()
      set(\${out} \"\${CMAKE_INSTALL_PREFIX}/\${dir}\" PARENT_SCOPE)
    endif()
  endfunction()
  ckpt_install_path(sbin \"${CMAKE_INSTALL_SBINDIR}\")
  ckpt_install_path(confdir \"${CMAKE_INSTALL_SYSCONFDIR}/ckptd\")
  ckpt_install_path(unitdir \"${CKPT_SYSTEMD_UNIT_DIR}\")
  set(CKPT_UNIT_CKPTD \"\${sbin}/ckptd\")
  set(CKPT_UNIT_CONF \"\${confdir}/ckptd.conf\")
  if(\"\${CKPT_UNIT_CKPTD}\${CKPT_UNIT_CONF}\" MATCHES \"[ \\t]\")
    message(FATAL_ERROR \"ckptd.service: the install paths must not contain blanks\")
  endif()

  # The unit: always written (it is ours, not the operator's: local changes
  # belong in a drop-in, `systemctl edit ckptd`).
  set(unit \"\$ENV{DESTDIR}\${unitdir}/ckptd.service\")
  message(STATUS \"Installing: \${unit}\")
  configure_file(\"${PROJECT_BINARY_DIR}/deploy/ckptd.service.in\" \"\${unit}\" @ONLY)
  file(CHMOD \"\${unit}\" PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES \"\${unitdir}/ckptd.service\")

  # The config: installed when absent, never over an existing (edited) one.
  # share/ckptd/ckptd.conf always holds the current default for comparison.
  set(conf \"\$ENV{DESTDIR}\${CKPT_UNIT_CONF}\")
  if(EXISTS \"\${conf}\")
    message(STATUS \"Keeping: \${conf} (exists; the default is in share/ckptd/ckptd.conf)\")
  else()
    message(STATUS \"Installing: \${conf}\")
    # file(INSTALL) adds DESTDIR itself and lists the file in the manifest.
    file(INSTALL \"${PROJECT_SOURCE_DIR}/deploy/ckptd.conf\" DESTINATION \"\${confdir}\"
      FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ MESSAGE_NEVER)
  endif()
" COMPONENT daemon)
