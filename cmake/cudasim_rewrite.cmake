# For the CUDA simulator (BATON_CUDA=SIM): copies a .cu or .cuh file with each kernel launch
#   name<...><<<grid, block, smem, stream>>>(args)
# rewritten as
#   ::cudasim::launch(name<...>, "name<...>", grid, block, smem, stream)(args)
# so that the host compiler can build it, and each __shared__ declaration followed by a call that
# lets the simulator poison it (below). Line numbers are kept. Usage: cmake -DIN=a.cu -DOUT=a.cpp -P this
file(READ "${IN}" src)
string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_:]*(<[^<>;]*>)?)([ \t\r\n]*)<<<" "::cudasim::launch(\\1, \"\\1\",\\3" src "${src}")
string(REPLACE ">>>(" ")(" src "${src}")
if(src MATCHES "<<<|>>>")
  message(FATAL_ERROR "cudasim_rewrite: a launch in ${IN} has a form this rewrite does not know")
endif()
# Each `__shared__ T name[dims];` (one declarator per statement) is followed, on the same line, by
#   ::cudasim::shared_declared(&name, sizeof(name));
# The first thread of each block to pass it fills the variable with 0xFF bytes, so that a read of
# shared memory the block has not written shows up (under the simulator `__shared__` is a
# function-local static, which would otherwise hold what the previous block left there).
if(src MATCHES "__shared__[^;\n]*,")
  message(FATAL_ERROR "cudasim_rewrite: ${IN} declares several variables in one __shared__ statement; write one per line")
endif()
string(REGEX REPLACE "(__shared__[^;\n[]*[ \t*])([A-Za-z_][A-Za-z0-9_]*)([ \t]*(\\[[^;\n]*\\])?)[ \t]*;"
  "\\1\\2\\3; ::cudasim::shared_declared(&\\2, sizeof(\\2));" src "${src}")
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/cudasim_rewrite.cmake (rewritten for the CUDA simulator).\n#line 1 \"${IN}\"\n${src}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
