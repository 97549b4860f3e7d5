"""`python -m zcode.kernels`: builds every C++ kernel now (make install runs it)."""

from zcode.kernels.cpp_build import build_all, describe

print(f"C++ kernels: {describe(build_all())}")
