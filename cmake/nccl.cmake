# NCCL for the `nccl` communicator (src/comm/nccl_communicator.cpp). Included from cmake/cuda.cmake.
#
# LMOE_WITH_NCCL: AUTO builds the communicator when NCCL is found, ON requires it, OFF skips it.
# Where it looks, in order; the first place that has both nccl.h and the library wins, so that the
# header and the library always come from one installation:
#   0. LMOE_NCCL_INCLUDE_DIR and LMOE_NCCL_LIBRARY when both are given;
#   1. LMOE_NCCL_ROOT (cache variable) or $NCCL_ROOT / $NCCL_HOME;
#   2. the CUDA toolkit (/usr/local/cuda/include, /usr/local/cuda/lib64);
#   3. the system (/usr/include, /usr/lib/<arch>: Debian/Ubuntu's libnccl-dev);
#   4. a Python wheel (nvidia-nccl-cu12 / -cu13: <site-packages>/nvidia/nccl/{include,lib}), which
#      ships libnccl.so.2 without the unversioned link, as python3 reports it.
# Sets LMOE_HAS_NCCL and, when found, the imported target lmoe::nccl.

set(LMOE_NCCL_ROOT "" CACHE PATH "An NCCL installation to use first (include/ and lib/ below it)")
set(LMOE_NCCL_INCLUDE_DIR "" CACHE PATH "nccl.h's directory (with LMOE_NCCL_LIBRARY: skip the search)")
set(LMOE_NCCL_LIBRARY "" CACHE FILEPATH "The NCCL library (with LMOE_NCCL_INCLUDE_DIR: skip the search)")
set(LMOE_HAS_NCCL OFF)

# The oldest NCCL with everything the communicator uses (ncclCommInitRankConfig with nonblocking
# communicators, ncclGetLastError, ncclCommFinalize).
set(_lmoe_nccl_min_version 2.18.0)

function(_lmoe_nccl_version include_dir out_var)
  file(STRINGS "${include_dir}/nccl.h" _lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) [0-9]+")
  set(_version "")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _match "${_lines}")
    list(APPEND _version "${CMAKE_MATCH_1}")
  endforeach()
  list(JOIN _version "." _version)
  set(${out_var} "${_version}" PARENT_SCOPE)
endfunction()

# Looks for nccl.h and the library under one (include dirs, library dirs) pair only; the first
# pair that has both sets _lmoe_nccl_inc, _lmoe_nccl_lib and _lmoe_nccl_from in the caller.
function(_lmoe_nccl_try label include_dirs library_dirs)
  string(REPLACE ";" ", " _where "${label}: ${include_dirs} | ${library_dirs}")
  list(APPEND _lmoe_nccl_searched "${_where}")
  set(_lmoe_nccl_searched "${_lmoe_nccl_searched}" PARENT_SCOPE)
  if(_lmoe_nccl_inc AND _lmoe_nccl_lib)
    return()
  endif()
  find_path(_inc nccl.h PATHS ${include_dirs} NO_DEFAULT_PATH NO_CACHE)
  find_library(_lib NAMES nccl libnccl.so.2 PATHS ${library_dirs} NO_DEFAULT_PATH NO_CACHE)
  if(_inc AND _lib)
    cmake_path(SET _inc NORMALIZE "${_inc}")
    string(REGEX REPLACE "/$" "" _inc "${_inc}")
    set(_lmoe_nccl_inc "${_inc}" PARENT_SCOPE)
    set(_lmoe_nccl_lib "${_lib}" PARENT_SCOPE)
    set(_lmoe_nccl_from "${label}" PARENT_SCOPE)
  endif()
endfunction()

