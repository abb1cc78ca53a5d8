"""The quantized matmuls' portable path: `csrc/quant_matmul.cpp` and `csrc/dequant_matmul.cpp`
built without AVX-512 (as on a CPU that lacks it, where their scalar C++ runs) compute what
their PyTorch references compute. A child process loads that build, so that its ops do not meet
the AVX-512 build this process has registered under the same names."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvpool.kernels.cpu_kernels import COMPILE_FLAGS, CSRC_DIR, LINK_FLAGS

CHILD = textwrap.dedent("""
    import sys
    import torch
    from torch.utils import cpp_extension
    from kvpool.kernels.group_quant import quantize
    from kvpool.kernels.quant_matmul import (DEQUANTIZED_FROM, dequant_matmul_reference, pack,
                                             quant_matmul_reference)

    directory, flags, ldflags, *sources = sys.argv[1:]
    cpp_extension.load(name="kvpool_scalar_quant", sources=sources,
                       extra_cflags=flags.split(), extra_ldflags=ldflags.split(),
                       build_directory=directory, is_python_module=False)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for bits in (4, 8):
        for rows, cols, group in ((33, 128, 32), (16, 64, 16), (40, 256, 64)):
            weight = pack(quantize(torch.randn(rows, cols, generator=generator), bits, group))
            for tokens in (1, 5, 9, DEQUANTIZED_FROM):
                x = torch.randn(tokens, cols, generator=generator)
                args = (x, weight.data, bits, group, rows)
                if tokens >= DEQUANTIZED_FROM:
                    out = torch.ops.kvpool_cpu.dequant_matmul(*args)
                    reference = dequant_matmul_reference(x.double(), weight)
                else:
                    out = torch.ops.kvpool_cpu.quant_matmul(*args)
                    reference = quant_matmul_reference(x.double(), weight)
                torch.testing.assert_close(out.double(), reference, rtol=1e-5,
                                           atol=1e-5 * cols**0.5)
                checked += 1
    print("checked", checked)
""")


def test_the_scalar_build_computes_the_references(tmp_path):
    flags = [*COMPILE_FLAGS, "-mno-avx512f"]  # turns off every AVX-512 extension with it
    sources = [str(CSRC_DIR / name) for name in ("quant_matmul.cpp", "dequant_matmul.cpp")]
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), " ".join(flags), " ".join(LINK_FLAGS),
         *sources], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "24"
