# For the CUDA simulator (BATON_CUDA=SIM): copies a .cu file with each kernel launch
#   name<...><<<grid, block, smem, stream>>>(args)
# rewritten as
#   ::cudasim::launch(name<...>, "name<...>", grid, block, smem, stream)(args)
# so that the host compiler can build it. Line numbers are kept. Usage: cmake -DIN=a.cu -DOUT=a.cpp -P this
file(READ "${IN}" src)
string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_:]*(<[^<>;]*>)?)([ \t\r\n]*)<<<" "::cudasim::launch(\\1, \"\\1\",\\3" src "${src}")
string(REPLACE ">>>(" ")(" src "${src}")
if(src MATCHES "<<<|>>>")
  message(FATAL_ERROR "cudasim_rewrite: a launch in ${IN} has a form this rewrite does not know")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/cudasim_rewrite.cmake (launches rewritten for the CUDA simulator).\n#line 1 \"${IN}\"\n${src}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
