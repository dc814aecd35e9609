/*
 * A stub for each driver entry point the library hands out without a form of its own
 * (interpose.c: every function of libcuda a program looks up through cuGetProcAddress,
 * cudaGetDriverEntryPoint or dlsym): while the kernel is suspended it holds the call
 * before the driver sees it (gate.c), else it jumps straight to the driver's function.
 *
 * Written for x86-64 System V: a stub knows nothing of its function's parameters, so it
 * keeps every register that may carry one (rdi, rsi, rdx, rcx, r8, r9, rax for varargs,
 * xmm0-7) around the wait, and the stack (the seventh parameter on) is left as it was:
 * the jump to the driver's function is the caller's call. Each stub is 32 bytes, stub i
 * at vgpu_stub_base + 32 * i; its driver function at g_vgpu_stub_real[i]. On other
 * architectures the library has no stubs (interpose.c hands the driver's out as they are).
 */
#if defined(__x86_64__) && defined(__ELF__)
#include "stubs.h"

        .text
        .globl  vgpu_stub_base
        .hidden vgpu_stub_base
        .type   vgpu_stub_base, @function
        .balign 32
vgpu_stub_base:
        .set    i, 0
        .rept   VGPU_STUBS
        .balign 32
        cmpl    $VGPU_SUSPENDED, g_vgpu_away(%rip)
        je      1f
        jmp     *g_vgpu_stub_real+8*i(%rip)
1:      movl    $i, %r11d
        jmp     vgpu_stub_slow
        .set    i, i+1
        .endr

        .balign 16
vgpu_stub_slow:
        pushq   %rdi
        pushq   %rsi
        pushq   %rdx
        pushq   %rcx
        pushq   %r8
        pushq   %r9
        pushq   %rax
        pushq   %r11
        subq    $136, %rsp              /* eight xmm registers, and the stack 16-byte aligned */
        movdqu  %xmm0, 0(%rsp)
        movdqu  %xmm1, 16(%rsp)
        movdqu  %xmm2, 32(%rsp)
        movdqu  %xmm3, 48(%rsp)
        movdqu  %xmm4, 64(%rsp)
        movdqu  %xmm5, 80(%rsp)
        movdqu  %xmm6, 96(%rsp)
        movdqu  %xmm7, 112(%rsp)
        movl    %r11d, %edi
        call    vgpu_stub_hold
        movdqu  0(%rsp), %xmm0
        movdqu  16(%rsp), %xmm1
        movdqu  32(%rsp), %xmm2
        movdqu  48(%rsp), %xmm3
        movdqu  64(%rsp), %xmm4
        movdqu  80(%rsp), %xmm5
        movdqu  96(%rsp), %xmm6
        movdqu  112(%rsp), %xmm7
        addq    $136, %rsp
        testl   %eax, %eax
        jnz     2f
        popq    %r11
        popq    %rax
        popq    %r9
        popq    %r8
        popq    %rcx
        popq    %rdx
        popq    %rsi
        popq    %rdi
        leaq    g_vgpu_stub_real(%rip), %r10
        jmp     *(%r10,%r11,8)
2:      addq    $64, %rsp               /* the way back failed: the call returns its error */
        ret
        .size   vgpu_stub_base, .-vgpu_stub_base

        .section .note.GNU-stack,"",@progbits
#endif
