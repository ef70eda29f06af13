"""Every CUDA kernel that synchronizes is in CI's race run.

CI's ThreadSanitizer run over the simulated threads (scripts/tsan_races.sh) runs only the tests
its filter selects: the whole simulator suite is far too slow under TSan. So each kernel in
csrc/cuda that uses an atomic, a barrier, shared memory or a warp collective (in its own body or
in a device function it calls) must be launched by a test of tests/cudasim/test_kernel_races.cc,
which names each test's kernels (kernels("...")), and the filter must select those tests. A new
kernel added without one fails here. Also: scripts/test.sh and scripts/mutate_kernels.py run the
race run through that one script, and every mutant of mutate_kernels.py still matches its file.
"""

import fnmatch
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "csrc" / "cuda"
RACES = ROOT / "tests" / "cudasim" / "test_kernel_races.cc"
RACE_RUN = ROOT / "scripts" / "tsan_races.sh"

# Atomics, barriers, warp collectives, fences and shared memory.
SYNC = re.compile(
    r"\batomic[A-Z]\w*|\b__syncthreads\w*|\b__syncwarp\b|\b__shfl\w*_sync\b|\b__ballot_sync\b"
    r"|\b__any_sync\b|\b__all_sync\b|\b__uni_sync\b|\b__match_\w+_sync\b|\b__reduce_\w+_sync\b"
    r"|\b__threadfence\w*|\b__shared__\b|\bcooperative_groups\b"
)
CALL = re.compile(r"\b([A-Za-z_]\w*)\s*(?:<[^;{}()]*>)?\s*\(")
NOT_A_NAME = {"__launch_bounds__", "alignas", "__align__", "if", "for", "while", "switch", "return"}


def code_of(path: Path) -> str:
    """The file without comments (string literals kept)."""
    pattern = r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"'
    return re.sub(
        pattern, lambda m: m.group(0) if m.group(0)[0] == '"' else " ", path.read_text(), flags=re.S
    )


def closing(text: str, i: int) -> int:
    """Index of the bracket closing the one at text[i]."""
    pair = {"(": ")", "{": "}"}[text[i]]
    depth = 0
    for k in range(i, len(text)):
        if text[k] == text[i]:
            depth += 1
        elif text[k] == pair:
            depth -= 1
            if depth == 0:
                return k
    raise ValueError(f"unbalanced {text[i]!r} at {i}")


def device_functions(path: Path):
    """(name, is_kernel, body) of every __global__ / __device__ function defined in the file."""
    text = code_of(path)
    for m in re.finditer(r"\b(__global__|__device__)\b", text):
        call = next((c for c in CALL.finditer(text, m.end()) if c.group(1) not in NOT_A_NAME), None)
        if call is None or re.search(r"[;{}]", text[m.end() : call.start()]):
            continue  # a __device__ variable, not a function
        after = closing(text, call.end() - 1) + 1
        brace = re.compile(r"[;{]").search(text, after)
        if brace is None or text[brace.start()] == ";":
            continue  # a declaration
        yield (
            call.group(1),
            m.group(1) == "__global__",
            text[brace.start() : closing(text, brace.start()) + 1],
        )


def synchronizing_kernels(cuda: Path = CUDA) -> dict[str, str]:
    """Kernel name -> file, for the kernels of csrc/cuda that synchronize directly or through
    the device functions they call (functions are matched by name over all of csrc/cuda, so a
    name defined twice counts as synchronizing if either definition does)."""
    calls: dict[str, set[str]] = {}
    syncs: set[str] = set()
    kernels: dict[str, str] = {}
    for path in sorted(cuda.glob("*.cu*")):
        for name, is_kernel, body in device_functions(path):
            calls.setdefault(name, set()).update(c.group(1) for c in CALL.finditer(body))
            if SYNC.search(body):
                syncs.add(name)
            if is_kernel:
                kernels[name] = path.name
    changed = True
    while changed:
        changed = False
        for name, called in calls.items():
            if name not in syncs and called & syncs:
                syncs.add(name)
                changed = True
    return {k: f for k, f in kernels.items() if k in syncs}


def race_tests() -> dict[str, set[str]]:
    """Race test name -> the kernels it names."""
    text = code_of(RACES)
    tests = {}
    for m in re.finditer(r"\bTEST(?:_F)?\(\s*(\w+)\s*,\s*(\w+)\s*\)\s*\{", text):
        body = text[m.end() - 1 : closing(text, m.end() - 1) + 1]
        names = set()
        for declared in re.findall(r'\bkernels\(\s*"([^"]*)"\s*\)', body):
            names.update(declared.split())
        tests[f"{m.group(1)}.{m.group(2)}"] = names
    return tests


def race_filter() -> str:
    m = re.search(r"^RACE_FILTER='([^']*)'$", RACE_RUN.read_text(), re.M)
    assert m, f"no RACE_FILTER='...' line in {RACE_RUN}"
    return m.group(1)


