"""How the cpu extension is compiled: setup.py builds tensorfold._cpu with these flags, and
tests/test_cpu_isa_variants.py rebuilds the kernels with them for other instruction sets.

Exactness rests on them: -ffp-contract=off (the compiler fuses no multiply and add that the
source did not fuse), never fast-math (no reordering, no approximate division or exp).
"""
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-std=c++17",
         "-g0"]  # Python's -g made the torch-heavy bindings compile 1.7x slower (82 -> 48 s for layer.cpp)

# The torch bindings; every other source is a kernel on raw pointers (kernels.h) whose vector
# code follows -march.
BINDINGS = ("layer.cpp", "mamba2_layer.cpp", "module.cpp")


def arch_flags(arch: str) -> list[str]:
    """-march for `arch` ("native", an ISA level such as "x86-64-v3"; "none": the compiler's default)."""
    return [] if arch == "none" else [f"-march={arch}"]
