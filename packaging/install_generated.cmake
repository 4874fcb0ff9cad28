# Runs at install time (cmake --install, cpack), included by the install(CODE) of
# packaging/CMakeLists.txt: the install prefix is known only then, and the unit, gpuq.pc and the
# config's place depend on it. Inputs (set by that install(CODE)): GPUQ_SOURCE_DIR,
# GPUQ_GENERATED_DIR, GPUQ_VERSION, GPUQ_HAVE_SYSTEMD, GPUQ_WATCHDOG_SEC and the GNUInstallDirs
# directories GPUQ_BINDIR, GPUQ_LIBDIR, GPUQ_INCLUDEDIR, GPUQ_SYSCONFDIR, GPUQ_DOCDIR,
# GPUQ_SYSTEMD_UNIT_DIR, GPUQ_SYSUSERS_DIR (relative: under the prefix).
set(_prefix "${CMAKE_INSTALL_PREFIX}")
string(REGEX REPLACE "/+$" "" _prefix "${_prefix}")

function(gpuq_install_path out dir)
  if(IS_ABSOLUTE "${dir}")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "${_prefix}/${dir}" PARENT_SCOPE)
  endif()
endfunction()

gpuq_install_path(_bindir "${GPUQ_BINDIR}")
gpuq_install_path(_libdir "${GPUQ_LIBDIR}")
gpuq_install_path(_includedir "${GPUQ_INCLUDEDIR}")
gpuq_install_path(_docdir "${GPUQ_DOCDIR}")
gpuq_install_path(_unitdir "${GPUQ_SYSTEMD_UNIT_DIR}")
gpuq_install_path(_sysusersdir "${GPUQ_SYSUSERS_DIR}")
# GNUInstallDirs' rule: with the prefix /usr (a distribution package), configuration lives in
# /etc, not /usr/etc.
if(IS_ABSOLUTE "${GPUQ_SYSCONFDIR}")
  set(_sysconfdir "${GPUQ_SYSCONFDIR}")
elseif(_prefix STREQUAL "/usr" OR _prefix STREQUAL "")
  set(_sysconfdir "/etc")
else()
  gpuq_install_path(_sysconfdir "${GPUQ_SYSCONFDIR}")
endif()

# The unit.
set(GPUQD_PATH "${_bindir}/gpuqd")
set(GPUQD_CONFIG_PATH "${_sysconfdir}/gpuq/gpuqd.json")
set(GPUQ_DOC_PATH "${_docdir}/service.md")
if(GPUQ_HAVE_SYSTEMD)
  set(GPUQD_SERVICE_TYPE notify)
  set(GPUQD_WATCHDOG_LINE "WatchdogSec=${GPUQ_WATCHDOG_SEC}")
else()
  set(GPUQD_SERVICE_TYPE simple)
  set(GPUQD_WATCHDOG_LINE
    "# No WatchdogSec=: this gpuqd was built without libsystemd (no sd_notify)")
endif()
configure_file("${GPUQ_SOURCE_DIR}/systemd/gpuqd.service.in"
  "${GPUQ_GENERATED_DIR}/gpuqd.service" @ONLY)
file(INSTALL "${GPUQ_GENERATED_DIR}/gpuqd.service" DESTINATION "${_unitdir}"
  PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)

# The gpuq user and group.
configure_file("${GPUQ_SOURCE_DIR}/systemd/gpuq.sysusers" "${GPUQ_GENERATED_DIR}/gpuq.conf"
  COPYONLY)
file(INSTALL "${GPUQ_GENERATED_DIR}/gpuq.conf" DESTINATION "${_sysusersdir}"
  PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)

# The example config, every key with its default (group and allowed_* set for the unit). An
# existing one is an administrator's: it is kept.
if(EXISTS "$ENV{DESTDIR}${_sysconfdir}/gpuq/gpuqd.json")
  message(STATUS "Keeping: $ENV{DESTDIR}${_sysconfdir}/gpuq/gpuqd.json (already there)")
else()
  file(INSTALL "${GPUQ_SOURCE_DIR}/systemd/gpuqd.json" DESTINATION "${_sysconfdir}/gpuq"
    PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
endif()

# pkg-config.
set(GPUQ_PC_PREFIX "${_prefix}")
set(GPUQ_PC_LIBDIR "${_libdir}")
set(GPUQ_PC_INCLUDEDIR "${_includedir}")
configure_file("${GPUQ_SOURCE_DIR}/packaging/gpuq.pc.in" "${GPUQ_GENERATED_DIR}/gpuq.pc" @ONLY)
file(INSTALL "${GPUQ_GENERATED_DIR}/gpuq.pc" DESTINATION "${_libdir}/pkgconfig"
  PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
