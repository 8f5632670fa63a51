#!/usr/bin/env python3
"""What ptxas says about every CUDA kernel, checked against the hardware's rules (no GPU needed).

Compiles each kernels/cuda/*.cu to PTX and that with ptxas -v (its resource report) and checks,
per kernel:
  - static shared memory <= 48 KiB: a block asking for more cannot launch (more needs a dynamic
    opt-in the kernels do not make);
  - registers x the largest block it is launched with <= 64 Ki registers of an SM: otherwise the
    launch fails with "too many resources requested" (the CUDA simulator cannot see either);
  - no local memory (stack frame, spills) beyond the few measured and left alone below: in the
    hot loops local memory costs DRAM traffic the roofline does not count (docs/GPU.md).
And, from the PTX of kernels/cuda/gemv.cu, that every GEMV kernel streams its weights in 16-byte
loads: each has 16-byte global loads and no byte-wide ones (a weight read split into bytes, as
the compiler does when it cannot prove alignment, would cost the GEMV its bandwidth).
Prints one line per kernel family, then the violations; exits 1 when there are any.

Usage: check_cuda_resources.py --nvcc NVCC --arch 90 --source-dir DIR [--keep DIR]
"""
import argparse
import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile

# The largest block each kernel is launched with (the launch sites in kernels/cuda/*.cu). A kernel
# that matches none of these fails the check: add it here with its block size.
MAX_THREADS = [
    (r"gemv_kernel<", 128),                                   # kGemvThreads
    (r"gemv_stream_kernel<", 128),                            # kGemvThreads
    (r"gemv_experts_kernel<", 128),                           # kGemvThreads
    (r"moe_route_kernel\(", 128),                             # kRouteThreads
    (r"attn_combine_kernel<", 256),                           # one thread per dimension, <= 256
    (r"attn_(split|prefill)_kernel<", 128),                   # kAttnThreads
    (r"attn_prefill_mma_kernel<", 128),                       # kMmaWarps * 32
    (r"(top_k|argmax|top_k_split)_kernel\(", 1024),          # kSelThreads
    (r"argmax_split_kernel\(", 256),                          # kSliceThreads
    (r"rms_norm_kernel<", 1024),                              # 4 slices of V values per thread, up to kNormMaxThreads
    (r"(rope_kernel|rope_stage_kernel<)", 256),                # kRopeThreads; rope_stage: 256
    (r"embed_kernel<", 128),
    (r"(ew_kernel<|kv_commit_kernel\(|kv_q8_kernel\(|kv_f16_kernel\(|dequant_f16_kernel<|act_to_f16_kernel\("
     r"|quantize_act_kernel\(|gather_rows_kernel\(|scatter_add_rows_kernel\(|add_rows_kernel\("
     r"|add_rows_id_kernel\(|moe_combine_kernel\()", 256),
]

# Local memory measured and left alone (docs/GPU.md, "Registers and local memory"): bytes of stack
# frame allowed. Everything else must have none.
LOCAL_ALLOWED = [
    (r"(rope_kernel|rope_stage_kernel<)", 40),                # double sincos: its slow path for huge angles
    (r"attn_split_kernel<", 40),                              # the same sincos: a decode step's rope (session 18)
    # Q2_K (session 25): ptxas spills one word in 2 of its 16 GEMV instances (5 and 7 columns, one
    # row per warp); half the unroll or one accumulator spilled more. Untimed on a GPU.
    (r"gemv_kernel<baton::cuda::TQ2_K, [57], 1>", 8),
]

STATIC_SMEM_MAX = 48 * 1024
REGISTERS_PER_SM = 64 * 1024


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"check_cuda_resources: {' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout + r.stderr


