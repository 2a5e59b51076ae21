; nantrace gpucheck kernels (LLVM IR for NVPTX). Compiled to nantrace/data/gpucheck.ptx with
;   /usr/lib/llvm-22/bin/llc -march=nvptx64 -mcpu=sm_80 -mattr=+ptx78 -O2 gpucheck.ll -o gpucheck.ptx
; (scripts/gpucheck-ptx.sh). The driver JIT-compiles the PTX: no CUDA toolkit is needed.
;
; fma_*: each thread iterates the logistic map a <- r*a*(1-a) (r = 3.9, chaotic: one wrong bit
; anywhere in the chain changes the result) with fused multiply-adds in one precision, from a
; seeded start, and stores its final value. Deterministic: no reductions, no atomics.
; mem_fill / mem_check: write a pattern over a buffer, read it back, count mismatches.
target datalayout = "e-p6:32:32-i64:64-i128:128-v16:16-v32:32-n16:32:64"
target triple = "nvptx64-nvidia-cuda"

declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.nctaid.x()
declare float @llvm.fma.f32(float, float, float)
declare half @llvm.fma.f16(half, half, half)
declare bfloat @llvm.fma.bf16(bfloat, bfloat, bfloat)

define i32 @gid() {
  %tid = call i32 @llvm.nvvm.read.ptx.sreg.tid.x()
  %ctaid = call i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
  %ntid = call i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
  %b = mul i32 %ctaid, %ntid
  %g = add i32 %b, %tid
  ret i32 %g
}

; The start value in (0.1, 0.9) for a thread and a seed.
define float @start(i32 %g, i32 %seed) {
  %h0 = xor i32 %g, %seed
  %h1 = mul i32 %h0, -1640531535
  %h2 = lshr i32 %h1, 22
  %f = uitofp i32 %h2 to float
  %s = fmul float %f, 0x3F4A000000000000
  %a = fadd float %s, 0x3FB99999A0000000
  ret float %a
}

define ptx_kernel void @fma_f32(ptr addrspace(1) %out, i32 %n, i32 %iters, i32 %seed) {
entry:
  %g = call i32 @gid()
  %in = icmp ult i32 %g, %n
  br i1 %in, label %body, label %exit
body:
  %a0 = call float @start(i32 %g, i32 %seed)
  br label %loop
loop:
  %i = phi i32 [ 0, %body ], [ %i1, %loop ]
  %a = phi float [ %a0, %body ], [ %a1, %loop ]
  %t = fmul float %a, 0x400F333340000000
  %nt = fneg float %t
  %a1 = call float @llvm.fma.f32(float %nt, float %a, float %t)
  %i1 = add i32 %i, 1
  %c = icmp ult i32 %i1, %iters
  br i1 %c, label %loop, label %store
store:
  %g64 = zext i32 %g to i64
  %p = getelementptr float, ptr addrspace(1) %out, i64 %g64
  store float %a1, ptr addrspace(1) %p
  br label %exit
exit:
  ret void
}

define ptx_kernel void @fma_f16(ptr addrspace(1) %out, i32 %n, i32 %iters, i32 %seed) {
entry:
  %g = call i32 @gid()
  %in = icmp ult i32 %g, %n
  br i1 %in, label %body, label %exit
body:
  %a0f = call float @start(i32 %g, i32 %seed)
  %a0 = fptrunc float %a0f to half
  br label %loop
loop:
  %i = phi i32 [ 0, %body ], [ %i1, %loop ]
  %a = phi half [ %a0, %body ], [ %a1, %loop ]
  %t = fmul half %a, 0xH43CD
  %nt = fneg half %t
  %a1 = call half @llvm.fma.f16(half %nt, half %a, half %t)
  %i1 = add i32 %i, 1
  %c = icmp ult i32 %i1, %iters
  br i1 %c, label %loop, label %store
store:
  %g64 = zext i32 %g to i64
  %p = getelementptr half, ptr addrspace(1) %out, i64 %g64
  store half %a1, ptr addrspace(1) %p
  br label %exit
exit:
  ret void
}

