"""Make this process's requests for AMX tile state fail, as on a host or container whose kernel
refuses them: a seccomp filter (Linux Documentation/userspace-api/seccomp_filter.rst) that
answers `arch_prctl(ARCH_REQ_XCOMP_PERM, ...)` with EPERM and lets every other call through.

`install()` must run before any thread that should be covered starts (the filter applies to
the calling thread and the threads and children it creates afterwards): first thing in a
subprocess, before torch is imported. x86-64 Linux only. Raises OSError if prctl fails.

    python tests/refuse_amx.py MODULE ARGS...     # install, then run MODULE as `python -m`
"""

from __future__ import annotations

import ctypes
import errno
import os
import runpy
import sys

SYS_ARCH_PRCTL = 158                # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# classic BPF opcodes and seccomp return values
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def install() -> None:
    """Install the filter on the calling thread (and what it starts from now on)."""
    program = [
        SockFilter(LD_W_ABS, 0, 0, 0),                           # seccomp_data.nr
        SockFilter(JEQ_K, 0, 3, SYS_ARCH_PRCTL),
        SockFilter(LD_W_ABS, 0, 0, 16),                          # args[0], low 32 bits
        SockFilter(JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
        SockFilter(RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
        SockFilter(RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    filters = (SockFilter * len(program))(*program)
    prog = SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0):
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter not installed: {errno.errorcode.get(err, err)}")


if __name__ == "__main__":
    install()
    sys.path[0] = os.getcwd()                     # as `python -m` has it, not this folder
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
