# The cargo step of the root CMakeLists.txt (run with cmake -P by its
# engram_cargo target): builds libengram as scripts/install.sh does, then
# lays the libraries out as an install does under LIB_DIR.
#
# In: CARGO MANIFEST TARGET_DIR PROFILE PROFILE_DIR SONAME REALNAME LIB_DIR
#     NATIVE_LIBS (the list the configure step used) NATIVE_FILE.
cmake_minimum_required(VERSION 3.18)

# One build of the library (cdylib, staticlib, rlib) with the SONAME set and
# the system libraries of a static link printed; the same arguments as
# install.sh, so the two share a build in one target dir.
execute_process(
  COMMAND "${CARGO}" rustc --lib --profile "${PROFILE}" --manifest-path "${MANIFEST}" --target-dir "${TARGET_DIR}"
          -- -C "link-arg=-Wl,-soname,${SONAME}" --print native-static-libs
  RESULT_VARIABLE rc
  ERROR_VARIABLE err
  ECHO_ERROR_VARIABLE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "engram: cargo rustc failed (${rc})")
endif()

# The note comes once per crate type that links natively; take the last.
string(REGEX MATCHALL "native-static-libs: [^\r\n]*" notes "${err}")
set(note "")
if(notes)
  list(GET notes -1 note)
endif()
string(REGEX REPLACE "^native-static-libs: *" "" got "${note}")
string(STRIP "${got}" got)
if(NOT got)
  message(FATAL_ERROR "engram: rustc printed no native-static-libs")
endif()
if(NOT got STREQUAL NATIVE_LIBS)
  # The static target was configured with another list: record this one,
  # which the next build's configure step reads (the file is a configure
  # dependency), and stop rather than link with the wrong libraries.
  file(WRITE "${NATIVE_FILE}" "${got}\n")
  message(FATAL_ERROR "engram: a static link needs '${got}', not '${NATIVE_LIBS}' as configured; "
                      "recorded in ${NATIVE_FILE}: build again (CMake re-configures with it)")
endif()
file(WRITE "${NATIVE_FILE}.tmp" "${got}\n")
execute_process(COMMAND "${CMAKE_COMMAND}" -E copy_if_different "${NATIVE_FILE}.tmp" "${NATIVE_FILE}")
file(REMOVE "${NATIVE_FILE}.tmp")

# The installed layout, copied only when changed (so nothing relinks after a
# build that changed nothing): libengram.so.X.Y.Z, its SONAME link, the
# development link, libengram.a.
set(out "${TARGET_DIR}/${PROFILE_DIR}")
file(MAKE_DIRECTORY "${LIB_DIR}")
foreach(pair IN ITEMS "libengram.so=${REALNAME}" "libengram.a=libengram.a")
  string(REPLACE "=" ";" pair "${pair}")
  list(GET pair 0 from)
  list(GET pair 1 to)
  if(NOT EXISTS "${out}/${from}")
    message(FATAL_ERROR "engram: cargo did not build ${out}/${from}")
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" -E copy_if_different "${out}/${from}" "${LIB_DIR}/${to}"
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "engram: cannot copy ${out}/${from} to ${LIB_DIR}/${to}")
  endif()
endforeach()
file(CREATE_LINK "${REALNAME}" "${LIB_DIR}/${SONAME}" SYMBOLIC)
file(CREATE_LINK "${SONAME}" "${LIB_DIR}/libengram.so" SYMBOLIC)

# Another build in the same target dir (a plain `cargo build --release`)
# writes a libengram.so without the SONAME; the copy must have ours.
find_program(READELF readelf)
if(READELF)
  execute_process(COMMAND "${READELF}" -d "${LIB_DIR}/${REALNAME}" OUTPUT_VARIABLE dyn)
  if(NOT dyn MATCHES "Library soname: \\[${SONAME}\\]")
    file(REMOVE "${LIB_DIR}/${REALNAME}")
    message(FATAL_ERROR "engram: ${out}/libengram.so has no SONAME ${SONAME} (a concurrent cargo build "
                        "replaced it?); build again")
  endif()
endif()
