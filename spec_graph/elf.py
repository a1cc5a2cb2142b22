"""The shared libraries an ELF shared object links (its DT_NEEDED entries), read from its bytes, and the check
for an AOTInductor library built with its own (static) libstdc++."""
from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path


def _elf_needed(data: bytes) -> list[str] | None:
    """The DT_NEEDED libraries of a 64-bit little-endian ELF shared object; None for anything else."""
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _, sh_type, _, _, off, size, link, _ in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        stroff = sections[link][4]
        for at in range(off, off + size, 16):
            tag, val = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                needed.append(data[stroff + val: data.index(b"\0", stroff + val)].decode())
    return needed


def _process_links_libstdcxx() -> bool:
    try:
        return "libstdc++.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def static_cxx_runtime(package) -> str | None:
    """The AOTInductor library in ``package`` (a path or the bytes of one) with its own libstdc++, if any.

    torch runs on the shared libstdc++; a library built with a statically linked
    one (some toolchains' g++ default to it) resolves part of its C++ runtime to
    the process's copy and crashes on load, in std::regex in the model's
    constructor, with no Python error. So export and load check it first."""
    if not _process_links_libstdcxx():
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(package) if isinstance(package, bytes) else package) as z:
            for name in z.namelist():
                needed = _elf_needed(z.read(name)) if name.endswith(".so") else None
                if needed is not None and not any(n.startswith(("libstdc++.so", "libc++.so")) for n in needed):
                    return Path(name).name
    except (zipfile.BadZipFile, ValueError, IndexError, struct.error):
        return None  # damaged: the loader reports it
    return None
