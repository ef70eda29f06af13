"""Builds tierlift._C, the one compiled extension, with torch.utils.cpp_extension.

Every build switch is read here, in BuildOptions.from_env():

  TIERLIFT_CUDA=auto|0|1   compile csrc/cuda/*.cu and the CUDA op implementations.
                           auto: when torch was built with CUDA and nvcc is found (CUDA_HOME).
  TORCH_CUDA_ARCH_LIST     GPU architectures to compile for; default "9.0" (H100/H200). One
                           architecture keeps builds fast; list more for wider wheels.
  TIERLIFT_URING=auto|0|1  link liburing for the io_uring NVMe backend.
                           auto: when liburing.h is found (apt-get install liburing-dev).
  TIERLIFT_CCACHE=auto|0   wrap the compilers in ccache when it is installed.
  TIERLIFT_DEBUG=0|1       -O0 -g instead of -O3.
  MAX_JOBS                 parallel compile jobs (read by torch's ninja build).

  pip install --no-build-isolation -e .      (torch must already be installed)
"""

import dataclasses
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(kw_only=True)
class BuildOptions:
    cuda: bool
    cuda_arch_list: str
    uring: bool
    ccache: bool
    debug: bool

    @staticmethod
    def _tristate(name: str) -> str:
        value = os.environ.get(name, "auto").strip().lower()
        if value not in ("auto", "0", "1"):
            sys.exit(f"setup.py: {name} must be auto, 0 or 1 (got {value!r})")
        return value

    @classmethod
    def from_env(cls) -> "BuildOptions":
        import torch
        from torch.utils.cpp_extension import CUDA_HOME

        cuda_flag = cls._tristate("TIERLIFT_CUDA")
        nvcc = CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
        cuda_possible = torch.version.cuda is not None and bool(nvcc)
        if cuda_flag == "1" and not cuda_possible:
            sys.exit("setup.py: TIERLIFT_CUDA=1 but torch has no CUDA or nvcc was not found "
                     f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME})")
        uring_flag = cls._tristate("TIERLIFT_URING")
        uring_possible = _find_header("liburing.h") is not None
        if uring_flag == "1" and not uring_possible:
            sys.exit("setup.py: TIERLIFT_URING=1 but liburing.h was not found "
                     "(apt-get install liburing-dev)")
        return cls(
            cuda=cuda_possible if cuda_flag == "auto" else cuda_flag == "1",
            cuda_arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
            uring=uring_possible if uring_flag == "auto" else uring_flag == "1",
            ccache=cls._tristate("TIERLIFT_CCACHE") != "0" and shutil.which("ccache") is not None,
            debug=os.environ.get("TIERLIFT_DEBUG", "0") == "1",
        )


def _find_header(name: str):
    dirs = os.environ.get("CPATH", "").split(os.pathsep) + ["/usr/include", "/usr/local/include"]
    for d in dirs:
        if d and os.path.exists(os.path.join(d, name)):
            return d
    return None


def _use_ccache() -> None:
    """Compiles through ccache so that a fresh clone elsewhere (CI's) hits what an earlier
    checkout compiled: paths under the checkout hashed relative to it, and the working directory
    (the clone's build folder, hashed because Python's flags carry -g) not at all. Newer torch
    prepends ccache to both compilers itself; older ones (2.11, the GPU machine's) only read
    CXX and PYTORCH_NVCC."""
    from torch.utils import cpp_extension

    os.environ.setdefault("CCACHE_BASEDIR", ROOT)
    os.environ.setdefault("CCACHE_NOHASHDIR", "1")
    if hasattr(cpp_extension, "_wrap_compiler"):
        return
    masquerade = "/usr/lib/ccache/c++"  # Debian's: torch's compiler checks take it for g++
    if "CXX" not in os.environ and os.path.exists(masquerade):
        os.environ["CXX"] = masquerade
    if "PYTORCH_NVCC" not in os.environ and cpp_extension.CUDA_HOME:
        nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        os.environ["PYTORCH_NVCC"] = f"ccache {nvcc}"


def _sources(pattern: str):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern),
                                                               recursive=True))


def build_extension(opts: BuildOptions):
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    os.environ["TORCH_CUDA_ARCH_LIST"] = opts.cuda_arch_list
    if opts.ccache:
        _use_ccache()
    else:
        os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"

    opt = ["-O0", "-g"] if opts.debug else ["-O3"]
    # No FMA contraction: kernels follow torch's operation order and must round like it.
    cxx = opt + ["-fvisibility=hidden", "-ffp-contract=off", "-Wall", "-Wno-unused-function",
                 "-Wno-maybe-uninitialized"]
    # A compiler that links libstdc++ statically (as one GPU image's does) must keep that copy to
    # itself: exported, its locale data binds to the process's libstdc++ instead (std::ifstream
    # in the extension crashed there). A no-op for a shared libstdc++.
    link = ["-Wl,--exclude-libs,ALL"]
    sources = _sources("csrc/core/**/*.cc") + _sources("csrc/torch/*.cpp")
    macros, libraries, include_dirs = [], [], [os.path.join(ROOT, "csrc")]
    if opts.uring:
        macros.append(("TIERLIFT_HAVE_URING", "1"))
        libraries.append("uring")
        header_dir = _find_header("liburing.h")
        if header_dir not in ("/usr/include", None):
            include_dirs.append(header_dir)
    if opts.cuda:
        macros.append(("TIERLIFT_WITH_CUDA", "1"))
        sources += _sources("csrc/cuda/*.cu")
        nvcc = opt + ["--fmad=false", "--expt-relaxed-constexpr", "-lineinfo"]
        return CUDAExtension("tierlift._C", sources, include_dirs=include_dirs,
                             define_macros=macros, libraries=libraries,
                             extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                             extra_link_args=link)
    return CppExtension("tierlift._C", sources, include_dirs=include_dirs, define_macros=macros,
                        libraries=libraries, extra_compile_args={"cxx": cxx},
                        extra_link_args=link)


def main():
    from torch.utils.cpp_extension import BuildExtension

    opts = BuildOptions.from_env()
    print(f"tierlift build: {opts}", flush=True)
    setup(
        packages=find_packages("python"),
        package_dir={"": "python"},
        ext_modules=[build_extension(opts)],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