define ptx_kernel void @fma_bf16(ptr addrspace(1) %out, i32 %n, i32 %iters, i32 %seed) {
entry:
  %g = call i32 @gid()
  %in = icmp ult i32 %g, %n
  br i1 %in, label %body, label %exit
body:
  %a0f = call float @start(i32 %g, i32 %seed)
  %a0 = fptrunc float %a0f to bfloat
  br label %loop
loop:
  %i = phi i32 [ 0, %body ], [ %i1, %loop ]
  %a = phi bfloat [ %a0, %body ], [ %a1, %loop ]
  %t = fmul bfloat %a, 0xR4079
  %nt = fneg bfloat %t
  %a1 = call bfloat @llvm.fma.bf16(bfloat %nt, bfloat %a, bfloat %t)
  %i1 = add i32 %i, 1
  %c = icmp ult i32 %i1, %iters
  br i1 %c, label %loop, label %store
store:
  %g64 = zext i32 %g to i64
  %p = getelementptr bfloat, ptr addrspace(1) %out, i64 %g64
  store bfloat %a1, ptr addrspace(1) %p
  br label %exit
exit:
  ret void
}

; Pattern for word `idx`: kind 0 = address-in-address (idx ^ seed), 1 = walking ones,
; 2 = seeded random (a 32-bit mix of idx and seed).
define i32 @pattern(i64 %idx, i32 %kind, i32 %seed) {
  %lo = trunc i64 %idx to i32
  %hi64 = lshr i64 %idx, 32
  %hi = trunc i64 %hi64 to i32
  %k0 = xor i32 %lo, %seed
  %sh = and i32 %lo, 31
  %k1 = shl i32 1, %sh
  %m0 = xor i32 %lo, %hi
  %m1 = mul i32 %m0, -1640531535
  %m2 = add i32 %m1, %seed
  %m3 = lshr i32 %m2, 15
  %m4 = xor i32 %m2, %m3
  %m5 = mul i32 %m4, -2048144777
  %m6 = lshr i32 %m5, 13
  %k2 = xor i32 %m5, %m6
  %is0 = icmp eq i32 %kind, 0
  %is1 = icmp eq i32 %kind, 1
  %v12 = select i1 %is1, i32 %k1, i32 %k2
  %v = select i1 %is0, i32 %k0, i32 %v12
  ret i32 %v
}

define ptx_kernel void @mem_fill(ptr addrspace(1) %buf, i64 %n, i32 %kind, i32 %seed) {
entry:
  %g = call i32 @gid()
  %ntid = call i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
  %nct = call i32 @llvm.nvvm.read.ptx.sreg.nctaid.x()
  %st32 = mul i32 %ntid, %nct
  %stride = zext i32 %st32 to i64
  %start = zext i32 %g to i64
  %in = icmp ult i64 %start, %n
  br i1 %in, label %loop, label %exit
loop:
  %idx = phi i64 [ %start, %entry ], [ %next, %loop ]
  %v = call i32 @pattern(i64 %idx, i32 %kind, i32 %seed)
  %p = getelementptr i32, ptr addrspace(1) %buf, i64 %idx
  store volatile i32 %v, ptr addrspace(1) %p
  %next = add i64 %idx, %stride
  %c = icmp ult i64 %next, %n
  br i1 %c, label %loop, label %exit
exit:
  ret void
}

define ptx_kernel void @mem_check(ptr addrspace(1) %buf, i64 %n, i32 %kind, i32 %seed, ptr addrspace(1) %errs, ptr addrspace(1) %first) {
entry:
  %g = call i32 @gid()
  %ntid = call i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
  %nct = call i32 @llvm.nvvm.read.ptx.sreg.nctaid.x()
  %st32 = mul i32 %ntid, %nct
  %stride = zext i32 %st32 to i64
  %start = zext i32 %g to i64
  %in = icmp ult i64 %start, %n
  br i1 %in, label %loop, label %exit
loop:
  %idx = phi i64 [ %start, %entry ], [ %next, %cont ]
  %want = call i32 @pattern(i64 %idx, i32 %kind, i32 %seed)
  %p = getelementptr i32, ptr addrspace(1) %buf, i64 %idx
  %got = load volatile i32, ptr addrspace(1) %p
  %bad = icmp ne i32 %got, %want
  br i1 %bad, label %record, label %cont
record:
  %o1 = atomicrmw add ptr addrspace(1) %errs, i64 1 monotonic
  %o2 = atomicrmw umin ptr addrspace(1) %first, i64 %idx monotonic
  br label %cont
cont:
  %next = add i64 %idx, %stride
  %c = icmp ult i64 %next, %n
  br i1 %c, label %loop, label %exit
exit:
  ret void
}
