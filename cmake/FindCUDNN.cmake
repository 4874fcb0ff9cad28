# Finds cuDNN (headers and library). Sets CUDNN_FOUND, CUDNN_VERSION and the target CUDNN::cudnn.
find_path(CUDNN_INCLUDE_DIR cudnn_version.h
  HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include
  PATH_SUFFIXES include)
find_library(CUDNN_LIBRARY cudnn
  HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64
  PATH_SUFFIXES lib lib64)
if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/cudnn_version.h")
  file(READ "${CUDNN_INCLUDE_DIR}/cudnn_version.h" _cudnn_h)
  string(REGEX MATCH "define CUDNN_MAJOR ([0-9]+)" _m "${_cudnn_h}")
  set(_maj "${CMAKE_MATCH_1}")
  string(REGEX MATCH "define CUDNN_MINOR ([0-9]+)" _m "${_cudnn_h}")
  set(_min "${CMAKE_MATCH_1}")
  string(REGEX MATCH "define CUDNN_PATCHLEVEL ([0-9]+)" _m "${_cudnn_h}")
  set(CUDNN_VERSION "${_maj}.${_min}.${CMAKE_MATCH_1}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUDNN REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR
  VERSION_VAR CUDNN_VERSION)
if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
endif()
