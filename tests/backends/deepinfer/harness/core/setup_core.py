"""Compiles DeepInfer 0.1.0's engine core ``deepinfer._C`` as a CPU ``CppExtension`` (no CUDA toolkit needed).

Run by ``harness/build.py`` in a directory holding the patched ``csrc/`` and ``stubs/``: ``python setup_core.py
build_ext --inplace`` writes ``deepinfer/_C.cpython-312-*.so``. The sources are the sdist's own (those of its
``setup.py``) with the two CUDA-only files replaced by ``stubs/``.
"""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
DEEPINFER_SOURCES = [
    "csrc/pybind.cpp",
    "csrc/engine/pybind.cpp",
    "csrc/engine/pybind_sequence.cpp",
    "csrc/engine/pybind_scheduler.cpp",
    "csrc/engine/pybind_output.cpp",
    "csrc/engine/zos.cpp",
    "csrc/engine/input_metadata/block_load_plan.cpp",
    "csrc/engine/input_metadata/prepare_tensor_input_base.cpp",
    "csrc/engine/input_metadata/prepare_tensor_input_v4.cpp",
    "csrc/engine/prepare_sample.cpp",
    "csrc/graph_timer/pybind.cpp",
]
CPU_STANDINS = ["stubs/cuda_utils_cpu.cpp", "stubs/graph_timer_cpu.cpp"]
FLAGS = [
    "-g1",
    "-O2",
    "-std=c++20",
    "-Wno-deprecated-declarations",
    "-D_GLIBCXX_USE_CXX11_ABI=1",
    "-fvisibility=hidden",
    "-DDEEPINFER_CPU_STUB",
    "-DFMT_HEADER_ONLY",
]

setup(
    name="deepinfer-cpu-core",
    ext_modules=[
        CppExtension(
            name="deepinfer._C",
            sources=DEEPINFER_SOURCES + CPU_STANDINS,
            include_dirs=[str(HERE / "stubs" / "compat"), str(HERE / "csrc")],  # the <format> shim comes first
            extra_compile_args={"cxx": FLAGS},
            libraries=["pthread"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
