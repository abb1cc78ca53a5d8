"""Ahead-of-time compilation of the Triton kernels for a GPU target, on a machine without one.

Triton's wheel carries the whole NVIDIA tool chain (LLVM, ptxas, cuobjdump), so the kernels can
be compiled to machine code for, say, sm_90 (H100/H200) on any CPU. That proves they compile
for the real hardware (the interpreter checks only their arithmetic), and cuobjdump's resource
report says what each one costs: registers per thread, local memory (spills) and shared memory.

Kernels must be imported in compiled mode (not under TRITON_INTERPRET). A test helper, not part
of the library: it reaches into Triton's compiler internals (`ASTSource`, `GPUTarget`), and only
`test_triton_kernels.py::test_kernels_compile_for_sm90_without_spills` uses it. From the
repository root: `python -c "from tests.attention.triton_compile import compile_all; ..."`.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvpool.attention import triton_decode, triton_kv, triton_prefill
from kvpool.kernels import dtypes

_TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Quantized KV storage dtypes (torch name) → (Triton pointer element, KV_QUANT, build suffix).
_KV_QUANT = {
    "int8": ("i8", dtypes.KV_QUANT_INT8, "int8"),
    "float8_e4m3fn": ("fp8e4nv", dtypes.KV_QUANT_E4M3, "e4m3"),
    "float8_e5m2": ("fp8e5", dtypes.KV_QUANT_E5M2, "e5m2"),
}


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """What one compiled kernel variant costs on its target."""

    name: str
    num_registers: int  # per thread
    local_bytes: int  # per thread; > 0 means register spills
    shared_bytes: int  # per program
    num_warps: int
    has_async_copies: bool  # global loads went through 16-byte cp.async (pipelined, vectorised)


def _signature(kernel: Any, pointer_types: dict[str, str], constexprs: dict[str, Any]) -> dict:
    # Scalars default to i32; the cache's block stride may exceed 2**31 elements on a big GPU.
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        elif name in ("scale_log2", "softcap_log2"):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if name in ("stride_kv_block", "stride_block") else "i32"
    return signature


def _divisibility(kernel: Any, signature: dict[str, str]) -> dict:
    """What a real launch tells the compiler: pointers are 16-byte aligned and strides that are
    multiples of head_dim divide by 16 (Triton specialises such arguments at launch; without
    it, loads through the block table are not vectorised)."""
    # stride_s_slot is num_kv_heads, which need not divide by 16.
    unknown = ("stride_bt_seq", "stride_lse_seq", "stride_lse_head", "stride_s_slot")
    divisible = [
        index
        for index, name in enumerate(kernel.arg_names)
        if signature[name].startswith("*") or (name.startswith("stride_") and name not in unknown)
    ]
    return {(index,): [["tt.divisibility", 16]] for index in divisible}


def _resources(cubin: bytes) -> tuple[int, int]:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [cuobjdump, "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers = re.search(r"REG:(\d+)", report)
    local = re.search(r"LOCAL:(\d+)", report)
    assert registers and local, f"unexpected cuobjdump report: {report}"
    return int(registers.group(1)), int(local.group(1))


def compile_kernel(
    name: str,
    kernel: Any,
    pointer_types: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
    num_stages: int = 2,
    arch: int = 90,
) -> KernelBuild:
    """Compile one kernel variant for `sm_<arch>` and read its resource use."""
    signature = _signature(kernel, pointer_types, constexprs)
    source = ASTSource(kernel, signature, constexprs, _divisibility(kernel, signature))
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    num_registers, local_bytes = _resources(compiled.asm["cubin"])
    has_async_copies = "cp.async.cg.shared.global" in compiled.asm["ptx"]
    return KernelBuild(
        name, num_registers, local_bytes, compiled.metadata.shared, num_warps, has_async_copies
    )


def compile_all(
    dtype: str = "bfloat16",
    head_dim: int = 128,
    group_size: int = 4,
    block_size: int = 16,
    arch: int = 90,
    kv_dtypes: tuple[str, ...] = (),
) -> list[KernelBuild]:
    """Every kernel at its default configuration, for one model shape and dtype; then, for each
    quantized KV storage dtype in `kv_dtypes` (torch names: int8, float8_e4m3fn, float8_e5m2),
    the kernels that read or write it (builds named `decode_int8`, `write_kv_e4m3`, ...). The
    float cache's attention kernels are built soft-capped too (`decode_softcap`, ...)."""
    builds = _compile_variants(dtype, head_dim, group_size, block_size, arch, None)
    for kv_dtype in kv_dtypes:
        builds += _compile_variants(dtype, head_dim, group_size, block_size, arch, kv_dtype)
    return builds


