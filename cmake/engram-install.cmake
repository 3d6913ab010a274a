# Install-time part of the root CMakeLists.txt's install rules (included by
# its install(CODE)): the pkg-config files and the CMake package filled from
# the templates in this directory for the prefix given at install time, then
# the installed libraries stripped of debug info and the shared library's
# split off into lib/.debug/, as scripts/install.sh does (ENGRAM_INSTALL_DEBUG=1
# in the environment keeps it in the libraries, as there).
#
# In: ENGRAM_TEMPLATES ENGRAM_STAGE VERSION SONAME REALNAME NATIVE_LIBS
#     NATIVE_LIBS_CMAKE, and CMake's CMAKE_INSTALL_PREFIX; DESTDIR as usual.

set(PREFIX "${CMAKE_INSTALL_PREFIX}")
file(MAKE_DIRECTORY "${ENGRAM_STAGE}")
foreach(name IN ITEMS engram.pc engram-static.pc engramConfig.cmake engramConfigVersion.cmake)
  configure_file("${ENGRAM_TEMPLATES}/${name}.in" "${ENGRAM_STAGE}/${name}" @ONLY)
endforeach()
file(INSTALL "${ENGRAM_STAGE}/engram.pc" "${ENGRAM_STAGE}/engram-static.pc"
     DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/pkgconfig" FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
file(INSTALL "${ENGRAM_STAGE}/engramConfig.cmake" "${ENGRAM_STAGE}/engramConfigVersion.cmake"
     DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/cmake/engram" FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)

if(NOT "$ENV{ENGRAM_INSTALL_DEBUG}" STREQUAL "1")
  find_program(ENGRAM_OBJCOPY objcopy)
  find_program(ENGRAM_STRIP strip)
  if(NOT ENGRAM_OBJCOPY OR NOT ENGRAM_STRIP)
    message(FATAL_ERROR "engram: objcopy and strip (binutils) are needed to install the stripped libraries "
                        "(or set ENGRAM_INSTALL_DEBUG=1 to install them with their debug info)")
  endif()
  set(lib "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/lib")
  set(dbg "${lib}/.debug/${REALNAME}.debug")
  file(MAKE_DIRECTORY "${lib}/.debug")
  message(STATUS "Splitting: ${dbg}")
  foreach(cmd IN ITEMS
      "${ENGRAM_OBJCOPY};--only-keep-debug;${lib}/${REALNAME};${dbg}"
      "${ENGRAM_OBJCOPY};--strip-debug;--add-gnu-debuglink=${dbg};${lib}/${REALNAME}"
      "${ENGRAM_STRIP};--strip-debug;${lib}/libengram.a")
    execute_process(COMMAND ${cmd} RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "engram: failed (${rc}): ${cmd}")
    endif()
  endforeach()
  execute_process(COMMAND chmod 644 "${dbg}")
endif()
