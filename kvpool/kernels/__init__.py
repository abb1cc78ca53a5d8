"""kvpool's C++ CPU kernels: the build (`cpu_kernels`), paged decode attention
(`csrc/paged_decode.cpp`) and the fused elementwise ops of the model (`csrc/fused_ops.cpp`,
called through `fused`)."""
