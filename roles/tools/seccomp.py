"""The seccomp filter bwrap loads into each tool call (``bwrap --seccomp FD``): no new user
namespaces, and no memory that no limit counts.

Why: inside a user namespace of its own a tool holds every capability there, and can mount a
fresh tmpfs that no limit of ours covers (RLIMIT_AS does not count tmpfs pages, and the work
dir's size is that of our tmpfs only), so it could fill the host's memory until its timeout.
bwrap's own ``--disable-userns`` needs ``--unshare-user``, which as root would keep the call's
uid 0 and so exempt it from RLIMIT_NPROC (roles.tools.sandbox). The filter answers EPERM to
``unshare`` and ``clone`` with CLONE_NEWUSER, and ENOSYS to ``clone3`` (whose flags sit in
memory a filter cannot read; glibc then falls back to ``clone``) and to the syscalls of other
ABIs (i386, x32), whose numbers would slip past the checks. It also answers EPERM to
``memfd_create``, ``shmget`` and ``mq_open``: their pages are not counted by RLIMIT_AS (a
memfd or a System V segment holds them while unmapped) nor by any tmpfs size of ours (a call
held 120 MiB of memfd and 400 MiB of shm under 256 MiB of RLIMIT_AS). ``shm_open`` needs no
rule: it is a file in /dev/shm, a tmpfs of ``max_file_bytes``. The program is built here as the
kernel reads it (``struct sock_filter``: u16 code, u8 jt, u8 jf, u32 k), without libseccomp.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low 32 bits: the flags (little-endian machines)
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000
# machine -> (AUDIT_ARCH_*, {syscall: number}) from the kernel's syscall tables
_ARCHES = {
    "x86_64": (0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435, "memfd_create": 319, "shmget": 29,
                            "mq_open": 240}),
    "aarch64": (0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435, "memfd_create": 279, "shmget": 194,
                             "mq_open": 180}),
}
# memory outside RLIMIT_AS and every tmpfs size: refused outright
UNCOUNTED_MEMORY = ("memfd_create", "shmget", "mq_open")


def supported() -> bool:
    return platform.machine() in _ARCHES


def filter_program() -> bytes:
    """The BPF program for this machine's architecture; ``supported()`` must hold."""
    arch, nr = _ARCHES[platform.machine()]
    memfd_create, shmget, mq_open = (nr[name] for name in UNCOUNTED_MEMORY)
    enosys, eperm = _ERRNO | errno.ENOSYS, _ERRNO | errno.EPERM
    # (code, jt, jf, k); a jump's offsets count the instructions after it
    program = [
        (_LD_ABS, 0, 0, _ARCH),
        (_JEQ, 1, 0, arch),  # another ABI: skip to its refusal
        (_RET, 0, 0, enosys),
        (_LD_ABS, 0, 0, _NR),
        (_JGE, 10, 0, _X32_BIT),  # x32 numbers -> ENOSYS (index 15)
        (_JEQ, 9, 0, nr["clone3"]),  # -> ENOSYS (index 15)
        (_JEQ, 6, 0, memfd_create),  # -> EPERM (index 13)
        (_JEQ, 5, 0, shmget),  # -> EPERM (index 13)
        (_JEQ, 4, 0, mq_open),  # -> EPERM (index 13)
        (_JEQ, 1, 0, nr["unshare"]),  # -> the flags check (index 11)
        (_JEQ, 0, 3, nr["clone"]),  # not clone -> ALLOW (index 14)
        (_LD_ABS, 0, 0, _ARG0_LOW),
        (_JSET, 0, 1, CLONE_NEWUSER),  # no CLONE_NEWUSER -> ALLOW (index 14)
        (_RET, 0, 0, eperm),
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, enosys),
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
