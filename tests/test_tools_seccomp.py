"""The seccomp program the tool sandbox loads (roles/tools/seccomp.py), run by a BPF interpreter
written from the kernel's classic-BPF semantics, so that each decision is checked without a
kernel (tests/test_tools_sandbox.py runs it under bwrap for real)."""

import errno
import platform
import struct

import pytest

from roles.tools import seccomp

pytestmark = pytest.mark.skipif(not seccomp.supported(), reason=f"no filter for {platform.machine()}")


def run(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """The filter's verdict for one syscall (struct seccomp_data: nr, arch, ip, args)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    code = [struct.unpack_from("=HBBI", program, 8 * i) for i in range(len(program) // 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("=I", data, k)[0]
        elif op == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += jt if taken else jf
        pc += 1


def test_only_new_user_namespaces_and_uncounted_memory_are_refused():
    program = seccomp.filter_program()
    arch, nr = seccomp._ARCHES[platform.machine()]
    unshare, clone, clone3 = nr["unshare"], nr["clone"], nr["clone3"]
    allow, eperm, enosys = 0x7FFF0000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
    assert run(program, unshare, arch, seccomp.CLONE_NEWUSER | 0x20000) == eperm  # with CLONE_NEWNS
    assert run(program, clone, arch, seccomp.CLONE_NEWUSER) == eperm
    assert run(program, unshare, arch, 0x20000) == allow  # a mount namespace alone needs capabilities anyway
    assert run(program, clone, arch, 0x11) == allow  # fork: SIGCHLD
    assert run(program, clone3, arch) == enosys  # its flags are in memory: glibc falls back to clone
    assert run(program, 0, arch) == allow and run(program, 1, arch) == allow
    for name in ("memfd_create", "shmget", "mq_open"):  # memory that RLIMIT_AS and the tmpfs sizes miss
        assert run(program, nr[name], arch) == eperm, name
    assert run(program, unshare, 0x40000003, seccomp.CLONE_NEWUSER) == enosys  # i386 (AUDIT_ARCH_I386)
    assert run(program, 0x40000000 | unshare, arch, seccomp.CLONE_NEWUSER) == enosys  # x32
