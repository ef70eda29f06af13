"""import tierlift never fails when a compiled piece is missing; using it says what is missing."""

import subprocess
import sys
import textwrap

import tierlift


def test_build_info_reports_capabilities():
    info = tierlift.build_info()
    assert info["extension"] is True
    assert info["cpu_simd"] in ("avx512", "avx2", "scalar")
    assert info["cpu_threads"] >= 1


def test_import_without_compiled_extension_falls_back_to_reference():
    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["tierlift._C"] = None  # makes `from tierlift import _C` raise ImportError
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import tierlift
        assert any("could not be loaded" in str(w.message) for w in caught), caught
        import torch
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        tierlift.optim.AdamW([p], lr=0.1).step()   # pure-torch reference does the step
        assert torch.all(p < 1)
        try:
            tierlift._extension.require("extension")
        except tierlift.MissingCapabilityError as e:
            assert "pip install" in str(e)
            print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_thread_pool_takes_the_cpus_the_process_may_run_on():
    """Started on one CPU of the affinity mask (taskset, a container's cpuset), the pool has one
    thread, not one per CPU of the machine, unless TIERLIFT_NUM_THREADS says otherwise."""
    import os

    cpu = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); import tierlift; "
            "print(tierlift.build_info()['cpu_threads'])")
    env = {k: v for k, v in os.environ.items() if k != "TIERLIFT_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**env, "TIERLIFT_NUM_THREADS": "3"})
    assert out.returncode == 0 and out.stdout.split()[-1] == "3", out.stderr[-2000:]