if(NOT LMOE_WITH_NCCL STREQUAL "OFF")
  set(_lmoe_nccl_searched "")
  set(_lmoe_nccl_inc "")
  set(_lmoe_nccl_lib "")
  # Both given on the command line: used as they are.
  if(LMOE_NCCL_INCLUDE_DIR AND LMOE_NCCL_LIBRARY)
    set(_lmoe_nccl_inc "${LMOE_NCCL_INCLUDE_DIR}")
    set(_lmoe_nccl_lib "${LMOE_NCCL_LIBRARY}")
    set(_lmoe_nccl_from "LMOE_NCCL_INCLUDE_DIR and LMOE_NCCL_LIBRARY")
  endif()

  set(_lmoe_lib_suffixes lib lib64)
  if(CMAKE_LIBRARY_ARCHITECTURE)
    list(APPEND _lmoe_lib_suffixes "lib/${CMAKE_LIBRARY_ARCHITECTURE}")
  endif()
  foreach(_root IN ITEMS "${LMOE_NCCL_ROOT}" "$ENV{NCCL_ROOT}" "$ENV{NCCL_HOME}")
    if(_root)
      list(TRANSFORM _lmoe_lib_suffixes PREPEND "${_root}/" OUTPUT_VARIABLE _dirs)
      _lmoe_nccl_try("${_root}" "${_root}/include" "${_dirs}")
    endif()
  endforeach()

  _lmoe_nccl_try("the CUDA toolkit" "${CUDAToolkit_INCLUDE_DIRS}" "${CUDAToolkit_LIBRARY_DIR}")

  set(_system_libs "")
  foreach(_prefix /usr /usr/local)
    list(TRANSFORM _lmoe_lib_suffixes PREPEND "${_prefix}/" OUTPUT_VARIABLE _dirs)
    list(APPEND _system_libs ${_dirs})
  endforeach()
  _lmoe_nccl_try("the system" "/usr/include;/usr/local/include" "${_system_libs}")

  if(NOT (_lmoe_nccl_inc AND _lmoe_nccl_lib))
    find_program(LMOE_PYTHON3 python3)
    if(LMOE_PYTHON3)
      # find_spec handles both a regular and a namespace package, and None when it is absent.
      execute_process(
        COMMAND "${LMOE_PYTHON3}" -c
          "import importlib.util as u\ntry:\n  s = u.find_spec('nvidia.nccl')\nexcept Exception:\n  s = None\nprint(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
        OUTPUT_VARIABLE _wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _python_rc)
      if(_python_rc EQUAL 0 AND _wheel)
        _lmoe_nccl_try("the Python wheel nvidia-nccl" "${_wheel}/include" "${_wheel}/lib")
      endif()
    endif()
  endif()

  if(_lmoe_nccl_inc AND _lmoe_nccl_lib)
    _lmoe_nccl_version("${_lmoe_nccl_inc}" LMOE_NCCL_VERSION)
    if(LMOE_NCCL_VERSION VERSION_LESS _lmoe_nccl_min_version)
      set(_lmoe_nccl_problem "NCCL ${LMOE_NCCL_VERSION} at ${_lmoe_nccl_inc} is older than ${_lmoe_nccl_min_version}")
    else()
      set(LMOE_HAS_NCCL ON)
    endif()
  else()
    list(JOIN _lmoe_nccl_searched "\n    " _searched)
    set(_lmoe_nccl_problem "NCCL not found (nccl.h with libnccl.so or libnccl.so.2); looked in:\n    ${_searched}\n  set LMOE_NCCL_ROOT or NCCL_ROOT to an installation")
  endif()

  if(LMOE_HAS_NCCL)
    message(STATUS "lmoe: NCCL ${LMOE_NCCL_VERSION} found in ${_lmoe_nccl_from}: ${_lmoe_nccl_inc}/nccl.h, ${_lmoe_nccl_lib}")
    add_library(lmoe::nccl UNKNOWN IMPORTED)
    set_target_properties(lmoe::nccl PROPERTIES
      IMPORTED_LOCATION "${_lmoe_nccl_lib}"
      INTERFACE_INCLUDE_DIRECTORIES "${_lmoe_nccl_inc}")
  elseif(LMOE_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "lmoe: LMOE_WITH_NCCL=ON but ${_lmoe_nccl_problem}")
  else()
    message(STATUS "lmoe: ${_lmoe_nccl_problem}; the nccl communicator is not built")
  endif()
else()
  message(STATUS "lmoe: LMOE_WITH_NCCL=OFF; the nccl communicator is not built")
endif()