def _compile_variants(
    dtype: str, head_dim: int, group_size: int, block_size: int, arch: int, kv_dtype: str | None
) -> list[KernelBuild]:
    element = _TORCH_TO_TRITON[dtype]
    kv_element, kv_quant, suffix = (element, dtypes.KV_QUANT_NONE, "")
    if kv_dtype is not None:
        kv_element, kv_quant, suffix = _KV_QUANT[kv_dtype]
        suffix = f"_{suffix}"
    block_d = triton.next_power_of_2(head_dim)
    decode, prefill = triton_decode.DecodeConfig(), triton_prefill.PrefillConfig()
    io = {"query_ptr": f"*{element}", "kv_ptr": f"*{kv_element}", "scales_ptr": "*fp32"}
    tables = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
    shape = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_SIZE": block_size}
    attention = {**shape, "DOT_PRECISION": "ieee" if dtype == "float32" else "tf32"}
    attention["KV_QUANT"] = kv_quant
    attention["SOFTCAP"] = False
    decode_consts = {
        **attention,
        "GROUP": group_size,
        "BLOCK_H": max(16, triton.next_power_of_2(group_size)),
        "BLOCK_N": decode.block_n,
    }
    launch = {"num_warps": decode.num_warps, "num_stages": decode.num_stages, "arch": arch}
    builds = [
        compile_kernel(
            f"decode{suffix}",
            triton_decode._decode_kernel,
            {**io, **tables, "out_ptr": f"*{element}", "lse_ptr": "*fp32"},
            {**decode_consts, "IS_SPLIT": False},
            **launch,
        ),
        compile_kernel(
            f"decode_split{suffix}",
            triton_decode._decode_kernel,
            {**io, **tables, "out_ptr": "*fp32", "lse_ptr": "*fp32"},
            {**decode_consts, "IS_SPLIT": True},
            **launch,
        ),
        compile_kernel(
            f"prefill{suffix}",
            triton_prefill._prefill_kernel,
            {**io, **tables, "query_start_loc_ptr": "*i32", "out_ptr": f"*{element}"},
            {**attention, "GROUP": group_size}
            | {"BLOCK_M": max(prefill.block_m, group_size), "BLOCK_N": prefill.block_n},
            num_warps=prefill.num_warps,
            num_stages=prefill.num_stages,
            arch=arch,
        ),
        compile_kernel(
            f"write_kv{suffix}",
            triton_kv.write_kv_kernel,
            {"key_ptr": f"*{element}", "value_ptr": f"*{element}", "kv_ptr": f"*{kv_element}"}
            | {"scales_ptr": "*fp32", "slot_mapping_ptr": "*i64"},
            {**shape, "NUM_KV_HEADS": 8, "BLOCK_HEADS": 8, "KV_QUANT": kv_quant}
            | {"QMAX": dtypes.KV_QUANT_MAX[kv_quant]},
            arch=arch,
        ),
    ]
    if kv_dtype is None:  # the reduction and the block copy never see codes
        builds += _softcapped_variants({**io, **tables}, decode_consts, attention, group_size,
                                       launch)
        builds += [
            compile_kernel(
                "decode_reduce",
                triton_decode._reduce_kernel,
                {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "seq_lens_ptr": "*i32"}
                | {"out_ptr": f"*{element}"},
                {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_S": 32}
                | {"BLOCK_N": decode.block_n},
                arch=arch,
            ),
            compile_kernel(
                "copy_blocks",
                triton_kv._copy_blocks_kernel,
                {"kv_ptr": f"*{element}", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64"},
                {"CHUNK": triton_kv.COPY_CHUNK},
                arch=arch,
            ),
        ]
    return builds


def _softcapped_variants(pointers: dict, decode_consts: dict, attention: dict, group_size: int,
                         launch: dict) -> list[KernelBuild]:
    """The attention kernels of a model whose scores are soft-capped (`SOFTCAP`), each built as
    its uncapped twin is."""
    element = pointers["query_ptr"].removeprefix("*")
    prefill = triton_prefill.PrefillConfig()
    capped = [
        compile_kernel(
            "decode_split_softcap" if split else "decode_softcap",
            triton_decode._decode_kernel,
            {**pointers, "out_ptr": "*fp32" if split else f"*{element}", "lse_ptr": "*fp32"},
            {**decode_consts, "IS_SPLIT": split, "SOFTCAP": True},
            **launch,
        )
        for split in (False, True)
    ]
    capped.append(compile_kernel(
        "prefill_softcap",
        triton_prefill._prefill_kernel,
        {**pointers, "query_start_loc_ptr": "*i32", "out_ptr": f"*{element}"},
        {**attention, "GROUP": group_size, "SOFTCAP": True}
        | {"BLOCK_M": max(prefill.block_m, group_size), "BLOCK_N": prefill.block_n},
        num_warps=prefill.num_warps, num_stages=prefill.num_stages, arch=launch["arch"],
    ))
    return capped
