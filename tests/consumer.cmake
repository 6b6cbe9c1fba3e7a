# ctest's install test: installs this build into a scratch prefix, configures and builds examples/consumer (a
# project of its own) against it with find_package(halfgrad), and runs it; the consumer must find the installed
# WikiText-2 beside the installed library, not the build tree's; and the installed `halfgrad` program runs.
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DPREFIX_PATH=a|b -DGENERATOR=... -DCXX=... -P consumer.cmake
function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
string(REPLACE "|" ";" prefix_path "${prefix};${PREFIX_PATH}")
run("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(file include/halfgrad/halfgrad.h include/halfgrad/core/tensor.h lib/cmake/halfgrad/halfgradConfig.cmake
             lib/cmake/halfgrad/halfgradConfigVersion.cmake share/halfgrad/data/wikitext-2/train.txt
             share/halfgrad/data/wikitext-2/LICENSE.txt)
  if(NOT EXISTS "${prefix}/${file}")
    message(FATAL_ERROR "cmake --install did not install ${file}")
  endif()
endforeach()
run("configuring examples/consumer" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/consumer" -B "${WORK_DIR}/build"
    -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_PREFIX_PATH=${prefix_path}")
run("building examples/consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
set(ENV{HALFGRAD_DATA_DIR} "")
run("running the consumer" "${WORK_DIR}/build/consumer")
message(STATUS "${out}")
file(REAL_PATH "${prefix}/share/halfgrad/data" installed_data)
string(FIND "${out}" "WikiText-2 from ${installed_data}" found)
if(found EQUAL -1)
  message(FATAL_ERROR "the consumer did not read the installed data (${installed_data}):\n${out}")
endif()
# The installed program finds the installed library (its RUNPATH), when the build has the tools.
if(EXISTS "${prefix}/bin/halfgrad")
  run("the installed halfgrad info" "${prefix}/bin/halfgrad" info)
  if(NOT out MATCHES "^halfgrad [0-9]")
    message(FATAL_ERROR "the installed halfgrad info printed:\n${out}")
  endif()
endif()