def selects(gtest_filter: str, test: str) -> bool:
    """gtest's --gtest_filter rule: POSITIVE[-NEGATIVE], ':'-separated, '*' and '?' wildcards."""
    positive, _, negative = gtest_filter.partition("-")

    def matches(patterns: str) -> bool:
        return any(fnmatch.fnmatchcase(test, p) for p in patterns.split(":") if p)

    return (not positive or matches(positive)) and not matches(negative)


def test_the_scan_finds_the_known_synchronizing_kernels():
    found = synchronizing_kernels()
    # One kernel per way of synchronizing, so a scanner that stops seeing one fails here.
    assert found.get("nv_amax_kernel") == "fp4_quant.cu"  # shared memory, barrier, atomicMax
    assert found.get("mx_kernel") == "fp4_quant.cu"  # warp collectives only
    assert found.get("amax_tiles_kernel") == "fp8_quant_tiles.cu"  # atomic via fp8_device.cuh
    assert found.get("block1x128_kernel") == "fp8_quant.cu"  # shuffles via group_max<>()
    assert found.get("gather_kernel") == "gather.cu"  # atomicMin, atomicCAS
    assert found.get("adam_compact_kernel") == "adam_compact.cu"
    assert "amax_to_scale_kernel" not in found and "adam_kernel" not in found  # no sync


def test_the_scan_on_a_made_up_kernel_file(tmp_path):
    (tmp_path / "made_up.cuh").write_text(
        "__device__ int counter;  // a variable, not a function\n"
        "template <int kLanes>\n"
        "__device__ __forceinline__ float lane_max(float v) {\n"
        "  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));\n"
        "  return v;\n"
        "}\n"
        "__device__ float plain(float v);  // declared only\n"
    )
    (tmp_path / "made_up.cu").write_text(
        '#include "made_up.cuh"\n'
        "__device__ float plain(float v) { return v * 2.f; }  // atomicAdd in a comment\n"
        "__device__ float twice(float v) { return lane_max<8>(plain(v)); }\n"
        "template <typename T>\n"
        "__global__ void __launch_bounds__(256)\n"
        "    through_two_calls(T* x) { x[threadIdx.x] = twice(x[threadIdx.x]); }\n"
        "__global__ void no_sync(float* x) { x[0] = plain(x[0]); }\n"
        "__global__ void with_shared(float* x) {\n"
        "  __shared__ float s[32];\n"
        "  s[threadIdx.x] = x[threadIdx.x];\n"
        "  x[0] = s[0];\n"
        "}\n"
        "__global__ void with_atomic(unsigned* x) { atomicMax(x, 1u); }\n"
    )
    assert synchronizing_kernels(tmp_path) == {
        "through_two_calls": "made_up.cu",
        "with_shared": "made_up.cu",
        "with_atomic": "made_up.cu",
    }


def test_every_synchronizing_kernel_has_a_race_test():
    named = set().union(*race_tests().values())
    missing = {k: f for k, f in synchronizing_kernels().items() if k not in named}
    assert not missing, (
        f"kernels with an atomic, a barrier, shared memory or a warp collective and no race test: "
        f"{missing}. Add a small-shape KernelRaces test launching each (several blocks on each "
        f"atomic, several warps across each barrier, checked against core) to {RACES.name} and "
        f'name its kernels with kernels("...") (docs/cudasim.md)'
    )


def test_race_tests_name_real_kernels():
    kernels = set()
    for path in CUDA.glob("*.cu*"):
        kernels.update(name for name, is_kernel, _ in device_functions(path) if is_kernel)
    tests = race_tests()
    assert tests, f"no tests found in {RACES}"
    for test, names in tests.items():
        assert names, f"{test} names no kernels"
        assert names <= kernels, f"{test} names {sorted(names - kernels)}: not kernels in csrc/cuda"


def test_the_race_run_selects_every_race_test():
    gtest_filter = race_filter()
    for test in race_tests():
        assert selects(gtest_filter, test), f"{RACE_RUN.name}: {gtest_filter!r} skips {test}"
    assert selects(gtest_filter, "CudaSimRaces.PlainStoreWhereAnAtomicBelongs")
    # The slow per-kernel suites stay out (the whole suite is far too slow under TSan).
    assert not selects(gtest_filter, "Fp8Kernel.EveryScalingFormatAndDtype")


def test_ci_and_the_mutation_script_share_the_race_run():
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/tsan_races.sh ./build/tsan/tierlift_cudasim_tests" in test_sh
    assert "--gtest_filter" not in test_sh, "the race run's filter belongs in tsan_races.sh only"
    mutate = load_mutate_kernels()
    assert mutate.RACE_RUN == "scripts/tsan_races.sh"


def load_mutate_kernels():
    spec = importlib.util.spec_from_file_location(
        "mutate_kernels", ROOT / "scripts" / "mutate_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_mutant_still_matches_its_file_once():
    mutate = load_mutate_kernels()
    names = [m.name for m in mutate.MUTANTS]
    assert len(names) == len(set(names))
    for m in mutate.MUTANTS:
        text = (CUDA / m.file).read_text()
        assert text.count(m.original) == 1, f"{m.name}: its snippet is not once in {m.file}"
        assert m.mutated != m.original
        assert m.file in mutate.SUITES, f"{m.name}: no suites for {m.file}"