def compile_one(nvcc, ptxas, arch, source_dir, out_dir, cu):
    """nvcc to PTX, then ptxas on it with -v: ptxas's report and the PTX (the same as nvcc -cubin
    --resource-usage says, and the PTX comes without a second pass through the front end)."""
    ptx = os.path.join(out_dir, os.path.basename(cu) + ".ptx")
    run([nvcc, "-ptx", f"-arch=sm_{arch}", "-O3", "-DNDEBUG", "-DBATON_HAVE_CUDA=1", "-std=c++20",
         "--expt-relaxed-constexpr", f"-I{source_dir}", cu, "-o", ptx])
    report = run([ptxas, "-v", f"-arch=sm_{arch}", "-O3", ptx, "-o", ptx[:-4] + ".cubin"])
    with open(ptx) as f:
        return report, f.read()


def compile_all(nvcc, arch, source_dir, out_dir):
    """{file name: (ptxas report, PTX)} for every kernels/cuda/*.cu, compiled in parallel (the
    largest first: gemv.cu is half of the time)."""
    ptxas = os.path.join(os.path.dirname(nvcc), "ptxas")
    if not os.path.exists(ptxas):
        ptxas = "ptxas"
    cus = sorted(glob.glob(os.path.join(source_dir, "kernels", "cuda", "*.cu")), key=os.path.getsize, reverse=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(lambda cu: compile_one(nvcc, ptxas, arch, source_dir, out_dir, cu), cus)
        return {os.path.basename(cu): r for cu, r in zip(cus, done)}


# Bytes of one PTX global load: vector width x element size.
def load_bytes(vec, elem):
    n = int(vec[2:]) if vec else 1
    return n * int(re.sub(r"\D", "", elem)) // 8


def gemv_loads(ptx):
    """Per GEMV kernel in the PTX: (name, bytes in 16-byte loads, bytes in narrower loads, byte loads)."""
    out = []
    for body in re.split(r"\n(?=(?:\.visible |\.weak )?\.entry )", ptx):
        m = re.match(r"(?:\.visible |\.weak )?\.entry (\S+)\(", body)
        if not m or not re.search(r"gemv_(?:stream_)?kernel", m.group(1)):
            continue
        wide = narrow = byte_loads = 0
        for vec, elem in re.findall(r"\bld\.global(?:\.nc)?(?:\.L1::\w+)?(?:\.L2::\w+)?(\.v[248])?\.([usbf](?:8|16|32|64))\b", body):
            b = load_bytes(vec, elem)
            if b >= 16:
                wide += b
            else:
                narrow += b
            byte_loads += b == 1
        out.append((m.group(1), wide, narrow, byte_loads))
    names = subprocess.run(["c++filt"], input="\n".join(k[0] for k in out), capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return [(n,) + k[1:] for n, k in zip(names, out)]


TYPE_NAMES = {"TQ4_0": "Q4_0", "TQ4_1": "Q4_1", "TQ5<false>": "Q5_0", "TQ5<true>": "Q5_1", "TQ8_0": "Q8_0",
              "TQ4_K": "Q4_K", "TQ5_K": "Q5_K", "TQ6_K": "Q6_K", "TQ2_K": "Q2_K", "TQ3_K": "Q3_K",
              "TIQ4_NL": "IQ4_NL", "TIQ4_XS": "IQ4_XS", "TMXFP4": "MXFP4", "TFloat<(baton::GgmlType)0>": "F32",
              "TFloat<(baton::GgmlType)1>": "F16", "TFloat<(baton::GgmlType)30>": "BF16"}


def check_loads(loads):
    problems = []
    for name, wide, narrow, byte_loads in loads:
        if wide == 0:
            problems.append(f"{name}: no 16-byte global loads in the PTX: the weights are not streamed 16 bytes at a time")
        if byte_loads:
            problems.append(f"{name}: {byte_loads} byte-wide global loads in the PTX (a split weight load?)")
    return problems


def parse(report):
    kernels, cur, props = [], None, None  # props: the function the next stack/spill line is about
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = {"mangled": m.group(1), "stack": 0, "spill": 0, "regs": 0, "smem": 0}
            kernels.append(cur)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = m.group(1)  # a kernel, or a device function called from it (e.g. sincos's slow path)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props == cur["mangled"]:
            cur["stack"], cur["spill"] = int(m.group(1)), max(int(m.group(2)), int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    names = subprocess.run(["c++filt"], input="\n".join(k["mangled"] for k in kernels), capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for k, n in zip(kernels, names):
        k["name"] = n
    return kernels


def first_match(rules, name):
    for pattern, value in rules:
        if re.search(pattern, name):
            return value
    return None


def check(kernels):
    problems = []
    for k in kernels:
        name = k["name"]
        threads = first_match(MAX_THREADS, name)
        if threads is None:
            problems.append(f"{name}: not in MAX_THREADS (tests/check_cuda_resources.py): add its largest block")
        elif k["regs"] * threads > REGISTERS_PER_SM:
            problems.append(f"{name}: {k['regs']} registers x {threads} threads > {REGISTERS_PER_SM}: the launch would "
                            "fail (add __launch_bounds__ or use fewer registers)")
        if k["smem"] > STATIC_SMEM_MAX:
            problems.append(f"{name}: {k['smem']} bytes of static shared memory > {STATIC_SMEM_MAX}")
        local = max(k["stack"], k["spill"])
        allowed = first_match(LOCAL_ALLOWED, name) or 0
        if local > allowed:
            problems.append(f"{name}: {k['stack']} bytes stack frame, {k['spill']} bytes spilled (allowed {allowed}): "
                            "local memory; see LOCAL_ALLOWED")
    return problems


def family(name):
    m = re.search(r"(\w+_kernel)", name)
    return m.group(1) if m else name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvcc", required=True)
    ap.add_argument("--arch", default="90")
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", help="write the ptxas report here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = compile_all(a.nvcc, a.arch, a.source_dir, tmp)
    report = "\n".join(r for r, _ in out.values())
    loads = gemv_loads(out["gemv.cu"][1])
    if a.keep:
        with open(a.keep, "w") as f:
            f.write(report)
    kernels = parse(report)
    gemv = [k for k in kernels if re.search(r"gemv_(?:stream_)?kernel<", k["name"])]
    # The parse itself: at least 11 weight types x 1..8 columns of GEMV, and the other families.
    if len(gemv) < 88 or len(kernels) < 120:
        sys.exit(f"check_cuda_resources: parsed only {len(kernels)} kernels ({len(gemv)} GEMV) from ptxas's report")

    fams = {}
    for k in kernels:
        f = fams.setdefault(family(k["name"]), {"n": 0, "regs": 0, "smem": 0, "local": 0})
        f["n"] += 1
        f["regs"] = max(f["regs"], k["regs"])
        f["smem"] = max(f["smem"], k["smem"])
        f["local"] = max(f["local"], k["stack"], k["spill"])
    print(f"sm_{a.arch}: {len(kernels)} kernels")
    print(f"{'kernel':<24} {'instances':>9} {'max regs':>9} {'max smem':>9} {'max local':>9}")
    for name, f in sorted(fams.items()):
        print(f"{name:<24} {f['n']:>9} {f['regs']:>9} {f['smem']:>9} {f['local']:>9}")
    if len(loads) != len(gemv):
        sys.exit(f"check_cuda_resources: {len(loads)} GEMV kernels in the PTX, {len(gemv)} in ptxas's report")
    by_type = {}
    for name, wide, narrow, _ in loads:
        t = re.search(r"gemv_(?:stream_)?kernel<baton::cuda::(\w+(?:<[^>]*>)?)", name)
        key = TYPE_NAMES.get(t.group(1), t.group(1)) if t else name
        by_type[key] = min(by_type.get(key, 1.0), wide / max(1, wide + narrow))
    print("GEMV global loads in 16-byte instructions (share of the bytes in a kernel's load instructions, "
          "lowest over 1..8 columns):")
    print("  " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(by_type.items())))
    problems = check(kernels) + check_loads(loads)
    for p in problems:
        print("FAIL", p)
    if problems:
        sys.exit(1)
    print("every kernel: static shared memory, registers per block and local memory within bounds; "
          "every GEMV streams its weights in 16-byte loads")


if __name__ == "__main__":
    main()
